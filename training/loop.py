"""The training loop, top to bottom: config → model + data → steps → metrics, evals and checkpoints.

Called by train.py with the config and the run directory; returns the run's summary. `train` validates the config,
`build` makes the run's objects (one `Run`), `run` is the loop, and each of its parts is one function after it:
`train_step`, `log_train`, `evaluate`, `save`, `stop_note`, `finish`; what `build` reads from init_from and
train.resume comes last. Under torchrun every process runs this same loop on its slice of each batch; the few
multi-process hooks are marked "Distributed:" and live in training/distributed.py.
"""

import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from data import PreparedData, TokenLoader, get_encoding, prepare_dataset
from model import GPT, GPTConfig
from model.attention import detect_sdpa_kernel
from model.pretrained import OVERRIDABLE, pretrained_config, pretrained_encoding
from training import distributed as D
from training import metrics as M
from training.checkpoint import (
    SHARDED,
    CheckpointError,
    is_sharded,
    load_checkpoint,
    remove_checkpoint,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from training.config import Config, Distributed, validate
from training.device import resolve_device, resolve_dtype
from training.faults import NonFiniteGuard, StopSignal, resume_command
from training.optim import (
    apply_step,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    is_fused,
    keep_hyperparameters,
)

SHAPE_KEYS = ("family", "block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_kv_head", "n_embd",
              "bias", "intermediate_size", "rope_theta", "rope_scaling", "norm_eps", "qkv_bias", "tie_embeddings")
DATA_KEYS = ("name", "source", "path", "subset", "data_files", "split", "encoding", "val_fraction", "val_split",
             "max_documents")


@dataclass
class Run:
    """One run's objects, made by `build`; the loop's parts below read them and update the run's progress."""

    cfg: Config
    ctx: D.Context
    run_dir: Path
    gpt_config: GPTConfig
    model: GPT  # the optimizer and checkpoints use it
    parallel: nn.Module  # Distributed: runs the steps (the DDP wrapper, or `model` sharded in place by FSDP2)
    step_model: nn.Module  # `parallel`, compiled if train.compile
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: TokenLoader
    autocast: torch.autocast
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    fold_clip: bool  # the clip is folded into fused AdamW (training/optim.py: clip_gradients)
    guard: NonFiniteGuard
    logger: M.MetricsLogger | M.NullLogger
    throughput: M.Throughput
    flops_per_token: float
    peak_flops: float | None  # of one GPU; None (no MFU) on CPU and on GPUs missing from the table
    config_dict: dict[str, Any]  # cfg as plain containers: the wandb config, and a copy in every checkpoint
    start_step: int = 0
    # progress
    best_val: float = math.inf
    last_saved: str | None = None  # the latest checkpoint saved or resumed from, named by errors
    first_loss: float = math.nan
    last_loss: float = math.nan
    val_loss: float = math.nan
    rates: list[float] = field(default_factory=list)  # tokens/sec of each log window
    peaks: list[dict[str, float]] = field(default_factory=list)  # peak memory of each log window


def train(cfg: Config, run_dir: Path, root: Path | None = None) -> dict[str, Any]:
    validate(cfg)
    # Distributed: join torchrun's process group (a no-op for one process); left on success or error.
    ctx = D.setup(cfg.train.distributed, resolve_device(cfg.train.device.value, key="train.device"))
    try:
        dtype = resolve_dtype(cfg.train.dtype, ctx.device, key="train.dtype")  # after setup: on this rank's GPU
        # No reference to the Run outlives run(): DDP's reducer must be freed before its process group is destroyed
        # (freed after it, gloo's destructor can deadlock).
        return run(build(cfg, ctx.from_main(run_dir), root, ctx, dtype))
    finally:
        D.teardown(ctx)


def build(cfg: Config, run_dir: Path, root: Path | None, ctx: D.Context, dtype: torch.dtype) -> Run:
    """The run's objects, in the order that makes a resumed run continue exactly: seeds, data, model, optimizer,
    then the checkpoint's states (RNG included)."""
    t, device = cfg.train, ctx.device
    resume_from = resume_path(t.resume, run_dir, t.overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32

    # Data, then model: the tokenizer's vocabulary sizes the model, and the loader checks that the data's ids and
    # length fit it before any large allocation.
    # A sharded checkpoint's model and optimizer are read later, each rank its part (D.load_sharded).
    resume = load_checkpoint(resume_from, tensors=not is_sharded(resume_from)) if resume_from else None
    cfg.data.encoding = data_encoding(cfg)  # resolved once: the checkpoints and the data cache record the tokenizer
    gpt_config = model_config(cfg, get_encoding(cfg.data.encoding).n_vocab)
    if resume:
        check_resumable(resume, gpt_config, cfg)
    data: PreparedData = prepare_dataset(cfg.data, root=root)
    loader = TokenLoader(data, gpt_config.block_size, t.batch_size, device, t.seed, vocab_size=gpt_config.vocab_size,
                         rank=ctx.rank, world_size=ctx.world_size)
    model = build_model(cfg, gpt_config).to(device)
    model.set_activation_checkpointing(t.activation_checkpointing.value)
    n_params = model.num_params()
    parallel = D.wrap(model, ctx, dtype)  # Distributed: DDP or FSDP2 (see Run.parallel)
    optimizer = build_optimizer(model, t, device.type)
    scheduler = build_scheduler(optimizer, t)
    start_step, best_val, last_saved = 0, math.inf, None
    if resume:
        # The checkpoint's state (AdamW's moments, the schedule's step); this run's lr, betas, weight decay, schedule.
        with keep_hyperparameters(optimizer, scheduler):
            if is_sharded(resume_from):
                D.load_sharded(model, optimizer, resume_from)
            else:
                D.load_state_dicts(model, optimizer, resume)
            scheduler.load_state_dict(resume["scheduler"])
        loader.load_state_dict(resume["loader"])
        set_rng_state(resume["rng"])
        start_step, best_val = resume["step"], resume["best_val_loss"]
        last_saved = f"{resume_from} (step {start_step})"
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # fp16 only
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    step_model = torch.compile(parallel) if t.compile else parallel  # DDP too, as one graph (see D.wrap)
    fold_clip = is_fused(optimizer) and not scaler.is_enabled() and ctx.mode != Distributed.fsdp

    # Metrics: throughput from the steps after warm-up; MFU when the GPU is in the peak-FLOPS table. A step is the
    # global batch: batch_size × grad_accum_steps × world_size sequences.
    global_batch = t.batch_size * t.grad_accum_steps * ctx.world_size
    tokens_per_step = global_batch * gpt_config.block_size
    flops_per_token = M.flops_per_token(
        n_params, gpt_config.n_layer, gpt_config.n_head, gpt_config.n_embd // gpt_config.n_head, gpt_config.block_size)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_flops = M.peak_flops(device_name, dtype) if device.type == "cuda" else None
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    # Distributed: rank 0 alone logs. A run resumed in its own directory keeps its metrics.jsonl up to the step it
    # resumes from (the lines of the interrupted steps after it are logged anew); in a new directory the file starts
    # afresh. Either way the wandb run of the checkpoint continues.
    own = resume_from is not None and resume_from.parent.parent.resolve() == run_dir.resolve()
    logger = (M.MetricsLogger(run_dir, config_dict, cfg.wandb, t.max_steps, start_step,
                              kept_steps=start_step if own else 0, wandb_id=resume.get("wandb_id") if resume else None)
              if ctx.is_main else M.NullLogger())
    if resume:
        changes = config_changes(resume["config"], config_dict)
        logger.note(f"resuming {last_saved} with " + (", ".join(changes) if changes else "the checkpoint's config"))
    logger.summary({"attention": gpt_config.attention, "sdpa_backend": gpt_config.sdpa_backend,
                    "device": device_name, "dtype": str(dtype).removeprefix("torch."), "n_params": n_params,
                    "torch": torch.__version__, "tokens_per_step": tokens_per_step, "resumed_from_step": start_step,
                    "distributed": ctx.mode.value, "world_size": ctx.world_size, "global_batch_size": global_batch,
                    "global_batch_tokens": tokens_per_step})
    return Run(cfg=cfg, ctx=ctx, run_dir=run_dir, gpt_config=gpt_config, model=model, parallel=parallel,
               step_model=step_model, optimizer=optimizer, scheduler=scheduler, loader=loader, autocast=autocast,
               scaler=scaler, fold_clip=fold_clip, guard=NonFiniteGuard(t.nonfinite.value, t.max_skipped_steps),
               logger=logger, throughput=M.Throughput(device, tokens_per_step), flops_per_token=flops_per_token,
               peak_flops=peak_flops, config_dict=config_dict, start_step=start_step, best_val=best_val,
               last_saved=last_saved)


def run(r: Run) -> dict[str, Any]:
    """Optimizer steps until train.max_steps or a stop signal, with logs, evals and checkpoints at their intervals."""
    t, ctx = r.cfg.train, r.ctx
    # Which SDPA kernel runs is found by profiling one step after the first (compilation is over by then).
    profile_step = r.start_step + min(1, t.max_steps - r.start_step - 1)
    with StopSignal() as stop, M.close_on_error(r.logger):
        for step in range(r.start_step, t.max_steps):
            if step - r.start_step == t.perf_warmup_steps:
                r.throughput.start()
            lr = r.scheduler.get_last_lr()[0]
            if step == profile_step and r.gpt_config.attention == "sdpa":
                (loss, bad), kernel, evidence = detect_sdpa_kernel(lambda: train_step(r))
                r.logger.summary({"sdpa_kernel": kernel, "sdpa_kernel_evidence": evidence[:4]})
            else:
                loss, bad = train_step(r)
            r.scheduler.step()
            r.throughput.count()
            r.logger.advance()
            done = step + 1  # optimizer steps completed
            r.guard.record(done, bad)
            log_now = done % t.log_interval == 0 or done in (r.start_step + 1, t.max_steps)  # the first step too
            eval_now = done % t.eval_interval == 0 or done == t.max_steps
            sync_point = ctx.device.type == "cpu" or log_now or eval_now  # GPUs: points that synchronise anyway
            # Distributed: all ranks stop at the same step (see D.Context.stop_agreed)
            stopping = ctx.stop_agreed(stop.received is not None, sync_point)
            if (sync_point or stopping) and r.guard.check(r.last_saved):
                r.logger.log(done, {M.SKIPPED_STEPS: len(r.guard.skipped)})  # raises instead under nonfinite=stop

            if log_now:
                log_train(r, done, loss, lr)
            if eval_now:
                evaluate(r, done)
            if t.save_checkpoints and (eval_now or stopping):  # on a stop signal: save, skip the eval
                r.last_saved = save(r, "last", done, r.val_loss if eval_now else None) or r.last_saved
            if stopping:
                signal_name = stop.received or "signal (on another rank)"
                r.logger.summary({"stopped_by": signal_name, "stopped_at_step": done})
                r.logger.note(stop_note(r, signal_name, done))
                break
            if eval_now:
                r.throughput.restart()  # evals and checkpoints are not training throughput
    return finish(r)


def train_step(r: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum_steps micro-batches; returns (mean loss, whether it was skipped)."""
    t = r.cfg.train
    total = torch.zeros((), device=r.ctx.device)
    for micro in range(t.grad_accum_steps):
        x, y = r.loader.next_batch()
        with D.gradient_sync(r.parallel, micro == t.grad_accum_steps - 1):  # Distributed: reduce grads once a step
            with r.autocast:
                _, loss = r.step_model(x, y, return_logits=False)  # logits unused: no gradient buffer for them
            r.scaler.scale(loss / t.grad_accum_steps).backward()
        total += loss.detach()
    r.scaler.unscale_(r.optimizer)
    params = [p for p in r.model.parameters() if p.grad is not None]
    norm = clip_gradients(r.optimizer, params, t.grad_clip, fold=r.fold_clip)
    # Distributed: skip or apply a step on every rank alike (the norm is global, a rank's loss is not)
    bad = r.ctx.any(r.guard.bad(total, D.full_tensor(norm)))
    apply_step(r.optimizer, r.scaler, skip=bad)
    r.optimizer.zero_grad(set_to_none=True)
    return total / t.grad_accum_steps, bad


def mfu(r: Run, tokens_per_sec: float) -> float | None:
    """Model FLOPs utilisation of one GPU at this global rate, if the GPU's peak is known."""
    return tokens_per_sec / r.ctx.world_size * r.flops_per_token / r.peak_flops if r.peak_flops else None


def log_train(r: Run, step: int, loss: torch.Tensor, lr: float) -> None:
    """A log point: the step's loss (mean over ranks), the learning rate, throughput and MFU since the last log point,
    peak memory."""
    r.last_loss = r.ctx.mean(loss).item()  # synchronises: once per log interval, not per step
    if step == r.start_step + 1:
        r.first_loss = r.last_loss
    out = {M.TRAIN_LOSS: r.last_loss, M.LR: lr}
    rate = r.throughput.rate()
    if rate is not None:
        r.rates.append(rate)
        out[M.TOKENS_PER_SEC] = rate
        out[M.TOKENS_PER_SEC_PER_GPU] = rate / r.ctx.world_size
        if r.peak_flops:
            out[M.MFU] = mfu(r, rate)
    mem = M.memory_metrics(r.ctx.device)
    out.update(mem)
    r.peaks.append(mem)
    r.logger.log(step, out)


@torch.no_grad()
def evaluate(r: Run, step: int) -> None:
    """The val loss over train.eval_batches, logged; a new best is saved as checkpoints/best.pt."""
    r.step_model.eval()
    losses = []
    for x, y in r.loader.eval_batches("val", r.cfg.train.eval_batches):  # each rank: its share of the val windows
        with r.autocast:
            _, loss = r.step_model(x, y, return_logits=False)
        losses.append(loss.float())
    r.step_model.train()
    r.val_loss = r.ctx.mean(torch.stack(losses).mean()).item()  # Distributed: the mean over all ranks' windows
    r.logger.log(step, {M.VAL_LOSS: r.val_loss})
    if r.val_loss < r.best_val:
        r.best_val = r.val_loss
        if r.cfg.train.save_checkpoints:
            save(r, "best", step, r.val_loss)


def save(r: Run, name: str, step: int, val_loss: float | None = None) -> str | None:
    """checkpoints/<name>.pt or .dcp: everything needed to resume after `step`; returns what errors name it by. Nothing
    non-finite is saved: not after an eval (at this step: val_loss) whose loss is NaN/inf, not weights holding a
    NaN/inf; then the previous checkpoint stays, and this returns None.
    Distributed: under FSDP every rank writes its shards (a sharded checkpoint, checkpoints/<name>.dcp); otherwise
    rank 0 writes the whole state (checkpoints/<name>.pt), the others wait."""
    # One reduction over the weights, at saves only: their largest magnitude, NaN if any is NaN (a 2-norm would
    # also overflow on large finite weights). Distributed: every rank computes it (a collective under FSDP).
    with torch.no_grad():
        largest = D.full_tensor(torch.nn.utils.get_total_norm(list(r.model.parameters()), norm_type=math.inf)).item()
    bad = ("weights are" if not math.isfinite(largest) else
           "val loss is" if val_loss is not None and not math.isfinite(val_loss) else None)
    sharded = r.ctx.mode == Distributed.fsdp  # each rank writes its shards: nothing is gathered
    checkpoints = r.run_dir / "checkpoints"
    path = checkpoints / f"{name}{SHARDED if sharded else '.pt'}"
    if bad:
        r.logger.note(f"not saving checkpoints/{path.name} at step {step}: the {bad} not finite (NaN/inf); the last "
                      f"good checkpoint stays {r.last_saved or 'none'}")
        return None
    state = {"scheduler": r.scheduler.state_dict(), "step": step, "rng": rng_state(), "loader": r.loader.state_dict(),
             "config": r.config_dict, "model_config": asdict(r.gpt_config), "best_val_loss": r.best_val,
             "wandb_id": r.logger.wandb_id}
    if sharded:
        D.save_sharded(r.ctx, r.model, r.optimizer, state, path)
    else:
        state = {**D.state_dicts(r.model, r.optimizer), **state}
        if r.ctx.is_main:
            save_checkpoint(state, path)
        r.ctx.barrier()
    if r.ctx.is_main:  # the other form, from a run resumed in another mode, is older: it must not be resumed
        remove_checkpoint(checkpoints / f"{name}{'.pt' if sharded else SHARDED}")
    return f"{path} (step {step})"


def stop_note(r: Run, signal_name: str, step: int) -> str:
    """What a run stopped by a signal tells its user: where it saved, and the command that continues it."""
    if own_checkpoint(r.run_dir) is None:
        return (f"stopped by {signal_name} after step {step}; no checkpoint in {r.run_dir} to resume from (latest "
                f"good checkpoint: {r.last_saved or 'none'})")
    return (f"stopped by {signal_name} after step {step}; latest checkpoint: {r.last_saved}. To continue this run:\n"
            f"  {resume_command(r.run_dir, r.ctx.world_size)}")


def finish(r: Run) -> dict[str, Any]:
    """The end-of-run figures, added to the summary; closes the logger and returns the whole summary."""
    summary = {"first/train_loss": r.first_loss, "final/train_loss": r.last_loss, "final/val_loss": r.val_loss,
               "best/val_loss": r.best_val, "steps": r.cfg.train.max_steps, "skipped_steps": r.guard.skipped,
               "last_checkpoint": r.last_saved}
    if r.rates:
        median = summary["perf/tokens_per_sec_median"] = sorted(r.rates)[len(r.rates) // 2]
        if r.peak_flops:
            summary["perf/mfu_median"] = mfu(r, median)
    for key in r.peaks[0] if r.peaks else ():
        summary[f"{key}_max"] = max(p[key] for p in r.peaks)  # the run's peak: the largest of the per-log peaks
    r.logger.summary(summary)
    return r.logger.close()


def model_config(cfg: Config, vocab_size: int) -> GPTConfig:
    """The model's shapes. init_from=scratch: from cfg.model (vocab from the tokenizer unless model.vocab_size is
    set). init_from=<our checkpoint .pt>: that checkpoint's shapes. init_from=<GPT-2 name, hub id or Hugging Face
    model dir>: its config.json's shapes, unpadded vocab; of cfg.model only block_size (crops the context, at most
    the checkpoint's positions) applies. This run's attention backend, dropout and loss_chunk_tokens apply in every
    case."""
    m = cfg.model
    run = dict(dropout=m.dropout, attention=cfg.attention.name, sdpa_backend=cfg.attention.sdpa_backend,
               loss_chunk_tokens=m.loss_chunk_tokens)
    if cfg.init_from == "scratch":
        shapes = {k: getattr(m, k) for k in SHAPE_KEYS if k != "vocab_size"}
        return GPTConfig(vocab_size=m.vocab_size or vocab_size, **shapes, **run)
    if Path(cfg.init_from).is_file():
        shapes = load_checkpoint(cfg.init_from)["model_config"]
        return GPTConfig(**{k: shapes[k] for k in SHAPE_KEYS if k in shapes}, **run)  # older ones lack newer keys
    return pretrained_config(cfg.init_from, block_size=m.block_size, **run)  # errors name the accepted init_from


def data_encoding(cfg: Config) -> str:
    """data.encoding, or when it is null the tokenizer of init_from: our checkpoint's, gpt2 for a Hugging Face GPT-2,
    a Llama-family model's own tokenizer.json; bytes from scratch."""
    if cfg.data.encoding is not None:
        return cfg.data.encoding
    if cfg.init_from == "scratch":
        return "bytes"
    if Path(cfg.init_from).is_file():
        return load_checkpoint(cfg.init_from)["config"]["data"]["encoding"]
    return pretrained_encoding(cfg.init_from)


def build_model(cfg: Config, gpt_config: GPTConfig) -> GPT:
    """The model of gpt_config (from model_config), with the weights init_from names: the pretrained weights are
    read here only, model_config reads just the configs."""
    if cfg.init_from == "scratch":
        return GPT(gpt_config)
    if Path(cfg.init_from).is_file():
        model = GPT(gpt_config)
        model.load_state_dict(load_checkpoint(cfg.init_from)["model"])
        return model
    return GPT.from_pretrained(cfg.init_from, **{k: getattr(gpt_config, k) for k in OVERRIDABLE})


def check_resumable(state: dict[str, Any], gpt_config: GPTConfig, cfg: Config) -> None:
    """Resume only what can be continued: the same model shapes and the same data (the loader's position)."""
    saved = asdict(GPTConfig(**state["model_config"]))  # as this version reads it (older ones have no n_kv_head)
    diff = [f"model.{k}: checkpoint {saved[k]} vs run {getattr(gpt_config, k)}" for k in SHAPE_KEYS
            if saved[k] != getattr(gpt_config, k)]
    saved_data, data = state["config"]["data"], asdict(cfg.data)
    saved_data = {"val_split": "documents", **saved_data}  # checkpoints from before the key had this split
    diff += [f"data.{k}: checkpoint {saved_data[k]} vs run {data[k]}" for k in DATA_KEYS if saved_data[k] != data[k]]
    if diff:
        raise CheckpointError("cannot resume: the checkpoint's run differs from this one (" + "; ".join(diff)
                              + "). Resume with the same settings, or start anew with init_from=<checkpoint>.")


def config_changes(saved: dict[str, Any], run: dict[str, Any], prefix: str = "") -> list[str]:
    """`key old -> new` for each config key of this run whose value differs from the checkpoint's (train.resume
    aside). The run's values are what runs: hyperparameters included (build: keep_hyperparameters)."""
    changes = []
    for key, value in run.items():
        name, old = f"{prefix}{key}", saved.get(key)
        if key not in saved or name == "train.resume":  # older checkpoints lack newer keys
            continue
        if isinstance(value, dict) and isinstance(old, dict):
            changes += config_changes(old, value, f"{name}.")
        elif value != old:
            changes.append(f"{name} {old} -> {value}")
    return changes


def own_checkpoint(run_dir: Path) -> Path | None:
    """The run directory's resume point, checkpoints/last.pt or last.dcp, if it has one."""
    try:
        return resolve_checkpoint(run_dir)
    except CheckpointError:
        return None


def resume_path(resume: str | None, run_dir: Path, overwrite: bool) -> Path | None:
    """Which checkpoint to resume from. `auto` resumes this run directory if it holds one (a restarted job simply
    reruns its command); a run directory that holds another run's checkpoints is never clobbered unless asked."""
    own = own_checkpoint(run_dir)
    if resume == "auto":
        return own
    if own and not overwrite and (resume is None or resolve_checkpoint(resume).resolve() != own.resolve()):
        raise FileExistsError(f"{run_dir} already holds a run's checkpoints: continue it with train.resume=auto, "
                              "choose another hydra.run.dir, or set train.overwrite=true to replace them")
    return resolve_checkpoint(resume) if resume else None

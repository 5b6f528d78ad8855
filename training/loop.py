"""The training loop, top to bottom: config → model + data → steps → metrics, evals and checkpoints.

Called by train.py with the validated config and the run directory; returns the run's summary. Under torchrun every
process runs this same loop on its slice of each batch; the few multi-process hooks are marked "Distributed:" and
live in training/distributed.py.
"""

import math
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from data import PreparedData, TokenLoader, get_encoding, prepare_dataset
from model import GPT, GPTConfig
from model.attention import detect_sdpa_kernel
from model.pretrained import OVERRIDABLE, pretrained_config
from training import distributed as D
from training import metrics as M
from training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from training.config import Config, Device, Distributed, DType, validate
from training.faults import NonFiniteGuard, StopSignal
from training.optim import build_optimizer, build_scheduler, clip_gradients

DTYPES = {DType.bf16: torch.bfloat16, DType.fp16: torch.float16, DType.fp32: torch.float32}
SHAPE_KEYS = ("block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_embd", "bias")
DATA_KEYS = ("name", "source", "path", "subset", "data_files", "split", "encoding", "val_fraction", "max_documents")


def resolve_device(device: Device) -> torch.device:
    if device == Device.cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA GPU is visible: use train.device=auto or cpu")
    if device == Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device.value)


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    if dtype == DType.auto:
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[dtype]


def model_config(cfg: Config, vocab_size: int) -> GPTConfig:
    """The model's shapes. init_from=scratch: from cfg.model (vocab from the tokenizer unless model.vocab_size is
    set). init_from=<our checkpoint .pt>: that checkpoint's shapes. init_from=<GPT-2 name or Hugging Face model
    dir>: its config.json's shapes, unpadded vocab; of cfg.model only block_size (crops the position embeddings,
    at most n_positions) and dropout apply. This run's attention backend and dropout apply in every case."""
    m = cfg.model
    run = dict(dropout=m.dropout, attention=cfg.attention.name.value, sdpa_backend=cfg.attention.sdpa_backend.value)
    if cfg.init_from == "scratch":
        return GPTConfig(block_size=m.block_size, vocab_size=m.vocab_size or vocab_size,
                         pad_vocab_multiple=m.pad_vocab_multiple, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                         bias=m.bias, **run)
    if Path(cfg.init_from).is_file():
        shapes = load_checkpoint(cfg.init_from)["model_config"]
        return GPTConfig(**{k: shapes[k] for k in SHAPE_KEYS}, **run)
    return pretrained_config(cfg.init_from, block_size=m.block_size, **run)  # errors name the accepted init_from


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
    saved = state["model_config"]
    diff = [f"model.{k}: checkpoint {saved[k]} vs run {getattr(gpt_config, k)}" for k in SHAPE_KEYS
            if saved[k] != getattr(gpt_config, k)]
    saved_data, data = state["config"]["data"], asdict(cfg.data)
    diff += [f"data.{k}: checkpoint {saved_data[k]} vs run {data[k]}" for k in DATA_KEYS if saved_data[k] != data[k]]
    if diff:
        raise CheckpointError("cannot resume: the checkpoint's run differs from this one (" + "; ".join(diff)
                              + "). Resume with the same settings, or start anew with init_from=<checkpoint>.")


def resume_path(resume: str | None, run_dir: Path, overwrite: bool) -> Path | None:
    """Which checkpoint to resume from. `auto` resumes this run directory if it holds one (a restarted job simply
    reruns its command); a run directory that holds another run's checkpoints is never clobbered unless asked."""
    own = run_dir / "checkpoints" / "last.pt"
    if resume == "auto":
        return own if own.is_file() else None
    if own.is_file() and not overwrite and (resume is None or resolve_checkpoint(resume) != own):
        raise FileExistsError(f"{run_dir} already holds a run's checkpoints: continue it with train.resume=auto, "
                              "choose another hydra.run.dir, or set train.overwrite=true to replace them")
    return resolve_checkpoint(resume) if resume else None


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TokenLoader, n_batches: int, autocast: torch.autocast,
             ctx: D.Context) -> float:
    model.eval()
    losses = []
    for x, y in loader.eval_batches("val", n_batches):  # each rank: its share of the val windows
        with autocast:
            _, loss = model(x, y, return_logits=False)
        losses.append(loss.float())
    model.train()
    return ctx.mean(torch.stack(losses).mean()).item()  # Distributed: the mean over all ranks' windows


def train(cfg: Config, run_dir: Path, root: Path | None = None) -> dict[str, Any]:
    validate(cfg)
    # Distributed: join torchrun's process group (a no-op for one process); left on success or error.
    ctx = D.setup(cfg.train.distributed, resolve_device(cfg.train.device))
    try:
        return run(cfg, ctx.from_main(run_dir), root, ctx)
    finally:
        D.teardown(ctx)


def run(cfg: Config, run_dir: Path, root: Path | None, ctx: D.Context) -> dict[str, Any]:
    t = cfg.train
    resume_from = resume_path(t.resume, run_dir, t.overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = ctx.device
    dtype = resolve_dtype(t.dtype, device)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32

    # Data, then model: the tokenizer's vocabulary sizes the model, and the loader checks that the data's ids and
    # length fit it before any large allocation.
    resume = load_checkpoint(resume_from) if resume_from else None
    gpt_config = model_config(cfg, get_encoding(cfg.data.encoding).n_vocab)
    if resume:
        check_resumable(resume, gpt_config, cfg)
    data: PreparedData = prepare_dataset(cfg.data, root=root)
    loader = TokenLoader(data, gpt_config.block_size, t.batch_size, device, t.seed, vocab_size=gpt_config.vocab_size,
                         rank=ctx.rank, world_size=ctx.world_size)
    model = build_model(cfg, gpt_config).to(device)
    n_params = model.num_params()
    # Distributed: `parallel` runs the steps (DDP wrapper, or `model` sharded in place by FSDP2); the optimizer and
    # checkpoints use `model`.
    parallel = D.wrap(model, ctx, dtype)

    optimizer = build_optimizer(model, t, device.type)
    scheduler = build_scheduler(optimizer, t)
    start_step, best_val, last_saved = 0, math.inf, "none yet"
    if resume:
        D.load_state_dicts(model, optimizer, resume)
        scheduler.load_state_dict(resume["scheduler"])
        loader.load_state_dict(resume["loader"])
        set_rng_state(resume["rng"])
        start_step, best_val = resume["step"], resume["best_val_loss"]
        last_saved = f"{resume_from} (step {start_step})"
    step_model = torch.compile(parallel) if t.compile else parallel  # DDP: compiled per bucket (DDPOptimizer)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    fused = any(group.get("fused") for group in optimizer.param_groups)
    guard = NonFiniteGuard(t.nonfinite.value, t.max_skipped_steps)

    # Metrics: throughput from the steps after warm-up; MFU when the GPU is in the peak-FLOPS table. A step is the
    # global batch: batch_size × grad_accum_steps × world_size sequences.
    global_batch = t.batch_size * t.grad_accum_steps * ctx.world_size
    tokens_per_step = global_batch * gpt_config.block_size
    throughput = M.Throughput(device, tokens_per_step)
    flops_per_token = M.flops_per_token(
        n_params, gpt_config.n_layer, gpt_config.n_head, gpt_config.n_embd // gpt_config.n_head, gpt_config.block_size)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = M.peak_flops(device_name, dtype) if device.type == "cuda" else None
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    # Distributed: rank 0 alone logs.
    logger = (M.MetricsLogger(run_dir, config_dict, cfg.wandb, t.max_steps, start_step) if ctx.is_main
              else M.NullLogger())
    logger.summary({"attention": gpt_config.attention, "sdpa_backend": gpt_config.sdpa_backend,
                    "device": device_name, "dtype": str(dtype).removeprefix("torch."), "n_params": n_params,
                    "torch": torch.__version__, "tokens_per_step": tokens_per_step, "resumed_from_step": start_step,
                    "distributed": ctx.mode.value, "world_size": ctx.world_size, "global_batch_size": global_batch,
                    "global_batch_tokens": tokens_per_step})

    def save(name: str, step: int) -> str:
        # Distributed: every rank helps gather the full state (FSDP), rank 0 writes it, the others wait.
        state = {**D.state_dicts(model, optimizer), "scheduler": scheduler.state_dict(), "step": step,
                 "rng": rng_state(), "loader": loader.state_dict(), "config": config_dict,
                 "model_config": asdict(gpt_config), "best_val_loss": best_val}
        if ctx.is_main:
            save_checkpoint(state, run_dir / "checkpoints" / name)
        ctx.barrier()
        return f"{run_dir / 'checkpoints' / name} (step {step})"

    def train_step() -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum_steps micro-batches; returns (mean loss, whether it was skipped)."""
        total = torch.zeros((), device=device)
        for micro in range(t.grad_accum_steps):
            x, y = loader.next_batch()
            with D.gradient_sync(parallel, micro == t.grad_accum_steps - 1):  # Distributed: reduce grads once a step
                with autocast:
                    _, loss = step_model(x, y, return_logits=False)  # logits unused: no gradient buffer for them
                scaler.scale(loss / t.grad_accum_steps).backward()
            total += loss.detach()
        scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        norm = clip_gradients(optimizer, params, t.grad_clip,
                              fold=fused and not scaler.is_enabled() and ctx.mode != Distributed.fsdp)
        # Distributed: skip or apply a step on every rank alike (the norm is global, a rank's loss is not)
        bad = ctx.any(guard.bad(total, D.full_tensor(norm)))
        if scaler.is_enabled():  # fp16: the GradScaler already skips steps whose gradients are not finite
            scaler.step(optimizer)
            scaler.update()
        elif fused:  # fused AdamW skips the whole update on the GPU when found_inf is set: no synchronisation
            optimizer.found_inf = bad.float()
            optimizer.step()  # divides the gradients by optimizer.grad_scale: the clipping
            del optimizer.found_inf
            optimizer.__dict__.pop("grad_scale", None)
        elif not bad.item():  # CPU: reading the flag costs nothing
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total / t.grad_accum_steps, bad

    # Which SDPA kernel runs is found by profiling one step after the first (compilation is over by then).
    profile_step = start_step + min(1, t.max_steps - start_step - 1)
    rates, peaks, first_loss, last_loss, val_loss = [], [], math.nan, math.nan, math.nan
    with StopSignal() as stop:
        for step in range(start_step, t.max_steps):
            if step - start_step == t.perf_warmup_steps:
                throughput.start()
            lr = scheduler.get_last_lr()[0]
            if step == profile_step and gpt_config.attention == "sdpa":
                (loss, bad), kernel, evidence = detect_sdpa_kernel(train_step)
                logger.summary({"sdpa_kernel": kernel, "sdpa_kernel_evidence": evidence[:4]})
            else:
                loss, bad = train_step()
            scheduler.step()
            throughput.count()
            logger.advance()
            done = step + 1  # optimizer steps completed
            guard.record(done, bad)
            log_now = done % t.log_interval == 0 or done in (start_step + 1, t.max_steps)  # the first step too
            eval_now = done % t.eval_interval == 0 or done == t.max_steps
            # Distributed: all ranks stop at the same step (see D.Context.stop_agreed)
            stopping = ctx.stop_agreed(stop.received is not None, device.type == "cpu" or log_now or eval_now)
            if (device.type == "cpu" or log_now or eval_now or stopping) and guard.check(last_saved):
                logger.log(done, {M.SKIPPED_STEPS: len(guard.skipped)})  # raises instead under nonfinite=stop

            if log_now:
                last_loss = ctx.mean(loss).item()  # synchronises: once per log interval, not per step
                first_loss = last_loss if done == start_step + 1 else first_loss
                out = {M.TRAIN_LOSS: last_loss, M.LR: lr}
                rate = throughput.rate()
                if rate is not None:
                    rates.append(rate)
                    out[M.TOKENS_PER_SEC] = rate
                    out[M.TOKENS_PER_SEC_PER_GPU] = rate / ctx.world_size
                    if peak:
                        out[M.MFU] = rate / ctx.world_size * flops_per_token / peak
                mem = M.memory_metrics(device)
                out.update(mem)
                peaks.append(mem)
                logger.log(done, out)

            if eval_now:
                val_loss = evaluate(step_model, loader, t.eval_batches, autocast, ctx)
                logger.log(done, {M.VAL_LOSS: val_loss})
                if val_loss < best_val:
                    best_val = val_loss
                    if t.save_checkpoints:
                        save("best.pt", done)
            if t.save_checkpoints and (eval_now or stopping):  # on a stop signal: save, skip the eval
                last_saved = save("last.pt", done)
            if stopping:
                logger.summary({"stopped_by": stop.received or "signal (on another rank)", "stopped_at_step": done})
                break
            if eval_now:
                throughput.restart()  # evals and checkpoints are not training throughput

    summary = {"first/train_loss": first_loss, "final/train_loss": last_loss, "final/val_loss": val_loss,
               "best/val_loss": best_val, "steps": t.max_steps, "skipped_steps": guard.skipped}
    if rates:
        median = summary["perf/tokens_per_sec_median"] = sorted(rates)[len(rates) // 2]
        if peak:
            summary["perf/mfu_median"] = median / ctx.world_size * flops_per_token / peak
    for key in peaks[0] if peaks else ():
        summary[f"{key}_max"] = max(p[key] for p in peaks)  # the run's peak: the largest of the per-log peaks
    logger.summary(summary)
    return logger.close()

"""The training loop, top to bottom: config → model + data → steps → metrics, evals and checkpoints.

Called by train.py with the config and the run directory; returns the run's summary. `train` validates the config,
`plan` settles what the run is (init_from's model config and tokenizer: training/init.py; the data: `setup_data`; the
checkpoint it resumes from; its length), `build` makes the run's objects (one `Run`) in steps, `setup_model`,
`setup_optimizer`, `restore` (a resumed run's states) and `setup_metrics`; `run` is the loop, and each of its parts is
one function after it: `train_step`, `log_train`, `evaluate`, `save`, `stop_note`, `finish`.
The loss of a step is the mean over all its trained tokens (every micro-batch, every rank: `token_shares`). Under
torchrun every process runs this same loop on its slice of each batch; the few multi-process hooks are marked
"Distributed:" and live in training/distributed.py.
"""

import gc
import json
import math
import random
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from data import Batch, ExampleLoader, PreparedExamples, TokenLoader, prepare_dataset
from model import GPT, GPTConfig
from model.config import SHAPE_KEYS, LoRAConfig
from model.lora import add_lora, fingerprint
from model.loss import IGNORE_INDEX
from training import distributed, metrics
from training.checkpoint import load_checkpoint, remove_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.config import Config, Distributed, config_warnings, validate
from training.device import resolve_device, resolve_dtype
from training.faults import NonFiniteGuard, StopSignal, resume_command
from training.init import Init, resolve_init
from training.optim import (
    ShardAdamW,
    apply_step,
    build_optimizer,
    build_scheduler,
    clip_gradients,
    is_fused,
    keep_hyperparameters,
)
from training.resume import SHARDED, CheckpointError, is_sharded, own_checkpoints, resume_point

DATA_KEYS = ("name", "source", "path", "subset", "data_files", "split", "encoding", "val_fraction", "val_split",
             "max_documents", "format", "train_on", "overlong", "packing")
# what a checkpoint written before a data key existed read: that key's value then
DATA_DEFAULTS = {"val_split": "documents", "format": "text", "train_on": "assistant", "overlong": "truncate",
                 "packing": False}  # packing: checkpoints from before data.packing read padded rows


@dataclass
class Run:
    """One run's objects, made by `build`; the loop's parts below read them and update the run's progress."""

    cfg: Config
    ctx: distributed.Context
    run_dir: Path
    gpt_config: GPTConfig
    model: GPT  # the optimizer and checkpoints use it
    parallel: nn.Module  # Distributed: runs the steps (the DDP wrapper, or `model` sharded in place by FSDP2)
    step_model: nn.Module  # `parallel`, compiled if train.compile (FSDP2: its blocks, see distributed.wrap)
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: TokenLoader
    autocast: torch.autocast
    scaler: torch.amp.GradScaler  # enabled for fp16 only
    fold_clip: bool  # the clip is folded into fused AdamW (training/optim.py: clip_gradients)
    guard: NonFiniteGuard
    logger: metrics.MetricsLogger | metrics.NullLogger
    throughput: metrics.Throughput
    flops_per_token: float
    peak_flops: float | None  # of one GPU; None (no MFU) on CPU and on GPUs missing from the table
    config_dict: dict[str, Any]  # cfg as plain containers: the wandb config, and a copy in every checkpoint
    base: dict[str, Any] | None  # a LoRA run's frozen base: its init_from and fingerprint (model/lora.py)
    start_step: int = 0
    # progress
    step: int = 0  # optimizer steps completed
    best_val: float = math.inf
    last_saved: str | None = None  # the latest checkpoint saved or resumed from, named by errors
    first_loss: float = math.nan  # the run's first logged loss (step 1's), carried by its checkpoints
    segment_first_loss: float = math.nan  # this launch's first (step start_step + 1's): first_loss unless resumed
    last_loss: float = math.nan
    val_loss: float = math.nan
    rates: list[float] = field(default_factory=list)  # tokens/sec of each log window
    trained_rates: list[float] = field(default_factory=list)  # trained tokens/sec of each log window
    peaks: list[dict[str, float]] = field(default_factory=list)  # peak memory of each log window


def train(cfg: Config, run_dir: Path, root: Path | None = None) -> dict[str, Any]:
    validate(cfg)
    # Distributed: join torchrun's process group (a no-op for one process); left on success or error.
    ctx = distributed.setup(cfg.train.distributed, resolve_device(cfg.train.device.value, key="train.device"))
    try:
        dtype = resolve_dtype(cfg.train.dtype, ctx.device, key="train.dtype")  # after setup: on this rank's GPU
        run_dir = ctx.from_main(run_dir)
        p = plan(cfg, run_dir, root, ctx)
        if p.resume is not None and p.resume["step"] >= cfg.train.max_steps:
            return nothing_to_train(p.resume["step"], cfg.train.max_steps, p.resume_from, run_dir, ctx)
        # No reference to the Run outlives run(): DDP's reducer must be freed before its process group is destroyed
        # (freed after it, gloo's destructor can deadlock).
        return run(build(cfg, run_dir, ctx, dtype, p))
    finally:
        distributed.teardown(ctx)


@dataclass
class Plan:
    """What a run is, settled before any model is built: its model config and tokenizer (init_from), its data, the
    checkpoint it resumes from, and (train.epochs) its length."""

    init: Init
    loader: TokenLoader | ExampleLoader
    resume_from: Path | None
    resume: dict[str, Any] | None


def plan(cfg: Config, run_dir: Path, root: Path | None, ctx: distributed.Context) -> Plan:
    """The run's Plan; train.epochs sets train.max_steps here, from the data."""
    t = cfg.train
    resume_from = resume_point(run_dir, t.resume, t.overwrite)  # the launch applied the same policy (claim)
    if t.resume == "auto" and resume_from is None and ctx.is_main:
        print(f"note: train.resume=auto found no checkpoint in {run_dir}: starting afresh (a default run directory "
              "is new at every launch: to continue a run, give its directory as hydra.run.dir)", flush=True)
    # A sharded checkpoint's model and optimizer are read later, each rank its part (distributed.load_sharded).
    resume = load_checkpoint(resume_from, tensors=not is_sharded(resume_from)) if resume_from else None
    init = resolve_init(cfg)
    cfg.data.encoding = init.encoding  # resolved once: the checkpoints and the data cache record the tokenizer
    if resume:
        check_resumable(resume, init.gpt_config, cfg)
    # Data, then model: the loader checks that the data's ids and length fit the model before any large allocation.
    loader = setup_data(cfg, init.gpt_config, ctx, root)
    if t.epochs is not None:
        t.max_steps = math.ceil(t.epochs * loader.epoch_batches() / t.grad_accum_steps)
        if ctx.is_main:
            print(f"note: train.epochs={t.epochs} is train.max_steps={t.max_steps}", flush=True)
    return Plan(init, loader, resume_from, resume)


def nothing_to_train(step: int, max_steps: int, resume_from: Path, run_dir: Path, ctx: distributed.Context
                     ) -> dict[str, Any]:
    """A resume whose checkpoint is at train.max_steps already: the run is complete, and this launch writes nothing
    (its summary.json stays the one that tells how it went). One past it is refused."""
    if step > max_steps:
        raise CheckpointError(f"cannot resume {resume_from} (step {step}) up to train.max_steps={max_steps}: it is "
                              f"past that step already; set train.max_steps above {step} to train on")
    if ctx.is_main:
        print(f"note: {resume_from} is at step {step} = train.max_steps: the run is complete, nothing to train (set "
              f"train.max_steps above {step} to train on)", flush=True)
    summary = run_dir / "summary.json"
    own = resume_from.parent.parent.resolve() == run_dir.resolve()
    return json.loads(summary.read_text()) if own and summary.is_file() else {"steps": step}


def build(cfg: Config, run_dir: Path, ctx: distributed.Context, dtype: torch.dtype, p: Plan) -> Run:
    """The run's objects, in the order that makes a resumed run continue exactly: seeds, model, optimizer, then the
    states of the checkpoint resumed from, RNG included."""
    t, init, loader, resume_from, resume = cfg.train, p.init, p.loader, p.resume_from, p.resume
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32

    model, base = setup_model(cfg, init, ctx, dtype)
    if resume and base:
        check_base_of(resume, base, resume_from)
    n_params = model.num_params()  # before FSDP2 shards the parameters
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Distributed: DDP or FSDP2 (see Run.parallel); compiled as one graph (DDP too, see distributed.wrap) or, under
    # FSDP2, block by block (train.fsdp.compile_blocks)
    parallel, step_model = distributed.wrap(model, ctx, dtype, t.compile, t.fsdp)
    optimizer, scheduler = setup_optimizer(cfg, model, ctx)
    start_step, best_val, last_saved = 0, math.inf, None
    if resume:
        start_step, best_val, last_saved = restore(resume, resume_from, model, optimizer, scheduler, loader)
    first_loss = resume.get("first_train_loss", math.nan) if resume else math.nan  # older checkpoints lack it
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)  # fp16 only
    autocast = torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32)
    fold_clip = is_fused(optimizer) and not scaler.is_enabled() and (ctx.mode != Distributed.fsdp
                                                                     or isinstance(optimizer, ShardAdamW))
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    # A run resumed in its own directory keeps its metrics.jsonl up to the step it resumes from (the lines of the
    # interrupted steps after it are logged anew); in a new directory the file starts afresh.
    own = resume_from is not None and resume_from.parent.parent.resolve() == run_dir.resolve()
    logger, throughput, flops_per_token, peak_flops = setup_metrics(
        cfg, run_dir, ctx, dtype, init.gpt_config, n_params, n_trainable, config_dict, start_step,
        kept_steps=start_step if own else 0, wandb_id=resume.get("wandb_id") if resume else None)
    if isinstance(loader, ExampleLoader):
        logger.summary(loader.summary())  # the examples served, truncated and dropped
    if resume:
        changes = config_changes(resume["config"], config_dict)
        logger.note(f"resuming {last_saved} with " + (", ".join(changes) if changes else "the checkpoint's config"))
    for warning in config_warnings(t):
        logger.note(f"warning: {warning}")
    return Run(cfg=cfg, ctx=ctx, run_dir=run_dir, gpt_config=init.gpt_config, model=model, parallel=parallel,
               step_model=step_model, optimizer=optimizer, scheduler=scheduler, loader=loader, autocast=autocast,
               scaler=scaler, fold_clip=fold_clip, guard=NonFiniteGuard(t.nonfinite.value, t.max_skipped_steps),
               logger=logger, throughput=throughput, flops_per_token=flops_per_token, peak_flops=peak_flops,
               config_dict=config_dict, base=base, start_step=start_step, step=start_step, best_val=best_val,
               last_saved=last_saved, first_loss=first_loss)


def setup_data(cfg: Config, gpt_config: GPTConfig, ctx: distributed.Context, root: Path | None
               ) -> TokenLoader | ExampleLoader:
    """The prepared data (made once, cached) and the loader of this rank's batches: token windows of text
    (data.format=text), or instruction or chat examples (data/sft.py), packed into rows or one per row."""
    data = prepare_dataset(cfg.data, root=root)
    args = (data, gpt_config.block_size, cfg.train.batch_size, ctx.device, cfg.train.seed)
    kwargs = {"vocab_size": gpt_config.vocab_size, "rank": ctx.rank, "world_size": ctx.world_size}
    if not isinstance(data, PreparedExamples):
        return TokenLoader(*args, **kwargs)
    loader = ExampleLoader(*args, overlong=cfg.data.overlong, packing=cfg.data.packing, **kwargs)
    if ctx.is_main:
        rows_per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * ctx.world_size
        counts = loader.summary()
        packed = (f", packed into {loader.rows_per_epoch:,} rows of {gpt_config.block_size} tokens "
                  f"({counts['data/packing_fill']:.1%} filled)" if loader.packing else "")
        print(f"note: {counts['data/train_examples']:,} train and {counts['data/val_examples']:,} val examples "
              f"({loader.describe_drops()}){packed}; an epoch is {loader.rows_per_epoch / rows_per_step:,.1f} "
              f"steps of {rows_per_step} {'rows' if loader.packing else 'examples'}", flush=True)
    return loader


def setup_model(cfg: Config, init: Init, ctx: distributed.Context, dtype: torch.dtype
                ) -> tuple[GPT, dict[str, Any] | None]:
    """The model init_from names, on this rank's device, set up for this run's training, and for a LoRA run (lora.rank
    > 0) its base: adapters added, every other weight frozen and kept in the compute dtype (no gradient, optimizer
    state or fp32 copy for it), the adapters in fp32."""
    model, base = init.model(), None
    if cfg.lora.rank:
        add_lora(model, cfg.lora)
        base = {"init_from": cfg.init_from, "fingerprint": fingerprint(model)}  # of the weights as loaded
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)
    model.to(ctx.device).set_activation_checkpointing(cfg.train.activation_checkpointing.value)
    return model, base


def setup_optimizer(cfg: Config, model: GPT, ctx: distributed.Context
                    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = build_optimizer(model, cfg.train, ctx.device.type)
    return optimizer, build_scheduler(optimizer, cfg.train)


def restore(resume: dict[str, Any], resume_from: Path, model: GPT, optimizer: torch.optim.AdamW,
            scheduler: torch.optim.lr_scheduler.LambdaLR, loader: TokenLoader) -> tuple[int, float, str]:
    """A checkpoint's states into the run's objects; returns (its step, its best val loss, how errors name it).
    AdamW's moments and the schedule's step are the checkpoint's; lr, betas, weight decay and schedule this run's."""
    with keep_hyperparameters(optimizer, scheduler):
        if is_sharded(resume_from):
            distributed.load_sharded(model, optimizer, resume_from)
        else:
            distributed.load_state_dicts(model, optimizer, resume)
        scheduler.load_state_dict(resume["scheduler"])
    loader.load_state_dict(resume["loader"])
    set_rng_state(resume["rng"])
    return resume["step"], resume["best_val_loss"], f"{resume_from} (step {resume['step']})"


def setup_metrics(cfg: Config, run_dir: Path, ctx: distributed.Context, dtype: torch.dtype, gpt_config: GPTConfig,
                  n_params: int, n_trainable: int, config_dict: dict[str, Any], start_step: int, kept_steps: int,
                  wandb_id: str | None
                  ) -> tuple[metrics.MetricsLogger | metrics.NullLogger, metrics.Throughput, float, float | None]:
    """The logger (rank 0 alone logs: Distributed), the throughput meter, the FLOPs per token and the GPU's peak
    FLOP/s (None: no MFU, on CPU and on GPUs missing from the table). A step is the global batch: batch_size ×
    grad_accum_steps × world_size sequences. The run's facts go into the summary."""
    t, device = cfg.train, ctx.device
    global_batch = t.batch_size * t.grad_accum_steps * ctx.world_size
    tokens_per_step = global_batch * gpt_config.block_size
    frozen = n_params - n_trainable if cfg.lora.rank else 0  # a LoRA run's base (no embedding trains)
    flops_per_token = metrics.flops_per_token(n_params, gpt_config.n_layer, gpt_config.n_head, gpt_config.head_dim,
                                              gpt_config.block_size, frozen)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_flops = metrics.peak_flops(device_name, dtype) if device.type == "cuda" else None
    # The wandb run of a resumed checkpoint continues (wandb_id).
    logger = (metrics.MetricsLogger(run_dir, config_dict, cfg.wandb, t.max_steps, start_step, kept_steps=kept_steps,
                                    wandb_id=wandb_id) if ctx.is_main else metrics.NullLogger())
    logger.summary({"attention": gpt_config.attention, "sdpa_backend": gpt_config.sdpa_backend,
                    "device": device_name, "dtype": str(dtype).removeprefix("torch."), "n_params": n_params,
                    "n_trainable_params": n_trainable, "torch": torch.__version__, "tokens_per_step": tokens_per_step,
                    "resumed_from_step": start_step,
                    "distributed": ctx.mode.value, "world_size": ctx.world_size, "global_batch_size": global_batch,
                    "global_batch_tokens": tokens_per_step})
    return logger, metrics.Throughput(device, tokens_per_step), flops_per_token, peak_flops


def run(r: Run) -> dict[str, Any]:
    """Optimizer steps until train.max_steps or a stop signal, with logs, evals and checkpoints at their intervals."""
    t, ctx = r.cfg.train, r.ctx
    # Which SDPA kernel runs is found by profiling one step after the first (compilation is over by then).
    profile_step = r.start_step + min(1, t.max_steps - r.start_step - 1)
    with (StopSignal() as stop, metrics.close_on_error(r.logger), ScheduledGC(t.gc_interval) as collector,
          torch.autograd.set_multithreading_enabled(t.autograd_multithreading)):
        for step in range(r.start_step, t.max_steps):
            collector.step(step)
            if step - r.start_step == t.perf_warmup_steps:
                r.throughput.start()
            lr = r.scheduler.get_last_lr()[0]
            if step == profile_step and r.gpt_config.attention == "sdpa":
                (loss, bad), kernel, evidence = metrics.detect_sdpa_kernel(lambda: train_step(r))
                r.logger.summary({"sdpa_kernel": kernel, "sdpa_kernel_evidence": evidence[:4]})
            else:
                loss, bad = train_step(r)
            r.scheduler.step()
            r.logger.advance()
            done = r.step = step + 1  # optimizer steps completed
            r.guard.record(done, bad)
            log_now = done % t.log_interval == 0 or done in (r.start_step + 1, t.max_steps)  # the first step too
            eval_now = done % t.eval_interval == 0 or done == t.max_steps
            sync_point = ctx.device.type == "cpu" or log_now or eval_now  # GPUs: points that synchronise anyway
            # Distributed: all ranks stop at the same step (see distributed.Context.stop_agreed)
            stopping = ctx.stop_agreed(stop.received is not None, sync_point)
            if (sync_point or stopping) and r.guard.check(r.last_saved):
                r.logger.log(done, {metrics.SKIPPED_STEPS: len(r.guard.skipped)})  # raises instead under nonfinite=stop

            if log_now:
                log_train(r, done, loss, lr)
            if eval_now:
                collector.full()
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


class ScheduledGC:
    """With interval > 0, Python's automatic garbage collection is off in the loop: the young generations are collected
    every `interval` steps (torchtitan's gc_freq) and everything at each eval point. An automatic collection starts
    wherever allocations cross its threshold, in the middle of a step, and its full passes walk every object of the
    process, time in which a host-bound step (FSDP2's hooks, small models) leaves the GPU waiting. interval=0 leaves
    Python's automatic collection on."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def __enter__(self) -> "ScheduledGC":
        if self.interval:
            gc.disable()
            gc.collect()
        return self

    def step(self, step: int) -> None:
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def full(self) -> None:
        if self.interval:
            gc.collect()

    def __exit__(self, *exc: object) -> None:
        if self.interval:
            gc.enable()


def train_step(r: Run) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over grad_accum_steps micro-batches; returns (its loss, whether it was skipped). The loss is
    the mean over the step's trained tokens: this rank's share of it, which the mean over ranks completes (log_train),
    as DDP's and FSDP's mean of the gradients completes the gradient's."""
    t = r.cfg.train
    batches = [r.loader.next_batch() for _ in range(t.grad_accum_steps)]
    shares, trained = token_shares(r.ctx, [batch.y for batch in batches])  # (grad_accum_steps,), all ranks' count
    total = torch.zeros((), device=r.ctx.device)
    for micro, (batch, share) in enumerate(zip(batches, shares, strict=True)):
        # Distributed: gradients are reduced across ranks once a step, in the last micro-batch's backward
        with distributed.gradient_sync(r.parallel, micro == t.grad_accum_steps - 1):
            with r.autocast:
                _, loss = r.step_model(batch.x, batch.y, **model_inputs(batch))  # no logits: no gradient buffer
            loss = weighted(loss, share)
            r.scaler.scale(loss / t.grad_accum_steps).backward()
        total += loss.detach()
    r.scaler.unscale_(r.optimizer)
    params = [p for p in r.model.parameters() if p.grad is not None]
    norm = clip_gradients(r.optimizer, params, t.grad_clip, fold=r.fold_clip)
    # Distributed: skip or apply a step on every rank alike (the norm is global, a rank's loss is not)
    bad = r.ctx.any(r.guard.bad(total, distributed.full_tensor(norm)))
    apply_step(r.optimizer, r.scaler, skip=bad)
    r.optimizer.zero_grad(set_to_none=True)
    r.throughput.count(trained)
    return total / t.grad_accum_steps, bad


def model_inputs(batch: Batch) -> dict[str, Any]:
    """The model's keyword inputs for a batch besides x and y: no logits (so no gradient buffer for them) and, for
    packed rows only, the positions (the graph of unpacked batches stays as it was)."""
    return {"return_logits": False, **({"positions": batch.positions} if batch.positions is not None else {})}


def token_shares(ctx: distributed.Context, targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of each micro-batch's mean loss in the mean over every trained token of all of them, on all ranks:
    its trained tokens × the number of micro-batches × ranks / all trained tokens; and that number of all trained
    tokens. The weighted mean losses, averaged over micro-batches and ranks, are the mean over all trained tokens;
    where every target counts, each weight is exactly 1.0, so a step computes the same floats as a plain mean of its
    micro-batches' means. A collective."""
    counts = torch.stack([(y != IGNORE_INDEX).sum() for y in targets])  # (n,) int64
    total = ctx.sum(counts.sum())
    return counts * (len(targets) * ctx.world_size) / total, total


def weighted(losses: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
    """Mean losses times their token_shares; a micro-batch without a trained token (its mean is NaN) adds nothing."""
    return torch.where(shares > 0, losses * shares, 0.0)


def mfu(r: Run, tokens_per_sec: float) -> float | None:
    """Model FLOPs utilisation of one GPU at this global rate, if the GPU's peak is known."""
    return tokens_per_sec / r.ctx.world_size * r.flops_per_token / r.peak_flops if r.peak_flops else None


def log_train(r: Run, step: int, loss: torch.Tensor, lr: float) -> None:
    """A log point: the step's loss (mean over ranks), the learning rate, throughput and MFU since the last log point,
    peak memory."""
    r.last_loss = r.ctx.mean(loss).item()  # synchronises: once per log interval, not per step
    if step == r.start_step + 1:
        r.segment_first_loss = r.last_loss
        if r.start_step == 0:
            r.first_loss = r.last_loss
    out = {metrics.TRAIN_LOSS: r.last_loss, metrics.LR: lr}
    rate = r.throughput.rate()
    if rate is not None:
        r.rates.append(rate)
        out[metrics.TOKENS_PER_SEC] = rate
        out[metrics.TOKENS_PER_SEC_PER_GPU] = rate / r.ctx.world_size
        out[metrics.TRAINED_TOKENS_PER_SEC] = r.throughput.trained_rate
        r.trained_rates.append(r.throughput.trained_rate)
        if r.peak_flops:
            out[metrics.MFU] = mfu(r, rate)
    mem = metrics.memory_metrics(r.ctx.device)
    out.update(mem)
    r.peaks.append(mem)
    r.logger.log(step, out)


@torch.no_grad()
def evaluate(r: Run, step: int) -> None:
    """The val loss, the mean over the trained tokens of train.eval_batches batches (on every rank), logged; a new
    best is saved as checkpoints/best.pt."""
    r.step_model.eval()
    losses, targets = [], []
    for batch in r.loader.eval_batches("val", r.cfg.train.eval_batches):  # each rank: its share of the val windows
        with r.autocast:
            _, loss = r.step_model(batch.x, batch.y, **model_inputs(batch))
        losses.append(loss.float())
        targets.append(batch.y)
    r.step_model.train()
    val = weighted(torch.stack(losses), token_shares(r.ctx, targets)[0]).mean()
    r.val_loss = r.ctx.mean(val).item()  # Distributed: the mean over all ranks' windows
    r.logger.log(step, {metrics.VAL_LOSS: r.val_loss})
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
        largest = distributed.full_tensor(
            torch.nn.utils.get_total_norm(list(r.model.parameters()), norm_type=math.inf)).item()
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
             "first_train_loss": r.first_loss, "wandb_id": r.logger.wandb_id}
    if r.base:  # the adapters alone (distributed.GATHER leaves the frozen base out), and the base they belong to
        state |= {"lora": asdict(r.cfg.lora), "base": r.base}
    if sharded:
        distributed.save_sharded(r.ctx, r.model, r.optimizer, state, path)
    else:
        state = {**distributed.state_dicts(r.model, r.optimizer), **state}
        if r.ctx.is_main:
            save_checkpoint(state, path)
        r.ctx.barrier()
    if r.ctx.is_main:  # the other form, from a run resumed in another mode, is older: it must not be resumed
        remove_checkpoint(checkpoints / f"{name}{'.pt' if sharded else SHARDED}")
    return f"{path} (step {step})"


def stop_note(r: Run, signal_name: str, step: int) -> str:
    """What a run stopped by a signal tells its user: where it saved, and the command that continues it."""
    if not own_checkpoints(r.run_dir):
        return (f"stopped by {signal_name} after step {step}; no checkpoint in {r.run_dir} to resume from (latest "
                f"good checkpoint: {r.last_saved or 'none'})")
    return (f"stopped by {signal_name} after step {step}; latest checkpoint: {r.last_saved}. To continue this run:\n"
            f"  {resume_command(r.run_dir, r.ctx.world_size)}")


def finish(r: Run) -> dict[str, Any]:
    """The end-of-run figures, added to the summary; closes the logger and returns the whole summary."""
    summary = {"first/train_loss": r.first_loss, "final/train_loss": r.last_loss, "final/val_loss": r.val_loss,
               "best/val_loss": r.best_val, "steps": r.step, "skipped_steps": r.guard.skipped,
               "last_checkpoint": r.last_saved}
    if r.start_step:  # resumed: the first loss of this launch's steps, beside the run's
        summary["resumed/first_train_loss"] = r.segment_first_loss
    if r.rates:
        median = summary["perf/tokens_per_sec_median"] = sorted(r.rates)[len(r.rates) // 2]
        summary["perf/trained_tokens_per_sec_median"] = sorted(r.trained_rates)[len(r.trained_rates) // 2]
        if r.peak_flops:
            summary["perf/mfu_median"] = mfu(r, median)
    for key in r.peaks[0] if r.peaks else ():
        summary[f"{key}_max"] = max(p[key] for p in r.peaks)  # the run's peak: the largest of the per-log peaks
    r.logger.summary(summary)
    return r.logger.close()


def check_resumable(state: dict[str, Any], gpt_config: GPTConfig, cfg: Config) -> None:
    """Resume only what can be continued: the same model shapes, the same data (the loader's position), the same
    seed (the data order and the random state continue the checkpoint's: another seed would not apply) and the same
    adapters (LoRA: rank, alpha, targets)."""
    saved = asdict(GPTConfig(**state["model_config"]))  # normalised as the run's (n_kv_head, qkv_bias, defaults)
    diff = [f"model.{k}: checkpoint {saved[k]} vs run {getattr(gpt_config, k)}" for k in SHAPE_KEYS
            if saved[k] != getattr(gpt_config, k)]
    saved_data = {**DATA_DEFAULTS, **state["config"]["data"]}
    data = {k: v.value if isinstance(v, Enum) else v for k, v in asdict(cfg.data).items()}  # as checkpoints hold them
    diff += [f"data.{k}: checkpoint {saved_data[k]} vs run {data[k]}" for k in DATA_KEYS if saved_data[k] != data[k]
             and (k != "packing" or data["format"] != "text")]  # text windows are full rows either way
    if state["config"]["train"]["seed"] != cfg.train.seed:
        diff.append(f"train.seed: checkpoint {state['config']['train']['seed']} vs run {cfg.train.seed}")
    saved_lora = state.get("lora", asdict(LoRAConfig()))  # a checkpoint without adapters: rank 0
    diff += [f"lora.{k}: checkpoint {saved_lora[k]} vs run {getattr(cfg.lora, k)}" for k in ("rank", "alpha", "targets")
             if saved_lora[k] != getattr(cfg.lora, k) and (cfg.lora.rank or k == "rank")]
    if diff:
        raise CheckpointError("cannot resume: the checkpoint's run differs from this one (" + "; ".join(diff)
                              + "). Resume with the same settings, or start anew from its weights with "
                              "init_from=<checkpoint>.")


def check_base_of(state: dict[str, Any], base: dict[str, Any], resume_from: Path) -> None:
    """A LoRA checkpoint resumes only on the base its adapters were trained on."""
    if state["base"]["fingerprint"] != base["fingerprint"]:
        raise CheckpointError(f"cannot resume {resume_from}: its adapters were trained on init_from="
                              f"{state['base']['init_from']}, and the weights of init_from={base['init_from']} differ "
                              "from those (another model, or its files changed): resume on the base it trained on")


def config_changes(saved: dict[str, Any], run: dict[str, Any], prefix: str = "") -> list[str]:
    """`key old -> new` for each config key of this run whose value differs from the checkpoint's (train.resume
    aside). The run's values are what runs: hyperparameters included (build: keep_hyperparameters)."""
    changes = []
    for key, value in run.items():
        name, old = f"{prefix}{key}", saved.get(key)
        if key not in saved or name == "train.resume":  # a key the checkpoint's config lacks: nothing to compare
            continue
        if isinstance(value, dict) and isinstance(old, dict):
            changes += config_changes(old, value, f"{name}.")
        elif value != old:
            changes.append(f"{name} {old} -> {value}")
    return changes

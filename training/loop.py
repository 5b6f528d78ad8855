"""The training loop, top to bottom: config → model + data → steps → metrics, evals and checkpoints.

Called by train.py with the validated config and the run directory; returns the run's summary.
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
from training import metrics as M
from training.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.config import Config, Device, DType, validate
from training.optim import build_optimizer, build_scheduler

DTYPES = {DType.bf16: torch.bfloat16, DType.fp16: torch.float16, DType.fp32: torch.float32}
SHAPE_KEYS = ("block_size", "vocab_size", "pad_vocab_multiple", "n_layer", "n_head", "n_embd", "bias")


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
    """The model's shapes: from the config, or from the checkpoint that init_from names (with this run's
    attention backend and dropout)."""
    m = cfg.model
    config = GPTConfig(
        block_size=m.block_size, vocab_size=m.vocab_size or vocab_size, pad_vocab_multiple=m.pad_vocab_multiple,
        n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout, bias=m.bias,
        attention=cfg.attention.name.value, sdpa_backend=cfg.attention.sdpa_backend.value,
    )
    if cfg.init_from == "scratch":
        return config
    if Path(cfg.init_from).is_file():
        shapes = load_checkpoint(cfg.init_from)["model_config"]
        return GPTConfig(**{**asdict(config), **{k: shapes[k] for k in SHAPE_KEYS}})
    raise ValueError(f"init_from={cfg.init_from!r}: expected 'scratch' or a checkpoint file of ours (.pt)")


def build_model(cfg: Config, gpt_config: GPTConfig) -> GPT:
    model = GPT(gpt_config)
    if cfg.init_from != "scratch":
        model.load_state_dict(load_checkpoint(cfg.init_from)["model"])
    return model


def check_resumable(state: dict[str, Any], gpt_config: GPTConfig) -> None:
    saved = state["model_config"]
    diff = [f"model.{k}: checkpoint {saved[k]} vs run {getattr(gpt_config, k)}" for k in SHAPE_KEYS
            if saved[k] != getattr(gpt_config, k)]
    if diff:
        raise CheckpointError("cannot resume: the checkpoint's model differs from this run's (" + "; ".join(diff)
                              + "). Resume with the same model settings, or start anew with init_from=<checkpoint>.")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TokenLoader, n_batches: int, autocast: torch.autocast) -> float:
    model.eval()
    losses = []
    for x, y in loader.eval_batches("val", n_batches):
        with autocast:
            _, loss = model(x, y)
        losses.append(loss.float())
    model.train()
    return torch.stack(losses).mean().item()


def train(cfg: Config, run_dir: Path, root: Path | None = None) -> dict[str, Any]:
    validate(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    device = resolve_device(t.device)
    dtype = resolve_dtype(t.dtype, device)
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    torch.backends.cuda.matmul.allow_tf32 = t.tf32
    torch.backends.cudnn.allow_tf32 = t.tf32

    # Data, then model: the tokenizer's vocabulary sizes the model, and the loader checks that the data's ids and
    # length fit it before any large allocation.
    resume = load_checkpoint(t.resume) if t.resume else None
    gpt_config = model_config(cfg, get_encoding(cfg.data.encoding).n_vocab)
    if resume:
        check_resumable(resume, gpt_config)
    data: PreparedData = prepare_dataset(cfg.data, root=root)
    loader = TokenLoader(data, gpt_config.block_size, t.batch_size, device, t.seed, vocab_size=gpt_config.vocab_size)
    model = build_model(cfg, gpt_config).to(device)

    optimizer = build_optimizer(model, t, device.type)
    scheduler = build_scheduler(optimizer, t)
    start_step, best_val = 0, math.inf
    if resume:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        loader.load_state_dict(resume["loader"])
        set_rng_state(resume["rng"])
        start_step, best_val = resume["step"], resume["best_val_loss"]
    step_model = torch.compile(model) if t.compile else model
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # Metrics: throughput from the steps after warm-up; MFU when the GPU is in the peak-FLOPS table.
    tokens_per_step = t.batch_size * t.grad_accum_steps * gpt_config.block_size
    throughput = M.Throughput(device, tokens_per_step)
    n_params = model.num_params()
    flops_per_token = M.flops_per_token(
        n_params, gpt_config.n_layer, gpt_config.n_head, gpt_config.n_embd // gpt_config.n_head, gpt_config.block_size)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = M.peak_flops(device_name, dtype) if device.type == "cuda" else None
    config_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    logger = M.MetricsLogger(run_dir, config_dict, cfg.wandb, t.max_steps, start_step)
    logger.summary({"attention": gpt_config.attention, "sdpa_backend": gpt_config.sdpa_backend,
                    "device": device_name, "dtype": str(dtype).removeprefix("torch."), "n_params": n_params,
                    "torch": torch.__version__, "tokens_per_step": tokens_per_step})

    def save(name: str, step: int) -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "step": step, "rng": rng_state(), "loader": loader.state_dict(), "config": config_dict,
                 "model_config": asdict(gpt_config), "best_val_loss": best_val}
        save_checkpoint(state, run_dir / "checkpoints" / name)

    def train_step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(t.grad_accum_steps):
            x, y = loader.next_batch()
            with autocast:
                _, loss = step_model(x, y)
            scaler.scale(loss / t.grad_accum_steps).backward()
            total += loss.detach()
        if t.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return total / t.grad_accum_steps

    # Which SDPA kernel runs is found by profiling one step after the first (compilation is over by then).
    profile_step = start_step + min(1, t.max_steps - start_step - 1)
    rates, peaks, first_loss, last_loss, val_loss = [], [], math.nan, math.nan, math.nan
    for step in range(start_step, t.max_steps):
        if step - start_step == t.perf_warmup_steps:
            throughput.start()
        lr = scheduler.get_last_lr()[0]
        if step == profile_step and gpt_config.attention == "sdpa":
            loss, kernel, evidence = detect_sdpa_kernel(train_step)
            logger.summary({"sdpa_kernel": kernel, "sdpa_kernel_evidence": evidence[:4]})
        else:
            loss = train_step()
        scheduler.step()
        throughput.count()
        logger.advance()
        done = step + 1  # optimizer steps completed

        if done % t.log_interval == 0 or done in (start_step + 1, t.max_steps):  # the first step's loss too
            last_loss = loss.item()  # synchronises: once per log interval, not per step
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"train/loss is {last_loss} at step {done}: lower train.learning_rate")
            first_loss = last_loss if done == start_step + 1 else first_loss
            out = {M.TRAIN_LOSS: last_loss, M.LR: lr}
            rate = throughput.rate()
            if rate is not None:
                rates.append(rate)
                out[M.TOKENS_PER_SEC] = rate
                if peak:
                    out[M.MFU] = rate * flops_per_token / peak
            mem = M.memory_metrics(device)
            out.update(mem)
            peaks.append(mem)
            logger.log(done, out)

        if done % t.eval_interval == 0 or done == t.max_steps:
            val_loss = evaluate(step_model, loader, t.eval_batches, autocast)
            logger.log(done, {M.VAL_LOSS: val_loss})
            if val_loss < best_val:
                best_val = val_loss
                if t.save_checkpoints:
                    save("best.pt", done)
            if t.save_checkpoints:
                save("last.pt", done)
            throughput.restart()  # evals and checkpoints are not training throughput

    summary = {"first/train_loss": first_loss, "final/train_loss": last_loss, "final/val_loss": val_loss,
               "best/val_loss": best_val, "steps": t.max_steps}
    if rates:
        median = summary["perf/tokens_per_sec_median"] = sorted(rates)[len(rates) // 2]
        if peak:
            summary["perf/mfu_median"] = median * flops_per_token / peak
    for key in peaks[0] if peaks else ():
        summary[f"{key}_max"] = max(p[key] for p in peaks)  # the run's peak: the largest of the per-log peaks
    logger.summary(summary)
    return logger.close()

"""AdamW with weight decay on matrices only, gradient clipping, the step that may be skipped, and the learning-rate
schedule (linear warm-up, cosine decay).

A training step ends with `clip_gradients` then `apply_step` (training/loop.py: train_step). A resumed run loads
the optimizer and scheduler state inside `keep_hyperparameters`. Under FSDP2 with train.fsdp.local_optimizer, both
run on each rank's local shards (`ShardAdamW`, `shard_norm`) instead of through DTensor's dispatch.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from training.config import Distributed, TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (also for FSDP's sharded DTensor parameters: DTensor runs the kernel on each shard)."""
    # Decay the >=2-D weights (matmuls, embeddings); biases and LayerNorm gains are left alone.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    local = cfg.distributed == Distributed.fsdp and cfg.fsdp.local_optimizer
    return (ShardAdamW if local else torch.optim.AdamW)(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=device_type == "cuda"
    )


def local(tensors: list[Tensor]) -> list[Tensor]:
    """Each DTensor's local shard (a plain tensor, the same storage); plain tensors as they are."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


class ShardAdamW(torch.optim.AdamW):
    """torch's AdamW step run on the local shards of FSDP2's DTensor parameters, gradients and moments. The update is
    elementwise, so each rank's shards alone give the stock step's result, bit for bit; the stock step hands the
    DTensors to the kernel, and DTensor's dispatch of the lists costs host time per parameter and step. The state
    stays DTensors (checkpoints are unchanged); `clip_gradients` folds the clip into it as on one GPU."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists = [], [], [], [], [], []
            has_complex = self._init_group(group, *lists)  # AdamW's own: creates the state on the first step
            adam(*map(local, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)), steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=group["betas"][0],
                 beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
                 differentiable=group["differentiable"], fused=group["fused"],
                 grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                 decoupled_weight_decay=group["decoupled_weight_decay"])


def shard_norm(grads: list[Tensor]) -> Tensor:
    """The global L2 norm of FSDP2's sharded gradients from the local shards: one all-reduce of the squared sum."""
    squares = torch.stack(torch._foreach_norm(local(grads))).float().square().sum()
    if dist.is_initialized():
        dist.all_reduce(squares)
    return squares.sqrt()


def clip_gradients(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float,
                   fold: bool) -> torch.Tensor:
    """Clip the gradients' global L2 norm to max_norm (0: no clipping); returns the norm before clipping.

    fold=False rescales the gradients in place (`clip_grad_norm_`). fold=True, for fused AdamW only, hands the
    divisor max(1, norm / max_norm) to the optimizer as `grad_scale` (the contract GradScaler uses): the fused kernel
    divides each gradient as it reads it, which saves a read-write pass over all gradients (measured in
    docs/results/). The next optimizer step applies it: `apply_step`, which then removes it. With ShardAdamW the norm
    is taken on the local shards (`shard_norm`).
    """
    grads = [p.grad for p in params]
    total_norm = shard_norm if isinstance(optimizer, ShardAdamW) else torch.nn.utils.get_total_norm
    if max_norm <= 0:
        return total_norm(grads)
    if not fold:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = total_norm(grads)
    # the same coefficient as clip_grad_norm_: max_norm / (norm + 1e-6), at most 1
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).float()
    return norm


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer runs the fused kernel (build_optimizer: on CUDA)."""
    return any(group.get("fused") for group in optimizer.param_groups)


def apply_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: torch.Tensor) -> None:
    """optimizer.step(), unless skip (a 0-d bool tensor: the step's loss or gradients are not finite) is true.

    - fp16 (the scaler is enabled): GradScaler skips the steps whose gradients are not finite itself.
    - fused AdamW: `found_inf` makes the kernel skip the whole update on the GPU, so skip is never read back (no host
      synchronisation per step); the kernel also divides by `grad_scale`, the clip that clip_gradients folded in.
    - otherwise (CPU): skip is read on the host, which costs nothing there.
    """
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif is_fused(optimizer):
        optimizer.found_inf = skip.float()
        optimizer.step()
        del optimizer.found_inf
        optimizer.__dict__.pop("grad_scale", None)
    elif not skip.item():
        optimizer.step()


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Factor on train.learning_rate at `step`: linear warm-up, cosine to min_lr_ratio, then flat."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step >= decay_steps:
        return cfg.min_lr_ratio
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + 0.5 * (1.0 - cfg.min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


@contextmanager
def keep_hyperparameters(optimizer: torch.optim.Optimizer,
                         scheduler: torch.optim.lr_scheduler.LambdaLR) -> Iterator[None]:
    """Load a checkpoint's optimizer and scheduler state inside this: the state is the checkpoint's (AdamW's moments
    and step counts, the schedule's step), the hyperparameters stay this run's config, which built the optimizer and
    scheduler (every param-group setting: lr, betas, weight_decay, ...; the schedule's base lr; the schedule itself
    is build_scheduler's function of the config and is never saved). Loading alone would bring back the
    checkpoint's hyperparameters, while the run's config recorded the new ones."""
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs)
    yield
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        group.update(own)
    scheduler.base_lrs = base_lrs
    # The lr of the next step: this schedule at the loaded step, computed as LambdaLR.step does (so bit-identical
    # to the checkpoint's when nothing changed). _last_lr is what get_last_lr() reports and state_dict() saves.
    scheduler._last_lr = [base * schedule(scheduler.last_epoch)
                          for base, schedule in zip(base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, scheduler._last_lr, strict=True):
        group["lr"] = lr

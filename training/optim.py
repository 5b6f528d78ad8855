"""AdamW with weight decay on matrices only, and the learning-rate schedule (linear warm-up, cosine decay)."""

import math

import torch
from torch import nn

from training.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str, fused: bool = True) -> torch.optim.AdamW:
    """AdamW, fused on CUDA unless fused=False (FSDP's sharded DTensor parameters take the foreach path)."""
    # Decay the >=2-D weights (matmuls, embeddings); biases and LayerNorm gains are left alone.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=fused and device_type == "cuda"
    )


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

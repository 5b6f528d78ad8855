"""Rotary position embeddings (RoPE, Su et al. 2021) as the Llama family uses them, with Llama-3's frequency scaling.

    cos, sin = rope_cos_sin(positions, head_dim=64, theta=10000.0, scaling=None, device=x.device)  # (P, T, hs) each
    qk = apply_rope(qk, cos, sin)   # qk: (B, T, heads, hs), rotated by each token's position

positions is (1, T) when every row sits at the same positions, (B, T) when each row has its own (KV-cache decoding
with rows of different lengths).

Each pair of channels (i, i + hs/2) of a query or key head is rotated by the angle position · inv_freq[i]; the dot
product of a rotated query and key then depends on their positions only through the difference. The pairing of
channel i with i + hs/2 (not 2i with 2i + 1) is the one of Hugging Face's Llama weights.
"""

import math
from typing import Any

import torch
from torch import Tensor


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device) -> Tensor:
    """(hs/2,) fp32 angular frequencies theta^(-2i/hs). Llama-3 scaling divides the low frequencies (wavelengths
    longer than original_max_position_embeddings / low_freq_factor) by factor, keeps the high ones (wavelengths
    shorter than original / high_freq_factor) and interpolates smoothly between the two."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    if not scaling or scaling.get("rope_type", "default") == "default":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelengths, 1: short ones
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


@torch.library.custom_op("gpt::rope_tables", mutates_args=())
def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin (P, T, hs) fp32 of positions (P, T) times inv_freq (hs/2,). An opaque op, so that torch.compile
    computes the tables once per forward: inlined, its trigonometry was recomputed inside every layer's rotary
    kernels, forward and backward."""
    freqs = positions.float()[..., None] * inv_freq  # (P, T, hs/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (P, T, hs): channel i and i + hs/2 share an angle
    return angles.cos(), angles.sin()


@rope_tables.register_fake
def _(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin (P, T, hs) in fp32 of the rotation angles at positions (P, T): computed per forward from the
    config, not kept as buffers, so a dtype cast of the model (model.to(bf16)) never rounds them."""
    return rope_tables(positions, inverse_frequencies(head_dim, theta, scaling, device))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, heads, hs) rotated: x·cos + rotate_half(x)·sin (cos, sin: (P, T, hs), P = 1 or B), in x's dtype."""
    cos, sin = cos.to(x.dtype)[:, :, None, :], sin.to(x.dtype)[:, :, None, :]  # (P, T, 1, hs)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

"""Tests for the kernel package (kernels/): the public functions against float64, layouts, errors, torch integration.

Run on CPU through the Triton interpreter (`TRITON_INTERPRET=1 python -m pytest tests/test_flash_attention.py -q`) or
on a CUDA GPU (compiled kernels; `-m gpu` selects the GPU-only tests: bf16, long sequences, determinism, inductor).

Accuracy rule (flash-attn's): against a float64 reference computed from the same (rounded) inputs, our max abs error
must be at most 2x the error of PyTorch's own attention computed in the input dtype, plus a small absolute slack (a
floor plus half an ulp of the largest reference value). Inputs are fresh random draws on every run. Every
buffer the kernels write is allocated pre-filled with NaN (autouse fixture), so an element the kernels fail to write
fails the check.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton
from helpers import ATOL, within_tolerance

from kernels import document_bounds, env, flash_attention, flash_attention_qkvpacked, flash_attention_varlen, launch
from kernels.ops import _bounds, dropout_mask, flash_attention_with_lse

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_backend = pytest.mark.skipif(DEVICE == "cpu" and not env.INTERPRET,
                                      reason="no GPU: run with TRITON_INTERPRET=1")
pytestmark = requires_backend

LSE_ATOL = 1e-5  # fp32 LSE of O(1-10) magnitude: a few ulps from the exp2/log2 domain changes


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every kernel output buffer start as NaN (integer buffers: 2), so unwritten elements cannot pass as zeros."""
    monkeypatch.setattr(launch, "alloc", lambda shape, dtype, device: torch.full(
        shape, math.nan if dtype.is_floating_point else 2, dtype=dtype, device=device))


# ----------------------------------------------------------------------------------------------------------------------
# References and the accuracy rule
# ----------------------------------------------------------------------------------------------------------------------
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               keep: torch.Tensor | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention in the inputs' dtype (the float64 reference, or PyTorch's low-precision error baseline). With
    fewer key-value heads than query heads, each is repeated for its group of query heads (autograd sums dK, dV).
    With a keep mask (B, H, T, T) the probabilities are dropped and scaled by 1 / (1 - p), p as the kernels round it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T, D)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if keep is not None:
        p = p * keep / (1 - launch.dropout_rate(dropout_p))
    return p @ v, torch.logsumexp(s, dim=-1)


def _run(fn, q, k, v, do):
    """fn(q, k, v) -> (o, lse); returns o, lse, dq, dk, dv. detach() keeps each input's strides (clone would not)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v)
    o.backward(do)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None,
           dropout_p: float = 0.0) -> None:
    """Our forward (O, LSE) and backward (dQ, dK, dV) against float64, with PyTorch-in-dtype as the error yardstick.
    With dropout, the reference applies the keep-mask that `dropout_mask` returns for the seed the kernels get."""
    scale_ = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    do = torch.randn_like(q)
    seed = torch.randint(0, 2**62, (1,), device=q.device) if dropout_p else None
    keep = dropout_mask(seed, q.shape[0], q.shape[1], q.shape[2], dropout_p) if dropout_p else None
    reference = lambda q, k, v: _attention(q, k, v, causal, scale_, keep, dropout_p)
    got = _run(lambda q, k, v: flash_attention_with_lse(q, k, v, causal, scale, dropout_p, seed), q, k, v, do)
    refs = _run(reference, q.double(), k.double(), v.double(), do.double())
    bases = _run(reference, q, k, v, do)
    # The backward rebuilds P = exp(S - LSE) from the fp32 LSE, whose rounding is a relative error of |LSE| eps on
    # every probability: negligible, unless the scores are huge (_very_negative_scores: |LSE| ~ 130).
    rebuilt = refs[1].abs().max().item() * torch.finfo(torch.float32).eps
    for name, g, r, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, refs, bases, strict=True):
        assert g.dtype == (torch.float32 if name == "LSE" else q.dtype)
        atol = LSE_ATOL if name == "LSE" else ATOL[q.dtype] + (rebuilt * r.abs().max().item() if name[0] == "d" else 0)
        ok, msg = within_tolerance(g, r, b, atol)
        assert ok, f"{name}: {msg} (shape {tuple(q.shape)}, causal={causal}, {q.dtype})"


def _run_packed(fn, qkv: torch.Tensor, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(qkv) -> o; returns o and the gradient of the packed input."""
    qkv = qkv.detach().requires_grad_()
    o = fn(qkv)
    o.backward(do)
    return o.detach(), qkv.grad


def _qkv(B: int, H: int, T: int, D: int, dtype: torch.dtype,
         H_kv: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, T, D) and k, v (B, H_kv, T, D) (H_kv defaults to H)."""
    heads = (H, H_kv or H, H_kv or H)
    return tuple(torch.randn(B, h, T, D, device=DEVICE, dtype=dtype) for h in heads)


# ----------------------------------------------------------------------------------------------------------------------
# Correctness matrix (CPU interpreter or compiled on a GPU)
# ----------------------------------------------------------------------------------------------------------------------
SEQ_LENS = [1, 17, 64, 97, 128, 200, 257]
HEAD_DIMS = [16, 32, 64, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("T", SEQ_LENS)
def test_forward_backward(T: int, D: int, causal: bool, dtype: torch.dtype) -> None:
    _check(*_qkv(1, 2, T, D, dtype), causal)


@pytest.mark.parametrize("D", HEAD_DIMS + [256])
def test_every_head_dim_fp16_ragged(D: int) -> None:
    _check(*_qkv(1, 1, 97, D, torch.float16), causal=True)


GQA_HEADS = [(4, 4), (4, 2), (4, 1), (6, 3)]  # (H, H_kv): multi-head, groups of 2, multi-query, groups of 2 of 3 heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", GQA_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_grouped_query_attention_matches_reference_that_repeats_kv(heads: tuple[int, int], causal: bool,
                                                                   dtype: torch.dtype) -> None:
    H, H_kv = heads
    for T in (1, 97):
        _check(*_qkv(2, H, T, 32, dtype, H_kv), causal)


def test_grouped_query_attention_strided_views_in_place() -> None:
    """q from a (B, T, H, D) buffer and k, v from a fused GQA projection, used as strided (B, H, T, D) views."""
    B, T, H, H_kv, D = 2, 97, 6, 2, 32
    q = torch.randn(B, T, H, D, device=DEVICE).transpose(1, 2)
    kv = torch.randn(B, T, 2 * H_kv, D, device=DEVICE)
    k, v = (t.transpose(1, 2) for t in kv.split(H_kv, dim=2))
    assert not (q.is_contiguous() or k.is_contiguous())
    _check(q, k, v, causal=True)


def _very_negative_scores(B: int, H: int, T: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v whose every score is about -16 sqrt(D), so LSE is far below -88 and exp(-LSE) overflows fp32: the
    probability a key row past T (zero-filled, score 0) would get were it not masked."""
    q, k, v = _qkv(B, H, T, D, dtype)
    return q + 4, k - 4, v


def test_ragged_keys_past_t_get_no_probability_when_every_score_is_very_negative() -> None:
    """Full attention with T not a multiple of the key tile: the gradients stay finite and match float64."""
    _check(*_very_negative_scores(1, 2, 97, 64, torch.float32), causal=False)


# ----------------------------------------------------------------------------------------------------------------------
# Dropout inside the kernels
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_dropout_matches_reference_with_the_kernels_mask(heads: tuple[int, int], causal: bool,
                                                         dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_DROPOUT_RNG=philox (the hashed mask: below): O and every gradient against float64 attention that
    applies the mask `dropout_mask` returns for the same seed: the forward and both backward kernels drop exactly that
    mask. (fp16 skips T=1: there the exact dQ is 0 and PyTorch's is exactly 0, while delta = rowsum(dO ∘ O) carries
    O's fp16 rounding, which dropout's 1 / (1 - p) makes inexact: a residue of a fraction of an fp16 ulp, as in every
    FlashAttention backward.)"""
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "philox")
    H, H_kv = heads
    for T in (1, 97) if dtype == torch.float32 else (17, 97):
        _check(*_qkv(2, H, T, 32, dtype, H_kv), causal, dropout_p=0.3)


def _philox4x32(c: list[np.ndarray], seed: int, rounds: int) -> list[np.ndarray]:
    """Philox4x32 (Salmon et al., 2011) on uint64 arrays holding 32-bit words, key = the seed's two halves."""
    mask = np.uint64(0xFFFFFFFF)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(rounds):
        hi0_lo0 = np.uint64(0xD2511F53) * c[0]
        hi2_lo2 = np.uint64(0xCD9E8D57) * c[2]
        c = [(hi2_lo2 >> np.uint64(32)) ^ c[1] ^ k0, hi2_lo2 & mask, (hi0_lo0 >> np.uint64(32)) ^ c[3] ^ k1,
             hi0_lo0 & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return c


def test_dropout_mask_is_philox_of_each_elements_coordinates(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_DROPOUT_RNG=philox: the mask is a function of (seed, head, query, key) alone, as documented in
    `_keep`: Philox4x32-7 with counter (4 · (j // 32) + (j % 8) // 2, head, 8 · (i // 16) + i % 8, 0) and the seed as
    key; word (j % 32) // 8, byte 2 · ((i // 8) % 2) + j % 2, kept iff that byte >= round(256 p). Recomputed here in
    NumPy for T = 80 (ragged)."""
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "philox")
    seed, B, H, T, p = 0x1234_5678_9ABC_DEF, 1, 3, 80, 0.3
    got = launch.dropout_mask(torch.tensor([seed], device=DEVICE), B, H, T, p).cpu().numpy()
    bh, i, j = (x.astype(np.uint64) for x in np.meshgrid(np.arange(B * H), np.arange(T), np.arange(T), indexing="ij"))
    counter = [4 * (j // 32) + (j % 8) // 2, bh, 8 * (i // 16) + i % 8, np.zeros_like(i)]
    words = np.stack(_philox4x32(counter, seed, rounds=7))  # (4, B * H, T, T)
    word = np.take_along_axis(words, ((j % 32) // 8)[None].astype(np.int64), axis=0)[0]
    byte = (word >> (np.uint64(8) * (2 * ((i // 8) % 2) + j % 2))) & np.uint64(0xFF)
    expected = (byte >= launch.dropout_threshold(p)).reshape(B, H, T, T)
    assert np.array_equal(got.astype(bool), expected)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_hashed_dropout_matches_reference_with_the_kernels_mask(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_DROPOUT_RNG=hash: the forward, the dQ kernel and the dK/dV kernel (which makes its bytes in the
    transposed layout) drop exactly the mask `dropout_mask` returns, with grouped-query heads."""
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "hash")
    for T in (1, 97):
        _check(*_qkv(2, 4, T, 32, torch.float32, 2), causal, dropout_p=0.3)


def _mix32(x: np.ndarray) -> np.ndarray:
    """kernels/flash_kernels.py: _mix32 on uint64 arrays holding 32-bit words."""
    mask = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x21F0AAAD)) & mask
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0xD35A2D97)) & mask
    return x ^ (x >> np.uint64(15))


def test_hashed_dropout_mask_is_the_documented_hash_of_each_elements_coordinates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_DROPOUT_RNG=hash: the mask is the function of (seed, head, query, key) documented in
    `_hashed_bytes`, recomputed here in NumPy for T = 80 (ragged)."""
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "hash")
    seed, B, H, T, p = 0x1234_5678_9ABC_DEF, 1, 3, 80, 0.3
    got = launch.dropout_mask(torch.tensor([seed], device=DEVICE), B, H, T, p).cpu().numpy()
    bh, i, j = (x.astype(np.uint64) for x in np.meshgrid(np.arange(B * H), np.arange(T), np.arange(T), indexing="ij"))
    mask = np.uint64(0xFFFFFFFF)
    key = _mix32((_mix32(np.uint64(seed & 0xFFFFFFFF) ^ (bh * np.uint64(0xC2B2AE35) & mask)) + np.uint64(seed >> 32))
                 & mask)
    block_row, block_col = 8 * (i // 16) + i % 8, 8 * (j // 16) + j % 8
    word = _mix32((block_row * np.uint64(0x9E3779B9) & mask) ^ ((block_col * np.uint64(0x85EBCA6B) + key) & mask))
    byte = (word >> (np.uint64(8) * (2 * ((i // 8) % 2) + (j // 8) % 2))) & np.uint64(0xFF)
    expected = (byte >= launch.dropout_threshold(p)).reshape(B, H, T, T)
    assert np.array_equal(got.astype(bool), expected)


@pytest.mark.parametrize("rng", ["philox", "hash"])
def test_dropout_keeps_a_fraction_one_minus_p_independently_of_position(rng: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", rng)
    B, H, T = 2, 4, 128
    raw = launch.dropout_mask(torch.tensor([11], device=DEVICE), B, H, T, 0.3)  # int8, from a poisoned buffer
    assert set(raw.unique().tolist()) == {0, 1}  # every element written, as 0 or 1
    p = launch.dropout_rate(0.3)  # 77 / 256
    keep = raw.double()
    n, sigma = keep.numel(), (p * (1 - p) / keep.numel()) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma  # binomial: 5 standard deviations
    if rng == "philox":  # the 16 bytes of one call: (query // 8) % 2, (key % 32) // 8 and key % 2 pick the byte
        by_byte = keep.view(B, H, T // 16, 2, 8, T // 32, 4, 4, 2).mean(dim=(0, 1, 2, 4, 5, 7)).flatten()
    else:  # the 4 bytes of one word: (query // 8) % 2 and (key // 8) % 2 pick the byte
        by_byte = keep.view(B, H, T // 16, 2, 8, T // 16, 2, 8).mean(dim=(0, 1, 2, 4, 5, 7)).flatten()
    for rows in (keep.mean(dim=(0, 1, 3)), keep.mean(dim=(0, 1, 2)), by_byte):  # per query, per key, per byte
        assert (rows - (1 - p)).abs().max() < 6 * (p * (1 - p) / (n / rows.numel())) ** 0.5
    assert not torch.equal(keep[0, 0], keep[0, 1])  # heads draw different masks


@pytest.mark.parametrize("rng", ["philox", "hash"])
def test_dropout_mask_elements_at_every_offset_within_a_generators_group_are_independent(
        rng: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both elements of a pair are kept with probability (1 - p)^2, within 5 standard deviations, for pairs that
    share a random word (8 rows or columns apart), neighbours, pairs 16 and 32 apart, the same element of two heads,
    and of two seeds that differ in their low or their high 32 bits only."""
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", rng)
    B, H, T = 2, 4, 128
    mask = lambda seed: launch.dropout_mask(torch.tensor([seed], device=DEVICE), B, H, T, 0.5).double()
    keep = mask(5)
    q = 1 - launch.dropout_rate(0.5)
    pairs = [(keep[..., : T - di, : T - dj], keep[..., di:, dj:])
             for di, dj in [(0, 1), (1, 0), (1, 1), (0, 8), (8, 0), (8, 8), (0, 2), (0, 16), (16, 0), (0, 32)]]
    pairs += [(keep[:, 0], keep[:, 1]), (keep, mask(4)), (keep, mask(5 + 2**32))]
    for a, b in pairs:
        both = (a * b).mean().item()
        assert abs(both - q * q) < 5 * (q * q * (1 - q * q) / a.numel()) ** 0.5


def test_dropout_is_reproducible_from_torch_seed_and_changes_with_it() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 64, 32, torch.float32))

    def run(seed: int) -> list[torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        torch.manual_seed(seed)
        o = flash_attention(q, k, v, dropout_p=0.2)
        o.sum().backward()
        return [o.detach(), q.grad, k.grad, v.grad]

    first, again, other = run(1), run(1), run(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    torch.manual_seed(1)  # the seed the call drew: one draw from torch's generator of the device
    keep = dropout_mask(torch.randint(0, 2**62, (1,), device=DEVICE), 1, 2, 64, 0.2)
    expected = _attention(q.detach(), k.detach(), v.detach(), True, 32 ** -0.5, keep, 0.2)[0]
    torch.testing.assert_close(first[0], expected, atol=1e-5, rtol=1e-5)


def test_dropout_mean_over_masks_converges_to_the_dropout_free_output() -> None:
    """128 heads with the same q, k, v draw 128 independent masks; their mean output approaches attention without
    dropout, within what the samples' spread allows."""
    q, k, v = (t.expand(1, 128, 16, 16).contiguous() for t in _qkv(1, 1, 16, 16, torch.float32))
    o = flash_attention(q, k, v, causal=False, dropout_p=0.25)  # (1, 128, 16, 16)
    exact = flash_attention(q[:, :1], k[:, :1], v[:, :1], causal=False)[0, 0]
    mean, spread = o[0].mean(0), o[0].std(0) / 128 ** 0.5  # the standard error of each element's mean
    assert ((mean - exact).abs() <= 5 * spread + 1e-6).all()
    assert (o[0].std(0) > 0).all()  # the masks do differ


def test_dropout_out_of_range_raises() -> None:
    q = torch.randn(1, 1, 16, 32, device=DEVICE)
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            flash_attention(q, q, q, dropout_p=p)
    with pytest.raises(ValueError, match="rounds to 0"):
        flash_attention(q, q, q, dropout_p=0.001)


def test_qkvpacked_dropout_draws_its_seed_from_torch_and_matches_the_reference() -> None:
    B, T, H, H_kv, D = 2, 97, 4, 2, 32
    qkv = torch.randn(B, T, H + 2 * H_kv, D, device=DEVICE, requires_grad=True)
    torch.manual_seed(5)
    o = flash_attention_qkvpacked(qkv, kv_heads=H_kv, dropout_p=0.1)
    torch.manual_seed(5)
    keep = dropout_mask(torch.randint(0, 2**62, (1,), device=DEVICE), B, H, T, 0.1)
    q, k, v = (x.transpose(1, 2) for x in qkv.detach().split([H, H_kv, H_kv], dim=2))
    torch.testing.assert_close(o, _attention(q, k, v, True, D ** -0.5, keep, 0.1)[0].transpose(1, 2), atol=1e-5,
                               rtol=1e-5)


def test_batch_heads_and_custom_scale() -> None:
    _check(*_qkv(3, 3, 97, 32, torch.float32), causal=False, scale=0.3)
    _check(*_qkv(2, 5, 64, 16, torch.float16), causal=True, scale=1.7)


@pytest.mark.parametrize("T,D,causal,dtype", [(1, 16, True, torch.float32), (97, 32, True, torch.float16),
                                                (200, 64, False, torch.float32), (17, 128, True, torch.float16)])
def test_tma_variant(monkeypatch: pytest.MonkeyPatch, T: int, D: int, causal: bool, dtype: torch.dtype) -> None:
    """FLASH_ATTN_TMA=1: the forward and both backward kernels stream tiles through tensor descriptors (ragged T,
    fused-QKV strides)."""
    monkeypatch.setenv("FLASH_ATTN_TMA", "1")
    q, k, v = _qkv(1, 2, T, D, dtype)
    assert launch.use_tma(q, k, v)
    _check(q, k, v, causal)
    x = torch.randn(2, T, 3 * 2 * D, device=DEVICE, dtype=dtype)
    fused = [t.view(2, T, 2, D).transpose(1, 2) for t in x.split(2 * D, dim=2)]
    assert launch.use_tma(*fused)
    _check(*fused, causal)
    assert not launch.use_tma(q.transpose(2, 3))  # D not unit-stride: the pointer path


def test_tma_modes_off_and_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _qkv(1, 1, 8, 128, torch.float16)[0]
    monkeypatch.setenv("FLASH_ATTN_TMA", "0")
    assert not launch.use_tma(q)
    monkeypatch.setenv("FLASH_ATTN_TMA", "auto")  # Hopper at D = 128 only: never on CPU
    assert launch.use_tma(q) == (DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9)


# ----------------------------------------------------------------------------------------------------------------------
# Layouts: strided views are used in place
# ----------------------------------------------------------------------------------------------------------------------
def test_fused_qkv_views_without_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    B, T, H, D = 2, 97, 2, 32
    C = H * D
    x = torch.randn(B, T, 3 * C, device=DEVICE)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(C, dim=2))  # strides (T*3C, D, 3C, 1)
    assert q.stride() == (T * 3 * C, D, 3 * C, 1)
    _check(q, k, v, causal=True)
    launched = []  # the tensors each kernel launch receives
    real_launch = launch._launch
    monkeypatch.setattr(launch, "_launch", lambda plan, site, kernel, grid, *args, **meta: (
        launched.append(args), real_launch(plan, site, kernel, grid, *args, **meta)))
    flash_attention(q, k, v)
    for arg, t in zip(launched[0][:3], (q, k, v), strict=True):
        assert arg.data_ptr() == t.data_ptr() and arg.stride() == t.stride(), "q/k/v were copied"
    # the gradient flows back into the fused projection output
    qkv = x.clone().requires_grad_()
    qs, ks, vs = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))
    o = flash_attention(qs, ks, vs)
    assert o.transpose(1, 2).is_contiguous()  # (B, T, H, D) memory: the merge-heads reshape is free
    o.backward(torch.randn_like(o))
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("H,H_kv", [(4, 2), (3, 1)], ids=["4q2kv", "3q1kv"])
@pytest.mark.parametrize("T,causal,dtype", [(1, True, torch.float32), (97, True, torch.float16),
                                            (200, False, torch.float32)])
def test_qkvpacked_grouped_query_matches_reference(H: int, H_kv: int, T: int, causal: bool,
                                                   dtype: torch.dtype) -> None:
    """The GQA packed form (B, T, H + 2 H_kv, D): O and the one gradient of the fused projection, against float64."""
    B, D = 2, 32
    qkv = torch.randn(B, T, H + 2 * H_kv, D, device=DEVICE, dtype=dtype)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=dtype)

    def reference(t: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in t.split([H, H_kv, H_kv], dim=2))
        return _attention(q, k, v, causal, D ** -0.5)[0].transpose(1, 2)

    got = _run_packed(lambda t: flash_attention_qkvpacked(t, causal, kv_heads=H_kv), qkv, do)
    refs = _run_packed(reference, qkv.double(), do.double())
    bases = _run_packed(reference, qkv, do)
    assert got[0].shape == (B, T, H, D) and got[0].is_contiguous() and got[1].shape == qkv.shape
    for name, g, r, b in zip(("O", "dqkv"), got, refs, bases, strict=True):
        ok, msg = within_tolerance(g, r, b, ATOL[dtype])
        assert ok, f"{name}: {msg} (H={H}, H_kv={H_kv}, T={T}, causal={causal}, {dtype})"


@pytest.mark.parametrize("T,D,causal,dtype", [(1, 16, True, torch.float32), (97, 32, True, torch.float16),
                                                (200, 64, False, torch.float32), (17, 128, True, torch.float16)])
def test_qkvpacked_matches_reference(T: int, D: int, causal: bool, dtype: torch.dtype) -> None:
    """flash_attention_qkvpacked: O and the one (B, T, 3, H, D) gradient, by the same rule against float64."""
    B, H = 2, 2
    qkv = torch.randn(B, T, 3, H, D, device=DEVICE, dtype=dtype)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=dtype)

    def reference(t: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in t.unbind(2))
        return _attention(q, k, v, causal, D ** -0.5)[0].transpose(1, 2)

    got = _run_packed(lambda t: flash_attention_qkvpacked(t, causal), qkv, do)
    refs = _run_packed(reference, qkv.double(), do.double())
    bases = _run_packed(reference, qkv, do)
    assert got[0].shape == (B, T, H, D) and got[0].is_contiguous()  # merging heads is a free view
    for name, g, r, b in zip(("O", "dqkv"), got, refs, bases, strict=True):
        assert g.dtype == dtype
        ok, msg = within_tolerance(g, r, b, ATOL[dtype])
        assert ok, f"{name}: {msg} (T={T}, D={D}, causal={causal}, {dtype})"


def test_qkvpacked_bad_shape_raises() -> None:
    with pytest.raises(ValueError, match=r"qkv must be \(B, T, 3, H, D\)"):
        flash_attention_qkvpacked(torch.randn(1, 8, 2, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"with kv_heads=2, qkv must be \(B, T, H \+ 2 \* kv_heads, D\)"):
        flash_attention_qkvpacked(torch.randn(1, 8, 4, 16, device=DEVICE), kv_heads=2)  # no query head left
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        flash_attention_qkvpacked(torch.randn(1, 8, 7, 16, device=DEVICE), kv_heads=2)  # 3 query heads, 2 kv
    with pytest.raises(ValueError, match="head dim 20 is not supported"):
        flash_attention_qkvpacked(torch.randn(1, 8, 3, 2, 20, device=DEVICE))


def test_outputs_follow_dense_input_layouts() -> None:
    # contiguous (B, H, T, D) inputs: O and the gradients come back in the same layout (no AccumulateGrad copies)
    q, k, v = (torch.randn(1, 2, 64, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v)
    o.backward(torch.randn_like(o))
    assert o.is_contiguous() and all(t.grad.stride() == t.stride() for t in (q, k, v))
    # (B, T, H, D) memory seen as (B, H, T, D): O keeps that order, so merging heads is a free view
    q = torch.randn(1, 64, 2, 16, device=DEVICE).transpose(1, 2)
    assert flash_attention(q, q, q).stride() == q.stride()


def test_transposed_head_dim_layout() -> None:
    # stride along D != 1 (not the fast path, but must be correct)
    q, k, v = (torch.randn(1, 2, 32, 97, device=DEVICE).transpose(-1, -2) for _ in range(3))
    _check(q, k, v, causal=False)


@pytest.mark.parametrize("shape", [(0, 2, 16, 32), (1, 2, 0, 32)], ids=["B=0", "T=0"])
def test_empty_inputs(shape: tuple) -> None:
    q = torch.randn(shape, device=DEVICE, requires_grad=True)
    o = flash_attention(q, q, q)
    o.sum().backward()
    assert o.shape == q.shape and q.grad.shape == q.shape


def test_broadcast_output_gradient() -> None:
    # o.sum().backward() hands the kernel a dO with all-zero strides
    q, k, v = (torch.randn(1, 2, 97, 32, device=DEVICE, requires_grad=True) for _ in range(3))
    flash_attention(q, k, v).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    _attention(qd, kd, vd, True, 32 ** -0.5)[0].sum().backward()
    for ours, ref in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# The test machinery can fail
# ----------------------------------------------------------------------------------------------------------------------
def test_poisoning_is_active() -> None:
    assert torch.isnan(launch.alloc((4,), torch.float32, DEVICE)).all()
    assert torch.isnan(launch.empty_like_layout(torch.empty(1, 2, 3, 16), torch.float16)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_tolerance_rejects_wrong_results(dtype: torch.dtype) -> None:
    q, k, v = _qkv(1, 2, 97, 32, dtype)
    do = torch.randn_like(q)
    scale = 32 ** -0.5
    ours = _run(lambda q, k, v: flash_attention_with_lse(q, k, v, True), q, k, v, do)
    ref = _run(lambda q, k, v: _attention(q, k, v, True, scale), q.double(), k.double(), v.double(), do.double())
    base = _run(lambda q, k, v: _attention(q, k, v, True, scale), q, k, v, do)
    for g, r, b in zip(ours, ref, base, strict=True):
        assert within_tolerance(g, r, b, ATOL[dtype])[0]
        assert not within_tolerance(g * 1.01, r, b, ATOL[dtype])[0], "a 1% error must fail"
        unwritten = g.clone()
        unwritten[tuple(n - 1 for n in unwritten.shape)] = math.nan
        assert not within_tolerance(unwritten, r, b, ATOL[dtype])[0], "an unwritten element must fail"


# ----------------------------------------------------------------------------------------------------------------------
# Unsupported inputs raise ValueError naming the limit
# ----------------------------------------------------------------------------------------------------------------------
def _bad(shape=(1, 2, 16, 32), dtype=torch.float32, **overrides):
    t = {n: torch.randn(shape, device=DEVICE).to(dtype) for n in "qkv"}
    t.update(overrides)
    return t["q"], t["k"], t["v"]


@pytest.mark.parametrize("args,kwargs,match", [
    (_bad((1, 2, 16, 44)), {}, "head dim 44 is not supported; supported head dims are the multiples of 8 up to 256"),
    (_bad((1, 2, 16, 264)), {}, "head dim 264"),
    (_bad(dtype=torch.float64), {}, "dtype torch.float64"),
    (_bad(dtype=torch.int32), {}, "dtype torch.int32"),
    (_bad((2, 16, 32)), {}, "must be 4-D"),
    (_bad(k=torch.randn(1, 2, 24, 32, device=DEVICE)), {}, "Tq == Tk"),
    (_bad(v=torch.randn(1, 1, 16, 32, device=DEVICE)), {}, "H a multiple of H_kv"),
    (_bad(k=torch.randn(1, 3, 16, 32, device=DEVICE), v=torch.randn(1, 3, 16, 32, device=DEVICE)), {},
     "H a multiple of H_kv"),
    (_bad(k=torch.randn(1, 2, 16, 32, device=DEVICE, dtype=torch.float16)), {}, "share one dtype"),
    (_bad(), {"scale": -1.0}, "scale must be"),
], ids=["D44", "D264", "float64", "int32", "3d", "Tq!=Tk", "k-v-heads-differ", "kv-heads-not-a-divisor", "mixed-dtype",
        "negative-scale"])
def test_unsupported_inputs_raise(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        flash_attention(*args, **kwargs)


def test_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "INTERPRET", False)
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 to run on CPU, or move tensors to CUDA"):
        flash_attention(q, q, q)


def test_bad_knob_values_raise_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTN_TMA", "sometimes")  # read at each call
    q = torch.randn(1, 1, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="FLASH_ATTN_TMA='sometimes'"):
        flash_attention(q, q, q)
    monkeypatch.setenv("FLASH_ATTN_TMA", "auto")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "perhaps")  # read at each backward
    q.requires_grad_()
    with pytest.raises(ValueError, match="FLASH_ATTN_GLUON='perhaps'"):
        flash_attention(q, q, q).sum().backward()
    monkeypatch.setenv("FLASH_ATTN_GLUON", "auto")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", "often")  # read at each forward
    with pytest.raises(ValueError, match="FLASH_ATTN_PERSISTENT='often'"):
        flash_attention(q, q, q)
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", "auto")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_ORDER", "zigzag")  # read at each forward
    with pytest.raises(ValueError, match="FLASH_ATTN_PERSISTENT_ORDER='zigzag': use fold or stride"):
        flash_attention(q, q, q)
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_ORDER", "fold")
    monkeypatch.setenv("FLASH_ATTN_PINGPONG", "maybe")  # read at each forward
    with pytest.raises(ValueError, match="FLASH_ATTN_PINGPONG='maybe': use 1 or 0"):
        flash_attention(q, q, q)
    monkeypatch.delenv("FLASH_ATTN_PINGPONG")
    assert env.pingpong()  # on unless set to 0: it measured faster
    monkeypatch.setenv("FLASH_ATTN_TRACE_ITEMS", "all")  # read at each forward
    with pytest.raises(ValueError, match="FLASH_ATTN_TRACE_ITEMS='all': use a whole number"):
        flash_attention(q, q, q)
    monkeypatch.delenv("FLASH_ATTN_TRACE_ITEMS")
    monkeypatch.setenv("FLASH_ATTN_O_IN_K", "sometimes")  # read at each forward
    with pytest.raises(ValueError, match="FLASH_ATTN_O_IN_K='sometimes': use 1 or 0"):
        flash_attention(q, q, q)
    monkeypatch.delenv("FLASH_ATTN_O_IN_K")
    monkeypatch.setenv("FLASH_ATTN_ROTATE", "1")  # read at each forward; it stages O in K
    monkeypatch.setenv("FLASH_ATTN_O_IN_K", "0")
    with pytest.raises(ValueError, match="FLASH_ATTN_ROTATE=1 stages each tile's O in its last K tile"):
        flash_attention(q, q, q)
    monkeypatch.delenv("FLASH_ATTN_O_IN_K")
    monkeypatch.delenv("FLASH_ATTN_ROTATE")
    assert not env.rotate()  # off until it is measured
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", "later")  # read at each backward
    with pytest.raises(ValueError, match="FLASH_ATTN_PERSISTENT_BACKWARD='later': use auto, 1, 0 or queue"):
        flash_attention(q, q, q).sum().backward()
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", "auto")
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE", "often")  # read at each backward
    with pytest.raises(ValueError, match="FLASH_ATTN_BY_EXAMPLE='often': use 1 or 0"):
        flash_attention(q, q, q).sum().backward()
    monkeypatch.delenv("FLASH_ATTN_BY_EXAMPLE")
    assert not env.by_example()  # off until it is measured
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE_MAX", "long")
    with pytest.raises(ValueError, match="FLASH_ATTN_BY_EXAMPLE_MAX='long': use a whole number of tokens"):
        env.by_example_max()
    monkeypatch.delenv("FLASH_ATTN_BY_EXAMPLE_MAX")
    assert env.by_example_max() == 1024
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "dice")  # read at each call with dropout
    with pytest.raises(ValueError, match="FLASH_ATTN_DROPOUT_RNG='dice': use philox or hash"):
        flash_attention(q, q, q, dropout_p=0.1)
    result = subprocess.run([sys.executable, "-c", "import kernels"], cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "FLASH_ATTN_AUTOTUNE": "maybe"}, capture_output=True, text=True)
    assert result.returncode != 0 and "ValueError: FLASH_ATTN_AUTOTUNE='maybe': use 1 or 0" in result.stderr


# ----------------------------------------------------------------------------------------------------------------------
# torch integration: custom op registration, torch.compile, autocast
# ----------------------------------------------------------------------------------------------------------------------
def test_custom_op_registration() -> None:
    q, k, v = (torch.randn(1, 2, 17, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    fwd, packed_fwd = torch.ops.flashgpt.flash_attention_fwd.default, torch.ops.flashgpt.flash_attention_qkvpacked_fwd
    seed = torch.tensor([7], device=DEVICE)
    first, end = document_bounds(_positions([[5, 12]]))
    bounds = [first, end, first, end]  # ops._bounds of these documents
    torch.library.opcheck(fwd, (q, k, v, True, 0.25, 0.0, None, []), test_utils=utils)
    k, v = (torch.randn(1, 1, 17, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    torch.library.opcheck(fwd, (q, k, v, False, 0.25, 0.2, seed, []), test_utils=utils)
    torch.library.opcheck(fwd, (q, k, v, True, 0.25, 0.2, seed, bounds), test_utils=utils)
    qkv = torch.randn(1, 17, 2 + 2 * 1, 16, device=DEVICE, requires_grad=True)  # 2 query heads, 1 key-value head
    torch.library.opcheck(packed_fwd.default, (qkv, 1, True, 0.25, 0.2, seed, []), test_utils=utils)
    torch.library.opcheck(packed_fwd.default, (qkv, 1, False, 0.25, 0.0, None, bounds), test_utils=utils)


def _compiled_matches_eager(backend: str, dtype: torch.dtype, tol: float, layout: str) -> None:
    """A fused QKV projection -> attention -> merge heads, compiled with fullgraph=True against eager: qkv (split
    views, 2 heads), qkvpacked ((B, T, 3, 2, D)) or gqa-packed (4 query heads, 2 key-value heads: (B, T, 8, D)),
    gqa-packed-dropout (the same with dropout 0.1: the seed is drawn inside the graph, from the same generator);
    -documents: packed rows of two examples (bounds as inputs of the graph)."""
    documents = document_bounds(_positions([[40, 57], [97]])) if layout.endswith("documents") else None

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        if layout == "qkvpacked":
            return flash_attention_qkvpacked((x @ w).view(B, T, 3, 2, C // 2)).reshape(B, T, C).square().sum()
        if layout.startswith("gqa-packed"):
            dropout_p = 0.1 if layout.endswith("dropout") else 0.0
            y = flash_attention_qkvpacked((x @ w).view(B, T, 8, C // 4), dropout_p=dropout_p, kv_heads=2,
                                          documents=documents)
            return y.reshape(B, T, C).square().sum()  # y: (B, T, 4, C // 4)
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (x @ w).split(C, dim=2))
        return flash_attention(q, k, v, documents=documents).transpose(1, 2).reshape(B, T, C).square().sum()

    x = torch.randn(2, 97, 64, device=DEVICE, dtype=dtype)
    w = torch.randn(64, 128 if layout.startswith("gqa-packed") else 192, device=DEVICE, dtype=dtype) / 8
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # fullgraph: any graph break raises
    grads = []
    for fn in (block, compiled):
        xi = x.clone().requires_grad_()
        torch.manual_seed(0)
        fn(xi, w).backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["qkv", "qkvpacked", "gqa-packed", "gqa-packed-dropout", "qkv-documents",
                                    "gqa-packed-documents"])
def test_torch_compile_fullgraph(layout: str) -> None:
    torch._dynamo.reset()
    _compiled_matches_eager("aot_eager", torch.float32, 1e-4, layout)


def test_autocast_casts_inputs() -> None:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # CPU: the interpreter mis-computes bf16
    q, k, v = _qkv(1, 2, 64, 32, torch.float32)
    with torch.autocast(DEVICE, dtype=dtype):
        o = flash_attention(q, k, v)
    assert o.dtype == dtype
    torch.testing.assert_close(o, flash_attention(q.to(dtype), k.to(dtype), v.to(dtype)), atol=0, rtol=0)


def test_kernels_build_for_hopper_and_the_gluon_forward_spills_no_registers() -> None:
    """Every kernel compiles down to an sm_90 binary (Triton's ahead-of-time path, no GPU needed), with Hopper's wgmma:
    the interpreter runs the kernels' semantics but would not catch code that only the compiler rejects. The Gluon
    forward's consumers hold S, P, O and the row statistics in registers: its builds have no stack frame."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "scripts/check_kernel_build.py", "--head-dims", "64"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL"))]
    builds = {line.split("|")[1].strip(): line for line in lines}
    expected = [f"{kernel}{tma}{variant} D=64" for kernel in ("forward", "dQ", "dK/dV") for tma in ("", ", TMA")
                for variant in ("", ", GQA 4", ", dropout", ", hashed dropout", ", packed rows GQA 4",
                                ", bounded full GQA 4")]
    gluon_variants = ("", ", GQA 4", ", packed rows GQA 4", ", bounded full GQA 4", ", hashed dropout GQA 4")
    memory_bound = ["backward preprocess D=64", "backward preprocess, long examples' rows D=64",
                    "dQ cast of long examples' rows D=64"]
    one_pass = [*(f"{kernel}{v} D=64" for kernel in ("one-pass backward", "ws backward") for v in gluon_variants),
                "ws backward, traced packed rows GQA 4 D=64"]
    one_pass += [f"persistent ws backward{v} D=64" for v in ("", ", packed rows GQA 4",
                                                              ", hashed dropout GQA 4, stride order", ", work queue",
                                                              ", packed rows GQA 4, work queue")]
    gluon_forward = [f"Gluon forward{v} D=64" for v in gluon_variants]
    gluon_forward += [f"Gluon persistent forward{v} D=64" for v in ("", ", packed rows GQA 4", ", bounded full GQA 4",
                                                                     ", hashed dropout packed rows", ", folded order",
                                                                     ", ping-pong", ", ping-pong packed rows GQA 4",
                                                                     ", traced", ", O in Q",
                                                                     ", O in Q packed rows GQA 4", ", rotated",
                                                                     ", rotated packed rows GQA 4",
                                                                     ", rotated bounded full, dropout",
                                                                     ", rotated without ping-pong")]
    by_example = [f"by-example ws backward{v} D=64" for v in (", packed rows GQA 4",
                                                              ", bounded full, hashed dropout")]
    swiglu = ["swiglu forward", "swiglu backward"]  # kernels/swiglu.py: plain loads, no matmul
    assert sorted(builds) == sorted(expected + memory_bound + one_pass + by_example + gluon_forward + swiglu), \
        result.stdout
    assert all(builds[name].startswith("ok ") for name in swiglu), result.stdout
    for name in expected:
        line = builds[name]
        assert line.startswith("ok ") and "wgmma=True" in line, line
        assert ("tma=True" in line) == ("TMA" in name), line
    assert all(builds[name].startswith("ok ") for name in memory_bound), result.stdout
    for name in one_pass + by_example:  # the Gluon backward: wgmma, TMA loads, and dQ added by the copy engine (by
        # example, for the key tiles of long examples only)
        assert builds[name].startswith("ok ") and "wgmma=True tma=True reduce=True" in builds[name], builds[name]
    for name in gluon_forward:  # the Gluon forward: wgmma and TMA, nothing spilled to local memory
        assert builds[name].startswith("ok ") and "wgmma=True tma=True" in builds[name], builds[name]
        assert builds[name].endswith(" stack=0"), builds[name]
    # the hashed dropout mask is made in the dK/dV kernel's own layout: no shared memory to exchange it
    smem = {name: int(line.rsplit("smem=", 1)[1].split()[0]) for name, line in builds.items() if "smem=" in line}
    for tma in ("", ", TMA"):
        assert smem[f"dK/dV{tma}, hashed dropout D=64"] == smem[f"dK/dV{tma} D=64"], result.stdout


# ----------------------------------------------------------------------------------------------------------------------
# GPU only: bf16, long sequences, 256 head dim, determinism, inductor
# ----------------------------------------------------------------------------------------------------------------------
GPU_SHAPES = [  # (B, H, T, D, causal, H_kv)
    (1, 2, 8192, 64, True, 2),
    (1, 2, 4096, 128, False, 2),
    (2, 3, 1000, 128, True, 3),
    (1, 2, 2047, 256, True, 2),
    (2, 2, 513, 32, False, 2),
    (1, 1, 1537, 16, True, 1),
    (2, 8, 1000, 128, True, 2),  # grouped-query, TMA on Hopper
    (1, 6, 2047, 64, False, 1),  # multi-query
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_gpu_bf16_matches_reference(shape: tuple) -> None:
    B, H, T, D, causal, H_kv = shape
    _check(*_qkv(B, H, T, D, torch.bfloat16, H_kv), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:2] + GPU_SHAPES[-1:], ids=lambda s: "-".join(map(str, s)))
def test_gpu_fp16_matches_reference(shape: tuple) -> None:
    B, H, T, D, causal, H_kv = shape
    _check(*_qkv(B, H, T, D, torch.float16, H_kv), causal)


@pytest.mark.gpu
def test_gpu_fp32_ieee_and_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    _check(*_qkv(1, 2, 300, 64, torch.float32), causal=True)  # IEEE fp32 dots: as accurate as PyTorch fp32
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    q, k, v = _qkv(1, 2, 300, 64, torch.float32)
    ref = _attention(q.double(), k.double(), v.double(), True, 0.125)[0]
    err = (flash_attention(q, k, v).double() - ref).norm() / ref.norm()
    assert err < 2e-3, f"tf32 relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 1000, 64, True, 2), (1, 2, 2047, 128, False, 2), (1, 8, 513, 32, True, 1)],
                         ids=lambda s: "-".join(map(str, s)))
def test_gpu_philox_dropout_bf16_matches_reference_with_the_kernels_mask(shape: tuple,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "philox")
    B, H, T, D, causal, H_kv = shape
    _check(*_qkv(B, H, T, D, torch.bfloat16, H_kv), causal, dropout_p=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 1000, 64, True, 2), (1, 2, 2047, 128, False, 2)],
                         ids=lambda s: "-".join(map(str, s)))
def test_gpu_hashed_dropout_bf16_matches_reference_with_the_kernels_mask(shape: tuple,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "hash")
    B, H, T, D, causal, H_kv = shape
    _check(*_qkv(B, H, T, D, torch.bfloat16, H_kv), causal, dropout_p=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("ws_backward", ["0", "1", "persistent", "queue"],
                         ids=["bwd64", "bwd-ws", "bwd-persistent", "bwd-queue"])
@pytest.mark.parametrize("persistent", ["0", "1"], ids=["per-tile", "persistent"])
def test_gpu_gluon_kernels_drop_the_hashed_mask_dropout_mask_returns(monkeypatch: pytest.MonkeyPatch, persistent: str,
                                                                     ws_backward: str) -> None:
    """FLASH_ATTN_DROPOUT_RNG=hash at D = 128 on Hopper: the Gluon forward (per tile and persistent) and both Gluon
    backwards make the mask in their own layouts; O and the gradients match float64 attention with the mask of the
    Triton mask kernel, grouped-query heads and a ragged last tile included."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "hash")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", persistent)
    _set_gluon_backward(monkeypatch, ws_backward)
    q, k, v = _qkv(2, 4, 1000, 128, torch.bfloat16, 2)
    assert launch.use_gluon_forward(q, k, v, q, dropout=True) and launch.use_one_pass_backward(q, k, v, q, dropout=True)
    _check(q, k, v, True, dropout_p=0.1)
    _check_documents([[300, 200, 524], [1, 1023]], 4, 2, 128, torch.bfloat16, dropout_p=0.1)  # packed rows


@pytest.mark.gpu
def test_gpu_dropout_is_bit_identical_for_the_same_seed() -> None:
    q, k, v = _qkv(2, 4, 2048, 64, torch.bfloat16)
    do = torch.randn_like(q)
    seed = torch.tensor([3], device=DEVICE)
    fn = lambda q, k, v: flash_attention_with_lse(q, k, v, True, None, 0.1, seed)
    first, second = _run(fn, q, k, v, do), _run(fn, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
def test_gpu_backward_is_bit_identical_run_to_run() -> None:
    q, k, v = _qkv(2, 4, 2048, 64, torch.bfloat16)
    do = torch.randn_like(q)
    fn = lambda q, k, v: flash_attention_with_lse(q, k, v, True)
    first, second = _run(fn, q, k, v, do), _run(fn, q, k, v, do)
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), first, second, strict=True):
        assert torch.equal(a, b), f"{name} differs between identical runs"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["qkv", "qkvpacked", "gqa-packed"])
def test_gpu_torch_compile_inductor(layout: str) -> None:
    torch._dynamo.reset()
    _compiled_matches_eager("inductor", torch.bfloat16, 3e-2, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,D", [("auto", 128), ("1", 64)])
def test_gpu_tma(monkeypatch: pytest.MonkeyPatch, mode: str, D: int) -> None:
    """The TMA kernels on Hopper, twice: the autotuning launches, then the direct launches (global scratch for the
    in-kernel descriptors comes from the allocator on both paths)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA descriptors need Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_TMA", mode)
    for T in (2047, 2047):
        q, k, v = _qkv(1, 2, T, D, torch.bfloat16)
        assert launch.use_tma(q, k, v)
        _check(q, k, v, causal=True)


def test_gluon_kernels_are_not_chosen_off_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon forward and backward need a Hopper GPU: on CPU (interpreter) the Triton kernels run, in every
    mode."""
    q = torch.randn(1, 2, 64, 128, device=DEVICE, dtype=torch.float16)
    if q.is_cuda and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("on Hopper the GPU tests cover the choice")
    for mode in ("auto", "1", "0"):
        monkeypatch.setenv("FLASH_ATTN_GLUON", mode)
        assert not launch.use_gluon_forward(q, q, q, q, dropout=False)
        assert not launch.use_one_pass_backward(q, q, q, q, dropout=False)


def _gluon_inputs(shape: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """q, k, v and causal for a (B, H, T, D, causal, dtype, layout, H_kv) row of the Gluon kernels' tests; layout
    "bthd": views of one packed projection (B, T, H + 2 H_kv, D)."""
    B, H, T, D, causal, dtype, layout, H_kv = shape
    if layout == "bthd":
        qkv = torch.randn(B, T, H + 2 * H_kv, D, device=DEVICE, dtype=dtype).transpose(1, 2)
        q, k, v = qkv.split([H, H_kv, H_kv], dim=1)
    else:
        q, k, v = _qkv(B, H, T, D, dtype, H_kv)
    return q, k, v, causal


ONE_PASS_SHAPES = [  # (B, H, T, D, causal, dtype, layout, H_kv)
    (2, 3, 1000, 128, True, torch.bfloat16, "bhtd", 3),
    (1, 2, 4096, 128, False, torch.bfloat16, "bhtd", 2),
    (2, 4, 516, 128, True, torch.float16, "bthd", 4),  # strided views of one (B, T, H, D) buffer, ragged T
    (1, 3, 2048, 64, True, torch.bfloat16, "bhtd", 3),  # D = 64 runs when asked for (FLASH_ATTN_GLUON=1)
    (3, 2, 4, 128, True, torch.bfloat16, "bhtd", 2),  # fewer queries than one tile
    (2, 8, 1000, 128, True, torch.bfloat16, "bhtd", 2),  # grouped-query: 4 query heads per key-value head
    (1, 6, 516, 128, False, torch.float16, "bthd", 3),  # grouped-query views of one packed (B, T, H + 2 H_kv, D)
    (2, 4, 300, 128, True, torch.bfloat16, "bhtd", 1),  # multi-query, ragged T
    (1, 6, 1024, 64, True, torch.bfloat16, "bhtd", 2),  # grouped-query at D = 64
]


def _set_gluon_backward(monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """The Gluon backward's shape: "0" one warpgroup over 64 keys, "1" warp-specialised over 128, "persistent" the
    same as one program per multiprocessor, "queue" the same taking its key tiles from a work queue, "by-example"
    (bounded attention) one program per multiprocessor walking whole examples, "by-example-split" the same with
    examples over 100 tokens walked one key tile per work item."""
    monkeypatch.setenv("FLASH_ATTN_WS_BACKWARD", "0" if shape == "0" else "1")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", {"persistent": "1", "queue": "queue"}.get(shape, "0"))
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE", "1" if shape.startswith("by-example") else "0")
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE_MAX", "100" if shape == "by-example-split" else "1000000")


GLUON_BACKWARDS = pytest.mark.parametrize("ws", ["0", "1", "persistent", "queue"],
                                          ids=["64-keys", "warp-specialised", "persistent", "queue"])


@pytest.mark.gpu
@GLUON_BACKWARDS
@pytest.mark.parametrize("shape", ONE_PASS_SHAPES, ids=lambda s: "-".join(map(str, s)).replace("torch.", ""))
def test_gpu_one_pass_backward_matches_reference(monkeypatch: pytest.MonkeyPatch, shape: tuple, ws: str) -> None:
    """kernels/flash_gluon.py's backward (FLASH_ATTN_GLUON=1), one warpgroup over 64 keys or warp-specialised over
    128 (a program per key tile or per multiprocessor), against float64, by the same rule as the Triton kernels; dQ,
    dK and dV start as NaN."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    _set_gluon_backward(monkeypatch, ws)
    q, k, v, causal = _gluon_inputs(shape)
    assert launch.use_one_pass_backward(q, k, v, q, dropout=False)
    assert launch.use_ws_backward() == (ws != "0")
    _check(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,H_kv", [(6, 20, 1536, 20), (2, 8, 1000, 2), (1, 3, 1300, 1)],
                         ids=["mha", "gqa-ragged", "mqa-odd-tiles"])
def test_gpu_persistent_backward_gives_dk_dv_bit_identical_to_a_program_per_key_tile(
        monkeypatch: pytest.MonkeyPatch, B: int, H: int, T: int, H_kv: int) -> None:
    """FLASH_ATTN_PERSISTENT_BACKWARD only changes which program runs a key tile, in either order or taken from the
    work queue: dK and dV are the per-tile kernel's bit for bit, dQ (added up by the copy engine in another order)
    equal to within rounding."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is written for Hopper (sm_90)")
    q, k, v = _qkv(B, H, T, 128, torch.bfloat16, H_kv)
    do = torch.randn_like(q)
    fn = lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True)
    runs = []
    for persistent, order in (("0", "fold"), ("1", "fold"), ("1", "stride"), ("queue", "fold")):
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", persistent)
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT_ORDER", order)
        runs.append(_run(fn, q, k, v, do))
    for run in runs[1:]:
        dq, dk, dv = run[-3:]
        assert torch.equal(dk, runs[0][-2]) and torch.equal(dv, runs[0][-1])
        torch.testing.assert_close(dq, runs[0][-3], rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@GLUON_BACKWARDS
def test_gpu_one_pass_backward_masks_keys_past_t_when_every_score_is_very_negative(
        monkeypatch: pytest.MonkeyPatch, ws: str) -> None:
    """The one-pass backward, full attention, ragged T: zero-filled keys past T get no probability (else dQ is NaN)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    _set_gluon_backward(monkeypatch, ws)
    q, k, v = _very_negative_scores(1, 2, 300, 128, torch.bfloat16)
    assert launch.use_one_pass_backward(q, k, v, q, dropout=False)
    _check(q, k, v, causal=False)


@pytest.mark.gpu
def test_gpu_one_pass_backward_is_the_default_at_d128_unless_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the one-pass backward at D = 128 (at D = 64 only from 2048 keys), grouped-query heads included; not for
    dropout with Philox's mask (with the hashed one it is), T not a multiple of 4, or under
    torch.use_deterministic_algorithms (its dQ sums run in a varying order)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "auto")
    q, k, v = _qkv(1, 4, 256, 128, torch.bfloat16)
    choose = launch.use_one_pass_backward
    assert choose(q, k, v, q, dropout=False)
    assert choose(q, k, v, q, dropout=True)
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "philox")
    assert not choose(q, k, v, q, dropout=True)
    monkeypatch.delenv("FLASH_ATTN_DROPOUT_RNG")
    assert choose(q, k[:, :2], v[:, :2], q, dropout=False)
    assert not choose(*(t[:, :, :255] for t in (q, k, v, q)), dropout=False)
    assert not choose(*_qkv(1, 4, 256, 64, torch.bfloat16), q[..., :64], dropout=False)  # D = 64 below 2048 keys
    torch.use_deterministic_algorithms(True)
    try:
        assert not choose(q, k, v, q, dropout=False)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FLASH_ATTN_GLUON", "0")
    assert not choose(q, k, v, q, dropout=False)


@pytest.mark.gpu
def test_gpu_one_pass_backward_is_the_default_at_d64_for_plain_rows_from_2048_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """auto at D = 64: the one-pass backward (warp-specialised, persistent) after the Triton forward for plain causal
    attention over 2048 keys or more, grouped-query heads included, matching float64; the Triton backward below 2048
    keys, without causal masking, with dropout, with bounds and under deterministic mode."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is written for Hopper (sm_90)")
    for name in ("FLASH_ATTN_GLUON", "FLASH_ATTN_WS_BACKWARD", "FLASH_ATTN_PERSISTENT_BACKWARD"):
        monkeypatch.delenv(name, raising=False)
    q, k, v = _qkv(2, 6, 2048, 64, torch.bfloat16, 2)
    choose = launch.use_one_pass_backward
    assert choose(q, k, v, q, dropout=False) and not launch.use_gluon_forward(q, k, v, q, dropout=False)
    assert launch.use_persistent_backward(docs=False)
    assert not choose(q, k, v, q, dropout=True) and not choose(q, k, v, q, dropout=False, docs=True)
    assert not choose(q, k, v, q, dropout=False, causal=False)
    short = [t[:, :, :2044] for t in (q, k, v, q)]
    assert not choose(*short, dropout=False)
    torch.use_deterministic_algorithms(True)
    try:
        assert not choose(q, k, v, q, dropout=False)
    finally:
        torch.use_deterministic_algorithms(False)
    _check(q, k, v, causal=True)
    _check(*_qkv(1, 4, 2052, 64, torch.float16), causal=True)


GLUON_FORWARD_SHAPES = [  # (B, H, T, D, causal, dtype, layout, H_kv)
    (2, 3, 1000, 128, True, torch.bfloat16, "bhtd", 3),
    (1, 2, 2048, 128, False, torch.bfloat16, "bhtd", 2),
    (2, 4, 517, 128, True, torch.float16, "bthd", 4),  # views of one packed projection, T neither a tile nor 4k
    (3, 2, 1, 128, True, torch.bfloat16, "bhtd", 2),  # a single query
    (1, 4, 130, 128, False, torch.bfloat16, "bhtd", 4),  # two query tiles, the second with 2 rows
    (2, 8, 1000, 128, True, torch.bfloat16, "bhtd", 2),  # grouped-query: 4 query heads per key-value head
    (1, 6, 333, 128, False, torch.float16, "bthd", 3),  # grouped-query views of one packed (B, T, H + 2 H_kv, D)
    (2, 4, 300, 128, True, torch.bfloat16, "bhtd", 1),  # multi-query
    (1, 4, 1024, 64, True, torch.bfloat16, "bhtd", 2),  # D = 64 runs when asked for (FLASH_ATTN_GLUON=1)
]


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", ["0", "1"], ids=["per-tile", "persistent"])
@pytest.mark.parametrize("shape", GLUON_FORWARD_SHAPES, ids=lambda s: "-".join(map(str, s)).replace("torch.", ""))
def test_gpu_gluon_forward_matches_reference(monkeypatch: pytest.MonkeyPatch, shape: tuple, persistent: str) -> None:
    """kernels/flash_gluon.py's forward (FLASH_ATTN_GLUON=1), a program per query tile or per multiprocessor, against
    float64, O and LSE by the same rule as the Triton kernels (both start as NaN), and the gradients computed from its
    LSE."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", persistent)
    q, k, v, causal = _gluon_inputs(shape)
    assert launch.use_gluon_forward(q, k, v, launch.empty_like_layout(q, q.dtype), dropout=False)
    assert launch.use_persistent_forward() == (persistent == "1")
    _check(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T", [(6, 20, 1536), (2, 3, 1000), (1, 3, 1300)],
                         ids=["tiles-divide-programs", "fewer-pairs-than-programs", "odd-tiles-per-head"])
def test_gpu_persistent_forward_in_folded_order_is_bit_identical_to_one_program_per_tile(
        monkeypatch: pytest.MonkeyPatch, B: int, H: int, T: int) -> None:
    """FLASH_ATTN_PERSISTENT_ORDER only changes which program runs a tile: O and LSE equal the per-tile forward's bit
    for bit, with full and partial rounds (6 x 20 x 12 tiles over the multiprocessors), fewer pairs than programs,
    and an odd number of tiles per head and in all (a pair across two heads, a last item alone)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    q, k, v = _qkv(B, H, T, 128, torch.bfloat16)
    runs = []
    for persistent, order in (("0", "stride"), ("1", "stride"), ("1", "fold")):
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT", persistent)
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT_ORDER", order)
        runs.append(flash_attention_with_lse(q, k, v, causal=True))
    for o, lse in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,H_kv,T,D,causal", [(6, 20, 20, 1536, 128, True), (2, 8, 2, 1000, 128, False),
                                                 (3, 6, 6, 1300, 64, True)],
                         ids=["d128-causal", "d128-gqa4-full-ragged", "d64-causal-ragged"])
def test_gpu_pingpong_forward_is_bit_identical_to_the_persistent_forward(
        monkeypatch: pytest.MonkeyPatch, B: int, H: int, H_kv: int, T: int, D: int, causal: bool) -> None:
    """FLASH_ATTN_PINGPONG only orders when the two consumer warpgroups issue their matmuls: O and LSE equal the
    persistent forward's bit for bit (D = 64 under FLASH_ATTN_GLUON=1), and packed rows with a window stay within
    tolerance of float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", "1")
    q, k, v = _qkv(B, H, T, D, torch.bfloat16, H_kv)
    runs = []
    for pingpong in ("0", "1"):
        monkeypatch.setenv("FLASH_ATTN_PINGPONG", pingpong)
        runs.append(flash_attention_with_lse(q, k, v, causal=causal))
    assert torch.equal(runs[1][0], runs[0][0]) and torch.equal(runs[1][1], runs[0][1])
    _check_documents([_random_lengths(T, 300)], H, H_kv, D, torch.bfloat16, causal=causal, window=(100, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,H_kv,T,D,causal", [(6, 20, 20, 1536, 128, True), (2, 8, 2, 1000, 128, False),
                                                 (3, 6, 6, 1300, 64, True)],
                         ids=["d128-causal", "d128-gqa4-full-ragged", "d64-causal-ragged"])
def test_gpu_forward_with_o_in_k_is_bit_identical_to_the_persistent_forward(
        monkeypatch: pytest.MonkeyPatch, B: int, H: int, H_kv: int, T: int, D: int, causal: bool) -> None:
    """FLASH_ATTN_O_IN_K only moves where O is staged for its store and when the store is waited for: O and LSE equal
    the persistent forward's bit for bit (D = 64 under FLASH_ATTN_GLUON=1), packed rows of short examples
    included (items of a single key tile), and packed rows with a window stay within tolerance of float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    q, k, v = _qkv(B, H, T, D, torch.bfloat16, H_kv)
    positions = torch.cat([torch.arange(n) for n in _random_lengths(T, 200)]).to(q.device)[None].expand(B, T)
    for documents in (None, document_bounds(positions)):
        runs = []
        for o_in_k in ("0", "1"):
            monkeypatch.setenv("FLASH_ATTN_O_IN_K", o_in_k)
            runs.append(flash_attention_with_lse(q, k, v, causal=causal, documents=documents))
        for o, lse in runs[1:]:
            assert torch.equal(o, runs[0][0]) and torch.equal(lse, runs[0][1])
    _check_documents([_random_lengths(T, 300)], H, H_kv, D, torch.bfloat16, causal=causal, window=(100, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,H_kv,T,D,causal", [(6, 20, 20, 1536, 128, True), (2, 8, 2, 1000, 128, False),
                                                 (3, 6, 6, 1300, 64, True), (1, 1, 1, 100, 128, True)],
                         ids=["d128-causal", "d128-gqa4-full-ragged", "d64-causal-ragged", "one-tile"])
def test_gpu_rotated_forward_is_bit_identical_to_the_persistent_forward(
        monkeypatch: pytest.MonkeyPatch, B: int, H: int, H_kv: int, T: int, D: int, causal: bool) -> None:
    """FLASH_ATTN_ROTATE only issues each tile's last P V in one turn with the next tile's first S: O and LSE equal
    the persistent forward's bit for bit (D = 64 under FLASH_ATTN_GLUON=1), with packed rows and hashed dropout, on
    programs of many tiles and of one; packed rows with a window and dropout stay within tolerance of float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    q, k, v = _qkv(B, H, T, D, torch.bfloat16, H_kv)
    seed = torch.tensor([1234], dtype=torch.int64, device=q.device)
    positions = torch.cat([torch.arange(n) for n in _random_lengths(T, 200)]).to(q.device)[None].expand(B, T)
    for documents in (None, document_bounds(positions)):
        for dropout_p in (0.0, 0.1):
            runs = []
            for rotate in ("0", "1"):
                monkeypatch.setenv("FLASH_ATTN_ROTATE", rotate)
                runs.append(flash_attention_with_lse(q, k, v, causal=causal, dropout_p=dropout_p, seed=seed,
                                                     documents=documents))
            assert torch.equal(runs[1][0], runs[0][0]) and torch.equal(runs[1][1], runs[0][1])
    _check_documents([_random_lengths(T, 300)], H, H_kv, D, torch.bfloat16, dropout_p=0.1, causal=causal,
                     window=(100, 0))


@pytest.mark.gpu
def test_gpu_traced_forward_keeps_its_outputs_and_stamps_every_phase_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_TRACE_ITEMS only records cycle stamps: O and LSE equal the untraced persistent forward's bit for
    bit, and every traced item's seven consumer stamps rise (scripts/trace_forward.py reads them as phases)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    q, k, v = _qkv(2, 4, 1000, 128, torch.bfloat16, 2)
    plain = flash_attention_with_lse(q, k, v, causal=True)
    monkeypatch.setenv("FLASH_ATTN_TRACE_ITEMS", "8")
    traced = flash_attention_with_lse(q, k, v, causal=True)
    assert torch.equal(traced[0], plain[0]) and torch.equal(traced[1], plain[1])
    stamps = launch.last_forward_trace  # (programs, 3, items, 8)
    items = stamps[:, :2][stamps[:, :2, :, 0] != 0]  # (traced items, 8)
    assert items.shape[0] == 2 * (2 * 4 * 8)  # each tile of 128 rows of each (batch, head), once per consumer
    assert bool((items[:, 1:7] >= items[:, :6]).all())
    assert int(stamps[:, 2, :, 4].sum()) == 2 * 4 * sum(range(1, 9))  # the producer's key tiles: causal triangles


@pytest.mark.gpu
def test_gpu_traced_backward_keeps_its_gradients_and_stamps_every_phase_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_TRACE_ITEMS in the warp-specialised backward (one program per key tile) only records cycle stamps:
    dK and dV equal the untraced backward's bit for bit, dQ (added in a varying order) to fp32 rounding, and every
    traced step's eight stamps rise (scripts/trace_backward.py reads them as phases)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon backward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", "0")
    q, k, v = (x.requires_grad_() for x in _qkv(2, 4, 1000, 128, torch.bfloat16, 2))
    do = torch.randn_like(q)
    grads = []
    for steps in ("0", "64"):
        monkeypatch.setenv("FLASH_ATTN_TRACE_ITEMS", steps)
        grads.append(torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do))
    assert torch.equal(grads[1][1], grads[0][1]) and torch.equal(grads[1][2], grads[0][2])
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=2e-2, rtol=2e-2)
    stamps = launch.last_backward_trace  # (key tiles, KV heads, B, 2, steps, 8)
    assert stamps.shape[:4] == (8, 2, 2, 2)
    assert bool((stamps[..., 0] != 0).any(-1).all())  # every program's warpgroups traced their steps
    steps = stamps[stamps[..., 0] != 0]  # (traced steps, 8)
    assert bool((steps[:, 1:] >= steps[:, :-1]).all())


@pytest.mark.gpu
def test_gpu_gluon_forward_is_the_default_at_d128(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the Gluon forward for 16-bit inputs at D = 128, grouped-query heads and deterministic mode included (it
    has no atomics), dropout with the hashed mask (the default); not for dropout with Philox's mask, fp32, D = 64 or
    FLASH_ATTN_GLUON=0."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "auto")
    q, k, v = _qkv(1, 4, 255, 128, torch.bfloat16)
    choose = lambda q, k, v, dropout=False: launch.use_gluon_forward(q, k, v, q, dropout)
    assert choose(q, k, v) and choose(q, k[:, :2], v[:, :2])
    assert choose(q, k, v, dropout=True)
    monkeypatch.setenv("FLASH_ATTN_DROPOUT_RNG", "philox")
    assert not choose(q, k, v, dropout=True)
    monkeypatch.delenv("FLASH_ATTN_DROPOUT_RNG")
    assert not choose(*(t.float() for t in (q, k, v)))
    assert not choose(*_qkv(1, 4, 256, 64, torch.bfloat16))
    torch.use_deterministic_algorithms(True)
    try:
        assert choose(q, k, v)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FLASH_ATTN_GLUON", "0")
    assert not choose(q, k, v)


def test_persistent_forward_runs_unless_set_off_and_folds_its_tiles_unless_set_to_stride(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_PERSISTENT: auto and 1 run the Gluon forward persistent, 0 one program per tile.
    FLASH_ATTN_PERSISTENT_ORDER: folded pairs of tiles unless stride."""
    for mode, persistent in (("auto", True), ("1", True), ("0", False)):
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT", mode)
        assert launch.use_persistent_forward() == persistent, mode
    monkeypatch.delenv("FLASH_ATTN_PERSISTENT_ORDER", raising=False)
    assert env.persistent_fold()
    for order, fold in (("fold", True), ("stride", False)):
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT_ORDER", order)
        assert env.persistent_fold() == fold, order


def test_ws_backward_is_chosen_unless_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_WS_BACKWARD: auto and 1 run the Gluon backward warp-specialised over 128 keys (at D = 128 and 64
    alike), 0 over 64 keys; another value is an error naming the variable."""
    for mode, ws in (("auto", True), ("1", True), ("0", False)):
        monkeypatch.setenv("FLASH_ATTN_WS_BACKWARD", mode)
        assert launch.use_ws_backward() == ws, mode
    monkeypatch.setenv("FLASH_ATTN_WS_BACKWARD", "maybe")
    with pytest.raises(ValueError, match="FLASH_ATTN_WS_BACKWARD='maybe'"):
        launch.use_ws_backward()


def test_persistent_backward_runs_on_plain_attention_under_auto_and_with_bounds_when_set_or_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASH_ATTN_PERSISTENT_BACKWARD: auto runs the warp-specialised backward one program per multiprocessor without
    bounds and one program per key tile with them (packed rows, windows), 1 and queue always, 0 never; never where
    the backward is not warp-specialised (FLASH_ATTN_WS_BACKWARD=0)."""
    monkeypatch.delenv("FLASH_ATTN_WS_BACKWARD", raising=False)
    for mode, plain, bounded in (("auto", True, False), ("1", True, True), ("queue", True, True), ("0", False, False)):
        monkeypatch.setenv("FLASH_ATTN_PERSISTENT_BACKWARD", mode)
        assert launch.use_persistent_backward(docs=False) == plain, mode
        assert launch.use_persistent_backward(docs=True) == bounded, mode
    monkeypatch.setenv("FLASH_ATTN_WS_BACKWARD", "0")
    assert not launch.use_persistent_backward(docs=False)


def test_launch_plans_are_keyed_on_strides_alignment_and_flags() -> None:
    """A call reuses the plan of an earlier call only when every tensor's strides and alignment and every flag agree,
    since the plan keeps kernels compiled for them."""
    B, H, T, D = 1, 2, 40, 16
    aligned = _qkv(B, H, T, D, torch.float32)
    padded = [torch.randn(B, H, T, D + 1, device=DEVICE)[..., 1:] for _ in range(3)]  # 4-byte offset, stride 17
    before = set(launch._PLANS)
    for qkv, causal in ((aligned, True), (aligned, True), (padded, True), (aligned, False)):
        flash_attention(*qkv, causal=causal)
    new = [key for key in launch._PLANS if key not in before]
    assert len(new) == 3 and all(key[0] == "fwd" for key in new)


@pytest.mark.gpu
@pytest.mark.parametrize("D,H_kv,dropout_p", [(64, 4, 0.0), (64, 2, 0.1), (128, 2, 0.0), (128, 4, 0.0)],
                         ids=["d64", "d64-gqa-dropout", "d128-gqa", "d128"])
def test_gpu_direct_launches_match_reference(D: int, H_kv: int, dropout_p: float) -> None:
    """From the third call of a signature every kernel is launched straight through its compiled launcher
    (launch._launch): those results still match float64 on each path (Triton kernels, dropout, the Gluon kernels at
    D = 128 on Hopper), and every site of the call's plans was compiled for it."""
    qkv = _qkv(2, 4, 200, D, torch.bfloat16, H_kv)
    before = set(launch._PLANS)
    for _ in range(3):
        _check(*qkv, causal=True, dropout_p=dropout_p)
    new = {key: plan for key, plan in launch._PLANS.items() if key not in before}
    assert {key[0] for key in new} == {"fwd", "bwd"}
    if env.DIRECT_LAUNCH:  # autotuned sites have a config, Gluon ones none; all have their compiled kernel
        assert all(plan.compiled and set(plan.configs) <= set(plan.compiled) for plan in new.values())


@pytest.mark.gpu
def test_gpu_direct_launch_keeps_each_specialization() -> None:
    """Launches after the first skip Triton's binder (Triton 3.6): a cached kernel compiled for aligned pointers and
    strides that are multiples of 16 must not run on misaligned views with odd strides, nor the other way round."""
    B, H, T, D = 2, 3, 300, 64
    aligned = _qkv(B, H, T, D, torch.bfloat16)
    padded = [torch.randn(B, H, T, D + 1, device=DEVICE, dtype=torch.bfloat16)[..., 1:] for _ in range(3)]
    assert padded[0].data_ptr() % 16 and padded[0].stride(2) % 16  # 2-byte offset, stride 65
    before = set(launch._PLANS)
    for qkv in (aligned, padded, aligned, padded, aligned, padded):  # tuning, compiling, then direct launches
        _check(*qkv, causal=True)
    if env.DIRECT_LAUNCH:  # both specializations were planned and compiled separately
        assert sum(key[0] == "fwd" and bool(plan.compiled) for key, plan in launch._PLANS.items()
                   if key not in before) == 2


# ----------------------------------------------------------------------------------------------------------------------
# Packed rows: several examples per row, each attending only to itself (documents)
# ----------------------------------------------------------------------------------------------------------------------
def _positions(rows: list[list[int]]) -> torch.Tensor:
    """(B, T) positions of rows packed with examples of these lengths (each row's lengths sum to T)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]).to(DEVICE)


def _random_lengths(T: int, longest: int) -> list[int]:
    """Fresh random example lengths summing to T: 1 to `longest` tokens each, with one-token examples made likely."""
    lengths = []
    while sum(lengths) < T:
        n = 1 if torch.rand(()) < 0.2 else int(torch.randint(1, longest + 1, ()))
        lengths.append(min(n, T - sum(lengths)))
    return lengths


def _allowed(positions: torch.Tensor, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """(B, T, T) bool: query i sees key j (one example, causal, within the window (left, right), -1 unbounded)."""
    ids = (positions == 0).cumsum(1)  # (B, T) example of each token
    t = torch.arange(positions.shape[1], device=positions.device)
    allowed = ids[:, :, None] == ids[:, None, :]
    if causal:
        allowed &= t[:, None] >= t[None, :]
    if window is not None and window[0] != -1:
        allowed &= t[:, None] - t[None, :] <= window[0]
    if window is not None and window[1] != -1 and not causal:
        allowed &= t[None, :] - t[:, None] <= window[1]
    return allowed


def _check_documents(rows: list[list[int]], H: int, H_kv: int, D: int, dtype: torch.dtype, dropout_p: float = 0.0,
                     window: tuple[int, int] | None = None, packed: bool = True, causal: bool = True) -> None:
    """O, LSE and every gradient of packed rows (packed=False: rows of one example, no documents given) against
    float64 attention masked to each example, causal or not, and to the window (left, right) if given."""
    positions = _positions(rows)
    B, T = positions.shape
    q, k, v = _qkv(B, H, T, D, dtype, H_kv)
    documents = document_bounds(positions) if packed else None
    allowed = _allowed(positions, causal, window)
    seed = torch.randint(0, 2**62, (1,), device=DEVICE) if dropout_p else None
    keep = dropout_mask(seed, B, H, T, dropout_p) if dropout_p else None
    scale = 1.0 / math.sqrt(D)

    def reference(q, k, v):
        group = H // H_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        if keep is not None:
            p = p * keep / (1 - launch.dropout_rate(dropout_p))
        return p @ v, torch.logsumexp(s, dim=-1)

    do = torch.randn_like(q)
    got = _run(lambda q, k, v: flash_attention_with_lse(q, k, v, causal, None, dropout_p, seed, documents, window),
               q, k, v, do)
    refs = _run(reference, q.double(), k.double(), v.double(), do.double())
    bases = _run(reference, q, k, v, do)
    for name, g, r, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, refs, bases, strict=True):
        ok, msg = within_tolerance(g, r, b, LSE_ATOL if name == "LSE" else ATOL[dtype])
        assert ok, f"{name}: {msg} (rows {rows}, causal={causal}, window={window}, {dtype})"


# T = 97 and 200: ragged tiles; examples of 1 token, examples spanning several tiles, a tile of many examples
DOC_ROWS = [[[30, 1, 66], [97]], [[5, 100, 40, 55], [1, 1, 1, 197]], [[1], [1]]]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rows", DOC_ROWS, ids=["T97", "T200", "T1"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_packed_rows_attend_only_within_each_example(rows: list[list[int]], heads: tuple[int, int],
                                                     causal: bool) -> None:
    _check_documents(rows, *heads, 32, torch.float32, causal=causal)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (3, 0)), (False, (17, 5)),
                                           (True, (0, 0))], ids=["causal", "full", "window", "full-window", "self"])
def test_examples_of_the_by_example_backward_are_the_finest_runs_that_see_only_themselves_most_work_first(
        causal: bool, window: tuple[int, int] | None) -> None:
    """launch._examples (FLASH_ATTN_BY_EXAMPLE's work list) from each bounds: the rows cut wherever no query on
    either side sees a key on the other, against the mask itself. Runs of at most `longest` rows are whole items,
    longest first (ties in row order); a longer run is one item per key tile it touches, and its rows are flagged for
    the fp32 accumulator; items sorted by work."""
    positions = _positions([_random_lengths(150, 40), _random_lengths(150, 5)])
    B, T = positions.shape
    kv_start, kv_end, _, _ = _bounds(document_bounds(positions), window, positions.new_empty(B, 1, T), causal)
    allowed = _allowed(positions, causal, window)  # (B, T, T)
    runs = []
    for b in range(B):
        cuts = [t for t in range(1, T) if not allowed[b, t:, :t].any() and not allowed[b, :t, t:].any()]
        runs += [(b, start, end) for start, end in zip([0, *cuts], [*cuts, T], strict=True)]
    runs.sort(key=lambda run: (run[1] - run[2], run[0] * T + run[1]))

    got, long = (x.tolist() for x in launch._examples(kv_start, kv_end, T, 16))  # every run whole
    n = got[0]
    assert n == len(runs)
    assert got[1:1 + n] == [b * T + start for b, start, _ in runs]
    assert got[1 + B * T:1 + B * T + n] == [end for _, _, end in runs]
    assert got[1 + 2 * B * T:1 + 2 * B * T + n] == [-1] * n
    assert long == [[0] * T] * B

    longest, block = 9, 16
    got, long = (x.tolist() for x in launch._examples(kv_start, kv_end, longest, block))
    items = {(b * T + start, end, -1) for b, start, end in runs if end - start <= longest}
    items |= {(b * T + start, end, t // block * block) for b, start, end in runs if end - start > longest
              for t in range(start, end) if t == start or t % block == 0}
    n = got[0]
    listed = list(zip(*(got[1 + i * B * T:1 + i * B * T + n] for i in range(3)), strict=True))
    assert n == len(items) and set(listed) == items
    work = [(end - flat % T) * (end - flat % T + 1) // 2 if tile < 0 else block * (end - max(tile, flat % T))
            for flat, end, tile in listed]
    assert work == sorted(work, reverse=True)
    assert long == [[int(any(start <= t < end and end - start > longest for b2, start, end in runs if b2 == b))
                     for t in range(T)] for b in range(B)]


def test_long_examples_rows_alone_are_zeroed_before_and_cast_after_the_by_example_backward() -> None:
    """The by-example backward's memory-bound passes (kernels/flash_kernels.py): the preprocess's Δ = rowsum(O ∘ dO)
    in float64's rounding, with zeros written into the fp32 dQ sums of the flagged rows only, and the cast of those
    rows alone, times the gradient's scale, into dQ; the other rows, poisoned, stay as they were. T = 70: a ragged
    last block."""
    from kernels.flash_kernels import _bwd_preprocess_kernel, _cast_rows_kernel

    B, H, T, D = 2, 3, 70, 32
    o, do = torch.randn(B, H, T, D, device=DEVICE), torch.randn(B, T, H, D, device=DEVICE).transpose(1, 2)
    flags = (torch.rand(B, T, device=DEVICE) < 0.4).to(torch.int8)
    delta = torch.full((B, H, T), float("nan"), device=DEVICE)
    acc = torch.full((B, H, T, D), float("nan"), device=DEVICE)
    grid = (triton.cdiv(T, 32), H, B)
    _bwd_preprocess_kernel[grid](o, do, delta, acc, flags, *o.stride(), *do.stride(), H, T, HEAD_DIM=D, BLOCK=32,
                                 ZERO=2)
    torch.testing.assert_close(delta, (o.double() * do.double()).sum(-1).float(), atol=1e-5, rtol=1e-5)
    long = flags.bool()[:, None, :, None].expand_as(acc)
    assert (acc[long] == 0).all() and acc[~long].isnan().all()

    acc = torch.randn(B, H, T, D, device=DEVICE)
    dq = torch.full((B, T, H, D), float("nan"), device=DEVICE, dtype=torch.float16).transpose(1, 2)  # strided
    _cast_rows_kernel[grid](acc, dq, flags, *dq.stride(), H, T, 0.375, HEAD_DIM=D, BLOCK=32)
    assert torch.equal(dq[long], (acc[long] * 0.375).half()) and dq[~long].isnan().all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,D", [((4, 1), 40), ((6, 3), 96), ((2, 1), 136)], ids=["mqa-d40", "gqa-d96", "d136"])
def test_packed_rows_of_random_lengths_match_the_reference(heads: tuple[int, int], D: int, causal: bool) -> None:
    """Fresh random boundaries (one-token examples, lengths that are multiples of no tile, many tiny examples) and
    head dims the kernels pad, GQA 4/1 and 6/3."""
    rows = [_random_lengths(150, 70), _random_lengths(150, 7)]
    _check_documents(rows, *heads, D, torch.float32, causal=causal)


def test_packed_rows_fp16_and_with_dropout_match_the_reference() -> None:
    _check_documents(DOC_ROWS[1], 4, 2, 64, torch.float16)
    _check_documents(DOC_ROWS[0], 2, 1, 32, torch.float32, dropout_p=0.25)
    _check_documents(DOC_ROWS[0], 2, 1, 32, torch.float32, dropout_p=0.25, causal=False, window=(17, 5))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_rows_through_the_fused_projection_match_separate_q_k_v(causal: bool) -> None:
    positions = _positions(DOC_ROWS[0])
    documents = document_bounds(positions)
    qkv = torch.randn(2, 97, 4 + 2 * 2, 32, device=DEVICE)
    do = torch.randn(2, 97, 4, 32, device=DEVICE)
    o, grad = _run_packed(lambda t: flash_attention_qkvpacked(t, causal, kv_heads=2, documents=documents,
                                                              window=(17, 5)), qkv, do)

    def separate(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split([4, 2, 2], dim=2)
        return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                               documents=documents, window=(17, 5)).transpose(1, 2)

    o_ref, grad_ref = _run_packed(separate, qkv, do)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=0)


WINDOWS = [(0, 0), (3, 0), (17, 5), (40, -1), (200, 3)]  # (200, 3): left >= T


@pytest.mark.parametrize("causal,window", [(True, w) for w in WINDOWS] + [(False, w) for w in WINDOWS + [(-1, 6)]],
                         ids=lambda x: str(x).replace(" ", "") if isinstance(x, tuple) else ("causal" if x else "full"))
def test_sliding_window_sees_only_the_keys_within_it(causal: bool, window: tuple[int, int]) -> None:
    _check_documents([[97], [97]], 4, 2, 32, torch.float32, window=window, packed=False, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sliding_window_within_packed_rows(causal: bool) -> None:
    _check_documents(DOC_ROWS[1], 4, 2, 32, torch.float32, window=(33, 9), causal=causal)


@pytest.mark.parametrize("D", [8, 24, 48, 80, 96])
def test_head_dims_between_the_tile_widths_are_padded_and_match_the_reference(D: int) -> None:
    _check(*_qkv(2, 4, 67, D, torch.float32, 2), causal=True)
    _check_documents(DOC_ROWS[0], 2, 1, D, torch.float32)
    qkv = torch.randn(1, 33, 4 + 2 * 2, D, device=DEVICE)
    do = torch.randn(1, 33, 4, D, device=DEVICE)
    o, grad = _run_packed(lambda t: flash_attention_qkvpacked(t, kv_heads=2), qkv, do)
    ref, ref_grad = _run_packed(lambda t: torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in t.split([4, 2, 2], dim=2)), is_causal=True, enable_gqa=True).transpose(1, 2),
        qkv.double(), do.double())
    assert o.shape == (1, 33, 4, D) and o.is_contiguous()
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-5, rtol=0)


def _varlen_inputs(lengths: list[int], H: int, H_kv: int, D: int) -> tuple[torch.Tensor, ...]:
    cu_seqlens = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device=DEVICE)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, D, device=DEVICE) for h in (H, H_kv, H_kv))
    return cu_seqlens, q, k, v, torch.randn(total, H, D, device=DEVICE)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (False, (9, 3))],
                         ids=["causal", "full", "full-window"])
def test_varlen_matches_each_sequence_attended_alone(causal: bool, window: tuple[int, int] | None) -> None:
    lengths = [30, 1, 66, 17, *_random_lengths(40, 12)]
    cu_seqlens, q, k, v, do = _varlen_inputs(lengths, 6, 3, 40)
    got = _run(lambda q, k, v: (flash_attention_varlen(q, k, v, cu_seqlens, max(lengths), causal, window=window), q),
               q, k, v, do)

    def alone(q, k, v):  # each sequence on its own, float64, concatenated
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            mask = _allowed(torch.arange(b - a, device=DEVICE)[None], causal, window)
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs), q

    ref = _run(alone, q.double(), k.double(), v.double(), do.double())
    for name, g, r in zip(("O", "dQ", "dK", "dV"), (got[0], *got[2:]), (ref[0], *ref[2:]), strict=True):
        torch.testing.assert_close(g.double(), r, atol=2e-5, rtol=0, msg=f"{name} (lengths {lengths})")


def test_varlen_changing_one_sequence_changes_nothing_outside_its_rows() -> None:
    """Bit for bit: perturbing one sequence's q, k, v leaves the other sequences' outputs and gradients as they were."""
    lengths = [45, 1, 70, 12]
    cu_seqlens, q, k, v, do = _varlen_inputs(lengths, 4, 2, 32)
    a, b = cu_seqlens[2].item(), cu_seqlens[3].item()  # the third sequence
    runs = []
    for scale in (1.0, 3.0):
        inputs = [x.clone() for x in (q, k, v)]
        for x in inputs:
            x[a:b] *= scale
        runs.append(_run(lambda q, k, v: (flash_attention_varlen(q, k, v, cu_seqlens, 70, causal=False), q),
                         *inputs, do))
    outside = torch.cat((torch.arange(a), torch.arange(b, sum(lengths)))).to(DEVICE)
    for name, x, y in zip(("O", "dQ", "dK", "dV"), (runs[0][0], *runs[0][2:]), (runs[1][0], *runs[1][2:]),
                          strict=True):
        assert torch.equal(x[outside], y[outside]), name
        assert not torch.equal(x[a:b], y[a:b]), name


def test_document_bounds_are_each_tokens_example_start_and_end() -> None:
    first, end = document_bounds(torch.tensor([[0, 1, 2, 0, 0, 1], [3, 4, 0, 1, 2, 3]]))
    assert first.dtype == end.dtype == torch.int32
    assert first.tolist() == [[0, 0, 0, 3, 4, 4], [0, 0, 2, 2, 2, 2]]  # token 0 always starts an example
    assert end.tolist() == [[3, 3, 3, 4, 6, 6], [2, 2, 6, 6, 6, 6]]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_key_bounds_and_backward_query_bounds_describe_one_mask(causal: bool) -> None:
    """The forward walks each query's keys [KV_START, KV_END), the backward each key's queries [Q_START, Q_END): for
    packed rows and every window both must be the mask the reference builds, or dK/dV would see other pairs than O."""
    from kernels.ops import _bounds

    T = 389
    positions = _positions([_random_lengths(T, 150), _random_lengths(T, 40)])
    for window in (None, (0, 0), (3, 0), (17, 5), (T, 2), (-1, 9)):
        q = torch.empty(2, 1, T, 8, device=DEVICE)
        kv_start, kv_end, q_start, q_end = _bounds(document_bounds(positions), window, q, causal)
        i, j = torch.arange(T, device=DEVICE)[:, None], torch.arange(T, device=DEVICE)[None, :]
        for b in range(2):
            by_query = (kv_start[b, :, None] <= j) & (j < kv_end[b, :, None])
            by_key = (q_start[b, None, :] <= i) & (i < q_end[b, None, :])
            if causal:
                by_query, by_key = by_query & (j <= i), by_key & (i >= j)
            assert torch.equal(by_query, by_key), (window, b)
            assert torch.equal(by_query, _allowed(positions, causal, window)[b]), (window, b)


def test_documents_need_the_bounds_pair_and_windows_their_two_reaches() -> None:
    q = torch.randn(1, 2, 16, 32, device=DEVICE)
    documents = document_bounds(torch.zeros(1, 16, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="document_bounds"):
        flash_attention(q, q, q, documents=(documents[0].long(), documents[1]))
    with pytest.raises(ValueError, match="integer"):
        document_bounds(torch.zeros(1, 16))
    with pytest.raises(ValueError, match="window must be"):
        flash_attention(q, q, q, window=(-2, 0))
    with pytest.raises(ValueError, match="window must be"):
        flash_attention(q, q, q, window=(4,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (300, 0)), (False, (100, 37))],
                         ids=["causal", "full", "causal-window", "full-window"])
@pytest.mark.parametrize("heads", [(8, 2, 128), (15, 5, 64), (4, 2, 96)], ids=["d128-gqa4", "d64-gqa3", "d96-gqa2"])
def test_gpu_packed_rows_bf16_match_reference(heads: tuple[int, int, int], causal: bool,
                                              window: tuple[int, int] | None) -> None:
    """Long packed rows in bf16 (D = 128: the TMA path on Hopper), examples of every length up to several tiles."""
    rows = [_random_lengths(2048, 400), _random_lengths(2048, 60)]
    _check_documents(rows, *heads, torch.bfloat16, causal=causal, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_sliding_window_bf16_matches_reference(causal: bool) -> None:
    _check_documents([[3000]], 8, 2, 128, torch.bfloat16, window=(1000, 200), packed=False, causal=causal)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (300, 0)), (False, (100, 37))],
                         ids=["causal", "full", "causal-window", "full-window"])
@pytest.mark.parametrize("heads,T", [((8, 2, 128), 2048), ((8, 8, 128), 1000), ((15, 5, 64), 1001)],
                         ids=["d128-gqa4", "d128-ragged", "d64-gqa3-odd"])
@pytest.mark.parametrize("persistent,ws", [("0", "0"), ("1", "0"), ("0", "1"), ("1", "persistent"), ("1", "queue"),
                                           ("1", "by-example"), ("1", "by-example-split")],
                         ids=["per-tile", "persistent", "ws-backward", "persistent-both", "persistent-queue",
                              "by-example", "by-example-split"])
def test_gpu_gluon_kernels_take_packed_rows_and_windows(monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int, int],
                                                       T: int, causal: bool, window: tuple[int, int] | None,
                                                       persistent: str, ws: str) -> None:
    """FLASH_ATTN_GLUON=1: the Gluon forward (a program per query tile or per multiprocessor) and one-pass backward
    (64 keys per program, or warp-specialised over 128, by key tile or by example, whole or long examples split
    into key tiles) run bounded attention (the backward where T is a multiple of 4; T = 1001 runs the Triton backward
    after the Gluon forward), against float64; by example, its fp32 dQ sums start as NaN too (zeroed only for the
    rows of split examples)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "1")
    monkeypatch.setenv("FLASH_ATTN_PERSISTENT", persistent)
    _set_gluon_backward(monkeypatch, ws)
    launch._PLANS.clear()
    _check_documents([_random_lengths(T, 400), _random_lengths(T, 60)], *heads, torch.bfloat16, causal=causal,
                     window=window)
    bounded = {key[0]: plan.gluon for key, plan in launch._PLANS.items() if key[8]}  # key[8]: bounds given
    assert bounded == {"fwd": True, "bwd": T % 4 == 0}, bounded


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,D", [((15, 5), 64), ((32, 8), 128)], ids=["d64-gqa3", "d128-gqa4"])
def test_gpu_by_example_backward_takes_packed_rows_at_d64_and_d128_under_auto(
        monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int], D: int) -> None:
    """FLASH_ATTN_BY_EXAMPLE=1 with FLASH_ATTN_GLUON=auto: the backward of packed rows is the by-example Gluon kernel
    at D = 64 (after the Triton forward) and 128, against float64, its fp32 dQ sums starting as NaN; examples over 300
    tokens walked by key tile."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are written for Hopper (sm_90)")
    monkeypatch.setenv("FLASH_ATTN_GLUON", "auto")
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE", "1")
    monkeypatch.setenv("FLASH_ATTN_BY_EXAMPLE_MAX", "300")
    launch._PLANS.clear()
    _check_documents([_random_lengths(2048, 600), _random_lengths(2048, 50)], *heads, D, torch.bfloat16)
    backward = [plan.gluon for key, plan in launch._PLANS.items() if key[0] == "bwd" and key[8]]  # key[8]: bounds
    assert backward == [True], backward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_varlen_replays_in_a_cuda_graph_with_boundaries_changed_in_place() -> None:
    """flash_attention_varlen captures (no host copy or synchronisation) and a replay follows cu_seqlens changed in
    place: bit for bit the eager call on the new boundaries."""
    cu_seqlens, q, k, v, _ = _varlen_inputs([300, 1, 700, 23], 8, 2, 128)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    run = lambda: flash_attention_varlen(q, k, v, cu_seqlens, 700)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles and plans outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    cu_seqlens.copy_(torch.tensor([0, 512, 513, 1000, 1024], dtype=torch.int32))
    graph.replay()
    expected = run()
    assert torch.equal(out, expected)
    other = flash_attention_varlen(q, k, v, cu_seqlens.new_tensor([0, 300, 1024]), 1024)  # rows 300.. start anew
    assert not torch.equal(expected[300:512], other[300:512])


def test_a_name_the_kernel_package_lacks_is_an_import_error_naming_hugging_faces_kernels_and_the_pin():
    """transformers >= 5.25 imports Hugging Face's `kernels` distribution, which our package of the same name shadows
    from the repository root: the error says so. Submodules not yet imported still import."""
    import kernels

    with pytest.raises(ImportError, match=r"shadows Hugging Face's `kernels`.*transformers<5\.25"):
        from kernels import CUDAProperties  # noqa: F401  transformers' first import from it
    assert not hasattr(kernels, "__wrapped__")
    from kernels import swiglu  # noqa: F401

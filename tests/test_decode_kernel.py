"""Tests for the split-KV decode kernel (`kernels.flash_decode`): against float64, masking by lengths, splits, head dims
between the tile widths, layouts, errors, torch integration.

Run on CPU through the Triton interpreter (`TRITON_INTERPRET=1 python -m pytest tests/test_decode_kernel.py -q`) or
on a CUDA GPU (`-m gpu` selects the GPU-only tests: long caches with the GPU's own split count, CUDA graphs,
torch.compile with mode="reduce-overhead").

Accuracy rule: tests/test_flash_attention.py's (flash-attn's): against a float64 reference computed from the same
(rounded) inputs, our max abs error is at most 2x that of PyTorch's attention computed in the input dtype, plus a
small slack. Inputs are fresh random draws on every run. Cache entries at index >= lengths[b] are NaN unless a test
says otherwise, so any read of them shows; every buffer the kernels write (output and fp32 workspaces) starts as NaN
(autouse fixture), so an element left unwritten, or a workspace entry read without having been written, shows too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ATOL, within_tolerance

import kernels
from kernels import env, flash_decode, launch
from kernels.decode import MAX_SPLITS, decode_plan, launch_config, query_blocking, split_plan, tile_head_dim

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not env.INTERPRET, reason="no GPU: run with TRITON_INTERPRET=1")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # bf16: upcast in the interpreter


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the kernels fill starts as NaN, so unwritten elements cannot pass as zeros."""
    monkeypatch.setattr(launch, "alloc", lambda shape, dtype, device: torch.full(
        shape, math.nan, dtype=dtype, device=device))


# ----------------------------------------------------------------------------------------------------------------------
# Inputs, the reference and the accuracy check
# ----------------------------------------------------------------------------------------------------------------------
def _inputs(B: int, Hq: int, Hkv: int, Tq: int, S: int, D: int, dtype: torch.dtype, lengths: list[int],
            poison: float = math.nan) -> tuple[torch.Tensor, ...]:
    """q (B, Hq, Tq, D), caches (B, Hkv, S, D) whose entries at index >= lengths[b] are `poison`, lengths (B,)."""
    q = torch.randn(B, Hq, Tq, D, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, D, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths_t = torch.tensor(lengths, device=DEVICE)
    beyond = (torch.arange(S, device=DEVICE) >= lengths_t[:, None])[:, None, :, None]  # (B, 1, S, 1)
    return q, k.masked_fill(beyond, poison), v.masked_fill(beyond, poison), lengths_t


def _lengths(B: int, S: int, Tq: int) -> list[int]:
    """A full row, then rows of random length in [Tq, S] (mostly not multiples of the tile or split size)."""
    return [S, *torch.randint(Tq, S + 1, (B - 1,)).tolist()]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
               scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention in the inputs' dtype (float64: the reference; the input dtype: PyTorch's error baseline).
    K/V heads repeated per group; query t of row b at position lengths[b] - Tq + t sees keys [0, position]; a query
    that sees no key gives zeros. Cache entries beyond the lengths are zeroed first (they hold poison)."""
    B, Hq, Tq, D = q.shape
    S, group = k.shape[2], Hq // k.shape[1]
    keys = torch.arange(S, device=q.device)
    valid = (keys < lengths[:, None])[:, None, :, None]  # (B, 1, S, 1)
    k, v = (torch.where(valid, t, 0).repeat_interleave(group, dim=1) for t in (k, v))  # (B, Hq, S, D)
    pos = lengths[:, None] - Tq + torch.arange(Tq, device=q.device)  # (B, Tq)
    visible = keys <= pos[:, :, None]  # (B, Tq, S)
    if window is not None:  # and the window's keys only
        visible &= keys >= pos[:, :, None] - window
    visible = visible[:, None]  # (B, 1, Tq, S)
    s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~visible, -math.inf)  # (B, Hq, Tq, S)
    p = torch.where(visible.any(-1, keepdim=True), torch.softmax(s, dim=-1), 0.0)
    return p @ v  # (B, Hq, Tq, D)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, num_splits: int | None = None,
           scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Our output against float64 by the accuracy rule; exact zeros for queries that see no key. Returns ours."""
    out = flash_decode(q, k, v, lengths, scale, num_splits=num_splits,
                       window=None if window is None else (window, 0))
    scale_ = scale if scale is not None else q.shape[-1] ** -0.5
    ref = _reference(q.double(), k.double(), v.double(), lengths, scale_, window)
    base = _reference(q, k, v, lengths, scale_, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    ok, msg = within_tolerance(out, ref, base, ATOL[q.dtype])
    assert ok, f"{msg} (q {tuple(q.shape)}, cache {tuple(k.shape)}, lengths {lengths.tolist()}, {num_splits} splits)"
    Tq = q.shape[2]
    blind = (lengths[:, None] - Tq + torch.arange(Tq, device=q.device)) < 0  # (B, Tq): the query sees no key
    assert (out.transpose(1, 2)[blind] == 0).all(), "a query that sees no key must output exact zeros"
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Correctness against float64
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference_for_every_dtype_and_head_dim(dtype: torch.dtype, D: int) -> None:
    """GQA 4/2, random lengths, one query and three (causal among them), three splits and the automatic count."""
    B, S = 3, 80
    for Tq, num_splits in ((1, 3), (3, 3), (1, None)):
        _check(*_inputs(B, 4, 2, Tq, S, D, dtype, _lengths(B, S, Tq)), num_splits=num_splits)


GQA_HEADS = [(2, 2), (4, 2), (6, 2), (4, 1), (8, 1)]  # (Hq, Hkv): groups of 1 (MHA), 2, 3, 4 (MQA), 8 (MQA)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", GQA_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_grouped_query_heads_match_reference_that_repeats_kv(heads: tuple[int, int], dtype: torch.dtype) -> None:
    Hq, Hkv = heads
    B, S = 2, 50
    for Tq in (1, 3):
        _check(*_inputs(B, Hq, Hkv, Tq, S, 32, dtype, _lengths(B, S, Tq)), num_splits=2)


def test_query_rows_beyond_one_program_take_several_row_blocks() -> None:
    """GROUP * Tq = 16 * 5 = 80 query rows per key-value head: more than one program's BLOCK_M (64)."""
    assert query_blocking(16, 5) == (64, 2)
    B, S = 2, 40
    _check(*_inputs(B, 16, 1, 5, S, 16, torch.float32, _lengths(B, S, 5)), num_splits=2)


ODD_HEAD_DIMS = [40, 96, 136]  # between the tile widths: tiles of 64, 128 and 256, the channels past D masked


@pytest.mark.parametrize("D", ODD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_head_dims_between_the_tile_widths_match_reference(dtype: torch.dtype, D: int) -> None:
    """GQA 6/3 and 4/1, Tq = 1 and 3, one, two and three splits, and a sliding window; contiguous caches, whose row
    strides at D = 40 and 136 are multiples of 8 but not of 16 (ALIGN_KV)."""
    B, S = 2, 50
    for Hq, Hkv, Tq, num_splits, window in ((6, 3, 1, 3, None), (4, 1, 3, 2, None), (6, 3, 3, 1, 9)):
        _check(*_inputs(B, Hq, Hkv, Tq, S, D, dtype, _lengths(B, S, Tq)), num_splits=num_splits, window=window)


def test_a_head_dim_between_the_tile_widths_reads_no_channel_past_it() -> None:
    """q and the caches are the first D = 40 channels of buffers whose further channels are NaN: a read of any of them
    would turn scores into NaN."""
    B, Hq, Hkv, Tq, S, D = 2, 4, 2, 2, 40, 40
    q, k, v, lengths = _inputs(B, Hq, Hkv, Tq, S, D + 8, torch.float32, _lengths(B, S, Tq))
    q, k, v = (t.index_fill(-1, torch.arange(D, D + 8, device=DEVICE), math.nan)[..., :D] for t in (q, k, v))
    for num_splits in (1, 3):
        _check(q, k, v, lengths, num_splits=num_splits)


def test_a_head_dim_between_the_tile_widths_writes_no_channel_past_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """D = 136 (a tile of 256): the output and the workspaces are followed by NaN guard elements, which must stay NaN
    (a store of the padding channels would reach past the last row)."""
    guards = []

    def alloc_with_guard(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        flat = torch.full((n + 256,), math.nan, dtype=dtype, device=device)
        guards.append(flat[n:])
        return flat[:n].view(shape)

    monkeypatch.setattr(launch, "alloc", alloc_with_guard)
    B, S = 2, 40
    for num_splits in (1, 3):
        _check(*_inputs(B, 4, 2, 1, S, 136, torch.float32, _lengths(B, S, 1)), num_splits=num_splits)
    assert len(guards) == 4  # the output; then the output, the partial outputs and their LSEs
    assert all(g.isnan().all() for g in guards)


def test_model_triton_decode_step_at_head_dim_40_runs_the_kernel_and_matches_naive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's triton decode step (model/attention.py) on q a view of a fused projection, as the model passes it,
    GQA 4/2, Tq = 2: flash_decode runs, SDPA does not, and the output matches naive decode."""
    from model import attention

    shapes = []  # of the queries flash_decode was called with
    real_flash_decode = kernels.flash_decode

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        shapes.append(tuple(q.shape))
        return real_flash_decode(q, *args, **kwargs)

    monkeypatch.setattr(kernels, "flash_decode", spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: pytest.fail("SDPA ran"))
    B, Hq, Hkv, Tq, S, D = 2, 4, 2, 2, 37, 40
    qkv = torch.randn(B, Tq, Hq + 2 * Hkv, D, device=DEVICE)
    q = qkv.transpose(1, 2)[:, :Hq]  # (B, Hq, Tq, D)
    k, v = (torch.randn(B, Hkv, S, D, device=DEVICE) for _ in range(2))
    positions = torch.tensor([[4, 5], [30, 31]], device=DEVICE)  # (B, Tq)
    y = attention.get_decode_attention("triton")(q, k, v, positions)
    assert shapes == [(B, Hq, Tq, D)]
    torch.testing.assert_close(y, attention.naive_decode(q, k, v, positions), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, MAX_SPLITS])
def test_every_split_count_matches_reference(num_splits: int) -> None:
    """Ranges of whole tiles; more splits than tiles leaves fewer splits. Rows of length S, 37, 1 and 0."""
    _check(*_inputs(4, 4, 2, 1, 100, 32, torch.float32, [100, 37, 1, 0]), num_splits=num_splits)


def test_more_splits_than_the_combine_holds_at_once_are_merged_in_chunks() -> None:
    """D = 128: the combine reads 16 splits' partial outputs at a time; 25 splits take two chunks."""
    q, k, v, lengths = _inputs(2, 2, 1, 1, 400, 128, torch.float32, [400, 211])
    assert decode_plan(q, k, num_splits=25).n_splits == 25
    _check(q, k, v, lengths, num_splits=25)


def test_length_one_returns_the_first_value_and_length_zero_returns_zeros() -> None:
    q, k, v, lengths = _inputs(2, 4, 2, 1, 64, 32, torch.float16, [1, 0])
    out = flash_decode(q, k, v, lengths, num_splits=4)
    torch.testing.assert_close(out[0, :, 0], v[0, :, 0].repeat_interleave(2, dim=0), atol=0, rtol=0)
    assert (out[1] == 0).all()


def test_new_queries_are_causal_among_themselves_and_blind_ones_output_zeros() -> None:
    """Tq = 3 with lengths 3 (query t sees keys 0..t), 2 and 1 (the first queries see no key), 0 and 50."""
    for num_splits in (1, 3):
        _check(*_inputs(5, 4, 2, 3, 50, 32, torch.float32, [3, 2, 1, 0, 50]), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_sliding_window_sees_only_the_last_keys_of_each_query(num_splits: int) -> None:
    """Window 10 against rows of 100, 37, 9 and 0 keys, Tq = 2 (the two queries' windows differ by one key); poisoned
    keys past each row's length, and keys before the window, change nothing."""
    _check(*_inputs(4, 4, 2, 2, 100, 32, torch.float32, [100, 37, 9, 0]), num_splits=num_splits, window=10)


def test_a_custom_scale_matches_the_reference() -> None:
    B, S = 2, 60
    _check(*_inputs(B, 4, 2, 2, S, 64, torch.float16, _lengths(B, S, 2)), num_splits=2, scale=0.3)


@pytest.mark.parametrize("poison", [math.nan, math.inf, 1e4], ids=["nan", "inf", "huge"])
def test_cache_entries_beyond_lengths_never_influence_the_output(poison: float) -> None:
    """Bit-identical to the same call on a cache whose entries beyond the lengths are zeros."""
    S = 64
    q, k, v, lengths = _inputs(4, 4, 2, 2, S, 32, torch.float32, [45, 17, S, 1], poison)
    beyond = (torch.arange(S, device=DEVICE) >= lengths[:, None])[:, None, :, None]  # (B, 1, S, 1)
    clean = [t.masked_fill(beyond, 0.0) for t in (k, v)]
    for num_splits in (1, 3):
        poisoned = flash_decode(q, k, v, lengths, num_splits=num_splits)
        assert torch.equal(poisoned, flash_decode(q, *clean, lengths, num_splits=num_splits))


def test_lengths_outside_the_cache_are_clamped_to_it() -> None:
    q, k, v, _ = _inputs(2, 2, 2, 1, 48, 32, torch.float32, [48, 48])
    out = flash_decode(q, k, v, torch.tensor([1000, -5], device=DEVICE), num_splits=2)
    torch.testing.assert_close(out, flash_decode(q, k, v, torch.tensor([48, 0], device=DEVICE), num_splits=2))


def test_int32_and_int64_lengths_agree() -> None:
    q, k, v, lengths = _inputs(3, 4, 2, 1, 40, 32, torch.float32, [40, 23, 5])
    as_int32, as_int64 = (flash_decode(q, k, v, lengths.to(t), num_splits=2) for t in (torch.int32, torch.int64))
    assert torch.equal(as_int32, as_int64)


# ----------------------------------------------------------------------------------------------------------------------
# Layouts: views are read in place
# ----------------------------------------------------------------------------------------------------------------------
def test_fused_projection_query_and_cache_views() -> None:
    """q the query part of a fused qkv projection (B, Tq, Hq + 2 Hkv, D) seen as (B, Hq, Tq, D); caches that are views:
    a (B, S, Hkv, D) buffer transposed, and the first S positions of a longer (B, Hkv, 2S, D) buffer."""
    B, Tq, Hq, Hkv, S, D = 3, 2, 6, 2, 40, 32
    qkv = torch.randn(B, Tq, Hq + 2 * Hkv, D, device=DEVICE, dtype=torch.float16)
    q = qkv.transpose(1, 2)[:, :Hq]  # (B, Hq, Tq, D)
    k = torch.randn(B, S, Hkv, D, device=DEVICE, dtype=torch.float16).transpose(1, 2)  # (B, Hkv, S, D)
    v = torch.randn(B, Hkv, 2 * S, D, device=DEVICE, dtype=torch.float16)[:, :, :S]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    lengths = torch.tensor(_lengths(B, S, Tq), device=DEVICE)
    out = _check(q, k, v, lengths, num_splits=3)
    assert out.transpose(1, 2).is_contiguous()  # (B, Tq, Hq, D) memory: merging heads is a free view
    _check(q.contiguous(), k, v, lengths, num_splits=1)


def test_output_of_contiguous_query_is_contiguous() -> None:
    q, k, v, lengths = _inputs(2, 4, 2, 1, 32, 16, torch.float32, [32, 9])
    assert flash_decode(q, k, v, lengths).is_contiguous()


def test_empty_batch_returns_empty() -> None:
    q, k, v, lengths = _inputs(1, 2, 2, 1, 16, 32, torch.float32, [16])
    out = flash_decode(q[:0], k[:0], v[:0], lengths[:0])
    assert out.shape == (0, 2, 1, 32)


# ----------------------------------------------------------------------------------------------------------------------
# The split plan: static shapes only
# ----------------------------------------------------------------------------------------------------------------------
def test_split_plan_fills_the_gpu_for_a_small_batch_with_a_long_cache() -> None:
    n, split_len = split_plan(S=32768, programs=8, block_n=64, sm_count=132)  # B = 1, Hkv = 8
    assert n * 8 >= 132 and split_len % 64 == 0 and n * split_len >= 32768 > (n - 1) * split_len


def test_split_plan_splits_less_as_batch_and_heads_fill_the_gpu() -> None:
    assert split_plan(S=4096, programs=16 * 8, block_n=64, sm_count=132) == (3, 1408)
    assert split_plan(S=4096, programs=1024, block_n=64, sm_count=132) == (1, 4096)


def test_split_plan_never_cuts_ranges_shorter_than_two_tiles_nor_more_than_the_maximum() -> None:
    assert split_plan(S=1024, programs=12, block_n=64, sm_count=132) == (8, 128)
    assert split_plan(S=100, programs=1, block_n=64, sm_count=132) == (1, 128)
    assert split_plan(S=10**6, programs=1, block_n=64, sm_count=132)[0] == MAX_SPLITS


def test_split_plan_rounds_a_requested_count_to_whole_tiles() -> None:
    assert split_plan(S=100, programs=1, block_n=16, sm_count=132, num_splits=3) == (3, 48)
    assert split_plan(S=100, programs=1, block_n=16, sm_count=132, num_splits=50) == (7, 16)
    assert split_plan(S=0, programs=1, block_n=16, sm_count=132) == (1, 16)


def test_launch_config_has_an_entry_for_every_supported_head_dim_and_dtype() -> None:
    for D in (16, 32, 64, 128, 256):
        for dtype in DTYPES.values():
            block_n, warps, stages = launch_config(D, dtype)
            assert block_n >= 16 and warps in (1, 2, 4, 8) and stages >= 1


def test_a_head_dim_runs_at_the_next_tile_width_with_that_widths_launch_config() -> None:
    dims = [8, 16, 24, 40, 64, 72, 96, 128, 136, 256]
    assert [tile_head_dim(D) for D in dims] == [16, 16, 32, 64, 64, 128, 128, 128, 256, 256]
    for D in range(8, 257, 8):
        for dtype in DTYPES.values():
            assert launch_config(D, dtype) == launch_config(tile_head_dim(D), dtype)


def test_empty_cache_outputs_zeros() -> None:
    q, k, v, lengths = _inputs(2, 2, 1, 1, 0, 32, torch.float32, [0, 0])
    assert torch.equal(flash_decode(q, k, v, lengths), torch.zeros_like(q))


# ----------------------------------------------------------------------------------------------------------------------
# Unsupported inputs raise ValueError naming the limit
# ----------------------------------------------------------------------------------------------------------------------
def _bad(dtype: torch.dtype = torch.float32, **overrides) -> dict:
    args = dict(zip(("q", "k_cache", "v_cache", "lengths"), _inputs(2, 4, 2, 1, 16, 32, dtype, [16, 3]), strict=True))
    return {**args, **overrides}


@pytest.mark.parametrize("kwargs,match", [
    (_bad(q=torch.randn(2, 4, 32)), "q must be 4-D"),
    (_bad(k_cache=torch.randn(2, 2, 16)), "k_cache must be 4-D"),
    (_bad(v_cache=torch.randn(2, 2, 8, 32)), "Hq a multiple of Hkv"),
    (_bad(k_cache=torch.randn(2, 3, 16, 32), v_cache=torch.randn(2, 3, 16, 32)), "Hq a multiple of Hkv"),
    (_bad(k_cache=torch.randn(3, 2, 16, 32), v_cache=torch.randn(3, 2, 16, 32)), r"\(B, Hkv, S, D\)"),
    (_bad(k_cache=torch.randn(2, 2, 16, 64), v_cache=torch.randn(2, 2, 16, 64)), r"\(B, Hkv, S, D\)"),
    (_bad(q=torch.randn(2, 4, 1, 32, dtype=torch.float16)), "share one dtype"),
    (_bad(dtype=torch.float64), "dtype torch.float64 is not supported"),
    (_bad(q=torch.randn(2, 4, 1, 44), k_cache=torch.randn(2, 2, 16, 44), v_cache=torch.randn(2, 2, 16, 44)),
     "head dim 44 is not supported; supported head dims are the multiples of 8 up to 256"),
    (_bad(q=torch.randn(2, 4, 1, 264), k_cache=torch.randn(2, 2, 16, 264), v_cache=torch.randn(2, 2, 16, 264)),
     "head dim 264"),
    (_bad(lengths=torch.tensor([16])), r"lengths must be a \(B,\) = \(2,\) int32 or int64"),
    (_bad(lengths=torch.tensor([[16, 3]])), r"lengths must be a \(B,\)"),
    (_bad(lengths=torch.tensor([16.0, 3.0])), "dtype torch.float32"),
    (_bad(lengths=torch.tensor([16, 3], device="meta")), "must be on one device"),
    (_bad(scale=-1.0), "scale must be a finite positive number"),
    (_bad(scale=math.inf), "scale must be a finite positive number"),
    (_bad(num_splits=0), r"num_splits must be in \[1, 128\]"),
    (_bad(num_splits=MAX_SPLITS + 1), r"num_splits must be in \[1, 128\]"),
], ids=["q-3d", "k-3d", "k-v-differ", "kv-heads-not-a-divisor", "batch-differs", "head-dim-differs", "mixed-dtype",
        "float64", "head-dim-44", "head-dim-264", "lengths-short", "lengths-2d", "lengths-float",
        "lengths-other-device", "negative-scale", "infinite-scale", "zero-splits", "too-many-splits"])
def test_unsupported_inputs_raise(kwargs: dict, match: str) -> None:
    kwargs = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
              for name, t in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        flash_decode(**kwargs)


def test_inputs_requiring_grad_raise_under_grad_mode_and_run_under_no_grad() -> None:
    args = _bad()
    q = args.pop("q").requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        flash_decode(q, **args)
    with torch.no_grad():
        assert torch.isfinite(flash_decode(q, **args)).all()


def test_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "INTERPRET", False)
    args = {name: t.cpu() for name, t in _bad().items()}
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 to run on CPU, or move tensors to CUDA"):
        flash_decode(**args)


# ----------------------------------------------------------------------------------------------------------------------
# torch integration: the custom op, torch.compile, the kernels' build for Hopper
# ----------------------------------------------------------------------------------------------------------------------
def test_custom_op_schema_and_fake_tensor_agree_with_the_kernel() -> None:
    q, k, v, lengths = _inputs(2, 4, 2, 2, 24, 16, torch.float32, [24, 7])
    op = torch.ops.flashgpt.flash_decode.default
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(op, (q, k, v, lengths, 0.25, None, -1), test_utils=utils)
    torch.library.opcheck(op, (q, k, v, lengths, 0.25, 2, 5), test_utils=utils)  # a sliding window
    qkv = torch.randn(2, 2, 8, 16, device=DEVICE)  # a fused projection's view: the output is (B, Tq, Hq, D) memory
    torch.library.opcheck(op, (qkv.transpose(1, 2)[:, :4], k, v, lengths, 0.25, 3, -1), test_utils=utils)


def test_torch_compile_fullgraph_matches_eager_as_lengths_change() -> None:
    """A decode step (fused projection -> flash_decode -> merge heads) compiled with fullgraph=True (any graph break
    raises) matches eager for lengths changed in place between calls."""
    B, Tq, Hq, Hkv, S, D = 2, 1, 4, 2, 32, 16
    w = torch.randn(Hq * D, (Hq + 2 * Hkv) * D, device=DEVICE) / 8
    _, k, v, lengths = _inputs(B, Hq, Hkv, Tq, S, D, torch.float32, [S, S])

    def step(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        q = (x @ w).view(B, Tq, Hq + 2 * Hkv, D).transpose(1, 2)[:, :Hq]  # (B, Hq, Tq, D)
        return flash_decode(q, k, v, lengths, num_splits=2).transpose(1, 2).reshape(B, Tq, Hq * D)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.randn(B, Tq, Hq * D, device=DEVICE)
    with torch.no_grad():
        for new_lengths in ([S, 5], [1, 20]):
            lengths.copy_(torch.tensor(new_lengths))
            torch.testing.assert_close(compiled(x, k, v, lengths), step(x, k, v, lengths), atol=1e-6, rtol=1e-6)


_BUILD_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.decode_kernels import _decode_combine_kernel, _decode_split_kernel

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Lengths": "*i64", "Out": "*bf16", "O_part": "*fp32",
            "LSE_part": "*fp32"}

def build(label, kernel, constexprs, num_warps, num_stages, odd_strides=()):
    # specialised as Triton specializes a launch on aligned, contiguous tensors: 16-byte aligned pointers and strides
    # (multiples of 16, but for odd_strides: the rows of a contiguous cache of D = 136), unit strides along D
    signature, fixed, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr or (name.startswith("stride") and name.endswith("d")):
            signature[name] = "constexpr"
            fixed[(i,)] = constexprs.get(name, 1)
        elif name in POINTERS:
            signature[name] = POINTERS[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if (name.startswith("stride") and name not in odd_strides) or name in ("S", "split_len"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]
    print(json.dumps({"build": label, "mma": "mma.sync" in ptx, "cp.async": "cp.async" in ptx}))

for single in (True, False):
    for head_dim, group, tq, block_m, block_n, warps, stages in ((128, 4, 1, 16, 64, 4, 3), (64, 1, 1, 16, 64, 4, 3),
                                                               (128, 8, 3, 32, 64, 4, 3), (256, 4, 1, 16, 32, 8, 2)):
        build(f"split D={head_dim} group={group} Tq={tq} single={single}", _decode_split_kernel,
              dict(HEAD_DIM=head_dim, HEAD_DIM_REAL=head_dim, GROUP=group, TQ=tq, SINGLE_SPLIT=single, UPCAST=False,
                   PRECISION="tf32", WINDOW=False, ALIGN_KV=False, BLOCK_M=block_m, BLOCK_N=block_n), warps, stages)
build("split D=64 group=4 Tq=1 window", _decode_split_kernel, dict(HEAD_DIM=64, HEAD_DIM_REAL=64, GROUP=4, TQ=1,
      SINGLE_SPLIT=False, UPCAST=False, PRECISION="tf32", WINDOW=True, ALIGN_KV=False, BLOCK_M=16, BLOCK_N=64), 4, 3)
# head dims between the tile widths: 96 in a tile of 128; 136 in a tile of 256, rows 136 elements apart (ALIGN_KV)
build("split D=96 group=4 Tq=1", _decode_split_kernel, dict(HEAD_DIM=128, HEAD_DIM_REAL=96, GROUP=4, TQ=1,
      SINGLE_SPLIT=False, UPCAST=False, PRECISION="tf32", WINDOW=False, ALIGN_KV=False, BLOCK_M=16, BLOCK_N=32), 4, 4)
build("split D=136 group=4 Tq=1", _decode_split_kernel, dict(HEAD_DIM=256, HEAD_DIM_REAL=136, GROUP=4, TQ=1,
      SINGLE_SPLIT=False, UPCAST=False, PRECISION="tf32", WINDOW=False, ALIGN_KV=True, BLOCK_M=16, BLOCK_N=32), 8, 2,
      odd_strides=("stride_qt", "stride_kt", "stride_vt", "stride_ot"))
build("combine", _decode_combine_kernel, dict(HEAD_DIM=128, HEAD_DIM_REAL=128, TQ=1, SPLITS=64, BLOCK_S=16), 4, 1)
build("combine D=136", _decode_combine_kernel, dict(HEAD_DIM=256, HEAD_DIM_REAL=136, TQ=1, SPLITS=64, BLOCK_S=8), 4, 1)
"""


def test_kernels_build_for_hopper_with_tensor_cores_and_pipelined_loads() -> None:
    """Both kernels compile to sm_90 binaries (Triton's ahead-of-time path, no GPU needed) for the launch configs'
    shapes, with tensor-core dots and asynchronous copies (the K/V loads are software-pipelined): the interpreter
    would not catch code that only the compiler rejects. Head dims 96 and 136 too, 136 with the row strides of a
    contiguous cache (multiples of 8, not 16), which ALIGN_KV keeps on 16-byte asynchronous copies."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ["TRITON_DEFAULT_FP_FUSION"] = environ.get("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", _BUILD_FOR_HOPPER], cwd=Path(__file__).resolve().parents[1],
                            env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    builds = {b.pop("build"): b for b in map(json.loads, result.stdout.splitlines())}
    splits = [f"split D={d} group={g} Tq={tq} single={single}" for single in (True, False)
              for d, g, tq in ((128, 4, 1), (64, 1, 1), (128, 8, 3), (256, 4, 1))]
    splits += ["split D=64 group=4 Tq=1 window", "split D=96 group=4 Tq=1", "split D=136 group=4 Tq=1"]
    assert sorted(builds) == sorted([*splits, "combine", "combine D=136"]), result.stdout
    assert all(builds[name] == {"mma": True, "cp.async": True} for name in splits), builds


# ----------------------------------------------------------------------------------------------------------------------
# GPU only: long caches with the GPU's own split count, CUDA graphs, torch.compile(mode="reduce-overhead")
# ----------------------------------------------------------------------------------------------------------------------
GPU_SHAPES = [  # (B, Hq, Hkv, Tq, S, D)
    (1, 32, 8, 1, 32768, 128),
    (16, 32, 8, 1, 4099, 128),
    (4, 12, 12, 1, 2048, 64),
    (2, 16, 2, 4, 3000, 128),
    (2, 8, 1, 1, 1000, 256),
    (3, 4, 4, 2, 777, 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_matches_reference_with_the_automatic_split_count(shape: tuple, dtype: torch.dtype) -> None:
    B, Hq, Hkv, Tq, S, D = shape
    lengths = _lengths(B, S, Tq)
    _check(*_inputs(B, Hq, Hkv, Tq, S, D, dtype, lengths))
    _check(*_inputs(B, Hq, Hkv, Tq, S, D, dtype, [0, *lengths[1:]]), num_splits=1)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_follow_lengths_changed_in_place() -> None:
    """One capture serves every length: the split plan depends on shapes only, and lengths are read on the device."""
    B, Hq, Hkv, S, D = 4, 32, 8, 8192, 128
    q, k, v, lengths = _inputs(B, Hq, Hkv, 1, S, D, torch.bfloat16, [S] * B, poison=0.0)
    flash_decode(q, k, v, lengths)  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_decode(q, k, v, lengths)
    for new_lengths in ([S, 1, 0, 4097], [77, S - 1, 2048, 3]):
        lengths.copy_(torch.tensor(new_lengths))
        graph.replay()
        ref = _reference(q.double(), k.double(), v.double(), lengths, D ** -0.5)
        ok, msg = within_tolerance(out, ref, _reference(q, k, v, lengths, D ** -0.5), ATOL[q.dtype])
        assert ok, f"{msg} (lengths {new_lengths})"


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead_matches_eager() -> None:
    B, Hq, Hkv, S, D = 8, 32, 8, 4096, 128
    q, k, v, lengths = _inputs(B, Hq, Hkv, 1, S, D, torch.bfloat16, [S] * B, poison=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: flash_decode(*args), fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # warm-up, recording, replays
            lengths.copy_(torch.randint(0, S + 1, (B,)))
            torch.testing.assert_close(compiled(q, k, v, lengths).clone(), flash_decode(q, k, v, lengths), atol=0,
                                       rtol=0)

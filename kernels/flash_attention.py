"""FlashAttention-2-style fused attention in Triton: forward and backward kernels, and their autograd wrappers.

Problem
-------
For q, k, v of shape (B, H, T, D) attention computes O = softmax(scale * Q K^T + mask) V per (batch, head). Done
naively it materialises the T x T score matrix S and the probabilities P in HBM: O(T^2) memory and, because every
element of S and P is written and read back, a memory-bound computation. FlashAttention computes the same O exactly
(not an approximation) without ever storing S or P: it tiles Q, K, V into blocks that fit in on-chip memory (registers
and shared memory) and combines the per-tile partial softmaxes with the "online softmax" rescaling below. HBM traffic
drops from O(T^2) to O(T^2 D / M) for an on-chip tile of M rows, and memory to O(T).

Forward (`_fwd_kernel`)
-----------------------
One program per (query tile of BLOCK_M rows, head, batch): grid (cdiv(T, BLOCK_M), H, B). The program loads its Q tile
once, then streams K/V tiles of BLOCK_N rows through on-chip memory. For each key tile it forms the scores
s = Q K_j^T (BLOCK_M x BLOCK_N, fp32 accumulation on the tensor cores) and keeps per query row a running maximum m and
a running normaliser l:

    m_new = max(m, rowmax(s))          p = 2^(s - m_new)
    l     = l * 2^(m - m_new) + rowsum(p)
    acc   = acc * 2^(m - m_new) + p V_j

so after the last tile O = acc / l. Everything runs in the base-2 domain: the softmax scale is pre-multiplied by
log2(e), so each exponential is one `exp2` (a single MUFU instruction) and scaling plus max subtraction fuse into one
FMA. Only O and the per-row log-sum-exp LSE = ln(sum_j exp(scale * s_j)) (natural log, fp32, (B, H, T)) are written to
HBM; LSE is all the backward needs to rebuild P exactly.

Causal masking is done at tile granularity. For query tile [m0, m0 + BLOCK_M) the key tiles entirely left of the
diagonal (keys < m0) need no mask and run a mask-free loop; the BLOCK_M / BLOCK_N key tiles that straddle the diagonal
run a second, masked loop; key tiles entirely right of the diagonal are never visited, which halves the work. (This
needs BLOCK_M to be a multiple of BLOCK_N, which every config is.) Causal programs are launched heaviest-first (the
last query tile has the most key tiles), which keeps the tail of the grid short. Ragged T (not a multiple of the block
size) masks the loads with `other=0` and sets the scores of out-of-range keys to -inf; rows beyond T are computed on
zeros and never stored. When T is a multiple of 128 (every block size divides 128) the whole mask-free path is taken.

Backward
--------
With dO the output gradient, the exact gradients are (P as above, all products per (batch, head)):

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)        dQ = scale * dS K        dK = scale * dS^T Q

where delta_i = sum_j P_ij dP_ij = rowsum(dO * O)_i, a per-row scalar (the identity follows from O = P V).

* Preprocess: delta = rowsum(dO * O), fp32 (B, H, T). It is fused into the dQ kernel, which loads the dO tile
  anyway, so it costs one extra O tile load per query tile instead of a launch and a second read of dO.
* dK, dV (`_bwd_dkdv_kernel`): one program per key tile of BLOCK_N rows, iterating over query tiles of BLOCK_M rows.
  The program keeps its K/V tile and fp32 dK/dV accumulators on chip and, for each query tile, recomputes
  P^T = 2^(K Q^T * scale * log2e - LSE * log2e) from the saved LSE, so no T x T matrix ever reaches HBM. Working in
  the transposed orientation (P^T, dP^T) means no tile has to be transposed in registers. Causal: query tiles above
  the diagonal are skipped, the diagonal query tiles run masked, the rest mask-free (BLOCK_N is a multiple of
  BLOCK_M). Key tile 0 has the most work and is launched first.
* dQ: a separate kernel (`_bwd_dq_kernel`, which also does the preprocess and runs first): one program per query
  tile iterating over key tiles, mirroring the forward. It recomputes S and dP a second time (7 tile matmuls per tile
  pair over the whole backward instead of 5) but needs no atomics, so the backward is deterministic (bit-identical run
  to run) and needs no fp32 dQ buffer. The alternative, FLASH_ATTN_DQ=atomic, accumulates dQ = scale * dS K inside
  the dK/dV kernel with relaxed fp32 `atomic_add`s into a zeroed fp32 buffer (after a separate preprocess kernel):
  5 matmuls, but T / BLOCK_N read-modify-writes of every dQ element, an fp32 (B, H, T, D) buffer, and run-to-run
  differences of a few fp32 ulps of dQ (summation order). Chosen by measurement on an H200 (bf16, backward alone):
  the separate pass was faster on every shape measured, by 7-20% (B,H,T,D = 8,12,2048,64 causal: 0.54 vs 0.65 ms;
  4,16,4096,128 causal: 2.43 vs 2.66 ms; 1,16,16384,128 causal: 7.84 vs 8.42 ms; 16,12,1024,64 full: 0.38 vs
  0.45 ms of kernel time), with 7% less peak memory. Details in docs/kernel_notes.md.

Block sizes and tuning
----------------------
Tiles are 32-128 rows: big enough to feed Hopper's warpgroup MMA (64-row instructions; 128-row tiles with 8 warps give
two warpgroups) and amortise each K/V load over many query rows, small enough that the fp32 accumulators stay in
registers and 2-4 pipelined stages fit in shared memory. Each kernel is autotuned over 3-4 H200 candidates (the
`_*_TUNING` tables), pruned by head dim and dtype and keyed on (T, D, causal, dtypes); the first entry of a list is
the default when FLASH_ATTN_AUTOTUNE=0. What the H200 picked (bf16): forward 128 x 64 with 8 warps (64 x 64 with 4
warps for T=1024 causal, D=64); dQ 64 x 64 with 4 warps (128 x 64 with 8 warps at T=16384); dK/dV 64 keys x 64
queries with 4 warps at D=64 causal, and 128 keys x 32 queries with 8 warps at D=128 (two fp32 accumulators, dK and
dV, make wide key tiles with narrow query tiles the register-friendly shape). Under TRITON_INTERPRET=1 a single small
config (64 x 32, 32 x 64) is used so the CPU tests exercise multi-tile, ragged and diagonal paths quickly.

Tiles are loaded either with pointer arithmetic on the caller's strides or, on Hopper, by the TMA copy engine through
in-kernel tensor descriptors over each (batch, head)'s (T, D) slab (`_slab_desc`; USE_TMA). TMA moves whole tiles
asynchronously, zero-fills rows past T and needs no masks or address registers. It is used where the H200 measured it
faster: 16-bit inputs at D = 128, where it took 2-11 % off the forward and 2-5 % off the backward. At D = 64 it was
slower in every measurement, by 7-50 % in the forward and 18-70 % in the backward (docs/kernel_notes.md, v6).
FLASH_ATTN_TMA=1 or 0 overrides the choice. Warp specialisation is not used: Triton's automatic warp specialisation
(`tl.range(..., warp_specialize=True)`) supports Blackwell only, in Triton 3.6 and 3.9 alike.

Precision
---------
fp16/bf16 inputs: tensor-core dots with fp32 accumulation; softmax statistics, accumulators, LSE and delta in fp32; P
and dS are rounded to the input dtype before their matmuls (as every FlashAttention implementation does). fp32 inputs:
IEEE fp32 dots, unless `torch.backends.cuda.matmul.allow_tf32` is set (`torch.set_float32_matmul_precision("high")`),
in which case tf32 tensor-core dots are used: the same contract as torch.matmul. Under the Triton interpreter 16-bit
dot operands are upcast to fp32 first (the interpreter mis-computes bf16 dots); the rounding points stay the same.

Interface
---------
`flash_attention(q, k, v, causal=True, scale=None)` takes (B, H, T, D) tensors like
`torch.nn.functional.scaled_dot_product_attention`, with any strides (the views from splitting a fused QKV projection
are used without copies). O and the gradients come back in the input's memory order when that is dense, else (for
fused-QKV views) as (B, H, T, D) views of (B, T, H, D)-contiguous buffers, so `o.transpose(1, 2).reshape(B, T, C)` is
free. `flash_attention_qkvpacked(qkv, causal=True, scale=None)` takes the packed (B, T, 3, H, D) tensor instead and
returns (B, T, H, D); its backward writes dq, dk, dv into one (B, T, 3, H, D) gradient, so the fused projection's
gradient needs no concatenation. Autograd wrapper: in eager mode a `torch.autograd.Function` (the lowest host overhead);
under `torch.compile` a pair of `torch.library.custom_op`s per entry point with fake implementations and registered
autograd, which Dynamo and AOTAutograd treat as opaque nodes (no graph break; autotuning happens at run time, outside
tracing). Host time per launch is kept low because it bounds small problems: after the first (autotuning) launch of a
shape, the chosen config is launched directly, and on Triton 3.6 straight through the compiled kernel's launcher
(`_launch`). Under autocast, floating inputs are cast to the autocast dtype first, as SDPA does. Anything outside the
support matrix raises ValueError.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["flash_attention", "flash_attention_qkvpacked"]

_TRUE = ("1", "true", "yes", "on", "y")
# Triton decides at decoration (import) time whether kernels are interpreted; mirror that decision.
_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# Every block size divides this, so T % _MAX_BLOCK == 0 means no tile is ragged and the mask-free path is exact.
_MAX_BLOCK = 128
# CUDA limits grid dimensions y and z (heads, batch) to 65535.
_MAX_GRID_YZ = 65535

_LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
_LN2 = tl.constexpr(0.6931471805599453)  # ln(2)


# ----------------------------------------------------------------------------------------------------------------------
# Autotuning candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by (head-dim class, fp32 inputs); class 64
# covers D = 16, 32, 64. BLOCK_M is always the query tile and BLOCK_N the key tile. The first entry of each list is the
# default (FLASH_ATTN_AUTOTUNE=0). fp32 operands take twice the shared memory and registers: smaller tiles.
# ----------------------------------------------------------------------------------------------------------------------
_Tuning = dict[tuple[int, bool], list[tuple[int, int, int, int]]]

_FWD_TUNING: _Tuning = {
    (64, False): [(128, 64, 8, 4), (64, 64, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3)],
    (128, False): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
    (256, False): [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
    (64, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (128, True): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
_DKDV_TUNING: _Tuning = {  # the key tile BLOCK_N is the per-program tile, the query tile BLOCK_M is streamed
    (64, False): [(64, 64, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3), (64, 128, 4, 3)],
    (128, False): [(32, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 4), (64, 64, 4, 3)],
    (256, False): [(32, 64, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1)],
    (64, True): [(64, 64, 4, 2), (32, 64, 4, 2)],
    (128, True): [(32, 64, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
_DQ_TUNING: _Tuning = {
    (64, False): [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4)],
    (128, False): [(64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 4)],
    (256, False): [(64, 32, 8, 2), (64, 64, 8, 2)],
    (64, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (128, True): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
# Interpreter: one small config, so that T = 17..257 exercises several tiles, ragged tiles and the diagonal masks.
_INTERPRET_QUERY_MAJOR = (64, 32, 4, 1)  # forward and dQ: BLOCK_M must be a multiple of BLOCK_N
_INTERPRET_KEY_MAJOR = (32, 64, 4, 1)  # dK/dV: BLOCK_N must be a multiple of BLOCK_M


def _configs(table: _Tuning, interpret_shape: tuple[int, int, int, int]) -> list[triton.Config]:
    shapes = [interpret_shape] if _INTERPRET else sorted({s for rows in table.values() for s in rows})
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]


def _pruner(table: _Tuning):
    """early_config_prune hook: keep the candidates listed for this head dim and dtype, in table order."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        q = named_args["Q"]
        wanted = table[(max(64, q.shape[-1]), q.dtype == torch.float32)]
        if os.environ.get("FLASH_ATTN_AUTOTUNE", "1").lower() not in _TRUE:
            wanted = wanted[:1]
        by_shape = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        return [by_shape[s] for s in wanted]

    return prune


def _autotune(table: _Tuning, interpret_shape: tuple[int, int, int, int], **kwargs):
    return triton.autotune(configs=_configs(table, interpret_shape), key=["T", "HEAD_DIM", "CAUSAL", "USE_TMA"],
                           prune_configs_by={"early_config_prune": _pruner(table)}, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# TMA: a tensor descriptor over one (batch, head)'s (T, D) slab. The copy engine (TMA) then moves whole tiles between
# HBM and shared memory asynchronously, zero-fills rows >= T on loads and clips them on stores (no masks).
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _slab_desc(X, b, h, stride_b, stride_h, stride_t, T, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    return tl.make_tensor_descriptor(X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h,
                                     shape=[T, HEAD_DIM], strides=[stride_t, 1], block_shape=[BLOCK, HEAD_DIM])


# ----------------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n, lo, hi, T,
               qk_scale, MASK_CAUSAL: tl.constexpr, MASK_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi). Mask-free unless MASK_CAUSAL (diagonal) or MASK_BOUNDS (ragged T);
    MASK_CAUSAL is only used together with MASK_BOUNDS (diagonal tiles are bounds-checked too).

    Integer arithmetic is hoisted out of the loop and the dots are written inline: besides being what the GPU wants,
    both matter a lot to the interpreter's speed (it re-patches the language on every helper call).
    """
    k_ptrs += lo * stride_kt
    v_ptrs += lo * stride_vt
    k_step = BLOCK_N * stride_kt
    v_step = BLOCK_N * stride_vt
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        if USE_TMA:  # the copy engine fills rows >= T with zeros
            k = k_desc.load([start_n, 0])  # (BLOCK_N, D)
            v = v_desc.load([start_n, 0])  # (BLOCK_N, D)
        elif MASK_BOUNDS:
            k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)  # (BLOCK_N, D)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) raw scores, fp32
        # On the diagonal the causal mask already hides every key >= T from the rows that are stored (row < T);
        # rows >= T see zero-filled keys, which are finite and discarded. So bounds are only needed off-causal.
        if MASK_CAUSAL:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, float("-inf"))
        elif MASK_BOUNDS:
            qk = tl.where(cols[None, :] < T, qk, float("-inf"))
        # Every row sees at least one unmasked key in its first visited tile (key 0, or its own index on the
        # diagonal), so m_new is finite and no (-inf) - (-inf) = NaN can arise.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,) in log2 units
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N): one FMA + one exp2 per score
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(k_ptrs.dtype.element_ty)  # P enters the tensor cores in the input dtype
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)  # (BLOCK_M, D)
        m_i = m_new
        k_ptrs += k_step
        v_ptrs += v_step
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE,
                stride_qb, stride_qh, stride_qt, stride_qd,
                stride_kb, stride_kh, stride_kt, stride_kd,
                stride_vb, stride_vh, stride_vt, stride_vd,
                stride_ob, stride_oh, stride_ot, stride_od,
                H, T, qk_scale,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Heaviest query tiles first: under causal masking the last tile visits the most key tiles.
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T

    # int64 base offsets: batch * stride can exceed 2^31 elements for large fused-QKV activations.
    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh \
        + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    k_ptrs = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh \
        + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd
    v_ptrs = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh \
        + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd

    if USE_TMA:  # loads and stores by the copy engine, through descriptors of this (batch, head)'s (T, D) slabs
        q_desc = _slab_desc(Q, b, h, stride_qb, stride_qh, stride_qt, T, HEAD_DIM, BLOCK_M)
        k_desc = _slab_desc(K, b, h, stride_kb, stride_kh, stride_kt, T, HEAD_DIM, BLOCK_N)
        v_desc = _slab_desc(V, b, h, stride_vb, stride_vh, stride_vt, T, HEAD_DIM, BLOCK_N)
        q = q_desc.load([start_m, 0])
    else:
        k_desc = None
        v_desc = None
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D), stays on chip for the whole loop
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        # keys [0, start_m): entirely below the diagonal, always in range -> mask-free
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, 0, start_m, T, qk_scale, False, False, BLOCK_N, UPCAST, PRECISION, USE_TMA)
        # keys [start_m, start_m + BLOCK_M): the diagonal tiles, masked; keys beyond are skipped
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, start_m, tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, True,
                                   BLOCK_N, UPCAST, PRECISION, USE_TMA)
    else:
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, 0, T, T, qk_scale, False, RAGGED_T, BLOCK_N, UPCAST, PRECISION, USE_TMA)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # natural-log LSE of the scaled scores
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    if USE_TMA:  # rows >= T are clipped by the copy engine
        o_desc = _slab_desc(Out, b, h, stride_ob, stride_oh, stride_ot, T, HEAD_DIM, BLOCK_M)
        o_desc.store([start_m, 0], acc.to(Out.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (b * H + h).to(tl.int64) * T + offs_m, lse, mask=row_ok)


_fwd = _autotune(_FWD_TUNING, _INTERPRET_QUERY_MAJOR)(_fwd_kernel)


# ----------------------------------------------------------------------------------------------------------------------
# Backward: preprocess (atomic-dQ variant only; the dQ kernel fuses it otherwise)
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(Out, DO, DELTA,
                           stride_ob, stride_oh, stride_ot, stride_od,
                           stride_dob, stride_doh, stride_dot, stride_dod,
                           H, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, one program per (query tile, head, batch)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + (b * H + h).to(tl.int64) * T + offs_m, delta, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------------------
# Backward: dK, dV (and, in the atomic variant, dQ) -- one program per key tile
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, dq_ptrs, lse_ptrs, delta_ptrs,
                stride_qt, stride_dot, stride_dqt, offs_m, cols, lo, hi, T, qk_scale, sm_scale,
                MASK_CAUSAL: tl.constexpr, MASK_BOUNDS: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dK, dV (unscaled dK) of one key tile over query tiles [lo, hi); masks as in `_fwd_inner`."""
    q_ptrs += lo * stride_qt
    do_ptrs += lo * stride_dot
    lse_ptrs += lo + offs_m  # (BLOCK_M,) pointers
    delta_ptrs += lo + offs_m
    q_step = BLOCK_M * stride_qt
    do_step = BLOCK_M * stride_dot
    if DQ_ATOMIC:
        dq_ptrs += lo * stride_dqt
        dq_step = BLOCK_M * stride_dqt
    for start_m in range(lo, hi, BLOCK_M):
        # zero-filled rows >= T have q = dO = 0 and LSE = delta = 0: they add exactly 0 to dK and dV
        rows = start_m + offs_m  # (BLOCK_M,) query indices
        row_ok = rows < T
        if USE_TMA:  # the copy engine zero-fills rows >= T
            q = q_desc.load([start_m, 0])  # (BLOCK_M, D)
            do = do_desc.load([start_m, 0])  # (BLOCK_M, D)
        elif MASK_BOUNDS:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        if MASK_BOUNDS:
            lse2 = tl.load(lse_ptrs, mask=row_ok, other=0.0) * _LOG2E  # (BLOCK_M,)
            delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)  # (BLOCK_M,)
        else:
            lse2 = tl.load(lse_ptrs) * _LOG2E
            delta = tl.load(delta_ptrs)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = S^T
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # P^T, the exact softmax probabilities
        if MASK_CAUSAL:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        elif MASK_BOUNDS:
            # zero-filled keys >= T would otherwise get P = 2^(-LSE), unbounded for extreme inputs
            p_t = tl.where(cols[:, None] < T, p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = dP^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T
        p_t = p_t.to(q_ptrs.dtype.element_ty)  # P and dS enter the tensor cores in the input dtype
        ds_t = ds_t.to(q_ptrs.dtype.element_ty)
        if UPCAST:
            p_t = p_t.to(tl.float32)
            ds_t = ds_t.to(tl.float32)
        dv = tl.dot(p_t, do, dv, input_precision=PRECISION)  # (BLOCK_N, D) += P^T dO
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)  # (BLOCK_N, D) += dS^T Q
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=PRECISION) * sm_scale  # (BLOCK_M, D) partial dQ
            if MASK_BOUNDS:
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
            dq_ptrs += dq_step
        q_ptrs += q_step
        do_ptrs += do_step
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQ_ACC, LSE, DELTA,
                     stride_qb, stride_qh, stride_qt, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd,
                     stride_vb, stride_vh, stride_vt, stride_vd,
                     stride_dob, stride_doh, stride_dot, stride_dod,
                     stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                     stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                     stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                     H, T, qk_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                     DQ_ATOMIC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N  # key tile 0 (most query tiles under causal masking) launches first
    h = tl.program_id(1)
    b = tl.program_id(2)
    cols = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T

    k = tl.load(K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
                + cols[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
                + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh \
        + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    do_ptrs = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh \
        + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod
    if USE_TMA:  # the streamed query-side tiles come through tensor descriptors
        q_desc = _slab_desc(Q, b, h, stride_qb, stride_qh, stride_qt, T, HEAD_DIM, BLOCK_M)
        do_desc = _slab_desc(DO, b, h, stride_dob, stride_doh, stride_dot, T, HEAD_DIM, BLOCK_M)
    else:
        q_desc = None
        do_desc = None
    if DQ_ATOMIC:
        dq_ptrs = DQ_ACC + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh \
            + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd
    else:
        dq_ptrs = DQ_ACC
    lse_ptrs = LSE + (b * H + h).to(tl.int64) * T
    delta_ptrs = DELTA + (b * H + h).to(tl.int64) * T

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # query tiles on the diagonal, masked (queries < start_n see none of these keys and are skipped)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, dq_ptrs, lse_ptrs, delta_ptrs,
                             stride_qt, stride_dot, stride_dqt, offs_m, cols,
                             start_n, tl.minimum(start_n + BLOCK_N, T), T, qk_scale, sm_scale,
                             True, True, DQ_ATOMIC, BLOCK_M, UPCAST, PRECISION, USE_TMA)
        # query tiles entirely below the diagonal
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, dq_ptrs, lse_ptrs, delta_ptrs,
                             stride_qt, stride_dot, stride_dqt, offs_m, cols,
                             start_n + BLOCK_N, T, T, qk_scale, sm_scale,
                             False, RAGGED_T, DQ_ATOMIC, BLOCK_M, UPCAST, PRECISION, USE_TMA)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, dq_ptrs, lse_ptrs, delta_ptrs,
                             stride_qt, stride_dot, stride_dqt, offs_m, cols, 0, T, T, qk_scale, sm_scale,
                             False, RAGGED_T, DQ_ATOMIC, BLOCK_M, UPCAST, PRECISION, USE_TMA)

    dk = dk * sm_scale
    tl.store(DK + b.to(tl.int64) * stride_dkb + h.to(tl.int64) * stride_dkh
             + cols[:, None] * stride_dkt + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + b.to(tl.int64) * stride_dvb + h.to(tl.int64) * stride_dvh
             + cols[:, None] * stride_dvt + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


_bwd_dkdv = _autotune(_DKDV_TUNING, _INTERPRET_KEY_MAJOR)(_bwd_dkdv_kernel)
# Atomic-dQ variant: each benchmarked config accumulates into DQ_ACC, so the autotuner must zero it before every
# trial and once more before the real launch (reset_to_zero does both).
_bwd_dkdv_dq_atomic = _autotune(_DKDV_TUNING, _INTERPRET_KEY_MAJOR, reset_to_zero=["DQ_ACC"])(_bwd_dkdv_kernel)


# ----------------------------------------------------------------------------------------------------------------------
# Backward: dQ (with the delta preprocess fused in) -- one program per query tile
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n, lo, hi,
              T, qk_scale, MASK_CAUSAL: tl.constexpr, MASK_BOUNDS: tl.constexpr, BLOCK_N: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dQ (unscaled) of one query tile over key tiles [lo, hi); masks as in `_fwd_inner`."""
    k_ptrs += lo * stride_kt
    v_ptrs += lo * stride_vt
    k_step = BLOCK_N * stride_kt
    v_step = BLOCK_N * stride_vt
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        if USE_TMA:  # the copy engine zero-fills rows >= T
            k = k_desc.load([start_n, 0])  # (BLOCK_N, D)
            v = v_desc.load([start_n, 0])
        elif MASK_BOUNDS:
            k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASK_CAUSAL:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        elif MASK_BOUNDS:
            p = tl.where(cols[None, :] < T, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = (p * (dp - delta[:, None])).to(k_ptrs.dtype.element_ty)
        if UPCAST:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)  # (BLOCK_M, D) += dS K
        k_ptrs += k_step
        v_ptrs += v_step
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, Out, DO, DQ, LSE, DELTA,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   stride_ob, stride_oh, stride_ot, stride_od,
                   stride_dob, stride_doh, stride_dot, stride_dod,
                   stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                   H, T, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # heaviest first, as in the forward
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T

    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod, mask=row_ok[:, None], other=0.0)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od, mask=row_ok[:, None], other=0.0)
    # Fused preprocess: delta = rowsum(dO * O), stored for the dK/dV kernel that runs next.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    row_base = (b * H + h).to(tl.int64) * T
    tl.store(DELTA + row_base + offs_m, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0) * _LOG2E
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    k_ptrs = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh \
        + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd
    v_ptrs = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh \
        + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd
    if USE_TMA:  # the streamed key-side tiles come through tensor descriptors
        k_desc = _slab_desc(K, b, h, stride_kb, stride_kh, stride_kt, T, HEAD_DIM, BLOCK_N)
        v_desc = _slab_desc(V, b, h, stride_vb, stride_vh, stride_vt, T, HEAD_DIM, BLOCK_N)
    else:
        k_desc = None
        v_desc = None
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       0, start_m, T, qk_scale, False, False, BLOCK_N, UPCAST, PRECISION, USE_TMA)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       start_m, tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, True,
                       BLOCK_N, UPCAST, PRECISION, USE_TMA)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       0, T, T, qk_scale, False, RAGGED_T, BLOCK_N, UPCAST, PRECISION, USE_TMA)

    dq = dq * sm_scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqt + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


_bwd_dq = _autotune(_DQ_TUNING, _INTERPRET_QUERY_MAJOR)(_bwd_dq_kernel)


# ----------------------------------------------------------------------------------------------------------------------
# Host side: launches, custom ops, autograd, public entry points
# ----------------------------------------------------------------------------------------------------------------------
def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels fill comes from here (the tests poison it with NaN to prove full coverage)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _memory_order(t: torch.Tensor) -> list[int]:
    """Dimension order, outermost first, for a (B, H, T, D) buffer that should share t's layout.

    A dense t (contiguous in some dimension order, e.g. a plain or head-transposed tensor) gives its own order, so
    gradients match their inputs and autograd's AccumulateGrad keeps them without a copy. Anything else (the strided
    views of a fused QKV projection) gives (B, T, H, D): then o.transpose(1, 2).reshape(B, T, H * D) is a free view.
    """
    order = sorted(range(4), key=lambda i: -t.stride(i))
    if t.permute(order).is_contiguous():
        return order
    return [0, 2, 1, 3]


def _empty_like_layout(t: torch.Tensor, dtype: torch.dtype, alloc=None) -> torch.Tensor:
    """(B, H, T, D) buffer of t's shape in `_memory_order(t)`; `alloc(shape, dtype, device)` defaults to `_alloc`."""
    alloc = alloc or _alloc
    if t.is_contiguous():  # the common case, without the permutes (host time is what bounds small problems)
        return alloc(tuple(t.shape), dtype, t.device)
    order = _memory_order(t)
    buf = alloc(tuple(t.shape[i] for i in order), dtype, t.device)
    return buf.permute([order.index(i) for i in range(4)])


def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: switch to t's device only when it differs."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: only matters for fp32, where it follows torch's matmul tf32 switch."""
    if dtype == torch.float32 and not _INTERPRET and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _launch_meta(q: torch.Tensor, causal: bool) -> dict:
    T, D = q.shape[2], q.shape[3]
    return dict(HEAD_DIM=D, CAUSAL=causal, RAGGED_T=T % _MAX_BLOCK != 0,
                UPCAST=_INTERPRET and q.dtype != torch.float32, PRECISION=_precision(q.dtype))


_TUNED: dict[tuple, triton.Config] = {}
_COMPILED: dict[tuple, tuple[object, list]] = {}  # -> (compiled kernel, its constexpr arguments in order)
# Direct launches call the compiled kernel's launcher with Triton 3.6's argument list; other versions, the
# interpreter and FLASH_ATTN_DIRECT_LAUNCH=0 take the standard `JITFunction.run` path (same kernels, more host time).
_DIRECT_LAUNCH = (not _INTERPRET and triton.__version__.startswith("3.6.")
                  and os.environ.get("FLASH_ATTN_DIRECT_LAUNCH", "1").lower() in _TRUE)


def _specialization(args: tuple) -> tuple:
    """A key for what Triton specializes a compiled kernel on, beyond dtypes and constexprs: the 16-byte alignment of
    every pointer, and for every integer whether it is 1, a multiple of 16 or 64-bit. Integers are kept whole (strides
    and sizes: a handful of values per model), which is finer than Triton's key and cheaper to build, so a cached
    kernel is never launched with arguments it was not compiled for. Floats only have a type."""
    return tuple([a if type(a) is int else a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else type(a)
                  for a in args])


def _launch(kernel, grid, key: tuple, *args, **meta) -> None:
    """Launch an autotuned kernel with few microseconds of host time (which is what bounds small problems).

    The first launch for `key` goes through the autotuner (`key` must cover its key: T, D, causal, dtype). Later
    launches use the chosen config; on Triton 3.6 they go straight to the compiled kernel's launcher, cached per
    argument specialization, skipping `JITFunction.run`'s per-launch binding and cache-key work (~50 us per launch
    measured on an H200 host).
    """
    tuned_key = (id(kernel), *key)
    config = _TUNED.get(tuned_key)
    if config is None:
        kernel[grid](*args, **meta)
        _TUNED[tuned_key] = kernel.best_config
        return
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    if not _DIRECT_LAUNCH or any(getattr(h, "calls", h) for h in hooks):  # a profiler hooks launches: Triton's path
        kernel.fn[grid](*args, **meta, **config.all_kwargs())
        return
    # meta is a function of tuned_key and the precision, so the constexprs can be cached with the compiled kernel
    compiled_key = (tuned_key, _specialization(args), _precision(args[0].dtype))
    entry = _COMPILED.get(compiled_key)
    if entry is None:
        meta = {**meta, **config.all_kwargs()}
        compiled = kernel.fn[grid](*args, **meta)  # compiles (or finds) and launches
        _COMPILED[compiled_key] = compiled, [meta[name] for name in kernel.fn.arg_names[len(args):]]
        return
    compiled, constexprs = entry
    stream = triton.runtime.driver.active.get_current_stream(args[0].device.index)
    compiled.run(*grid(config.kwargs), stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                 *constexprs)


def _dq_mode() -> str:
    mode = os.environ.get("FLASH_ATTN_DQ", "separate")
    if mode not in ("separate", "atomic"):
        raise ValueError(f"FLASH_ATTN_DQ must be 'separate' or 'atomic', got {mode!r}")
    return mode


def _check_device(q: torch.Tensor) -> None:
    """Checks that depend on the device at run time (kept out of the traced wrapper)."""
    if q.shape[3] == 256 and q.is_cuda and torch.cuda.get_device_capability(q.device) < (9, 0):
        raise ValueError("flash_attention: head dim 256 needs Hopper (sm_90) shared memory; "
                         "use head dim <= 128 on this GPU")


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch memory that in-kernel TMA descriptors need; Triton asks for it at each launch."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: launches run under its guard


def _use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels stream tiles through TMA descriptors for these (B, H, T, D) tensors.

    FLASH_ATTN_TMA=auto (default): 16-bit inputs at D = 128 on Hopper (sm_90), where the H200 measured it faster (at
    D = 64 it was slower; docs/kernel_notes.md). 1: wherever the GPU has TMA (sm_90+; also under the interpreter).
    0: never. In every case each tensor must fit a descriptor per (batch, head): unit stride along D, 16-byte aligned
    base and strides.
    """
    mode = os.environ.get("FLASH_ATTN_TMA", "auto").lower()
    t0 = tensors[0]
    if mode == "auto":
        wanted = (not _INTERPRET and t0.shape[-1] == 128 and t0.dtype != torch.float32
                  and torch.cuda.get_device_capability(t0.device)[0] == 9)
    elif mode in _TRUE:
        wanted = _INTERPRET or torch.cuda.get_device_capability(t0.device) >= (9, 0)
    elif mode in ("0", "false", "no", "off", "n"):
        wanted = False
    else:
        raise ValueError(f"FLASH_ATTN_TMA={mode!r}: use auto, 1 or 0")
    if not wanted:
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(t.stride(i) * size % 16 for i in range(3)):
            return False
    # Triton keeps the allocator in a ContextVar, i.e. per thread: set it in every thread that launches (autograd runs
    # the backward in a thread of its own).
    triton.set_allocator(_tma_scratch)
    return True


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_device(q)
    B, H, T, D = q.shape
    o = _empty_like_layout(q, q.dtype)
    lse = _alloc((B, H, T), torch.float32, q.device)
    if q.numel() == 0:  # nothing to launch (a zero-size grid is an error)
        return o, lse
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)
    tma = _use_tma(q, k, v, o)
    with _device_guard(q):
        _launch(_fwd, grid, (T, D, causal, q.dtype, q.device, tma), q, k, v, o, lse, *q.stride(), *k.stride(),
                *v.stride(), *o.stride(), H, T, scale * _LOG2E.value, USE_TMA=tma, **_launch_meta(q, causal))
    return o, lse


def _backward_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float,
                   grads: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), written into `grads` when given (the packed entry point's views of one dqkv buffer)."""
    B, H, T, D = q.shape
    qk_scale = scale * _LOG2E.value
    delta = _alloc((B, H, T), torch.float32, q.device)
    dq, dk, dv = grads or tuple(_empty_like_layout(t, t.dtype) for t in (q, k, v))
    if q.numel() == 0:
        return dq, dk, dv
    tma = _use_tma(q, k, v, do)  # the tensors the backward streams: query-side tiles in dK/dV, key-side in dQ
    meta = {**_launch_meta(q, causal), "USE_TMA": tma}
    key = (T, D, causal, q.dtype, q.device, tma)
    q_grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)
    k_grid = lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), H, B)
    with _device_guard(q):
        if _dq_mode() == "separate":
            _launch(_bwd_dq, q_grid, key, q, k, v, o, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(),
                    *o.stride(), *do.stride(), *dq.stride(), H, T, qk_scale, scale, **meta)
            _launch(_bwd_dkdv, k_grid, key, q, k, v, do, dk, dv, None, lse, delta, *q.stride(), *k.stride(),
                    *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), 0, 0, 0, 0, H, T, qk_scale, scale,
                    DQ_ATOMIC=False, **meta)
        else:
            block = 64 if D > 128 else 128
            _bwd_preprocess_kernel[(triton.cdiv(T, block), H, B)](o, do, delta, *o.stride(), *do.stride(), H, T,
                                                                  HEAD_DIM=D, BLOCK_M=block)
            dq_acc = _empty_like_layout(q, torch.float32, alloc=lambda shape, dtype, device: torch.zeros(
                shape, dtype=dtype, device=device))
            _launch(_bwd_dkdv_dq_atomic, k_grid, key, q, k, v, do, dk, dv, dq_acc, lse, delta, *q.stride(),
                    *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *dq_acc.stride(),
                    H, T, qk_scale, scale, DQ_ATOMIC=True, **meta)
            dq.copy_(dq_acc)
    return dq, dk, dv


def _unpack(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, 3, H, D) -> q, k, v as (B, H, T, D) views (no copies)."""
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _packed_forward_impl(qkv: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _forward_impl(*_unpack(qkv), causal, scale)
    return o.transpose(1, 2), lse  # (B, T, H, D): contiguous, since o follows the strided q view's (B, T, H, D) order


def _packed_backward_impl(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
                          scale: float) -> torch.Tensor:
    """dqkv (B, T, 3, H, D): the kernels write dq, dk, dv straight into their slices of one buffer."""
    dqkv = _alloc(tuple(qkv.shape), qkv.dtype, qkv.device)
    _backward_impl(do.transpose(1, 2), *_unpack(qkv), o.transpose(1, 2), lse, causal, scale, grads=_unpack(dqkv))
    return dqkv


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


class _FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd: the same forward/backward as the custom op below, without the custom-op dispatcher's host
    overhead (~100 us per forward + backward, which is visible at small problem sizes)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _forward_impl(q, k, v, causal, scale)
        _setup_context(ctx, (q, k, v, causal, scale), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward_impl(do, q, k, v, o, lse, ctx.causal, ctx.scale), None, None)


# torch.compile path: two opaque custom ops with fake (meta) implementations and registered autograd, so Dynamo and
# AOTAutograd trace them as single nodes (no graph break, nothing traced inside Triton's launcher or autotuner).
@torch.library.custom_op("flashgpt::flash_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, causal, scale)


def _fake_alloc(like: torch.Tensor):
    return lambda shape, dtype, device: like.new_empty(shape, dtype=dtype)


@_fwd_op.register_fake
def _fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    return _empty_like_layout(q, q.dtype, _fake_alloc(q)), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("flashgpt::flash_attention_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(do, q, k, v, o, lse, causal, scale)


@_bwd_op.register_fake
def _bwd_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_empty_like_layout(t, t.dtype, _fake_alloc(t)) for t in (q, k, v))


def _backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
    q, k, v, o, lse = ctx.saved_tensors
    return (*_bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.scale), None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# The packed entry point: the same kernels behind an autograd.Function (eager) and a custom-op pair (compile) whose
# input is the (B, T, 3, H, D) qkv tensor itself, so its gradient is one buffer the kernels fill (no concatenation).
def _packed_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    qkv, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(qkv, o, lse)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


class _FlashAttentionQKVPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _packed_forward_impl(qkv, causal, scale)
        _packed_setup_context(ctx, (qkv, causal, scale), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
        qkv, o, lse = ctx.saved_tensors
        return _packed_backward_impl(do, qkv, o, lse, ctx.causal, ctx.scale), None, None


@torch.library.custom_op("flashgpt::flash_attention_qkvpacked_fwd", mutates_args=())
def _packed_fwd_op(qkv: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _packed_forward_impl(qkv, causal, scale)


@_packed_fwd_op.register_fake
def _packed_fwd_fake(qkv: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = _unpack(qkv)[0]
    B, H, T, D = q.shape
    return _empty_like_layout(q, q.dtype, _fake_alloc(q)).transpose(1, 2), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("flashgpt::flash_attention_qkvpacked_bwd", mutates_args=())
def _packed_bwd_op(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
                   scale: float) -> torch.Tensor:
    return _packed_backward_impl(do, qkv, o, lse, causal, scale)


@_packed_bwd_op.register_fake
def _packed_bwd_fake(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool,
                     scale: float) -> torch.Tensor:
    return qkv.new_empty(qkv.shape)


def _packed_backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
    qkv, o, lse = ctx.saved_tensors
    return _packed_bwd_op(do, qkv, o, lse, ctx.causal, ctx.scale), None, None


_packed_fwd_op.register_autograd(_packed_backward, setup_context=_packed_setup_context)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (B, H, T, D) like scaled_dot_product_attention, "
                             f"got shape {tuple(t.shape)}")
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(f"flash_attention: only Tq == Tk is supported (self-attention), got Tq={q.shape[2]}, "
                         f"Tk={k.shape[2]}, Tv={v.shape[2]}; use F.scaled_dot_product_attention for cross-attention")
    if q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"flash_attention: q, k, v must have the same (B, H, T, D) shape (no GQA/MQA broadcasting: "
                         f"repeat k/v heads first), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} is not supported; supported dtypes are float16, bfloat16, "
                         f"float32 (cast with .to(torch.bfloat16))")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head dim {q.shape[3]} is not supported; supported head dims are "
                         f"{SUPPORTED_HEAD_DIMS} (pad the head dim up to the next one)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not _INTERPRET:
        raise ValueError("flash_attention: got CPU tensors but the Triton interpreter is off; "
                         "set TRITON_INTERPRET=1 to run on CPU, or move tensors to CUDA")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: device {q.device} is not supported; move tensors to CUDA")
    if q.shape[0] > _MAX_GRID_YZ or q.shape[1] > _MAX_GRID_YZ:
        raise ValueError(f"flash_attention: batch and head counts must be <= {_MAX_GRID_YZ} (CUDA grid limit), got "
                         f"B={q.shape[0]}, H={q.shape[1]}; split the batch")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_attention: scale must be a finite positive number, got {scale}")


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Like SDPA (an autocast lower-precision op): eligible floating inputs are cast to the autocast dtype."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `flash_attention`, but also returns the fp32 (B, H, T) log-sum-exp of the scaled, masked scores."""
    q, k, v = _autocast(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _validate(q, k, v, scale)
    if torch.compiler.is_compiling():
        return _fwd_op(q, k, v, causal, float(scale))
    return _FlashAttentionFunction.apply(q, k, v, causal, float(scale))


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """Fused exact attention, a drop-in for `F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`.

    Args:
        q, k, v: (B, H, T, D) tensors of one dtype (float16, bfloat16, float32) on one CUDA device (or CPU under
            TRITON_INTERPRET=1); any strides. D in {16, 32, 64, 128, 256 (Hopper)}; Tq == Tk; any B, H, T >= 1.
        causal: mask keys after the query position.
        scale: softmax scale, default 1 / sqrt(D).

    Returns:
        (B, H, T, D) attention output in q's dtype; differentiable with respect to q, k and v.
    """
    return _flash_attention_forward(q, k, v, causal, scale)[0]


def flash_attention_qkvpacked(qkv: torch.Tensor, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """`flash_attention` on a packed (B, T, 3, H, D) tensor, e.g. a fused QKV projection's (B, T, 3 * H * D) output
    viewed as such; returns (B, T, H, D), contiguous. The same kernels read q, k and v in place and the backward
    writes dq, dk and dv into one (B, T, 3, H, D) gradient, which saves autograd the concatenation of three separate
    gradients (a read and write of the whole qkv gradient per layer). Support matrix as `flash_attention`."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"flash_attention_qkvpacked: qkv must be (B, T, 3, H, D), got shape {tuple(qkv.shape)}")
    (qkv,) = _autocast(qkv)
    scale = 1.0 / math.sqrt(qkv.shape[-1]) if scale is None else scale
    _validate(*_unpack(qkv), scale)
    if torch.compiler.is_compiling():
        return _packed_fwd_op(qkv, causal, float(scale))[0]
    return _FlashAttentionQKVPackedFunction.apply(qkv, causal, float(scale))[0]

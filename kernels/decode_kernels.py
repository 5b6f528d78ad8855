"""The Flash-Decoding kernels in Triton: attention of a few new queries against a long KV cache, split over the keys.
Only `@triton.jit` code lives here; the split count, workspaces, launches and the public `flash_decode` are
kernels/decode.py. docs/kernel.md ("Decode kernel") describes the algorithm.

The problem. A decode step has Tq (usually 1) new queries per row and reads a cache of up to S keys per key-value head.
One program per (row, head) as in the training forward would launch only B·Hkv programs, too few to keep the GPU's
memory system busy when B is small and S long, and the step is bound by reading the cache: every K/V element is used
once per query.

1. Split (`_decode_split_kernel`). Grid (B·Hkv, splits, row blocks), B·Hkv on axis 0, whose CUDA limit is 2^31 - 1
   rather than 65535. The keys [0, S) are cut into `split_len`-key ranges, one per program along axis 1, clipped to
   the row's length. Each program runs the online softmax of the training forward over its range in BLOCK_N-key tiles
   and writes, per query, its partial output normalised by its own softmax sum, o_i, and the log-sum-exp of its
   scores, lse_i (base 2), to fp32 workspaces. A range past the row's length is empty: no K/V load, lse_i = -inf,
   and no o_i written.
2. Combine (`_decode_combine_kernel`). One program per (row, query head, query) merges the splits exactly:
   w_i = 2^(lse_i - max lse), out = Σ w_i o_i / Σ w_i, cast to the output dtype; when every lse_i is -inf (the query
   sees no key) out = 0. With a single split the split kernel writes the output itself (SINGLE_SPLIT) and the
   combine is not launched.

GQA. A program serves one key-value head and all GROUP = Hq / Hkv query heads that read it, for all Tq queries: its
query tile stacks rows r = g·Tq + t (query head h_kv·GROUP + g, query t), padded to BLOCK_M >= 16 for tl.dot, so each
K/V tile is loaded once per split and used by every query of the group (more rows than BLOCK_M take several row
blocks, axis 2).

Masking. Row b holds `length` = lengths[b] valid keys, which include the Tq new tokens: query t sits at position
length - Tq + t and sees keys [0, length - Tq + t] (causal among the new tokens, bottom-right aligned). Keys at index
>= length are never loaded; with a sliding window (WINDOW) a query sees only its `window` previous keys and itself,
and keys before the first query's window are not loaded either. A query with no visible key (length < Tq, or
length 0) outputs zeros. Softmax runs in base 2 (`qk_scale` = scale · log2(e)), as in kernels/flash_kernels.py.
UPCAST (interpreter only) computes 16-bit dots in fp32, because the interpreter mis-computes bf16 dots.

Head dims. HEAD_DIM is the tile width, a power of 2 (tl.arange's and tl.dot's requirement): the real head dim
HEAD_DIM_REAL (any multiple of 8 up to 256) rounded up to the next of 16, 32, 64, 128, 256. Loads along the head dim
are masked to the real channels, so the padding channels of q and K load as 0 and change no score (those of V
give output channels that are never stored), and the caches are read in place: nothing is padded or copied. The
output and the partial outputs hold the HEAD_DIM_REAL real channels only. The row strides of a contiguous cache of
D = 40 or 136 are multiples of 8 elements but not of 16, the only divisibility Triton's launch declares: the host
then passes ALIGN_KV and the kernel declares divisibility by 8 itself, so that K/V tiles still load as 16-byte
vectors.
"""

import triton
import triton.language as tl

from kernels.flash_kernels import _tile_ptrs


# ----------------------------------------------------------------------------------------------------------------------
# 1. Split: the online softmax of one key range, for every query of one key-value head
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _decode_split_kernel(Q, K, V, Lengths, Out, O_part, LSE_part,
                         stride_qb, stride_qh, stride_qt, stride_qd,
                         stride_kb, stride_kh, stride_kt, stride_kd,
                         stride_vb, stride_vh, stride_vt, stride_vd,
                         stride_ob, stride_oh, stride_ot, stride_od,
                         H_KV, S, split_len, qk_scale, window,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr,
                         SINGLE_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         WINDOW: tl.constexpr, ALIGN_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Partial output and LSE of keys [split · split_len, (split + 1) · split_len) ∩ [0, length) for the GROUP · TQ
    queries of one (row, key-value head); with SINGLE_SPLIT, the final output. split_len is a multiple of BLOCK_N,
    so no tile reaches into the next split's keys. WINDOW: a query at pos sees keys pos - window .. pos only, and
    keys before the earliest query's window are not read."""
    if ALIGN_KV:  # K/V row strides are multiples of 8 elements (checked by the host): 16-byte vector loads
        stride_kb, stride_kh, stride_kt = stride_kb // 8 * 8, stride_kh // 8 * 8, stride_kt // 8 * 8
        stride_vb, stride_vh, stride_vt = stride_vb // 8 * 8, stride_vh // 8 * 8, stride_vt // 8 * 8
    bh = tl.program_id(0)  # b * H_KV + h_kv
    split = tl.program_id(1)
    b = bh // H_KV
    h_kv = bh % H_KV
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) r = g * TQ + t
    row_ok = rows < GROUP * TQ
    t = rows % TQ  # query index among the new tokens
    h = h_kv * GROUP + rows // TQ  # query head
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM_REAL  # (HEAD_DIM,) the real channels: the others load as 0 and are never stored
    offs_n = tl.arange(0, BLOCK_N)

    # lengths cannot be checked on the host without a sync: out-of-range values are clamped, so no read leaves the cache
    length = tl.minimum(tl.maximum(tl.load(Lengths + b), 0), S).to(tl.int32)
    pos = length - TQ + t  # (BLOCK_M,) each query's position: it sees keys [0, pos]
    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)  # hi <= lo: an empty split, the loop below does not run
    if WINDOW:  # from the tile where the first query's window starts (whole tiles: none crosses into the next split)
        lo = tl.maximum(lo, tl.maximum(length - TQ - window, 0) // BLOCK_N * BLOCK_N)

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM), on chip throughout
    if UPCAST:
        q = q.to(tl.float32)
    # (BLOCK_N, HEAD_DIM) pointers to the split's first key tile
    k_ptrs = _tile_ptrs(K, b, h_kv, lo + offs_n, stride_kb, stride_kh, stride_kt, stride_kd, HEAD_DIM=HEAD_DIM)
    v_ptrs = _tile_ptrs(V, b, h_kv, lo + offs_n, stride_vb, stride_vh, stride_vt, stride_vd, HEAD_DIM=HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scaled scores, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        kv_ok = (cols[:, None] < hi) & d_ok[None, :]  # (BLOCK_N, HEAD_DIM)
        k = tl.load(k_ptrs, mask=kv_ok, other=0.0)  # (BLOCK_N, HEAD_DIM); keys >= length are never read
        v = tl.load(v_ptrs, mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        # pos < length, so this also hides the zero-filled keys >= length of a ragged last tile
        qk = tl.where(cols[None, :] <= pos[:, None], qk, float("-inf"))
        if WINDOW:
            qk = tl.where(cols[None, :] >= pos[:, None] - window, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a query that has seen no key yet keeps m = -inf: subtract 0 instead, so that exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(k_ptrs.dtype.element_ty)  # P enters the tensor cores in the input dtype
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)  # (BLOCK_M, D)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt

    seen = l_i > 0  # (BLOCK_M,) the query saw at least one key in this range; acc is exactly 0 otherwise
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]  # (BLOCK_M, D), normalised by this range's own softmax sum
    if SINGLE_SPLIT:  # the whole key range: this is the output (zeros for a query that sees no key)
        o_ptrs = (Out + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # workspaces (B * Hq * TQ, splits, [HEAD_DIM_REAL]): flat query index bh * GROUP * TQ + r, (b, h, t) in order
        n_splits = tl.num_programs(1)
        slot = (bh.to(tl.int64) * GROUP * TQ + rows) * n_splits + split  # (BLOCK_M,)
        tl.store(LSE_part + slot, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=row_ok)
        # the combine reads o only where lse > -inf: queries that saw nothing skip the store
        tl.store(O_part + slot[:, None] * HEAD_DIM_REAL + offs_d[None, :], o,
                 mask=(row_ok & seen)[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------------------------------
# 2. Combine: merge the splits' partial outputs of one query by their log-sum-exps
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _decode_combine_kernel(O_part, LSE_part, Out, stride_ob, stride_oh, stride_ot, stride_od, H, n_splits,
                           HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr, TQ: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """out = Σ_i 2^(lse_i - m) o_i / Σ_i 2^(lse_i - m), m = max_i lse_i, for one query (b, h, t); zeros when every
    split is empty for it. Grid (B * H * TQ,). SPLITS is n_splits rounded up to a power of 2; the partial outputs
    are read BLOCK_S splits at a time, to bound registers. HEAD_DIM (a power of 2) covers the HEAD_DIM_REAL
    channels, masked."""
    row = tl.program_id(0)  # flat (b, h, t)
    t = row % TQ
    h = (row // TQ) % H
    b = row // (TQ * H)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM_REAL
    base = row.to(tl.int64) * n_splits

    offs_s = tl.arange(0, SPLITS)
    lse = tl.load(LSE_part + base + offs_s, mask=offs_s < n_splits, other=float("-inf"))  # (SPLITS,), base 2
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: the weights below are all 0, not NaN
    denom = tl.sum(tl.math.exp2(lse - m), 0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # (BLOCK_S,)
        lse_s = tl.load(LSE_part + base + s, mask=s < n_splits, other=float("-inf"))
        # partial outputs of empty splits were never written: masked out, never read
        o = tl.load(O_part + (base + s)[:, None] * HEAD_DIM_REAL + offs_d[None, :],
                    mask=(lse_s > float("-inf"))[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, HEAD_DIM)
        acc += tl.sum(tl.math.exp2(lse_s - m)[:, None] * o, 0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + t * stride_ot + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_ok)

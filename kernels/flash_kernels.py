"""The FlashAttention-2 kernels in Triton, top-down as in the paper: forward, then backward (the delta preprocess fused
into the dQ kernel, then dK/dV; the one-pass backward of kernels/flash_gluon.py has a preprocess of its own here).
Only `@triton.jit` code lives here; tuning and launches are kernels/launch.py, autograd and the public functions
kernels/ops.py. docs/kernel.md explains the algorithm and the design choices.

Notation, per (batch, head): S = scale · Q Kᵀ, P = softmax(S) (causal: keys after the query masked), O = P V, and
LSE = log Σ_j exp(S_ij), the row log-sum-exp that lets the backward rebuild P exactly without storing it. Softmax runs
in the base-2 domain: `qk_scale` = scale · log2(e), so every exponential is one exp2.

Grouped-query attention: H query heads share H / GROUP key-value heads; query head h reads key-value head h // GROUP
in place (GROUP = 1 is multi-head attention, GROUP = H multi-query). The dK/dV kernel runs per key-value head and sums
over its GROUP query heads on chip.

Dropout (DROPOUT > 0): P is multiplied by a keep-mask Z / (1 - p) before P V, as FlashAttention does; the softmax
normaliser and LSE are those of P, before dropout. Z is never stored: `_keep` regenerates it from each element's
(batch·head, query, key), the same in the forward and in both backward kernels, with Philox (DROPOUT = 1) or a hash
per 2 × 2 block (DROPOUT = 2, FLASH_ATTN_DROPOUT_RNG=hash).

Tiles: BLOCK_M query rows and BLOCK_N key rows. Causal masking is by tile: tiles left of the diagonal run a loop with
no mask, the diagonal tiles a masked loop, tiles right of it are never visited. RAGGED_T (T not a multiple of every
block size) adds bounds masks; USE_TMA loads tiles through tensor descriptors (the copy engine zero-fills rows >= T);
UPCAST (interpreter only) computes 16-bit dots in fp32, because the interpreter mis-computes bf16 dots.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2)
PHILOX_ROUNDS = tl.constexpr(7)  # as FlashAttention-2; Philox4x32-7 passes BigCrush (Salmon et al., 2011)


# ----------------------------------------------------------------------------------------------------------------------
# Addressing: one (batch, head)'s (T, D) slab of a (B, H, T, D) tensor with any strides
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _tile_ptrs(X, b, h, rows, stride_b, stride_h, stride_t, stride_d, HEAD_DIM: tl.constexpr):
    """Pointers to rows `rows` of batch b, head h: (len(rows), HEAD_DIM). The base offset is int64: b * stride_b
    exceeds 2^31 elements in large fused-QKV activations."""
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    return base + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :] * stride_d


@triton.jit
def _slab_desc(X, b, h, stride_b, stride_h, stride_t, T, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA tensor descriptor over the same slab, moving (BLOCK, HEAD_DIM) tiles; rows >= T read as zeros and are not
    written."""
    return tl.make_tensor_descriptor(X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h,
                                     shape=[T, HEAD_DIM], strides=[stride_t, 1], block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _keep(seed, bh, start_row, start_col, threshold, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
          DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Dropout keep-mask of the (BLOCK_R, BLOCK_C) tile of head bh (= b * H + h) whose first query row is start_row and
    first key start_col (multiples of 16 and 32); (BLOCK_C, BLOCK_R), keys by queries, if TRANSPOSED. Element (i, j)
    is kept iff its 8-bit uniform is >= threshold (= p · 256, rounded). DROPOUT picks the generator: 1 = Philox
    (`_philox_bytes`), 2 = a hash per 2 × 2 block (`_hashed_bytes`)."""
    if DROPOUT == 2:
        b = _hashed_bytes(seed, bh, start_row, start_col, BLOCK_R, BLOCK_C, TRANSPOSED)
    else:
        b = _philox_bytes(seed, bh, start_row, start_col, BLOCK_R, BLOCK_C)
        if TRANSPOSED:
            b = tl.trans(b)
    return b >= threshold


@triton.jit
def _philox_bytes(seed, bh, start_row, start_col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The (BLOCK_R, BLOCK_C) tile's random bytes from Philox4x32-7.

    One Philox call gives 16 bytes, for the 16 elements that one thread holds in the tensor cores' accumulator layout:
    rows i and i + 8 of a 16-row block, and the same 2 neighbouring columns in each of the 4 8-column strips of a
    32-column block. So the random bits are used where they are made, with no exchange between threads. The call's
    counter is (c0, c1, c2) = (block column, bh, block row), with

        block row    = 8 · (i // 16) + i % 8                        byte  = 4 · k + 2 · ((i // 8) % 2) + j % 2
        block column = 4 · (j // 32) + (j % 8) // 2                  where k = (j % 32) // 8 picks the 32-bit word

    so the bytes depend only on (bh, i, j): the same in every kernel, whatever its tile shape. A kernel that holds the
    tile transposed (dK/dV: keys by queries) holds none of a call's 16 elements in one thread and must exchange them.
    """
    a = start_row // 16 + tl.arange(0, BLOCK_R // 16)  # 16-row blocks
    g = start_col // 32 + tl.arange(0, BLOCK_C // 32)  # 32-column blocks
    block_row = (a[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.uint32)  # (BLOCK_R / 16, 8)
    block_col = (g[:, None] * 4 + tl.arange(0, 4)[None, :]).to(tl.uint32)  # (BLOCK_C / 32, 4)
    c2 = tl.broadcast_to(block_row[:, :, None, None], (BLOCK_R // 16, 8, BLOCK_C // 32, 4))
    c0 = tl.broadcast_to(block_col[None, None, :, :], (BLOCK_R // 16, 8, BLOCK_C // 32, 4))
    c1 = tl.full(c0.shape, bh, tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c1 * 0, n_rounds=PHILOX_ROUNDS)
    w = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # (.., u, v): word k = 2v + u
    b = tl.join(tl.join(w & 0xFF, (w >> 8) & 0xFF), tl.join((w >> 16) & 0xFF, w >> 24))  # (.., e, s): byte 2s + e
    # dims (a, r = i % 8, g, q = (j % 8) // 2, u, v, e, s) -> row 16a + 8s + r, column 32g + 8 (2v + u) + 2q + e
    b = tl.permute(b, (0, 7, 1, 2, 5, 4, 3, 6))
    return tl.reshape(b, (BLOCK_R, BLOCK_C))


@triton.jit
def _mix32(x):
    """A bijection of uint32 in which every input bit flips each output bit with probability about 1/2 (the
    xorshift-multiply finaliser with Wellons' `lowbias32` constants)."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0xD35A2D97
    return x ^ (x >> 15)


@triton.jit
def _dropout_key(seed, bh):
    """Head bh's 32-bit key of the hashed dropout mask: seed and head mixed once per program."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(_mix32(seed_lo ^ bh.to(tl.uint32) * 0xC2B2AE35) + seed_hi)


@triton.jit
def _row_key(i):
    """Query i's share of its 2 × 2 block's word: its block row R = 8 · (i // 16) + i % 8, times an odd constant."""
    return ((i // 16) * 8 + i % 8).to(tl.uint32) * 0x9E3779B9


@triton.jit
def _col_key(j, key):
    """Key j's share: its block column C = 8 · (j // 16) + j % 8, times another odd constant, plus the head's key."""
    return ((j // 16) * 8 + j % 8).to(tl.uint32) * 0x85EBCA6B + key


@triton.jit
def _hashed_bytes(seed, bh, start_row, start_col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """The tile's random bytes from one 32-bit hash per 2 × 2 block {i, i + 8} × {j, j + 8} (i % 16 < 8, j % 16 < 8).

    Those 4 elements are held by one thread both in the accumulator layout and in its transpose, so a kernel that holds
    the tile keys by queries makes its bytes in place too (TRANSPOSED), with no exchange between threads. The word of
    block row R = 8 · (i // 16) + i % 8 and block column C = 8 · (j // 16) + j % 8 is

        mix(R · 0x9E3779B9 ^ (C · 0x85EBCA6B + key)),    key = mix(mix(seed_lo ^ bh · 0xC2B2AE35) + seed_hi)

    and its byte 2 · ((i // 8) % 2) + (j // 8) % 2 is element (i, j)'s. `_mix32` is a bijection, so every head has its
    own key and the words of one block row differ. Per index, one multiply: no hashing per row or column, which the
    transposed layout would pay for each of the many queries a thread holds.
    """
    key = _dropout_key(seed, bh)
    queries = start_row + tl.arange(0, BLOCK_R)
    keys = start_col + tl.arange(0, BLOCK_C)
    if TRANSPOSED:
        return _block_bytes(_col_key(keys, key)[:, None] ^ _row_key(queries)[None, :], BLOCK_C, BLOCK_R, True)
    else:
        return _block_bytes(_row_key(queries)[:, None] ^ _col_key(keys, key)[None, :], BLOCK_R, BLOCK_C, False)


@triton.jit
def _block_bytes(x, ROWS: tl.constexpr, COLS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The random bytes of a (ROWS, COLS) tile (multiples of 16) from x, each element's row key ^ column key: the
    elements are regrouped by 2 × 2 block (a reshape, a permute, two splits), each block's first element hashed once
    into its word, and the words' bytes put back in place. One thread holds a whole block in a tensor-core accumulator
    layout and in its transpose, so in those layouts this moves no data (kernels/flash_gluon.py: _keep asserts it).
    Element (i, j) takes byte 2 · ((i // 8) % 2) + (j // 8) % 2, or with TRANSPOSED (rows are keys) 2 · ((j // 8) % 2)
    + (i // 8) % 2."""
    # (row block, row half, row, column block, column half, column) -> the halves last; the first of each block
    x = tl.permute(tl.reshape(x, [ROWS // 16, 2, 8, COLS // 16, 2, 8]), [0, 2, 3, 5, 4, 1])
    x, _ = tl.split(x)
    x, _ = tl.split(x)
    w = _mix32(x)
    b0, b1, b2, b3 = w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, w >> 24
    if TRANSPOSED:
        b1, b2 = b2, b1
    y = tl.join(tl.join(b0, b1), tl.join(b2, b3))  # (.., column half, row half)
    return tl.reshape(tl.permute(y, [0, 5, 1, 2, 4, 3]), [ROWS, COLS])


# ----------------------------------------------------------------------------------------------------------------------
# Bounded attention (DOCS): packed rows, where several examples share a row and a query attends only to the keys of its
# own example, and sliding windows. Four int32 (B, T) arrays bound each token's partners: query i sees keys
# [KV_START[i], KV_END[i]) and key j is seen by queries [Q_START[j], Q_END[j]) (the same relation, read from either
# side). All four rise along a row, so a query tile's keys and a key tile's queries are each one contiguous range.
# Under CAUSAL the diagonal bounds the other side: KV_END and Q_START are not read.
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _doc_key_range(KV_START, KV_END, b, start_m, offs_m, row_ok, T, DOCS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The causal key range of query tile start_m as (lo, mid, kv_first, kv_end): tiles [lo, mid) need the bounds
    mask, [mid, start_m) are within every row's bounds, and kv_first, kv_end (BLOCK_M,) are each row's key bounds.
    Without DOCS: (0, 0, offs_m, offs_m + 1), the plain causal range."""
    if DOCS:
        row_base = b.to(tl.int64) * T
        kv_first = tl.load(KV_START + row_base + offs_m, mask=row_ok, other=0)  # (BLOCK_M,)
        first = tl.load(KV_START + row_base + start_m)  # the lowest start of the tile: its first row's
        last = tl.load(KV_START + row_base + tl.minimum(start_m + BLOCK_M, T) - 1)  # the highest: its last row's
        lo = first // BLOCK_N * BLOCK_N
        mid = tl.minimum((last + BLOCK_N - 1) // BLOCK_N * BLOCK_N, start_m)
        return lo, mid, kv_first, offs_m + 1
    else:
        return 0, 0, offs_m, offs_m + 1


@triton.jit
def _doc_query_range(Q_END, b, start_n, T, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The causal query range below the diagonal of key tile start_n as (mid, hi): query tiles [start_n + BLOCK_N, mid)
    see every key of the tile, [mid, hi) need the bounds mask, queries from hi on see none of its keys (skipped).
    Without DOCS: (T, T)."""
    if DOCS:
        row_base = b.to(tl.int64) * T
        first_end = tl.load(Q_END + row_base + start_n)  # the tile's first key is seen up to here
        hi = tl.load(Q_END + row_base + tl.minimum(start_n + BLOCK_N, T) - 1)  # ... and its last key up to here
        below = start_n + BLOCK_N
        mid = below + tl.maximum(first_end - below, 0) // BLOCK_M * BLOCK_M
        return mid, hi
    else:
        return T, T


@triton.jit
def _band(START, END, b, first, T, OWN: tl.constexpr, STEP: tl.constexpr):
    """Bounded attention without CAUSAL: the partners of the OWN rows from `first` (a query tile's keys, or a key
    tile's queries) as STEP-aligned (lo, a, c, hi): tiles [lo, a) and [c, hi) need the bounds mask, [a, c) lie within
    every row's bounds, and nothing outside [lo, hi) is seen. START, END: the rows' bounds (B, T), rising."""
    row_base = b.to(tl.int64) * T
    last = tl.minimum(first + OWN, T) - 1
    lo = tl.load(START + row_base + first) // STEP * STEP
    hi = (tl.load(END + row_base + last) + STEP - 1) // STEP * STEP
    a = tl.minimum(tl.maximum((tl.load(START + row_base + last) + STEP - 1) // STEP * STEP, lo), hi)
    c = tl.minimum(tl.maximum(tl.load(END + row_base + first) // STEP * STEP, a), hi)
    return lo, a, c, hi


# ----------------------------------------------------------------------------------------------------------------------
# Forward: one program per query tile; K/V tiles stream through, softmax online
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n, lo, hi, T,
               qk_scale, seed, bh, start_m, threshold, kv_first, kv_end, MASK_CAUSAL: tl.constexpr,
               MASK_BOUNDS: tl.constexpr, MASK_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Online softmax over key tiles [lo, hi): per query row a running max m and normaliser l,

        m_new = max(m, rowmax(s))      p = 2^(s - m_new)
        l = l·2^(m - m_new) + rowsum(p)      acc = acc·2^(m - m_new) + p V

    Mask-free unless MASK_CAUSAL (diagonal tiles, always with MASK_BOUNDS) or MASK_BOUNDS (ragged T); MASK_DOCS
    (bounded attention) also hides the keys outside each row's [kv_first, kv_end) (BLOCK_M,). Integer work is hoisted
    out of the loop and the dots are inline: both matter to the GPU and to the interpreter's speed.
    """
    k_ptrs += lo * stride_kt
    v_ptrs += lo * stride_vt
    k_step = BLOCK_N * stride_kt
    v_step = BLOCK_N * stride_vt
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        if USE_TMA:
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
        if MASK_DOCS:
            seen = (cols[None, :] >= kv_first[:, None]) & (cols[None, :] < kv_end[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        # Without MASK_DOCS every row sees an unmasked key in its first visited tile (key 0, or its own index on the
        # diagonal), so m_new is finite and no (-inf) - (-inf) = NaN can arise.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,) in log2 units
        if MASK_DOCS:  # a row that has seen no key within its bounds yet: p = 0 and alpha = 0, not NaN
            m_new = tl.where(m_new == float("-inf"), -1.0e30, m_new)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N): one FMA + one exp2 per score
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser sums P before dropout
        if DROPOUT:  # dropped to 0; the kept are scaled by 1 / (1 - p) at the end
            p = tl.where(_keep(seed, bh, start_m, start_n, threshold, BLOCK_M, BLOCK_N, DROPOUT), p, 0.0)
        p = p.to(k_ptrs.dtype.element_ty)  # P enters the tensor cores in the input dtype
        if UPCAST:
            p = p.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)  # (BLOCK_M, D)
        m_i = m_new
        k_ptrs += k_step
        v_ptrs += v_step
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, SEED, KV_START, KV_END,
                stride_qb, stride_qh, stride_qt, stride_qd,
                stride_kb, stride_kh, stride_kt, stride_kd,
                stride_vb, stride_vh, stride_vt, stride_vd,
                stride_ob, stride_oh, stride_ot, stride_od,
                H, T, qk_scale, threshold,
                HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
                DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O and LSE of one query tile. Grid (query tiles, H, B); causal programs run heaviest (last) tile first, which
    keeps the tail of the grid short. DOCS (bounded attention): query i sees keys [KV_START[i], KV_END[i])."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)  # query head
    h_kv = h // GROUP  # its key-value head
    b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < T

    # (BLOCK_N, D) pointers to the first key tile
    k_ptrs = _tile_ptrs(K, b, h_kv, offs_n, stride_kb, stride_kh, stride_kt, stride_kd, HEAD_DIM=HEAD_DIM)
    v_ptrs = _tile_ptrs(V, b, h_kv, offs_n, stride_vb, stride_vh, stride_vt, stride_vd, HEAD_DIM=HEAD_DIM)
    if USE_TMA:
        q_desc = _slab_desc(Q, b, h, stride_qb, stride_qh, stride_qt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
        k_desc = _slab_desc(K, b, h_kv, stride_kb, stride_kh, stride_kt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
        v_desc = _slab_desc(V, b, h_kv, stride_vb, stride_vh, stride_vt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
        q = q_desc.load([start_m, 0])
    else:
        k_desc = None
        v_desc = None
        q = tl.load(_tile_ptrs(Q, b, h, offs_m, stride_qb, stride_qh, stride_qt, stride_qd, HEAD_DIM=HEAD_DIM),
                    mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D), on chip for the whole loop
    if UPCAST:
        q = q.to(tl.float32)
    seed = tl.load(SEED) if DROPOUT else 0
    bh = b * H + h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL:
        lo, mid, kv_first, kv_end = _doc_key_range(KV_START, KV_END, b, start_m, offs_m, row_ok, T, DOCS, BLOCK_M,
                                                   BLOCK_N)
        if DOCS:  # keys [lo, mid): tiles that reach before some row's first key, masked; earlier ones skipped
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt,
                                       offs_m, offs_n, lo, mid, T, qk_scale, seed, bh, start_m, threshold, kv_first,
                                       kv_end, MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=True, BLOCK_M=BLOCK_M,
                                       BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                       DROPOUT=DROPOUT)
        # keys [mid, start_m): entirely below the diagonal, always in range (and in every row's bounds) -> mask-free
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, mid, start_m, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                                   MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=False, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)
        # keys [start_m, start_m + BLOCK_M): the diagonal tiles, masked; keys beyond are skipped
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, start_m, tl.minimum(start_m + BLOCK_M, T), T, qk_scale, seed, bh, start_m,
                                   threshold, kv_first, kv_end,
                                   MASK_CAUSAL=True, MASK_BOUNDS=True, MASK_DOCS=DOCS, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)
    elif DOCS:
        # keys [lo, a) and [c, hi): tiles that reach outside some row's bounds, masked; [a, c): within all, mask-free
        lo, a, c, hi = _band(KV_START, KV_END, b, start_m, T, OWN=BLOCK_M, STEP=BLOCK_N)
        kv_first = tl.load(KV_START + b.to(tl.int64) * T + offs_m, mask=row_ok, other=0)  # (BLOCK_M,)
        kv_end = tl.load(KV_END + b.to(tl.int64) * T + offs_m, mask=row_ok, other=0)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, lo, a, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                                   MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, a, c, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                                   MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=False, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, c, hi, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                                   MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)
    else:
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                                   offs_n, 0, T, T, qk_scale, seed, bh, start_m, threshold, offs_m, offs_m,
                                   MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=False, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                   DROPOUT=DROPOUT)

    acc = acc / l_i[:, None]
    if DROPOUT:
        acc = acc * (256.0 / (256 - threshold))  # 1 / (1 - p), p as the threshold rounded it
    lse = (m_i + tl.math.log2(l_i)) * LN2  # natural-log LSE of the scaled scores
    if USE_TMA:  # rows >= T are clipped by the copy engine
        o_desc = _slab_desc(Out, b, h, stride_ob, stride_oh, stride_ot, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
        o_desc.store([start_m, 0], acc.to(Out.dtype.element_ty))
    else:
        tl.store(_tile_ptrs(Out, b, h, offs_m, stride_ob, stride_oh, stride_ot, stride_od, HEAD_DIM=HEAD_DIM),
                 acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------------------
# Backward. With dO the output gradient and delta_i = rowsum(dO ∘ O)_i (= Σ_j P_ij dP_ij, since O = P V):
#
#     dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP - delta)      dQ = scale · dS K      dK = scale · dSᵀ Q
#
# 1. dQ kernel (runs first): the preprocess delta = rowsum(dO ∘ O) for its query tile (stored for step 2), then dQ
#    over the key tiles, mirroring the forward. It recomputes S and dP, so the backward costs 7 tile matmuls per tile
#    pair instead of 5, but needs no atomics: deterministic, and faster than fp32 atomic dQ where measured.
# 2. dK/dV kernel: one program per key tile, K/V and fp32 dK/dV accumulators on chip, streaming the query tiles and
#    rebuilding P from the saved LSE. It works in the transposed orientation (Pᵀ, dPᵀ) so no tile is transposed in
#    registers.
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n, lo, hi,
              T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end, MASK_CAUSAL: tl.constexpr,
              MASK_BOUNDS: tl.constexpr, MASK_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr):
    """Accumulate dQ (unscaled) of one query tile over key tiles [lo, hi); masks as in `_fwd_inner`."""
    k_ptrs += lo * stride_kt
    v_ptrs += lo * stride_vt
    k_step = BLOCK_N * stride_kt
    v_step = BLOCK_N * stride_vt
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        if USE_TMA:
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
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # P, rebuilt exactly from the LSE
        if MASK_CAUSAL:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        elif MASK_BOUNDS:
            p = tl.where(cols[None, :] < T, p, 0.0)
        if MASK_DOCS:
            p = tl.where((cols[None, :] >= kv_first[:, None]) & (cols[None, :] < kv_end[:, None]), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        if DROPOUT:  # dP of the kept probabilities; delta comes scaled by 1 - p, dQ is scaled back at the end
            dp = tl.where(_keep(seed, bh, start_m, start_n, threshold, BLOCK_M, BLOCK_N, DROPOUT), dp, 0.0)
        ds = (p * (dp - delta[:, None])).to(k_ptrs.dtype.element_ty)  # dS enters the tensor cores in the input dtype
        if UPCAST:
            ds = ds.to(tl.float32)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)  # (BLOCK_M, D) += dS K
        k_ptrs += k_step
        v_ptrs += v_step
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, Out, DO, DQ, LSE, DELTA, SEED, KV_START, KV_END,
                   stride_qb, stride_qh, stride_qt, stride_qd,
                   stride_kb, stride_kh, stride_kt, stride_kd,
                   stride_vb, stride_vh, stride_vt, stride_vd,
                   stride_ob, stride_oh, stride_ot, stride_od,
                   stride_dob, stride_doh, stride_dot, stride_dod,
                   stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                   H, T, qk_scale, sm_scale, threshold,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
                   DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """delta and dQ of one query tile. Grid (query tiles, H, B), heaviest first as in the forward."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    h = tl.program_id(1)  # query head
    h_kv = h // GROUP  # its key-value head
    b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < T

    q = tl.load(_tile_ptrs(Q, b, h, offs_m, stride_qb, stride_qh, stride_qt, stride_qd, HEAD_DIM=HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_tile_ptrs(DO, b, h, offs_m, stride_dob, stride_doh, stride_dot, stride_dod, HEAD_DIM=HEAD_DIM),
                 mask=row_ok[:, None], other=0.0)
    o = tl.load(_tile_ptrs(Out, b, h, offs_m, stride_ob, stride_oh, stride_ot, stride_od, HEAD_DIM=HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    # Preprocess: delta = rowsum(dO ∘ O), stored for the dK/dV kernel that runs next.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    bh = b * H + h
    row_base = bh.to(tl.int64) * T  # this (batch, head)'s rows of the (B, H, T) LSE and delta
    tl.store(DELTA + row_base + offs_m, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0) * LOG2E
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    # (BLOCK_N, D) pointers to the first key tile
    k_ptrs = _tile_ptrs(K, b, h_kv, offs_n, stride_kb, stride_kh, stride_kt, stride_kd, HEAD_DIM=HEAD_DIM)
    v_ptrs = _tile_ptrs(V, b, h_kv, offs_n, stride_vb, stride_vh, stride_vt, stride_vd, HEAD_DIM=HEAD_DIM)
    if USE_TMA:
        k_desc = _slab_desc(K, b, h_kv, stride_kb, stride_kh, stride_kt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
        v_desc = _slab_desc(V, b, h_kv, stride_vb, stride_vh, stride_vt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    else:
        k_desc = None
        v_desc = None
    seed = tl.load(SEED) if DROPOUT else 0
    keep_rate = (256 - threshold) / 256.0  # 1 - p
    if DROPOUT:  # the steps leave out the kept dP's factor 1 / (1 - p): delta takes 1 - p instead, dQ 1 / (1 - p)
        delta = delta * keep_rate
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:  # the forward's three key ranges (_doc_key_range)
        lo, mid, kv_first, kv_end = _doc_key_range(KV_START, KV_END, b, start_m, offs_m, row_ok, T, DOCS, BLOCK_M,
                                                   BLOCK_N)
        if DOCS:
            dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m,
                           offs_n, lo, mid, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                           MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                           UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       mid, start_m, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                       MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       start_m, tl.minimum(start_m + BLOCK_M, T), T, qk_scale, seed, bh, start_m, threshold,
                       kv_first, kv_end, MASK_CAUSAL=True, MASK_BOUNDS=True, MASK_DOCS=DOCS, BLOCK_M=BLOCK_M,
                       BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
    elif DOCS:  # the forward's three key ranges (_band)
        lo, a, c, hi = _band(KV_START, KV_END, b, start_m, T, OWN=BLOCK_M, STEP=BLOCK_N)
        kv_first = tl.load(KV_START + b.to(tl.int64) * T + offs_m, mask=row_ok, other=0)  # (BLOCK_M,)
        kv_end = tl.load(KV_END + b.to(tl.int64) * T + offs_m, mask=row_ok, other=0)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       lo, a, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                       MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       a, c, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                       MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       c, hi, T, qk_scale, seed, bh, start_m, threshold, kv_first, kv_end,
                       MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_desc, v_desc, stride_kt, stride_vt, offs_m, offs_n,
                       0, T, T, qk_scale, seed, bh, start_m, threshold, offs_m, offs_m,
                       MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                       UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)

    dq = dq * (sm_scale / keep_rate) if DROPOUT else dq * sm_scale
    tl.store(_tile_ptrs(DQ, b, h, offs_m, stride_dqb, stride_dqh, stride_dqt, stride_dqd, HEAD_DIM=HEAD_DIM),
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt, stride_dot, offs_m,
                start_n, cols, q_first, q_end, lo, hi, T, qk_scale, seed, bh, threshold, keep_rate,
                MASK_CAUSAL: tl.constexpr, MASK_BOUNDS: tl.constexpr, MASK_DOCS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                DROPOUT: tl.constexpr):
    """Accumulate dK (unscaled) and dV of one key tile over query tiles [lo, hi); masks as in `_fwd_inner`, from the
    keys' side under MASK_DOCS: key j is seen by queries [q_first[j], q_end[j]) (BLOCK_N,)."""
    q_ptrs += lo * stride_qt
    do_ptrs += lo * stride_dot
    lse_ptrs += lo + offs_m  # (BLOCK_M,) pointers
    delta_ptrs += lo + offs_m
    q_step = BLOCK_M * stride_qt
    do_step = BLOCK_M * stride_dot
    for start_m in range(lo, hi, BLOCK_M):
        # zero-filled rows >= T have q = dO = 0 and LSE = delta = 0: they add exactly 0 to dK and dV
        rows = start_m + offs_m  # (BLOCK_M,) query indices
        row_ok = rows < T
        if USE_TMA:
            q = q_desc.load([start_m, 0])  # (BLOCK_M, D)
            do = do_desc.load([start_m, 0])  # (BLOCK_M, D)
        elif MASK_BOUNDS:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        if MASK_BOUNDS:
            lse2 = tl.load(lse_ptrs, mask=row_ok, other=0.0) * LOG2E  # (BLOCK_M,)
            delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)  # (BLOCK_M,)
        else:
            lse2 = tl.load(lse_ptrs) * LOG2E
            delta = tl.load(delta_ptrs)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = Sᵀ
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # Pᵀ, rebuilt exactly from the LSE
        if MASK_CAUSAL:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
        elif MASK_BOUNDS:
            # zero-filled keys >= T would otherwise get P = 2^(-LSE), unbounded for extreme inputs
            p_t = tl.where(cols[:, None] < T, p_t, 0.0)
        if MASK_DOCS:  # queries outside each key's bounds
            p_t = tl.where((rows[None, :] >= q_first[:, None]) & (rows[None, :] < q_end[:, None]), p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = dPᵀ
        if DROPOUT:  # the forward's mask of this tile, transposed; dV sees the dropped P, dS the undropped one
            # both without the factor 1 / (1 - p) (delta scaled by 1 - p instead); dK and dV take it at the end
            keep_t = _keep(seed, bh, start_m, start_n, threshold, BLOCK_M, BLOCK_N, DROPOUT, TRANSPOSED=True)
            dp_t = tl.where(keep_t, dp_t, 0.0)
            ds_t = p_t * (dp_t - delta[None, :] * keep_rate)  # dSᵀ (1 - p)
            p_t = tl.where(keep_t, p_t, 0.0)
        else:
            ds_t = p_t * (dp_t - delta[None, :])  # dSᵀ
        p_t = p_t.to(q_ptrs.dtype.element_ty)  # P and dS enter the tensor cores in the input dtype
        ds_t = ds_t.to(q_ptrs.dtype.element_ty)
        if UPCAST:
            p_t = p_t.to(tl.float32)
            ds_t = ds_t.to(tl.float32)
        dv = tl.dot(p_t, do, dv, input_precision=PRECISION)  # (BLOCK_N, D) += Pᵀ dO
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)  # (BLOCK_N, D) += dSᵀ Q
        q_ptrs += q_step
        do_ptrs += do_step
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, SEED, Q_START, Q_END,
                     stride_qb, stride_qh, stride_qt, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd,
                     stride_vb, stride_vh, stride_vt, stride_vd,
                     stride_dob, stride_doh, stride_dot, stride_dod,
                     stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                     stride_dvb, stride_dvh, stride_dvt, stride_dvd,
                     H, T, qk_scale, sm_scale, threshold,
                     HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, RAGGED_T: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
                     DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK and dV of one key tile of one key-value head, summed over the GROUP query heads that read it. Grid (key
    tiles, H / GROUP, B); key tile 0 has the most query tiles under causal masking and launches first. DOCS (bounded
    attention): key j is seen by queries [Q_START[j], Q_END[j])."""
    start_n = tl.program_id(0) * BLOCK_N
    h_kv = tl.program_id(1)  # key-value head
    b = tl.program_id(2)
    cols = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
    offs_m = tl.arange(0, BLOCK_M)
    col_ok = cols < T

    k = tl.load(_tile_ptrs(K, b, h_kv, cols, stride_kb, stride_kh, stride_kt, stride_kd, HEAD_DIM=HEAD_DIM),
                mask=col_ok[:, None], other=0.0)  # (BLOCK_N, D), on chip for the whole loop
    v = tl.load(_tile_ptrs(V, b, h_kv, cols, stride_vb, stride_vh, stride_vt, stride_vd, HEAD_DIM=HEAD_DIM),
                mask=col_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    seed = tl.load(SEED) if DROPOUT else 0
    keep_rate = (256 - threshold) / 256.0  # 1 - p
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if DOCS:  # each key's queries (BLOCK_N,); keys >= T are seen by none
        q_first = cols if CAUSAL else tl.load(Q_START + b.to(tl.int64) * T + cols, mask=col_ok, other=0)
        q_end = tl.load(Q_END + b.to(tl.int64) * T + cols, mask=col_ok, other=0)
    else:
        q_first = cols
        q_end = cols
    if CAUSAL:
        mid, hi = _doc_query_range(Q_END, b, start_n, T, DOCS, BLOCK_M, BLOCK_N)
    elif DOCS:
        lo, a, c, hi = _band(Q_START, Q_END, b, start_n, T, OWN=BLOCK_N, STEP=BLOCK_M)
    for g in range(GROUP):  # the query heads of this key-value head
        h = h_kv * GROUP + g
        # (BLOCK_M, D) pointers to the first query tile
        q_ptrs = _tile_ptrs(Q, b, h, offs_m, stride_qb, stride_qh, stride_qt, stride_qd, HEAD_DIM=HEAD_DIM)
        do_ptrs = _tile_ptrs(DO, b, h, offs_m, stride_dob, stride_doh, stride_dot, stride_dod, HEAD_DIM=HEAD_DIM)
        if USE_TMA:
            q_desc = _slab_desc(Q, b, h, stride_qb, stride_qh, stride_qt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
            do_desc = _slab_desc(DO, b, h, stride_dob, stride_doh, stride_dot, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
        else:
            q_desc = None
            do_desc = None
        bh = b * H + h
        lse_ptrs = LSE + bh.to(tl.int64) * T
        delta_ptrs = DELTA + bh.to(tl.int64) * T
        if CAUSAL:
            # query tiles on the diagonal, masked (queries < start_n see none of these keys and are skipped)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, start_n,
                                 tl.minimum(start_n + BLOCK_N, T), T, qk_scale, seed, bh, threshold, keep_rate,
                                 MASK_CAUSAL=True, MASK_BOUNDS=True, MASK_DOCS=DOCS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                 UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA, DROPOUT=DROPOUT)
            # query tiles entirely below the diagonal (bounded: those within the bounds of all the tile's keys)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, start_n + BLOCK_N, mid, T, qk_scale,
                                 seed, bh, threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T,
                                 MASK_DOCS=False, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION,
                                 USE_TMA=USE_TMA, DROPOUT=DROPOUT)
            if DOCS:  # query tiles that see some of the tile's keys, masked; later ones are skipped
                dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                     stride_dot, offs_m, start_n, cols, q_first, q_end, mid, hi, T, qk_scale, seed, bh,
                                     threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True,
                                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION,
                                     USE_TMA=USE_TMA, DROPOUT=DROPOUT)
        elif DOCS:  # query tiles [lo, a) and [c, hi) masked, [a, c) within every key's bounds
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, lo, a, T, qk_scale, seed, bh,
                                 threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                 DROPOUT=DROPOUT)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, a, c, T, qk_scale, seed, bh,
                                 threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=False, MASK_DOCS=False,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                 DROPOUT=DROPOUT)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, c, hi, T, qk_scale, seed, bh,
                                 threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=True,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                 DROPOUT=DROPOUT)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, q_desc, do_desc, lse_ptrs, delta_ptrs, stride_qt,
                                 stride_dot, offs_m, start_n, cols, q_first, q_end, 0, T, T, qk_scale, seed, bh,
                                 threshold, keep_rate, MASK_CAUSAL=False, MASK_BOUNDS=RAGGED_T, MASK_DOCS=False,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST=UPCAST, PRECISION=PRECISION, USE_TMA=USE_TMA,
                                 DROPOUT=DROPOUT)

    if DROPOUT:  # the factor 1 / (1 - p) of the kept P and dP, left out of every step
        dk = dk * (sm_scale / keep_rate)
        dv = dv / keep_rate
    else:
        dk = dk * sm_scale
    tl.store(_tile_ptrs(DK, b, h_kv, cols, stride_dkb, stride_dkh, stride_dkt, stride_dkd, HEAD_DIM=HEAD_DIM),
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(_tile_ptrs(DV, b, h_kv, cols, stride_dvb, stride_dvh, stride_dvt, stride_dvd, HEAD_DIM=HEAD_DIM),
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_preprocess_kernel(Out, DO, DELTA, DQ_ACC, ZERO_ROWS,
                           stride_ob, stride_oh, stride_ot, stride_od,
                           stride_dob, stride_doh, stride_dot, stride_dod,
                           H, T, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ZERO: tl.constexpr):
    """For the one-pass backward (kernels/flash_gluon.py): delta = rowsum(dO ∘ O) of BLOCK query rows and zeros into
    the same rows of its fp32 dQ accumulator (B, H, T, HEAD_DIM): ZERO = 1, all of them and, once, the element after
    it (the persistent backward's work queue); ZERO = 2, the rows flagged in ZERO_ROWS (B, T) (the by-example
    backward's long examples); ZERO = 0, none. Grid (query blocks, H, B)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < T
    o = tl.load(_tile_ptrs(Out, b, h, rows, stride_ob, stride_oh, stride_ot, stride_od, HEAD_DIM=HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_tile_ptrs(DO, b, h, rows, stride_dob, stride_doh, stride_dot, stride_dod, HEAD_DIM=HEAD_DIM),
                 mask=row_ok[:, None], other=0.0)
    row_base = (b * H + h).to(tl.int64) * T
    tl.store(DELTA + row_base + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    if ZERO == 2:
        row_ok &= tl.load(ZERO_ROWS + b.to(tl.int64) * T + rows, mask=row_ok, other=0) != 0
    if ZERO:
        dq_ptrs = DQ_ACC + (row_base + rows)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(dq_ptrs, tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32), mask=row_ok[:, None])
    if ZERO == 1:
        if (tl.program_id(0) == 0) & (h == 0) & (b == 0):
            tl.store(DQ_ACC + tl.num_programs(2).to(tl.int64) * H * T * HEAD_DIM, 0.0)  # 0.0, int32 0: the same bits


@triton.jit
def _cast_rows_kernel(DQ_ACC, DQ, ROWS, stride_qb, stride_qh, stride_qt, stride_qd, H, T, grad_scale,
                      HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dQ (B, H, T, HEAD_DIM) of the rows flagged in ROWS (B, T): their fp32 sums of dS K times grad_scale, in dQ's
    dtype; a block with none flagged moves no more bytes (its loads and stores are masked off). Grid (query blocks,
    H, B)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    flagged = tl.load(ROWS + b.to(tl.int64) * T + rows, mask=rows < T, other=0) != 0
    acc = DQ_ACC + ((b * H + h).to(tl.int64) * T + rows)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    dq = tl.load(acc, mask=flagged[:, None], other=0.0)
    tl.store(_tile_ptrs(DQ, b, h, rows, stride_qb, stride_qh, stride_qt, stride_qd, HEAD_DIM=HEAD_DIM),
             (dq * grad_scale).to(DQ.dtype.element_ty), mask=flagged[:, None])


# ----------------------------------------------------------------------------------------------------------------------
# The dropout keep-mask itself, for tests and inspection: the same `_keep` the kernels apply
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _dropout_mask_kernel(Out, SEED, T, threshold, BLOCK: tl.constexpr, DROPOUT: tl.constexpr):
    """Out (B * H, T, T) int8: 1 where element (query, key) of head bh is kept by the generator DROPOUT picks (1 or 2,
    see `_keep`). Grid (query tiles, key tiles, B * H)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start_col = tl.program_id(1) * BLOCK
    cols = start_col + tl.arange(0, BLOCK)
    bh = tl.program_id(2)
    keep = _keep(tl.load(SEED), bh, tl.program_id(0) * BLOCK, start_col, threshold, BLOCK, BLOCK, DROPOUT)
    ptrs = Out + bh.to(tl.int64) * T * T + rows[:, None] * T + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < T) & (cols[None, :] < T))

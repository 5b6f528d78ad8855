"""FlashAttention for Hopper (sm_90) in Gluon, Triton's dialect with explicit register layouts, shared memory, TMA
copies and asynchronous wgmma: a warp-specialised forward and a one-pass backward, the latter in two shapes (one
warpgroup over 64 keys, or warp-specialised over 128). kernels/launch.py runs them for
16-bit inputs at head dim 128 on Hopper, packed rows and sliding windows included, and dropout with the hashed mask
(FLASH_ATTN_GLUON, FLASH_ATTN_DROPOUT_RNG=hash: `_keep` makes it in each kernel's registers; docs/kernel.md has the
measurements); everywhere else the Triton kernels of kernels/flash_kernels.py compute the same outputs and gradients.

Forward. One program per 128 query rows of one head, in three warp-specialised partitions: a producer warpgroup that
only issues TMA copies (its Q tile, then K and V tiles of 128 keys into a ring of three stages), and two consumer
warpgroups of 64 query rows each, which share those K/V stages and run the online softmax of the Triton forward
(base 2, O = acc / l and LSE written at the end). Registers are moved from the producer to the consumers (24 / 240 per
thread). Each consumer issues S = Q Kᵀ of the next key tile before the softmax of this one, so its tensor-core work
(that S, then P V of this tile) runs under its own exponentials, FlashAttention-3's order; a stage goes back to the
producer once both consumers have finished P V on it. The persistent forward (the one kernels/launch.py runs by
default) computes the same, bit for bit, with one program per multiprocessor walking its share of the tiles of query
rows, dealt in folded pairs (_item_at): O goes out through the tile's last K stage, so the next tile's Q loads under
this tile's last P V and its store runs under the next tile's first matmul; with ROTATE (off by default) that last P V
and the next tile's first S share one turn on the tensor cores (_rotated_items).

Backward. One program per (key tile, key-value head, batch) holds its K and V tiles in shared memory and dK, dV in
registers, and walks the query tiles of each query head that reads this key-value head (GROUP of them with
grouped-query attention, one otherwise) once, so dK and dV are summed over the group on chip. Per tile pair, with
Δ = rowsum(O ∘ dO) from the preprocess kernel:

    Sᵀ = K Qᵀ,   Pᵀ = exp2(qk_scale · Sᵀ − log2(e) · LSE),   dPᵀ = V dOᵀ,   dSᵀ = Pᵀ ∘ (dPᵀ − Δ)
    dV += Pᵀ dO,   dK += dSᵀ Q,   dQ[tile] += scale · dS K

Five matmuls where the two-kernel backward has seven (it recomputes S and dP for dQ). The dS K partial of every step
is added into an fp32 buffer by the copy engine (TMA reduce-add: no atomics in the program's own instructions); the
launcher zeroes that buffer and converts it, times the scale, at the end. The order of those additions varies from
run to run, so dQ is not bit-reproducible (the launcher keeps the two-kernel path under
torch.use_deterministic_algorithms).

Pipelining: the Q, dO, LSE and Δ tiles of the next step arrive by TMA while this step computes its dV, dK and dQ
products (two slots). Sᵀ and dPᵀ are issued together and the exponentials run while dPᵀ is still on the tensor
cores. Pᵀ and dSᵀ feed the dV and dK products straight from registers; dSᵀ also goes to shared memory, as the A
operand of dQ = dS K. dQ is staged for the copy engine in the step's own Q and dO tiles (one column half each: those
tiles are no longer read), so a program needs about 105 KB of shared memory and 255 registers per thread, and two
programs share a multiprocessor, each running its exponentials while the other's matmuls run.

The warp-specialised backward (the default at D = 128) computes the same per tile pair with 128 keys per program:
a producer warpgroup loads K and V once and each step's Q, dO, LSE and Δ into a ring of two slots, and two consumer
warpgroups each own 64 of the keys (their Sᵀ, dPᵀ, dK, dV). Each consumer stores its dSᵀ rows into a shared (128, 64)
tile; once both halves are in (an mbarrier both arrive on), consumer W computes column half W of dQ = scale · dS K over
all 128 keys and sends it from its own fp32 stage. So dQ is added once per 128 keys, half the bytes, and the K
dimension of that matmul doubles; a slot goes back to the producer, and its dS tile to the consumers, once both have
finished the step (a second mbarrier). 24 registers per producer thread, 240 per consumer thread, about 194 KB of
shared memory: one program per multiprocessor. Its persistent form walks many key tiles per program, dealt in advance
(_item_at) or taken from a work queue (_ws_queue_producer) by whichever program is free; its by-example form
(_bwd_ws_example_kernel, packed rows) walks each example's key tiles in order and finishes dQ itself, without the
fp32 buffer's zeroing and cast (long examples go one key tile per item, through the buffer, for balance).
"""

import triton.experimental.gluon.language as gl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.flash_kernels import _block_bytes, _col_key, _dropout_key, _row_key

LOG2E = gl.constexpr(1.4426950408889634)  # log2(e)
LN2 = gl.constexpr(0.6931471805599453)  # ln(2)
# Forward: query rows per program (two consumer warpgroups of 64), keys per K/V tile, K/V stages, producer warps.
FWD_BLOCK_M = 128
FWD_BLOCK_N = 128
FWD_STAGES = 3
FWD_NUM_WARPS = 4
# The register cap at entry of a warp-specialised kernel (12 warps) that lets its two consumer warpgroups grow to 240
# registers per thread while the producer's shrink to 24.
WS_MAXNREG = 168
# Backward
BLOCK_M = 64  # query rows per step
BLOCK_N = 64  # keys per program
NUM_WARPS = 4  # one warpgroup
WS_BLOCK_N = 128  # keys per program of the warp-specialised backward (64 per consumer warpgroup)

# Gluon renamed these in Triton 3.7; the kernels run on 3.6 and later.
if hasattr(tma, "async_load"):
    _tma_load = tma.async_load
    _tma_store = tma.async_store
    _cta_barrier = gl.barrier
else:
    _tma_load = tma.async_copy_global_to_shared
    _tma_store = tma.async_copy_shared_to_global
    _cta_barrier = gl.thread_barrier


@builtin
def _view(smem, dtype, shape, layout, _semantic=None):
    """The same shared memory as a `dtype` tile of `shape` (no copy): a (1, rows, cols) TMA tile as (rows, cols), or
    a consumed 16-bit tile as fp32 staging."""
    view = smem.reinterpret if hasattr(smem, "reinterpret") else smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """global[desc, coord tile] += src (shared memory), by the copy engine, asynchronously: `tma.store_wait` returns
    once src has been read."""
    offsets = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, offsets, src.handle)


@gluon.jit
def _clock():
    """The multiprocessor's cycle counter, for the forward's phase trace (FLASH_ATTN_TRACE_ITEMS)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _globaltimer():
    """Nanoseconds of the GPU's global timer: with _clock, the cycles' rate."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _trace(base, keep, t0, t1, t2, t3, t4, t5, t6, t7):
    """Record eight stamps at base (FLASH_ATTN_TRACE_ITEMS) if `keep`: a traced work item of the forward or step of
    the backward."""
    if keep:
        gl.store(base + 0, t0)
        gl.store(base + 1, t1)
        gl.store(base + 2, t2)
        gl.store(base + 3, t3)
        gl.store(base + 4, t4)
        gl.store(base + 5, t5)
        gl.store(base + 6, t6)
        gl.store(base + 7, t7)


@gluon.jit
def _keep(seed, bh, start_row, start_col, threshold, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr,
          TRANSPOSED: gl.constexpr):
    """The hashed dropout keep-mask (kernels/flash_kernels.py: _hashed_bytes, the same bits) of a (ROWS, COLS) tile in
    `layout`, a wgmma accumulator layout: queries by keys from (start_row, start_col), keys by queries if TRANSPOSED
    (multiples of 16). `_block_bytes` regroups the tile by 2 × 2 block, which one thread holds whole in such a layout:
    the conversion back to it is asserted to move no data."""
    key = _dropout_key(seed, bh)
    rows = start_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = start_col + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    if TRANSPOSED:
        x = _col_key(rows, key)[:, None] ^ _row_key(cols)[None, :]
    else:
        x = _row_key(rows)[:, None] ^ _col_key(cols, key)[None, :]
    return gl.convert_layout(_block_bytes(x, ROWS, COLS, TRANSPOSED), layout, assert_trivial=True) >= threshold


# ----------------------------------------------------------------------------------------------------------------------
# Tensor descriptors over one (batch, head)
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _slab(X, b, h, stride_b, stride_h, stride_t, T, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """(BLOCK, HEAD_DIM) tiles of batch b, head h's (T, HEAD_DIM) slab; rows >= T read as zeros."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], X.dtype.element_ty)
    return tma.make_tensor_descriptor(X + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h, shape=[T, HEAD_DIM],
                                      strides=[stride_t, 1], block_shape=[BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def _group_slab(X, b, h0, stride_b, stride_h, stride_t, T, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK: gl.constexpr):
    """(1, BLOCK, HEAD_DIM) tiles of the (GROUP, T, HEAD_DIM) slab of batch b's heads h0 .. h0 + GROUP - 1; rows >= T
    of each head read as zeros."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK, HEAD_DIM], X.dtype.element_ty)
    return tma.make_tensor_descriptor(X + b.to(gl.int64) * stride_b + h0.to(gl.int64) * stride_h,
                                      shape=[GROUP, T, HEAD_DIM], strides=[stride_h, stride_t, 1],
                                      block_shape=[1, BLOCK, HEAD_DIM], layout=layout)


@gluon.jit
def _group_rows(X, bh0, T, GROUP: gl.constexpr, BLOCK: gl.constexpr):
    """(1, BLOCK) pieces of the fp32 rows (LSE or Δ, contiguous (B * H, T)) of heads bh0 .. bh0 + GROUP - 1; entries
    past T read as zeros."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return tma.make_tensor_descriptor(X + bh0.to(gl.int64) * T, shape=[GROUP, T], strides=[T, 1],
                                      block_shape=[1, BLOCK], layout=layout)


# ----------------------------------------------------------------------------------------------------------------------
# The forward: a TMA producer and two consumer warpgroups
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _fwd_key_range(b, start_m, T, KV_START, KV_END, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles of the 128 query rows from start_m of batch b: (first key lo, number of tiles); and
    [inner_lo, inner_hi), the keys within every row's bounds, whose tiles go unmasked."""
    end_m = gl.minimum(start_m + 128, T)
    if DOCS:  # the bounds rise along the row: the first row has the lowest, the last row the highest
        row_base = b.to(gl.int64) * T
        lo = gl.load(KV_START + row_base + start_m) // BLOCK_N * BLOCK_N
        inner_lo = gl.load(KV_START + row_base + end_m - 1)
        if CAUSAL:
            hi = end_m
            inner_hi = start_m
        else:
            hi = gl.load(KV_END + row_base + end_m - 1)
            inner_hi = gl.load(KV_END + row_base + start_m)
    else:
        lo = 0
        hi = end_m if CAUSAL else T
        inner_lo = 0
        inner_hi = T
    return lo, gl.cdiv(hi - lo, BLOCK_N), inner_lo, inner_hi


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, free_bars, start_m, lo,
                  n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Each consumer's Q tile, then the K and V tiles from key lo on, tile j into stage j % STAGES once both consumers
    have freed it."""
    for w in gl.static_range(2):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        _tma_load(q_desc, [start_m + w * 64, 0], q_bars.index(w), q_smem.index(w))
    for j in range(n_tiles):
        st = j % STAGES
        mbarrier.wait(free_bars.index(st), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        mbarrier.expect(k_bars.index(st), k_desc.block_type.nbytes)
        _tma_load(k_desc, [lo + j * BLOCK_N, 0], k_bars.index(st), k_smem.index(st))
        mbarrier.expect(v_bars.index(st), v_desc.block_type.nbytes)
        _tma_load(v_desc, [lo + j * BLOCK_N, 0], v_bars.index(st), v_smem.index(st))


@gluon.jit
def _fwd_softmax(s, m_i, l_i, rows, start_n, start_m, T, qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, bh,
                 first_row, threshold, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
                 s_layout: gl.constexpr, DROPOUT: gl.constexpr, dtype: gl.constexpr):
    """The online softmax over one key tile: (P in `dtype`, new row max, rescale factor of the old sums, new row
    sums). DOCS (bounded attention): row i sees keys [kv_first[i], kv_end[i]); tiles within [inner_lo, inner_hi) lie
    within every row's bounds and go unmasked. DROPOUT: P comes back with the dropped elements zeroed (the sums are
    P's before dropout; O takes the factor 1 / (1 - p) at the end). S is scaled inside the exponent only, one FMA per
    score (qk_scale > 0 keeps each row's maximum); P leaves fp32 here, before the next tile's S is issued, so that
    the two never hold registers at once."""
    if DOCS:
        if start_n < inner_lo or start_n + BLOCK_N > inner_hi:  # a tile reaching outside some row's bounds
            keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            ok = (keys[None, :] >= kv_first[:, None]) & (keys[None, :] < kv_end[:, None])
            s = gl.where(ok, s, float("-inf"))
    elif start_n + BLOCK_N > T or (CAUSAL and start_n + BLOCK_N > start_m):  # ragged or diagonal tile
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:  # also hides every key >= T from the rows that are stored (row < T); rows >= T are discarded
            s = gl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        else:
            s = gl.where(keys[None, :] < T, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if DOCS:  # a row that has seen no key within its bounds yet: p = 0 and alpha = 0, not NaN
        m_new = gl.where(m_new == float("-inf"), -1.0e30, m_new)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    l_new = l_i * alpha + gl.sum(p, 1)
    if DROPOUT:
        p = gl.where(_keep(seed, bh, first_row, start_n, threshold, 64, BLOCK_N, s_layout, TRANSPOSED=False), p, 0.0)
    return p.to(dtype), m_new, alpha, l_new


@gluon.jit
def _fwd_pv(acc, p, alpha, v_s, v_bar, phase, o_layout: gl.constexpr):
    """acc · alpha + P V (P in V's dtype), V the tile v_s once v_bar has completed `phase`, issued asynchronously (the
    caller waits)."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p16 = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_bar, phase)
    return warpgroup_mma(p16, v_s, acc, is_async=True)


@gluon.jit
def _fwd_consumer(o_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, free_bars, LSE, KV_START, KV_END, SEED, b, bh,
                  T, qk_scale, threshold, start_m, lo, n_tiles, inner_lo, inner_hi, W: gl.constexpr,
                  HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, DROPOUT: gl.constexpr):
    """Warpgroup W: query rows start_m + 64 W ... + 63 against the key tiles from lo on, then O and LSE."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    rows, kv_first, kv_end = _fwd_rows(b, start_m, T, KV_START, KV_END, W, CAUSAL, DOCS, s_layout)
    q_s = q_smem.index(W)
    seed = gl.load(SEED) if DROPOUT else 0
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    s_init = gl.zeros([64, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type

    mbarrier.wait(q_bars.index(W), 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_s, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, m_i, alpha, l_i = _fwd_softmax(s, m_i, l_i, rows, lo, start_m, T, qk_scale, kv_first, kv_end, inner_lo,
                                      inner_hi, seed, bh, start_m + W * 64, threshold, CAUSAL=CAUSAL, DOCS=DOCS,
                                      BLOCK_N=BLOCK_N, s_layout=s_layout, DROPOUT=DROPOUT, dtype=dtype)
    for j in range(n_tiles - 1):
        # S of tile j + 1, then P V of tile j, on the tensor cores while tile j + 1's softmax runs.
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(nxt), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q_s, k_smem.index(nxt).permute((1, 0)), s_init, use_acc=False, is_async=True)
        acc = _fwd_pv(acc, p, alpha, v_smem.index(j % STAGES), v_bars.index(j % STAGES), (j // STAGES) & 1,
                      o_layout=o_layout)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p, m_i, alpha, l_i = _fwd_softmax(s, m_i, l_i, rows, lo + (j + 1) * BLOCK_N, start_m, T, qk_scale, kv_first,
                                          kv_end, inner_lo, inner_hi, seed, bh, start_m + W * 64, threshold,
                                          CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N, s_layout=s_layout,
                                          DROPOUT=DROPOUT, dtype=dtype)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(free_bars.index(j % STAGES), count=1)
    last = n_tiles - 1
    acc = _fwd_pv(acc, p, alpha, v_smem.index(last % STAGES), v_bars.index(last % STAGES), (last // STAGES) & 1,
                  o_layout=o_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(free_bars.index((n_tiles - 1) % STAGES), count=1)

    norm = l_i * ((256 - threshold) / 256.0) if DROPOUT else l_i  # dropout: O takes 1 / (1 - p), LSE does not
    acc = acc / gl.convert_layout(norm, gl.SliceLayout(1, o_layout))[:, None]
    gl.store(LSE + bh.to(gl.int64) * T + rows, (m_i + gl.log2(l_i)) * LN2, mask=rows < T)  # natural-log LSE
    q_s.store(acc.to(q_smem.dtype))  # Q is read no more: its tile stages O for the TMA store
    fence_async_shared()
    _cta_barrier()  # every warp of this warpgroup has stored its rows
    _tma_store(o_desc, [start_m + W * 64, 0], q_s)
    tma.store_wait(0)


@gluon.jit
def _fwd_kernel(Q, K, V, Out, LSE, KV_START, KV_END, SEED, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
                stride_kt, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, H, T, qk_scale, threshold,
                HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DROPOUT: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    # Causal: the last query tiles see the most keys; they are launched first.
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    start_m = pid_m * 128
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_desc = _slab(Q, b, h, stride_qb, stride_qh, stride_qt, T, HEAD_DIM=HEAD_DIM, BLOCK=64)
    o_desc = _slab(Out, b, h, stride_ob, stride_oh, stride_ot, T, HEAD_DIM=HEAD_DIM, BLOCK=64)
    k_desc = _slab(K, b, h // GROUP, stride_kb, stride_kh, stride_kt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    v_desc = _slab(V, b, h // GROUP, stride_vb, stride_vh, stride_vt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(free_bars.index(i), count=2)  # freed by both consumers

    lo, n_tiles, inner_lo, inner_hi = _fwd_key_range(b, start_m, T, KV_START, KV_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                     BLOCK_N=BLOCK_N)
    bh = b * H + h
    gl.warp_specialize([
        (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, free_bars, start_m,
                         lo, n_tiles, BLOCK_N, STAGES)),
        (_fwd_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, free_bars, LSE, KV_START, KV_END,
                         SEED, b, bh, T, qk_scale, threshold, start_m, lo, n_tiles, inner_lo, inner_hi, 0, HEAD_DIM,
                         CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT)),
        (_fwd_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, free_bars, LSE, KV_START, KV_END,
                         SEED, b, bh, T, qk_scale, threshold, start_m, lo, n_tiles, inner_lo, inner_hi, 1, HEAD_DIM,
                         CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT)),
    ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------------------------------------------------
# The persistent forward: one program per multiprocessor walks its share of the tiles of query rows
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _fwd_item(item, n_m, H, T, KV_START, KV_END, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
              FOLD: gl.constexpr):
    """Work item `item`: (batch, head, first query row, then _fwd_key_range's) of one tile of 128 query rows. Query
    tiles vary fastest, so the programs running at once share their heads' K and V in L2; causal, in _by_work's
    order, the last tiles of a head (they see the most keys) being the heaviest."""
    i = item % n_m
    m = n_m - 1 - _by_work(i, n_m, FOLD=FOLD) if CAUSAL else i
    h = (item // n_m) % H
    b = item // (n_m * H)
    start_m = m * 128
    lo, n_tiles, inner_lo, inner_hi = _fwd_key_range(b, start_m, T, KV_START, KV_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                     BLOCK_N=BLOCK_N)
    return b, h, start_m, lo, n_tiles, inner_lo, inner_hi


@gluon.jit
def _by_work(i, n, FOLD: gl.constexpr):
    """The i-th of a head's n causal tiles to deal, counted from the heaviest (0) to the lightest (n - 1): in that
    order, or with FOLD alternating from both ends (heaviest, lightest, second heaviest, ...), so that two
    consecutive tiles are n + 1 tiles of work together."""
    if FOLD:
        return n - 1 - i // 2 if i % 2 == 1 else i // 2
    return i


@gluon.jit
def _item_at(n, pid, n_programs, FOLD: gl.constexpr):
    """Program pid's n-th work item. Items are dealt round-robin, one per program per round (pid, pid + P, ...), or
    with FOLD two consecutive ones (2 pid, 2 pid + 1, 2 (pid + P), ...): a causal tile paired with its fold
    (_fwd_item), so every program's share of the work is the same. Round-robin alone gives a program the same query
    tile of every head whenever the tiles per head divide P."""
    G: gl.constexpr = 2 if FOLD else 1
    return ((n // G) * n_programs + pid) * G + n % G


@gluon.jit
def _item_count(pid, n_programs, n_items, FOLD: gl.constexpr):
    """How many work items program pid of n_programs runs: G per full round (G = 2 with FOLD, else 1), and those of
    its slot of the last, partial round that exist."""
    G: gl.constexpr = 2 if FOLD else 1
    rounds = n_items // (G * n_programs)
    left = n_items - rounds * G * n_programs - pid * G  # items of the last round from this program's slot on
    return rounds * G + gl.minimum(gl.maximum(left, 0), G)


@gluon.jit
def _fwd_load(desc, smem, bars, free_bars, it, b, h_kv, start_n, STAGES: gl.constexpr):
    """The program's it-th K (or V) tile, keys from start_n, into stage it % STAGES, once both consumers freed it."""
    st = it % STAGES
    mbarrier.wait(free_bars.index(st), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
    mbarrier.expect(bars.index(st), desc.block_type.nbytes)
    _tma_load(desc, [b, h_kv, start_n, 0], bars.index(st), smem.index(st))


@gluon.jit
def _persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars,
                         KV_START, KV_END, TRACE, pid, n_programs, n_items, n_m, H, T, CAUSAL: gl.constexpr,
                         DOCS: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         FOLD: gl.constexpr, TRACE_ITEMS: gl.constexpr):
    """For each item of this program: its first K tile, each consumer's Q tile once that consumer has stored the last
    item's O from it, then its first V tile and the other K and V tiles; tile it of the program into stage
    it % STAGES. (The first S = Q Kᵀ needs Q and K only.)"""
    it = 0
    for n in range(_item_count(pid, n_programs, n_items, FOLD=FOLD)):
        if TRACE_ITEMS:
            t0 = _clock()
        b, h, start_m, lo, n_tiles, _, _ = _fwd_item(_item_at(n, pid, n_programs, FOLD=FOLD), n_m, H, T, KV_START,
                                                     KV_END, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N, FOLD=FOLD)
        h_kv = h // GROUP
        _fwd_load(k_desc, k_smem, k_bars, free_bars, it, b, h_kv, lo, STAGES=STAGES)
        if TRACE_ITEMS:
            t1 = _clock()
        for w in gl.static_range(2):
            mbarrier.wait(q_free.index(w), (n & 1) ^ 1)
            mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, start_m + w * 64, 0], q_bars.index(w), q_smem.index(w))
        if TRACE_ITEMS:
            t2 = _clock()
        _fwd_load(v_desc, v_smem, v_bars, free_bars, it, b, h_kv, lo, STAGES=STAGES)
        for j in range(1, n_tiles):
            _fwd_load(k_desc, k_smem, k_bars, free_bars, it + j, b, h_kv, lo + j * BLOCK_N, STAGES=STAGES)
            _fwd_load(v_desc, v_smem, v_bars, free_bars, it + j, b, h_kv, lo + j * BLOCK_N, STAGES=STAGES)
        it += n_tiles
        if TRACE_ITEMS:
            _trace(TRACE + ((pid * 3 + 2) * TRACE_ITEMS + n) * 8, n < TRACE_ITEMS, t0, t1, t2, _clock(),
                   n_tiles.to(gl.int64), 0, 0, _globaltimer())


@gluon.jit
def _take_turn(turns, turn, W: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: consumer warpgroup W issues its matmuls only in its turn, the two warpgroups alternating (warpgroup 0
    first), so that one's softmax runs while the other's matmuls hold the tensor cores (FlashAttention-3's ping-pong).
    turns[W] completes a phase each time the other warpgroup passes the turn to W."""
    if PINGPONG:
        mbarrier.wait(turns.index(W), (turn + W + 1) & 1, pred=turn + W > 0)


@gluon.jit
def _pass_turn(turns, turn, W: gl.constexpr, PINGPONG: gl.constexpr):
    """After issuing its matmuls: hand the turn to the other warpgroup; the number of turns taken."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - W), count=1)
    return turn + 1


@gluon.jit
def _fwd_rows(b, start_m, T, KV_START, KV_END, W: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr,
              s_layout: gl.constexpr):
    """Warpgroup W's 64 query rows of an item from start_m and, DOCS, each row's key bounds [kv_first, kv_end); rows
    >= T see no key (their outputs are not stored)."""
    rows = start_m + W * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    if DOCS:
        kv_first = gl.load(KV_START + b.to(gl.int64) * T + rows, mask=rows < T, other=0)
        if CAUSAL:
            kv_end = rows + 1
        else:
            kv_end = gl.load(KV_END + b.to(gl.int64) * T + rows, mask=rows < T, other=0)
    else:
        kv_first = rows
        kv_end = rows
    return rows, kv_first, kv_end


@gluon.jit
def _fwd_key_loop(q_s, k_smem, v_smem, k_bars, v_bars, free_bars, turns, turn, it, n_tiles, acc, p, alpha, m_i, l_i,
                  rows, lo, start_m, T, qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, bh, threshold,
                  W: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, DROPOUT: gl.constexpr, PINGPONG: gl.constexpr, s_layout: gl.constexpr,
                  o_layout: gl.constexpr):
    """An item's key tiles it ... it + n_tiles - 1 after the first, whose softmax is done (p, alpha): S of tile j + 1,
    then P V of tile j, on the tensor cores while tile j + 1's softmax runs, and tile j's stage goes back. Returns
    (acc, p, alpha, m_i, l_i, turn) with the last tile's P V still to do."""
    dtype: gl.constexpr = q_s.dtype
    HEAD_DIM: gl.constexpr = q_s.shape[1]
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    s_init = gl.zeros([64, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    for j in range(it, it + n_tiles - 1):
        nxt = (j + 1) % STAGES
        _take_turn(turns, turn, W, PINGPONG)
        mbarrier.wait(k_bars.index(nxt), ((j + 1) // STAGES) & 1)
        k_s = _view(k_smem.index(nxt), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        s = warpgroup_mma(q_s, k_s.permute((1, 0)), s_init, use_acc=False, is_async=True)
        v_s = _view(v_smem.index(j % STAGES), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        acc = _fwd_pv(acc, p, alpha, v_s, v_bars.index(j % STAGES), (j // STAGES) & 1, o_layout=o_layout)
        turn = _pass_turn(turns, turn, W, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s, ))
        p, m_i, alpha, l_i = _fwd_softmax(s, m_i, l_i, rows, lo + (j + 1 - it) * BLOCK_N, start_m, T, qk_scale,
                                          kv_first, kv_end, inner_lo, inner_hi, seed, bh, start_m + W * 64,
                                          threshold, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N, s_layout=s_layout,
                                          DROPOUT=DROPOUT, dtype=dtype)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(free_bars.index(j % STAGES), count=1)
    return acc, p, alpha, m_i, l_i, turn


@gluon.jit
def _fwd_finish(acc, m_i, l_i, rows, LSE, bh, T, threshold, DROPOUT: gl.constexpr, o_layout: gl.constexpr):
    """O = acc / l of these rows, and their natural-log LSE stored (rows >= T not)."""
    norm = l_i * ((256 - threshold) / 256.0) if DROPOUT else l_i  # dropout: O takes 1 / (1 - p), LSE does not
    gl.store(LSE + bh.to(gl.int64) * T + rows, (m_i + gl.log2(l_i)) * LN2, mask=rows < T)
    return acc / gl.convert_layout(norm, gl.SliceLayout(1, o_layout))[:, None]


@gluon.jit
def _fwd_store_tile(o_desc, o, o_smem, b, h, first_row):
    """O's 64 rows from first_row out through o_smem by TMA (rows >= T are not written); the caller waits for it."""
    HEAD_DIM: gl.constexpr = o.shape[1]
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], o_smem.dtype)
    _view(o_smem, o_smem.dtype, [64, HEAD_DIM], q_layout).store(o.to(o_smem.dtype))
    fence_async_shared()
    _cta_barrier()  # every warp of this warpgroup has stored its rows
    _tma_store(o_desc, [b, h, first_row, 0], o_smem)


@gluon.jit
def _persistent_consumer(o_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns, k_done,
                         LSE, KV_START, KV_END, SEED, TRACE, pid, n_programs, n_items, n_m, H, T, qk_scale, threshold,
                         W: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DROPOUT: gl.constexpr, FOLD: gl.constexpr,
                         PINGPONG: gl.constexpr, O_IN_K: gl.constexpr, ROTATE: gl.constexpr,
                         TRACE_ITEMS: gl.constexpr):
    """Warpgroup W: for each item of this program, its query rows start_m + 64 W ... + 63 against the item's key
    tiles, then O and LSE. Both warpgroups take the same items, hence the same number of turns (_take_turn).
    O_IN_K: O is staged for its TMA store in the item's last K tile instead of the Q tile, so the Q tile goes back to
    the producer, for the next item's Q, as soon as the item's last S = Q Kᵀ is done (k_done: both warpgroups' are),
    and the store is waited for (and the K/V stage given back) only after the next item's first S, so it runs under
    that item's start. Without it, O goes through the Q tile, which the next Q may take once the store has read it.
    ROTATE (with O_IN_K): _rotated_items' order instead."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    q_s = _view(q_smem.index(W), dtype, [64, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype))
    seed = gl.load(SEED) if DROPOUT else 0
    if ROTATE:
        gl.static_assert(O_IN_K and not TRACE_ITEMS, "ROTATE stages O in K and is not traced")
        _rotated_items(o_desc, q_s, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns, k_done, LSE,
                       KV_START, KV_END, seed, pid, n_programs, n_items, n_m, H, T, qk_scale, threshold, W, HEAD_DIM,
                       CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, FOLD, PINGPONG, s_layout, o_layout)
    else:
        _items(o_desc, q_smem, q_s, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns, k_done, LSE,
               KV_START, KV_END, seed, TRACE, pid, n_programs, n_items, n_m, H, T, qk_scale, threshold, W, HEAD_DIM,
               CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, FOLD, PINGPONG, O_IN_K, TRACE_ITEMS, s_layout, o_layout)


@gluon.jit
def _items(o_desc, q_smem, q_s, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns, k_done, LSE,
           KV_START, KV_END, seed, TRACE, pid, n_programs, n_items, n_m, H, T, qk_scale, threshold, W: gl.constexpr,
           HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
           STAGES: gl.constexpr, DROPOUT: gl.constexpr, FOLD: gl.constexpr, PINGPONG: gl.constexpr,
           O_IN_K: gl.constexpr, TRACE_ITEMS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """_persistent_consumer's items one after the other: each one's first S, its key tiles, its last P V, O. q_s:
    this warpgroup's Q tile of q_smem."""
    dtype: gl.constexpr = q_s.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    o_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, 64, HEAD_DIM], dtype)  # o_desc's tiles
    s_init = gl.zeros([64, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    it = 0
    turn = 0
    stored = -1  # O_IN_K: the stage whose O store the last item left in flight
    for n in range(_item_count(pid, n_programs, n_items, FOLD=FOLD)):
        if TRACE_ITEMS:
            t0 = _clock()
            g0 = _globaltimer()
        b, h, start_m, lo, n_tiles, inner_lo, inner_hi = _fwd_item(_item_at(n, pid, n_programs, FOLD=FOLD), n_m, H,
                                                                   T, KV_START, KV_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                                   BLOCK_N=BLOCK_N, FOLD=FOLD)
        bh = b * H + h
        rows, kv_first, kv_end = _fwd_rows(b, start_m, T, KV_START, KV_END, W, CAUSAL, DOCS, s_layout)
        m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)

        mbarrier.wait(q_bars.index(W), n & 1)
        if TRACE_ITEMS:
            t1 = _clock()
        _take_turn(turns, turn, W, PINGPONG)
        mbarrier.wait(k_bars.index(it % STAGES), (it // STAGES) & 1)
        k_s = _view(k_smem.index(it % STAGES), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        s = warpgroup_mma(q_s, k_s.permute((1, 0)), s_init, use_acc=False, is_async=True)
        turn = _pass_turn(turns, turn, W, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if O_IN_K:
            if stored >= 0:  # the last item's O has left its K tile: the stage goes back
                tma.store_wait(0)
                mbarrier.arrive(free_bars.index(stored), count=1)
        if TRACE_ITEMS:
            t2 = _clock()
        p, m_i, alpha, l_i = _fwd_softmax(s, m_i, l_i, rows, lo, start_m, T, qk_scale, kv_first, kv_end, inner_lo,
                                          inner_hi, seed, bh, start_m + W * 64, threshold, CAUSAL=CAUSAL, DOCS=DOCS,
                                          BLOCK_N=BLOCK_N, s_layout=s_layout, DROPOUT=DROPOUT, dtype=dtype)
        if TRACE_ITEMS:
            t3 = _clock()
        acc, p, alpha, m_i, l_i, turn = _fwd_key_loop(q_s, k_smem, v_smem, k_bars, v_bars, free_bars, turns, turn, it,
                                                      n_tiles, acc, p, alpha, m_i, l_i, rows, lo, start_m, T,
                                                      qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, bh,
                                                      threshold, W, CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, PINGPONG,
                                                      s_layout, o_layout)
        it += n_tiles
        last = (it - 1) % STAGES
        if O_IN_K:  # every S = Q Kᵀ of the item is done: Q may take the next item's tile, the last K this one's O
            mbarrier.arrive(q_free.index(W), count=1)
            mbarrier.arrive(k_done.index(0), count=1)
        if TRACE_ITEMS:
            t4 = _clock()
        v_s = _view(v_smem.index(last), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        _take_turn(turns, turn, W, PINGPONG)
        acc = _fwd_pv(acc, p, alpha, v_s, v_bars.index(last), ((it - 1) // STAGES) & 1, o_layout=o_layout)
        turn = _pass_turn(turns, turn, W, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if not O_IN_K:
            mbarrier.arrive(free_bars.index(last), count=1)
        if TRACE_ITEMS:
            t5 = _clock()

        o = _fwd_finish(acc, m_i, l_i, rows, LSE, bh, T, threshold, DROPOUT, o_layout)
        if O_IN_K:  # O staged in half W of the last K tile's memory, once both warpgroups' last S is done
            o_smem = _view(k_smem.index(last), dtype, [2, 1, 1, 64, HEAD_DIM], o_tile).index(W)
            mbarrier.wait(k_done.index(0), n & 1)
        else:  # Q is read no more: its tile stages O
            o_smem = q_smem.index(W)
        _fwd_store_tile(o_desc, o, o_smem, b, h, start_m + W * 64)
        if O_IN_K:  # waited for under the next item's first S = Q Kᵀ
            stored = last
        else:
            tma.store_wait(0)
            mbarrier.arrive(q_free.index(W), count=1)  # the producer may load the next item's Q here
        if TRACE_ITEMS:
            _trace(TRACE + ((pid * 3 + W) * TRACE_ITEMS + n) * 8, n < TRACE_ITEMS, t0, t1, t2, t3, t4, t5, _clock(),
                   g0)
    if O_IN_K:
        tma.store_wait(0)


@gluon.jit
def _rotated_items(o_desc, q_s, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns, k_done, LSE,
                   KV_START, KV_END, seed, pid, n_programs, n_items, n_m, H, T, qk_scale, threshold, W: gl.constexpr,
                   HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, DROPOUT: gl.constexpr, FOLD: gl.constexpr, PINGPONG: gl.constexpr,
                   s_layout: gl.constexpr, o_layout: gl.constexpr):
    """_items with O in K, rotated by one matmul: an item's last P V goes to the tensor cores in the same turn as the
    next item's first S = Q Kᵀ, so this item's O normalisation and store run while that S (and the other
    warpgroup's turn) holds the tensor cores, instead of between the two. After the last item that S and its softmax
    run once more on tiles already there (the last item's Q and a stale K stage; nothing is waited for or stored), so
    every item takes the same path. The same O and LSE bit for bit."""
    dtype: gl.constexpr = q_s.dtype
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    o_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, 64, HEAD_DIM], dtype)  # o_desc's tiles
    s_init = gl.zeros([64, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    count = _item_count(pid, n_programs, n_items, FOLD=FOLD)  # at least 1: the launcher starts no idle program

    # The first item's first S and softmax.
    b, h, start_m, lo, n_tiles, inner_lo, inner_hi = _fwd_item(_item_at(0, pid, n_programs, FOLD=FOLD), n_m, H, T,
                                                               KV_START, KV_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                               BLOCK_N=BLOCK_N, FOLD=FOLD)
    rows, kv_first, kv_end = _fwd_rows(b, start_m, T, KV_START, KV_END, W, CAUSAL, DOCS, s_layout)
    mbarrier.wait(q_bars.index(W), 0)
    _take_turn(turns, 0, W, PINGPONG)
    mbarrier.wait(k_bars.index(0), 0)
    k_s = _view(k_smem.index(0), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
    s0 = warpgroup_mma(q_s, k_s.permute((1, 0)), s_init, use_acc=False, is_async=True)
    turn = _pass_turn(turns, 0, W, PINGPONG)
    s0 = warpgroup_mma_wait(0, deps=(s0, ))
    p, m_i, alpha, l_i = _fwd_softmax(s0, gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout)),
                                      gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout)), rows, lo, start_m, T,
                                      qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, b * H + h,
                                      start_m + W * 64, threshold, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N,
                                      s_layout=s_layout, DROPOUT=DROPOUT, dtype=dtype)
    it = 0
    for n in range(count):
        acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
        acc, p, alpha, m_i, l_i, turn = _fwd_key_loop(q_s, k_smem, v_smem, k_bars, v_bars, free_bars, turns, turn, it,
                                                      n_tiles, acc, p, alpha, m_i, l_i, rows, lo, start_m, T,
                                                      qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, b * H + h,
                                                      threshold, W, CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, PINGPONG,
                                                      s_layout, o_layout)
        it += n_tiles
        last = (it - 1) % STAGES
        mbarrier.arrive(q_free.index(W), count=1)  # every S of the item is done: the next item's Q may load
        mbarrier.arrive(k_done.index(0), count=1)

        # One turn: this item's last P V, then the next item's first S (after the last item: the last item again).
        more = n + 1 < count
        b2, h2, start_m2, lo2, n_tiles2, inner_lo2, inner_hi2 = _fwd_item(
            _item_at(gl.minimum(n + 1, count - 1), pid, n_programs, FOLD=FOLD), n_m, H, T, KV_START, KV_END,
            CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N, FOLD=FOLD)
        rows2, kv_first2, kv_end2 = _fwd_rows(b2, start_m2, T, KV_START, KV_END, W, CAUSAL, DOCS, s_layout)
        mbarrier.wait(q_bars.index(W), (n + 1) & 1, pred=more)
        _take_turn(turns, turn, W, PINGPONG)
        v_s = _view(v_smem.index(last), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        acc = _fwd_pv(acc, p, alpha, v_s, v_bars.index(last), ((it - 1) // STAGES) & 1, o_layout=o_layout)
        mbarrier.wait(k_bars.index(it % STAGES), (it // STAGES) & 1, pred=more)
        k_s = _view(k_smem.index(it % STAGES), dtype, [BLOCK_N, HEAD_DIM], kv_layout)
        s = warpgroup_mma(q_s, k_s.permute((1, 0)), s_init, use_acc=False, is_async=True)
        turn = _pass_turn(turns, turn, W, PINGPONG)
        acc = warpgroup_mma_wait(1, deps=(acc, ))  # P V, issued first, is done; S may still run

        # This item's O, staged in half W of its last K tile once both warpgroups' last S is done, under that S.
        o = _fwd_finish(acc, m_i, l_i, rows, LSE, b * H + h, T, threshold, DROPOUT, o_layout)
        o_smem = _view(k_smem.index(last), dtype, [2, 1, 1, 64, HEAD_DIM], o_tile).index(W)
        mbarrier.wait(k_done.index(0), n & 1)
        _fwd_store_tile(o_desc, o, o_smem, b, h, start_m + W * 64)

        # The next item's first softmax; then the store has left the stage, which goes back.
        b, h, start_m, lo, n_tiles, inner_lo, inner_hi = b2, h2, start_m2, lo2, n_tiles2, inner_lo2, inner_hi2
        rows, kv_first, kv_end = rows2, kv_first2, kv_end2
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, m_i, alpha, l_i = _fwd_softmax(s, gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout)),
                                          gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout)), rows, lo, start_m,
                                          T, qk_scale, kv_first, kv_end, inner_lo, inner_hi, seed, b * H + h,
                                          start_m + W * 64, threshold, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_N=BLOCK_N,
                                          s_layout=s_layout, DROPOUT=DROPOUT, dtype=dtype)
        tma.store_wait(0)
        mbarrier.arrive(free_bars.index(last), count=1)


@gluon.jit
def _fwd_persistent_kernel(Q, K, V, Out, LSE, KV_START, KV_END, SEED, TRACE, stride_qb, stride_qh, stride_qt,
                           stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_ob, stride_oh,
                           stride_ot, B, H, H_KV, T, qk_scale, threshold, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                           GROUP: gl.constexpr, DOCS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           DROPOUT: gl.constexpr, FOLD: gl.constexpr, PINGPONG: gl.constexpr, O_IN_K: gl.constexpr,
                           ROTATE: gl.constexpr, TRACE_ITEMS: gl.constexpr, num_warps: gl.constexpr):
    """The forward of _fwd_kernel, O and LSE bit for bit (PINGPONG too: it only orders the matmuls' issue), with P
    programs (one per multiprocessor) of which program p runs work items p, p + P, p + 2P, ... (with FOLD: 2p,
    2p + 1, 2(p + P), ...; _item_at): tiles of 128 query rows of one (batch, head), so that one item's O store
    overlaps the next item's first loads. One descriptor per tensor over (B, heads, T, HEAD_DIM) serves every item."""
    dtype: gl.constexpr = Q.dtype.element_ty
    n_m = gl.cdiv(T, 128)
    n_items = n_m * H * B
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    # (1, 1, rows, HEAD_DIM) tiles of (B, heads, T, HEAD_DIM); rows >= T read as zeros and are not written.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, 64, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q, shape=[B, H, T, HEAD_DIM], strides=[stride_qb, stride_qh, stride_qt, 1],
                                        block_shape=[1, 1, 64, HEAD_DIM], layout=q_layout)
    o_desc = tma.make_tensor_descriptor(Out, shape=[B, H, T, HEAD_DIM], strides=[stride_ob, stride_oh, stride_ot, 1],
                                        block_shape=[1, 1, 64, HEAD_DIM], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, H_KV, T, HEAD_DIM],
                                        strides=[stride_kb, stride_kh, stride_kt, 1],
                                        block_shape=[1, 1, BLOCK_N, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, H_KV, T, HEAD_DIM],
                                        strides=[stride_vb, stride_vh, stride_vt, 1],
                                        block_shape=[1, 1, BLOCK_N, HEAD_DIM], layout=kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, 64, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], kv_layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_done.index(0), count=2)  # O_IN_K: both warpgroups are done with the item's last K tile
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(free_bars.index(i), count=2)  # freed by both consumers

    gl.warp_specialize([
        (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_bars, v_bars,
                                free_bars, KV_START, KV_END, TRACE, pid, n_programs, n_items, n_m, H, T, CAUSAL, DOCS,
                                GROUP, BLOCK_N, STAGES, FOLD, TRACE_ITEMS)),
        (_persistent_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns,
                                k_done, LSE, KV_START, KV_END, SEED, TRACE, pid, n_programs, n_items, n_m, H, T,
                                qk_scale, threshold, 0, HEAD_DIM, CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, FOLD,
                                PINGPONG, O_IN_K, ROTATE, TRACE_ITEMS)),
        (_persistent_consumer, (o_desc, q_smem, k_smem, v_smem, q_bars, q_free, k_bars, v_bars, free_bars, turns,
                                k_done, LSE, KV_START, KV_END, SEED, TRACE, pid, n_programs, n_items, n_m, H, T,
                                qk_scale, threshold, 1, HEAD_DIM, CAUSAL, DOCS, BLOCK_N, STAGES, DROPOUT, FOLD,
                                PINGPONG, O_IN_K, ROTATE, TRACE_ITEMS)),
    ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, bar, g, start_m):
    """Query head g's Q, dO, LSE and Δ tiles from row start_m into one slot; `bar` completes when all have landed."""
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
    _tma_load(q_desc, [g, start_m, 0], bar, q_smem)
    _tma_load(do_desc, [g, start_m, 0], bar, do_smem)
    _tma_load(lse_desc, [g, start_m], bar, lse_smem)
    _tma_load(delta_desc, [g, start_m], bar, delta_smem)


@gluon.jit
def _step_at(step, lo, per_head, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query head within the group, first query row) of a step: the query tiles of head 0, then of head 1, ..."""
    if GROUP == 1:
        g = 0
        start_m = lo + step * BLOCK_M
    else:
        g = step // per_head
        start_m = lo + (step - g * per_head) * BLOCK_M
    return g, start_m


@gluon.jit
def _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr):
    """The query rows [lo, hi) that see some key of the BLOCK_N keys from start_n of batch b (causal: none before
    them), and [inner_lo, inner_hi), the queries within every such key's bounds, whose steps go unmasked. DOCS
    (bounded attention): key j is seen by queries [Q_START[j], Q_END[j]) (causal: from j on)."""
    if DOCS:  # the bounds rise along the row: the first key has the lowest, the last key the highest
        row_base = b.to(gl.int64) * T
        last_key = gl.minimum(start_n + BLOCK_N, T) - 1
        hi = gl.load(Q_END + row_base + last_key)
        inner_hi = gl.load(Q_END + row_base + start_n)
        if CAUSAL:
            lo = start_n
            inner_lo = start_n + BLOCK_N
        else:
            lo = gl.load(Q_START + row_base + start_n) // BLOCK_M * BLOCK_M
            inner_lo = gl.load(Q_START + row_base + last_key)
    else:
        lo = start_n if CAUSAL else 0
        hi = T
        inner_lo = 0
        inner_hi = T
    return lo, hi, inner_lo, inner_hi


@gluon.jit
def _key_bounds(b, keys, T, Q_START, Q_END, CAUSAL: gl.constexpr, DOCS: gl.constexpr):
    """DOCS (bounded attention): each key's queries [q_first, q_end), keys >= T seen by none; otherwise unused."""
    if DOCS:
        row_base = b.to(gl.int64) * T
        q_end = gl.load(Q_END + row_base + keys, mask=keys < T, other=0)
        if CAUSAL:
            q_first = keys
        else:
            q_first = gl.load(Q_START + row_base + keys, mask=keys < T, other=0)
    else:
        q_first = keys
        q_end = keys
    return q_first, q_end


@gluon.jit
def _bwd_probs(st, lse_s, keys, start_m, tile_end, keys_end, T, qk_scale, q_first, q_end, inner_lo, inner_hi,
               CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr, col_layout: gl.constexpr):
    """Pᵀ of one step from Sᵀ (these keys x the BLOCK_M queries from start_m), zero where a key is not seen: masked
    only on steps that reach outside some key's bounds (DOCS), cross the diagonal (causal: keys up to keys_end), or
    meet the program's keys past T (tile_end > T: zero-filled keys would get P = 2^(-LSE), unbounded)."""
    lse2 = lse_s.load(col_layout) * LOG2E
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if DOCS:
        if start_m < inner_lo or start_m + BLOCK_M > inner_hi or tile_end > T:
            queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            seen = (queries[None, :] >= q_first[:, None]) & (queries[None, :] < q_end[:, None])
            pt = gl.where(seen, pt, 0.0)
    elif CAUSAL:
        if start_m < keys_end:  # a diagonal tile: mask keys after the query
            queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            pt = gl.where(queries[None, :] >= keys[:, None], pt, 0.0)
    elif tile_end > T:
        pt = gl.where(keys[:, None] < T, pt, 0.0)
    return pt


@gluon.jit
def _bwd_ds(pt, dpt, delta, seed, bh, first_key, start_m, threshold, KEYS: gl.constexpr, BLOCK_M: gl.constexpr,
            s_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """(Pᵀ as dV takes it, dSᵀ = Pᵀ ∘ (dPᵀ − Δ)) of one step. DROPOUT: the forward's keep-mask of these keys and
    queries, made in this layout (_keep); both come without the factor 1 / (1 - p), which dQ, dK and dV take at the
    end (Δ is scaled by 1 - p instead)."""
    if DROPOUT:
        keep = _keep(seed, bh, first_key, start_m, threshold, KEYS, BLOCK_M, s_layout, TRANSPOSED=True)
        ds = pt * (gl.where(keep, dpt, 0.0) - delta[None, :] * ((256 - threshold) / 256.0))
        return gl.where(keep, pt, 0.0), ds
    else:
        return pt, pt * (dpt - delta[None, :])


@gluon.jit
def _store_dkdv(DK, DV, dk, dv, b, h_kv, first_key, key_lo, key_hi, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                stride_dvh, stride_dvt, sm_scale, threshold, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr,
                kv_layout: gl.constexpr, DROPOUT: gl.constexpr):
    """dK (scaled) and dV of the KEYS keys from first_key, only rows in [key_lo, key_hi) written (key_lo None: 0);
    with dropout dV takes 1 / (1 - p) (dK's sm_scale carries it already)."""
    if DROPOUT:
        dv = dv * (256.0 / (256 - threshold))
    dtype: gl.constexpr = DK.dtype.element_ty
    keys = first_key + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))[:, None]
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))[None, :]
    ok = keys < key_hi
    if key_lo is not None:  # None: no lower bound (one compare less where registers are tightest)
        ok = ok & (keys >= key_lo)
    dk_ptrs = DK + b.to(gl.int64) * stride_dkb + h_kv.to(gl.int64) * stride_dkh + keys * stride_dkt + dims
    dv_ptrs = DV + b.to(gl.int64) * stride_dvb + h_kv.to(gl.int64) * stride_dvh + keys * stride_dvt + dims
    gl.store(dk_ptrs, (dk * sm_scale).to(dtype), mask=ok)
    gl.store(dv_ptrs, dv.to(dtype), mask=ok)


@gluon.jit
def _bwd_kernel(Q, K, V, DO, DQ_ACC, DK, DV, LSE, DELTA, Q_START, Q_END, SEED,
                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                stride_dvt, H, T, qk_scale, sm_scale, threshold,
                HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = HEAD_DIM // 2
    start_n = gl.program_id(0) * BLOCK_N
    h_kv = gl.program_id(1)
    b = gl.program_id(2)
    h0 = h_kv * GROUP  # the first query head of this key-value head's group
    bh0 = b * H + h0

    # wgmma accumulators, warps stacked along rows: Sᵀ and dPᵀ (BLOCK_N, BLOCK_M), dK and dV (BLOCK_N, HEAD_DIM), a
    # column half of dQ (BLOCK_M, HALF); Pᵀ and dSᵀ as register A operands of the dV and dK products.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HALF, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (a column of Sᵀ)

    q_desc = _group_slab(Q, b, h0, stride_qb, stride_qh, stride_qt, T, GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
    do_desc = _group_slab(DO, b, h0, stride_dob, stride_doh, stride_dot, T, GROUP=GROUP, HEAD_DIM=HEAD_DIM,
                          BLOCK=BLOCK_M)
    k_desc = _slab(K, b, h_kv, stride_kb, stride_kh, stride_kt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    v_desc = _slab(V, b, h_kv, stride_vb, stride_vh, stride_vt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    lse_desc = _group_rows(LSE, bh0, T, GROUP=GROUP, BLOCK=BLOCK_M)
    delta_desc = _group_rows(DELTA, bh0, T, GROUP=GROUP, BLOCK=BLOCK_M)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC + bh0.to(gl.int64) * T * HEAD_DIM, shape=[GROUP, T, HEAD_DIM],
                                         strides=[T * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, BLOCK_M, HALF],
                                         layout=gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HALF], gl.float32))
    # The 2-D views of those (1, ...) tiles that the matmuls, loads and stores take.
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.float32)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], delta_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)

    # Steps walk the query tiles [lo, hi) of each head in turn; DOCS: key j is seen by queries [q_first, q_end).
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    lo, hi, inner_lo, inner_hi = _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    q_first, q_end = _key_bounds(b, keys, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS)
    per_head = gl.cdiv(hi - lo, BLOCK_M)
    n_steps = GROUP * per_head
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [start_n, 0], kv_bar, k_smem)
    _tma_load(v_desc, [start_n, 0], kv_bar, v_smem)
    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem.index(0), do_smem.index(0), lse_smem.index(0),
               delta_smem.index(0), bars.index(0), 0, lo)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    dq_init = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    seed = gl.load(SEED) if DROPOUT else 0
    grad_scale = sm_scale * 256.0 / (256 - threshold) if DROPOUT else sm_scale  # dropout: dQ, dK take 1 / (1 - p)
    mbarrier.wait(kv_bar, 0)

    for step in range(n_steps):
        g, start_m = _step_at(step, lo, per_head, GROUP=GROUP, BLOCK_M=BLOCK_M)
        slot = step % 2
        _cta_barrier()  # every warp is past the last step: its dS tile may be overwritten
        mbarrier.wait(bars.index(slot), (step // 2) & 1)
        q_s = _view(q_smem.index(slot), dtype, [BLOCK_M, HEAD_DIM], tile_layout)
        do_s = _view(do_smem.index(slot), dtype, [BLOCK_M, HEAD_DIM], tile_layout)
        lse_s = _view(lse_smem.index(slot), gl.float32, [BLOCK_M], row_layout)
        delta_s = _view(delta_smem.index(slot), gl.float32, [BLOCK_M], row_layout)

        st = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_init, use_acc=False, is_async=True)  # (BLOCK_N, BLOCK_M)
        dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_init, use_acc=False, is_async=True)

        st = warpgroup_mma_wait(1, deps=(st, ))
        pt = _bwd_probs(st, lse_s, keys, start_m, start_n + BLOCK_N, start_n + BLOCK_N, T, qk_scale, q_first, q_end,
                        inner_lo, inner_hi, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_M=BLOCK_M, col_layout=col_layout)  # Pᵀ
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        pt, ds = _bwd_ds(pt, dpt, delta_s.load(col_layout), seed, bh0 + g, start_n, start_m, threshold, BLOCK_N,
                         BLOCK_M, s_layout, DROPOUT=DROPOUT)
        ds16 = ds.to(dtype)  # dSᵀ
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_s, dv, is_async=True)
        ds_smem.store(ds16)
        dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_s, dk, is_async=True)
        fence_async_shared()
        _cta_barrier()  # dSᵀ of every warp in shared memory
        # The next step's tiles go to the other slot, which staged the last step's dQ: asked for this late, the copy
        # engine has had the exponentials' time to finish reading it (measured faster than asking right away).
        if step + 1 < n_steps:
            tma.store_wait(0)
            nxt = 1 - slot
            g_next, m_next = _step_at(step + 1, lo, per_head, GROUP=GROUP, BLOCK_M=BLOCK_M)
            _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem.index(nxt), do_smem.index(nxt),
                       lse_smem.index(nxt), delta_smem.index(nxt), bars.index(nxt), g_next, m_next)

        # dQ = dS K, one column half at a time, staged in this step's Q tile, then in its dO tile (the launcher's cast
        # applies the scale once).
        for half in gl.static_range(2):
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(half * HALF, HALF, dim=1), dq_init,
                               use_acc=False, is_async=True)  # (BLOCK_M, HALF)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            stage = (q_smem if half == 0 else do_smem).index(slot)
            _cta_barrier()  # no warp still reads this tile
            _view(stage, gl.float32, [BLOCK_M, HALF], stage_layout).store(dq)
            fence_async_shared()
            _cta_barrier()
            _tma_reduce_add(dq_desc, [g, start_m, half * HALF], _view(stage, gl.float32, [1, BLOCK_M, HALF],
                                                                      dq_desc.layout))

    tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(kv_bar)

    _store_dkdv(DK, DV, dk, dv, b, h_kv, start_n, None, T, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                stride_dvt, grad_scale, threshold, KEYS=BLOCK_N, HEAD_DIM=HEAD_DIM, kv_layout=kv_layout,
                DROPOUT=DROPOUT)


# ----------------------------------------------------------------------------------------------------------------------
# The warp-specialised backward: 128 keys per program over two consumer warpgroups and a TMA producer
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _ws_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem,
                 v_smem, kv_bar, q_bars, done_bars, start_n, lo, per_head, n_steps, GROUP: gl.constexpr,
                 BLOCK_M: gl.constexpr):
    """The program's K and V tiles once, then each step's Q, dO, LSE and Δ into slot step % 2, once both consumers
    are done with the step that last used it."""
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [start_n, 0], kv_bar, k_smem)
    _tma_load(v_desc, [start_n, 0], kv_bar, v_smem)
    for step in range(n_steps):
        slot = step % 2
        mbarrier.wait(done_bars.index(slot), ((step // 2) & 1) ^ 1)  # a fresh barrier passes the first round
        g, start_m = _step_at(step, lo, per_head, GROUP=GROUP, BLOCK_M=BLOCK_M)
        _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem.index(slot), do_smem.index(slot),
                   lse_smem.index(slot), delta_smem.index(slot), q_bars.index(slot), g, start_m)


@gluon.jit
def _in_order_rows(io, start_m, start_n, T, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   layout: gl.constexpr):
    """The by-example backward's rows of one step (`io`: _ws_example_consumer's dQ outputs, bounds and example
    [seg_start, seg_end) of its item): (rows, touched, later, last) of the BLOCK_M query rows from start_m, `touched`
    the rows of the example that see some key of this key tile, `later` those an earlier key tile has already written
    (their first key lies before this tile), `last` those whose last key lies in it (this tile finishes them)."""
    kv_start, kv_end, seg_start, seg_end = io[2], io[3], io[6], io[7]
    rows = start_m + gl.arange(0, BLOCK_M, layout=layout)
    in_example = (rows >= seg_start) & (rows < seg_end)
    first = gl.load(kv_start + rows, mask=in_example, other=T)  # rows outside: touched by no key tile
    end = gl.load(kv_end + rows, mask=in_example, other=0)
    if CAUSAL:  # the bounds of packed rows end at the example's end; a causal row's keys end at itself
        end = gl.minimum(end, rows + 1)
    touched = (first < start_n + BLOCK_N) & (end > start_n)
    return rows, touched, touched & (first < start_n), end <= start_n + BLOCK_N


@gluon.jit
def _in_order_sums(io, rows, later, g, T, W: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
    """The fp32 dQ sums so far of query head g's rows `later` (column half W; 0 elsewhere): the earlier key tiles'
    stores."""
    HALF: gl.constexpr = HEAD_DIM // 2
    cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    ptrs = io[1] + (g * T + rows).to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    return gl.load(ptrs, mask=later[:, None], other=0.0)


@gluon.jit
def _in_order_store(io, dq, rows, touched, last, g, T, W: gl.constexpr, HEAD_DIM: gl.constexpr,
                    layout: gl.constexpr):
    """Query head g's rows `touched` of column half W of dQ, their sums over this and the earlier key tiles: those
    `last` into dQ (io[0], in its dtype), the others into the fp32 sums (io[1]) for the next key tile."""
    dq_out, dq_sums, stride_dqh, stride_dqt = io[0], io[1], io[4], io[5]
    HALF: gl.constexpr = HEAD_DIM // 2
    cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    sums = dq_sums + (g * T + rows).to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(sums, dq, mask=(touched & ~last)[:, None])
    out = dq_out + g.to(gl.int64) * stride_dqh + rows.to(gl.int64)[:, None] * stride_dqt + cols[None, :]
    gl.store(out, dq.to(dq_out.dtype.element_ty), mask=(touched & last)[:, None])


@gluon.jit
def _ws_step(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_bars, ds_bars,
             done_bars, dk, dv, slot, phase, g, start_m, dq_row, bh, b, keys, q_first, q_end, T, qk_scale, seed,
             threshold, grad_scale, start_n, inner_lo, inner_hi, trace, step, io, W: gl.constexpr,
             HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, TRACE_STEPS: gl.constexpr, IN_ORDER: gl.constexpr):
    """One step of warpgroup W: query head g's BLOCK_M rows from start_m (slot `slot` of the ring) against its 64
    keys; dK and dV accumulate in registers, and column half W of the step's dQ over all BLOCK_N keys is added to
    row dq_row of dq_desc from both warpgroups' dSᵀ in shared memory (IN_ORDER: summed in place for the rows of the
    example, as _in_order_rows says, from registers; dq_desc, dq_smem unused). k_smem, v_smem: the
    (BLOCK_N, HEAD_DIM) K and V of the program's keys. TRACE_STEPS: the first TRACE_STEPS steps record eight cycle
    stamps each at `trace`."""
    dtype: gl.constexpr = q_smem.dtype
    KEYS: gl.constexpr = BLOCK_N // 2
    HALF: gl.constexpr = HEAD_DIM // 2
    if TRACE_STEPS:
        t0 = _clock()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (a column of Sᵀ)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.float32)

    k_w = k_smem.slice(W * KEYS, KEYS, dim=0)  # this warpgroup's keys
    v_w = v_smem.slice(W * KEYS, KEYS, dim=0)
    k_half = k_smem.slice(W * HALF, HALF, dim=1)  # dQ's B operand: head-dim half W of all the program's keys
    s_init = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    dq_init = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)

    mbarrier.wait(q_bars.index(slot), phase)
    if TRACE_STEPS:
        t1 = _clock()
    q_s = _view(q_smem.index(slot), dtype, [BLOCK_M, HEAD_DIM], tile_layout)
    do_s = _view(do_smem.index(slot), dtype, [BLOCK_M, HEAD_DIM], tile_layout)
    lse_s = _view(lse_smem.index(slot), gl.float32, [BLOCK_M], row_layout)
    delta_s = _view(delta_smem.index(slot), gl.float32, [BLOCK_M], row_layout)

    st = warpgroup_mma(k_w, q_s.permute((1, 0)), s_init, use_acc=False, is_async=True)  # (KEYS, BLOCK_M)
    dpt = warpgroup_mma(v_w, do_s.permute((1, 0)), s_init, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st, ))
    if TRACE_STEPS:
        t2 = _clock()
    pt = _bwd_probs(st, lse_s, keys, start_m, start_n + BLOCK_N, start_n + (W + 1) * KEYS, T, qk_scale, q_first,
                    q_end, inner_lo, inner_hi, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_M=BLOCK_M,
                    col_layout=col_layout)  # Pᵀ
    dpt = warpgroup_mma_wait(0, deps=(dpt, ))
    pt, ds = _bwd_ds(pt, dpt, delta_s.load(col_layout), seed, bh, start_n + W * KEYS, start_m, threshold,
                     KEYS, BLOCK_M, s_layout, DROPOUT=DROPOUT)
    ds16 = ds.to(dtype)  # dSᵀ
    if TRACE_STEPS:
        t3 = _clock()
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_s, dv, is_async=True)
    dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_s, dk, is_async=True)

    if IN_ORDER:  # the rows' key bounds load while dV and dK are on the tensor cores
        rows, touched, later, last = _in_order_rows(io, start_m, start_n, T, CAUSAL, BLOCK_M, BLOCK_N,
                                                    gl.SliceLayout(1, dq_layout))
    # Both warpgroups' dSᵀ into this slot (once both have read it two steps ago), then dQ's column half W.
    ds_s = ds_smem.index(slot)
    mbarrier.wait(done_bars.index(slot), phase ^ 1)  # a fresh barrier passes the first round
    ds_s.slice(W * KEYS, KEYS, dim=0).store(ds16)
    fence_async_shared()
    _cta_barrier()  # every warp of this warpgroup has stored its rows
    mbarrier.arrive(ds_bars.index(slot), count=1)
    mbarrier.wait(ds_bars.index(slot), phase)
    if TRACE_STEPS:
        t4 = _clock()
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_half, dq_init, use_acc=False, is_async=True)  # (BLOCK_M, HALF)
    if IN_ORDER:  # the sums so far load while dQ is on the tensor cores
        sums = _in_order_sums(io, rows, later, g, T, W, HEAD_DIM, dq_layout)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
    if TRACE_STEPS:
        t5 = _clock()
    if IN_ORDER:
        _cta_barrier()  # no warp still reads Q, dO or dS of this step
        mbarrier.arrive(done_bars.index(slot), count=1)
        _in_order_store(io, dq * grad_scale + sums, rows, touched, last, g, T, W, HEAD_DIM, dq_layout)
    else:
        tma.store_wait(0)  # the last step's dQ has left the stage
        if TRACE_STEPS:
            t6 = _clock()
        _cta_barrier()  # no warp still reads Q, dO or dS of this step
        mbarrier.arrive(done_bars.index(slot), count=1)
        stage = _view(dq_smem.index(W), gl.float32, [BLOCK_M, HALF], stage_layout)
        stage.store(dq)
        fence_async_shared()
        _cta_barrier()
        _tma_reduce_add(dq_desc, [dq_row, start_m, W * HALF], dq_smem.index(W))
    if TRACE_STEPS:
        _trace(trace + step * 8, step < TRACE_STEPS, t0, t1, t2, t3, t4, t5, t6, _clock())
    return dk, dv


@gluon.jit
def _ws_item(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars, ds_bars,
             done_bars, Q_START, Q_END, b, bh0, dq_base, kv_phase, it, T, qk_scale, seed, threshold, grad_scale,
             start_n, lo, per_head, inner_lo, inner_hi, key_lo, key_hi, trace, io, W: gl.constexpr,
             HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, TRACE_STEPS: gl.constexpr,
             IN_ORDER: gl.constexpr):
    """Warpgroup W's dK and dV (fp32, in registers) of keys start_n + 64 W ... + 63 over the GROUP x per_head steps
    of one key tile, once its K and V have landed (kv_bar's phase kv_phase); the steps take ring slots from the
    program's it-th step on, and each adds its dQ half to row dq_base + g of dq_desc (IN_ORDER: as _ws_step says).
    With key_lo given (by example), only keys in [key_lo, key_hi) are seen, so no dQ is added for the rows of the
    tile's other examples."""
    KEYS: gl.constexpr = BLOCK_N // 2
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    keys = start_n + W * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    q_first, q_end = _key_bounds(b, keys, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS)
    if key_lo is not None:
        q_end = gl.where((keys >= key_lo) & (keys < key_hi), q_end, q_first)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, kv_phase)
    for step in range(GROUP * per_head):
        g, start_m = _step_at(step, lo, per_head, GROUP=GROUP, BLOCK_M=BLOCK_M)
        dk, dv = _ws_step(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, q_bars,
                          ds_bars, done_bars, dk, dv, (it + step) % 2, ((it + step) // 2) & 1, g, start_m,
                          dq_base + g, bh0 + g, b, keys, q_first, q_end, T, qk_scale, seed, threshold,
                          grad_scale, start_n, inner_lo, inner_hi, trace, step, io, W, HEAD_DIM, CAUSAL, DOCS,
                          BLOCK_M, BLOCK_N, DROPOUT, TRACE_STEPS, IN_ORDER)
    return dk, dv


@gluon.jit
def _ws_consumer(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars,
                 ds_bars, done_bars, DK, DV, Q_START, Q_END, SEED, TRACE, stride_dkb, stride_dkh, stride_dkt,
                 stride_dvb, stride_dvh, stride_dvt, b, h_kv, bh0, T, qk_scale, sm_scale, threshold, start_n, lo,
                 per_head, inner_lo, inner_hi, W: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                 GROUP: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DROPOUT: gl.constexpr, TRACE_STEPS: gl.constexpr):
    """Warpgroup W: keys start_n + 64 W ... + 63 (dK, dV in registers), and column half W of each step's dQ over all
    the program's keys, from both warpgroups' dS tiles in shared memory."""
    KEYS: gl.constexpr = BLOCK_N // 2
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    seed = gl.load(SEED) if DROPOUT else 0
    grad_scale = sm_scale * 256.0 / (256 - threshold) if DROPOUT else sm_scale  # dropout: dQ, dK take 1 / (1 - p)
    program = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    trace = TRACE + (program.to(gl.int64) * 2 + W) * TRACE_STEPS * 8  # this warpgroup's (TRACE_STEPS, 8) stamps
    dk, dv = _ws_item(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar, q_bars,
                      ds_bars, done_bars, Q_START, Q_END, b, bh0, 0, 0, 0, T, qk_scale, seed, threshold, grad_scale,
                      start_n, lo, per_head, inner_lo, inner_hi, None, T, trace, None, W, HEAD_DIM, CAUSAL, GROUP,
                      DOCS, BLOCK_M, BLOCK_N, DROPOUT, TRACE_STEPS, False)
    tma.store_wait(0)
    _store_dkdv(DK, DV, dk, dv, b, h_kv, start_n + W * KEYS, None, T, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                stride_dvh, stride_dvt, grad_scale, threshold, KEYS=KEYS, HEAD_DIM=HEAD_DIM, kv_layout=kv_layout,
                DROPOUT=DROPOUT)


@gluon.jit
def _bwd_ws_kernel(Q, K, V, DO, DQ_ACC, DK, DV, LSE, DELTA, Q_START, Q_END, SEED, TRACE,
                   stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                   stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                   stride_dvt, H, T, qk_scale, sm_scale, threshold,
                   HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, TRACE_STEPS: gl.constexpr,
                   num_warps: gl.constexpr):
    """_bwd_kernel's gradients with BLOCK_N = 128 keys per program: a producer warpgroup loads each step's tiles, and
    two consumer warpgroups of 64 keys each compute dK and dV of their keys and one column half of dQ over all 128
    keys, so dQ is added once per 128 keys instead of per 64. TRACE_STEPS > 0: each consumer warpgroup records cycle
    stamps of its first TRACE_STEPS steps at TRACE, int64 (programs, 2, TRACE_STEPS, 8) (_ws_step)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = HEAD_DIM // 2
    start_n = gl.program_id(0) * BLOCK_N
    h_kv = gl.program_id(1)
    b = gl.program_id(2)
    h0 = h_kv * GROUP  # the first query head of this key-value head's group
    bh0 = b * H + h0

    q_desc = _group_slab(Q, b, h0, stride_qb, stride_qh, stride_qt, T, GROUP=GROUP, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_M)
    do_desc = _group_slab(DO, b, h0, stride_dob, stride_doh, stride_dot, T, GROUP=GROUP, HEAD_DIM=HEAD_DIM,
                          BLOCK=BLOCK_M)
    k_desc = _slab(K, b, h_kv, stride_kb, stride_kh, stride_kt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    v_desc = _slab(V, b, h_kv, stride_vb, stride_vh, stride_vt, T, HEAD_DIM=HEAD_DIM, BLOCK=BLOCK_N)
    lse_desc = _group_rows(LSE, bh0, T, GROUP=GROUP, BLOCK=BLOCK_M)
    delta_desc = _group_rows(DELTA, bh0, T, GROUP=GROUP, BLOCK=BLOCK_M)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC + bh0.to(gl.int64) * T * HEAD_DIM, shape=[GROUP, T, HEAD_DIM],
                                         strides=[T * HEAD_DIM, HEAD_DIM, 1], block_shape=[1, BLOCK_M, HALF],
                                         layout=gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HALF], gl.float32))

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], delta_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, HALF], dq_desc.layout)  # one stage per consumer
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a slot's tiles have landed
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # both dSᵀ halves stored
    done_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # both consumers done
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(ds_bars.index(i), count=2)
        mbarrier.init(done_bars.index(i), count=2)

    lo, hi, inner_lo, inner_hi = _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    per_head = gl.cdiv(hi - lo, BLOCK_M)
    n_steps = GROUP * per_head
    gl.warp_specialize([
        (_ws_producer, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem, delta_smem,
                        k_smem, v_smem, kv_bar, q_bars, done_bars, start_n, lo, per_head, n_steps, GROUP, BLOCK_M)),
        (_ws_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar,
                        q_bars, ds_bars, done_bars, DK, DV, Q_START, Q_END, SEED, TRACE, stride_dkb, stride_dkh,
                        stride_dkt, stride_dvb, stride_dvh, stride_dvt, b, h_kv, bh0, T, qk_scale, sm_scale, threshold,
                        start_n, lo, per_head, inner_lo, inner_hi, 0, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M,
                        BLOCK_N, DROPOUT, TRACE_STEPS)),
        (_ws_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar,
                        q_bars, ds_bars, done_bars, DK, DV, Q_START, Q_END, SEED, TRACE, stride_dkb, stride_dkh,
                        stride_dkt, stride_dvb, stride_dvh, stride_dvt, b, h_kv, bh0, T, qk_scale, sm_scale, threshold,
                        start_n, lo, per_head, inner_lo, inner_hi, 1, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M,
                        BLOCK_N, DROPOUT, TRACE_STEPS)),
    ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------------------------------------------------
# The persistent warp-specialised backward: one program per multiprocessor walks its share of the key tiles
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_item(item, n_n, H_KV, CAUSAL: gl.constexpr, FOLD: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item `item`: (first key, key-value head, batch) of one tile of BLOCK_N keys. Key tiles vary fastest;
    causal, in _by_work's order, the first tiles of a head (seen by the most queries) being the heaviest."""
    i = item % n_n
    n = _by_work(i, n_n, FOLD=FOLD) if CAUSAL else i
    h_kv = (item // n_n) % H_KV
    b = item // (n_n * H_KV)
    return n * BLOCK_N, h_kv, b


@gluon.jit
def _ws_load_item(item, it, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem,
                  delta_smem, k_smem, v_smem, kv_bar, q_bars, done_bars, Q_START, Q_END, n_n, H, H_KV, T,
                  CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, FOLD: gl.constexpr):
    """The producer's work for item `item` once both consumers are done with the last item's K and V: its K and V
    tiles, then each step's Q, dO, LSE and Δ into slot it % 2 (it counting the program's steps over all its items),
    once both consumers are done with the step that last used it. Returns it past this item's steps."""
    start_n, h_kv, b = _bwd_item(item, n_n, H_KV, CAUSAL=CAUSAL, FOLD=FOLD, BLOCK_N=BLOCK_N)
    lo, hi, _, _ = _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS, BLOCK_M=BLOCK_M,
                                    BLOCK_N=BLOCK_N)
    return _ws_load_tile(start_n, h_kv, b, lo, gl.cdiv(hi - lo, BLOCK_M), it, q_desc, do_desc, lse_desc, delta_desc,
                         k_desc, v_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_bar, q_bars,
                         done_bars, H, GROUP, BLOCK_M)


@gluon.jit
def _ws_load_tile(start_n, h_kv, b, lo, per_head, it, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem,
                  do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_bar, q_bars, done_bars, H, GROUP: gl.constexpr,
                  BLOCK_M: gl.constexpr):
    """The K and V tiles from key start_n of (batch b, key-value head h_kv), then each of the GROUP x per_head steps'
    Q, dO, LSE and Δ (query rows from lo) into slot it % 2 (it counting the program's steps), once both consumers are
    done with the step that last used it. Returns it past these steps."""
    h0 = h_kv * GROUP
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [b, h_kv, start_n, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, h_kv, start_n, 0], kv_bar, v_smem)
    for step in range(GROUP * per_head):
        slot = it % 2
        mbarrier.wait(done_bars.index(slot), ((it // 2) & 1) ^ 1)
        g, start_m = _step_at(step, lo, per_head, GROUP=GROUP, BLOCK_M=BLOCK_M)
        bar = q_bars.index(slot)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h0 + g, start_m, 0], bar, q_smem.index(slot))
        _tma_load(do_desc, [b, h0 + g, start_m, 0], bar, do_smem.index(slot))
        _tma_load(lse_desc, [b * H + h0 + g, start_m], bar, lse_smem.index(slot))
        _tma_load(delta_desc, [b * H + h0 + g, start_m], bar, delta_smem.index(slot))
        it += 1
    return it


@gluon.jit
def _ws_persistent_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem,
                            delta_smem, k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars, Q_START, Q_END, pid,
                            n_programs, n_items, n_n, H, H_KV, T, CAUSAL: gl.constexpr, GROUP: gl.constexpr,
                            DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, FOLD: gl.constexpr):
    """_ws_load_item for each item dealt to this program (_item_at), once both consumers are done with the last."""
    it = 0
    for n in range(_item_count(pid, n_programs, n_items, FOLD=FOLD)):
        mbarrier.wait(kv_free, (n & 1) ^ 1)  # a fresh barrier passes the first round
        it = _ws_load_item(_item_at(n, pid, n_programs, FOLD=FOLD), it, q_desc, do_desc, lse_desc, delta_desc, k_desc,
                           v_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_bar, q_bars, done_bars,
                           Q_START, Q_END, n_n, H, H_KV, T, CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, FOLD)


@gluon.jit
def _publish_item(item, item_smem, item_bar):
    """Hand item number `item` to both consumers (n_items or more: no more work)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    item_smem.store(gl.zeros([1], gl.int32, layout) + item)
    _cta_barrier()  # every producer warp has written it
    mbarrier.arrive(item_bar, count=1)


@gluon.jit
def _read_item(item_smem, item_bar, n):
    """The number of this program's n-th item, once the producer has published it."""
    mbarrier.wait(item_bar, n & 1)
    return gl.max(item_smem.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _ws_queue_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem, delta_smem,
                       k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars, item_smem, item_bar, QUEUE, Q_START, Q_END,
                       n_items, n_n, H, H_KV, T, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, FOLD: gl.constexpr):
    """Items taken from the work queue (one atomic add on its counter each) until it runs dry: each is published to
    the consumers, and its tiles loaded (_ws_load_item), once both consumers are done with the last item; the next
    number is fetched after this item's last loads are issued, while the consumers still work on it."""
    it = 0
    n = 0
    item = gl.atomic_add(QUEUE, 1)
    while item < n_items:
        mbarrier.wait(kv_free, (n & 1) ^ 1)  # also: both consumers have read the last item's number
        _publish_item(item, item_smem, item_bar)
        it = _ws_load_item(item, it, q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem,
                           delta_smem, k_smem, v_smem, kv_bar, q_bars, done_bars, Q_START, Q_END, n_n, H, H_KV, T,
                           CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, FOLD)
        item = gl.atomic_add(QUEUE, 1)
        n += 1
    mbarrier.wait(kv_free, (n & 1) ^ 1)
    _publish_item(item, item_smem, item_bar)


@gluon.jit
def _ws_dkdv_item(item, n, it, dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar,
                  kv_free, q_bars, ds_bars, done_bars, DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt,
                  stride_dvb, stride_dvh, stride_dvt, n_n, H, H_KV, T, qk_scale, seed, threshold, grad_scale,
                  W: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr,
                  DOCS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr,
                  FOLD: gl.constexpr):
    """Warpgroup W's part of the program's n-th item, number `item` (_ws_dkdv_tile). Returns the program's step
    count past this item."""
    start_n, h_kv, b = _bwd_item(item, n_n, H_KV, CAUSAL=CAUSAL, FOLD=FOLD, BLOCK_N=BLOCK_N)
    lo, hi, inner_lo, inner_hi = _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=DOCS,
                                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return _ws_dkdv_tile(start_n, h_kv, b, lo, gl.cdiv(hi - lo, BLOCK_M), inner_lo, inner_hi, None, T, n, it, dq_desc,
                         q_smem, do_smem, lse_smem, delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars,
                         ds_bars, done_bars, DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                         stride_dvh, stride_dvt, H, T, qk_scale, seed, threshold, grad_scale, None, W, HEAD_DIM,
                         CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, False)


@gluon.jit
def _ws_dkdv_tile(start_n, h_kv, b, lo, per_head, inner_lo, inner_hi, key_lo, key_hi, n, it, dq_desc, q_smem, do_smem,
                  lse_smem, delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars, done_bars, DK,
                  DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, H, T,
                  qk_scale, seed, threshold, grad_scale, io, W: gl.constexpr, HEAD_DIM: gl.constexpr,
                  CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, IN_ORDER: gl.constexpr):
    """Warpgroup W's part of the program's n-th key tile, from key start_n of (batch b, key-value head h_kv): its
    GROUP x per_head steps from query row lo (_ws_item; key_lo given: over its keys in [key_lo, key_hi) only), then it
    frees K and V for the producer's next tile before storing the dK and dV of those keys. Returns the program's step
    count past this tile."""
    KEYS: gl.constexpr = BLOCK_N // 2
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    bh0 = b * H + h_kv * GROUP
    dk, dv = _ws_item(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, q_bars,
                      ds_bars, done_bars, Q_START, Q_END, b, bh0, bh0, n & 1, it, T, qk_scale, seed, threshold,
                      grad_scale, start_n, lo, per_head, inner_lo, inner_hi, key_lo, key_hi, DK, io, W, HEAD_DIM,
                      CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, 0, IN_ORDER)  # no trace (DK: a placeholder)
    it += gl.maximum(GROUP * per_head, 0)  # the steps the producer loaded for this tile
    _cta_barrier()  # every warp of this warpgroup is done reading K and V
    mbarrier.arrive(kv_free, count=1)
    _store_dkdv(DK, DV, dk, dv, b, h_kv, start_n + W * KEYS, key_lo, key_hi, stride_dkb, stride_dkh, stride_dkt,
                stride_dvb, stride_dvh, stride_dvt, grad_scale, threshold, KEYS=KEYS, HEAD_DIM=HEAD_DIM,
                kv_layout=kv_layout, DROPOUT=DROPOUT)
    return it


@gluon.jit
def _persistent_consumer_setup(k_smem, v_smem, SEED, sm_scale, threshold, HEAD_DIM: gl.constexpr,
                               BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr):
    """A persistent backward consumer's (K, V as 2-D tiles, dropout seed, scale of dQ and dK)."""
    dtype: gl.constexpr = k_smem.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_2d = _view(k_smem, dtype, [BLOCK_N, HEAD_DIM], tile_layout)
    v_2d = _view(v_smem, dtype, [BLOCK_N, HEAD_DIM], tile_layout)
    seed = gl.load(SEED) if DROPOUT else 0
    grad_scale = sm_scale * 256.0 / (256 - threshold) if DROPOUT else sm_scale  # dropout: dQ, dK take 1 / (1 - p)
    return k_2d, v_2d, seed, grad_scale


@gluon.jit
def _ws_persistent_consumer(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar,
                            kv_free, q_bars, ds_bars, done_bars, item_smem, item_bar, QUEUE, DK, DV, Q_START, Q_END,
                            SEED, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, pid,
                            n_programs, n_items, n_n, H, H_KV, T, qk_scale, sm_scale, threshold, W: gl.constexpr,
                            HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr, FOLD: gl.constexpr,
                            QUEUED: gl.constexpr):
    """Warpgroup W: _ws_dkdv_item for each item of this program, dealt (_item_at) or, QUEUED, as the producer
    publishes them."""
    k_2d, v_2d, seed, grad_scale = _persistent_consumer_setup(k_smem, v_smem, SEED, sm_scale, threshold, HEAD_DIM,
                                                              BLOCK_N, DROPOUT)
    it = 0
    if QUEUED:
        n = 0
        item = _read_item(item_smem, item_bar, n)
        while item < n_items:
            it = _ws_dkdv_item(item, n, it, dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_2d, v_2d, ds_smem,
                               dq_smem, kv_bar, kv_free, q_bars, ds_bars, done_bars, DK, DV, Q_START, Q_END,
                               stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, n_n, H, H_KV,
                               T, qk_scale, seed, threshold, grad_scale, W, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M,
                               BLOCK_N, DROPOUT, FOLD)
            n += 1
            item = _read_item(item_smem, item_bar, n)
    else:
        for n in range(_item_count(pid, n_programs, n_items, FOLD=FOLD)):
            it = _ws_dkdv_item(_item_at(n, pid, n_programs, FOLD=FOLD), n, it, dq_desc, q_smem, do_smem, lse_smem,
                               delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars, done_bars,
                               DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                               stride_dvt, n_n, H, H_KV, T, qk_scale, seed, threshold, grad_scale, W, HEAD_DIM,
                               CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, FOLD)
    tma.store_wait(0)


@gluon.jit
def _bwd_descriptors(Q, K, V, DO, LSE, DELTA, DQ_ACC, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
                     stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, B, H, H_KV, T,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The persistent backward's TMA descriptors of Q, dO, K, V (tiles of one (batch, head)), LSE and Δ (rows of one
    batch x head), and of the fp32 dQ sums (B * H, T, HEAD_DIM), which the copy engine adds column halves of BLOCK_M
    rows to: one per tensor serves every item."""
    dtype: gl.constexpr = Q.dtype.element_ty
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_DIM], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    q_desc = tma.make_tensor_descriptor(Q, shape=[B, H, T, HEAD_DIM], strides=[stride_qb, stride_qh, stride_qt, 1],
                                        block_shape=[1, 1, BLOCK_M, HEAD_DIM], layout=tile_layout)
    do_desc = tma.make_tensor_descriptor(DO, shape=[B, H, T, HEAD_DIM],
                                         strides=[stride_dob, stride_doh, stride_dot, 1],
                                         block_shape=[1, 1, BLOCK_M, HEAD_DIM], layout=tile_layout)
    k_desc = tma.make_tensor_descriptor(K, shape=[B, H_KV, T, HEAD_DIM], strides=[stride_kb, stride_kh, stride_kt, 1],
                                        block_shape=[1, 1, BLOCK_N, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V, shape=[B, H_KV, T, HEAD_DIM], strides=[stride_vb, stride_vh, stride_vt, 1],
                                        block_shape=[1, 1, BLOCK_N, HEAD_DIM], layout=kv_layout)
    lse_desc = tma.make_tensor_descriptor(LSE, shape=[B * H, T], strides=[T, 1], block_shape=[1, BLOCK_M],
                                          layout=row_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA, shape=[B * H, T], strides=[T, 1], block_shape=[1, BLOCK_M],
                                            layout=row_layout)
    HALF: gl.constexpr = HEAD_DIM // 2
    dq_desc = tma.make_tensor_descriptor(DQ_ACC, shape=[B * H, T, HEAD_DIM], strides=[T * HEAD_DIM, HEAD_DIM, 1],
                                         block_shape=[1, BLOCK_M, HALF],
                                         layout=gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, HALF], gl.float32))
    return q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc


@gluon.jit
def _bwd_tiles(q_desc, k_desc, lse_desc, dq_desc, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """The persistent backward's shared memory: K and V of one key tile, two slots of Q, dO, LSE and Δ, two dSᵀ
    tiles (the consumers' exchange), and one fp32 dQ stage per consumer (what the copy engine adds from)."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M], lse_desc.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    return k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem


@gluon.jit
def _bwd_barriers():
    """The persistent backward's mbarriers, initialised: a key tile's K and V have landed (kv_bar); both consumers are
    done with them (kv_free); per slot, its tiles have landed (q_bars), both dSᵀ halves are stored (ds_bars), both
    consumers are done with it (done_bars)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_free, count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(ds_bars.index(i), count=2)
        mbarrier.init(done_bars.index(i), count=2)
    return kv_bar, kv_free, q_bars, ds_bars, done_bars


@gluon.jit
def _bwd_ws_persistent_kernel(Q, K, V, DO, DQ_ACC, DK, DV, LSE, DELTA, Q_START, Q_END, SEED, QUEUE,
                              stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                              stride_vt, stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt,
                              stride_dvb, stride_dvh, stride_dvt, B, H, H_KV, T, qk_scale, sm_scale, threshold,
                              HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, DOCS: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr,
                              FOLD: gl.constexpr, QUEUED: gl.constexpr, num_warps: gl.constexpr):
    """_bwd_ws_kernel's gradients with P programs (one per multiprocessor), each walking many (key tile, key-value
    head, batch) items, so that one item's dK and dV stores overlap the next item's first loads: program p's share
    dealt in advance (_item_at; with FOLD in folded pairs), or, QUEUED, items taken in _bwd_item's order from a work
    queue, the int32 counter QUEUE (zero at launch), by whichever program is free. One descriptor per tensor serves
    every item."""
    n_n = gl.cdiv(T, BLOCK_N)
    n_items = n_n * H_KV * B
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc = _bwd_descriptors(
        Q, K, V, DO, LSE, DELTA, DQ_ACC, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb,
        stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, B, H, H_KV, T, HEAD_DIM, BLOCK_M, BLOCK_N)
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = _bwd_tiles(
        q_desc, k_desc, lse_desc, dq_desc, HEAD_DIM, BLOCK_M, BLOCK_N)
    kv_bar, kv_free, q_bars, ds_bars, done_bars = _bwd_barriers()
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # QUEUED: next item
    item_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # QUEUED: its number is in
    mbarrier.init(item_bar, count=1)

    if QUEUED:  # the same consumers; a producer that takes items from the queue and hands them on
        gl.warp_specialize([
            (_ws_queue_producer, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem,
                                  delta_smem, k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars, item_smem, item_bar,
                                  QUEUE, Q_START, Q_END, n_items, n_n, H, H_KV, T, CAUSAL, GROUP, DOCS, BLOCK_M,
                                  BLOCK_N, FOLD)),
            (_ws_persistent_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                       kv_bar, kv_free, q_bars, ds_bars, done_bars, item_smem, item_bar, QUEUE, DK, DV,
                                       Q_START, Q_END, SEED, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                       stride_dvt, pid, n_programs, n_items, n_n, H, H_KV, T, qk_scale, sm_scale,
                                       threshold, 0, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, FOLD,
                                       QUEUED)),
            (_ws_persistent_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                       kv_bar, kv_free, q_bars, ds_bars, done_bars, item_smem, item_bar, QUEUE, DK, DV,
                                       Q_START, Q_END, SEED, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                       stride_dvt, pid, n_programs, n_items, n_n, H, H_KV, T, qk_scale, sm_scale,
                                       threshold, 1, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, FOLD,
                                       QUEUED)),
        ], [4, 4], [240, 240])
    else:
        gl.warp_specialize([
            (_ws_persistent_producer, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem,
                                       lse_smem, delta_smem, k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars,
                                       Q_START, Q_END, pid, n_programs, n_items, n_n, H, H_KV, T, CAUSAL, GROUP, DOCS,
                                       BLOCK_M, BLOCK_N, FOLD)),
            (_ws_persistent_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                       kv_bar, kv_free, q_bars, ds_bars, done_bars, item_smem, item_bar, QUEUE, DK, DV,
                                       Q_START, Q_END, SEED, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                       stride_dvt, pid, n_programs, n_items, n_n, H, H_KV, T, qk_scale, sm_scale,
                                       threshold, 0, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, FOLD,
                                       QUEUED)),
            (_ws_persistent_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                       kv_bar, kv_free, q_bars, ds_bars, done_bars, item_smem, item_bar, QUEUE, DK, DV,
                                       Q_START, Q_END, SEED, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                       stride_dvt, pid, n_programs, n_items, n_n, H, H_KV, T, qk_scale, sm_scale,
                                       threshold, 1, HEAD_DIM, CAUSAL, GROUP, DOCS, BLOCK_M, BLOCK_N, DROPOUT, FOLD,
                                       QUEUED)),
        ], [4, 4], [240, 240])


# ----------------------------------------------------------------------------------------------------------------------
# The by-example backward: each program walks whole examples of packed rows, their key tiles in order
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _example_rounds(pid, SEGMENTS, H_KV, n_programs):
    """How many items program pid of the by-example backward is dealt: one per round of n_programs (_example), the
    last round's if it reaches that far."""
    n_items = gl.load(SEGMENTS) * H_KV
    full = n_items // n_programs
    slot = gl.where(full % 2 == 0, pid, n_programs - 1 - pid)  # pid's place in the last round
    return full + (slot < n_items % n_programs).to(gl.int32)


@gluon.jit
def _example(r, pid, SEGMENTS, H_KV, T, BT, n_programs, BLOCK_N: gl.constexpr):
    """(batch, first row, end row, key-value head, first and end key of its key tiles, whether it is the whole
    example) of program pid's item of round r of the by-example backward: the items of SEGMENTS
    (kernels/launch.py: _examples), the most work first, each once per key-value head, dealt one per program per
    round, forwards in even rounds and backwards in odd ones (the program that took a round's largest item takes the
    next round's smallest). An item is a whole example or one key tile of a long one."""
    item = r * n_programs + gl.where(r % 2 == 0, pid, n_programs - 1 - pid)
    s = item // H_KV
    flat = gl.load(SEGMENTS + 1 + s)  # b * T + first row
    seg_start = flat % T
    seg_end = gl.load(SEGMENTS + 1 + BT + s)
    tile = gl.load(SEGMENTS + 1 + 2 * BT + s)  # -1: the whole example
    whole = tile < 0
    first_n = gl.where(whole, seg_start // BLOCK_N * BLOCK_N, tile)
    return flat // T, seg_start, seg_end, item % H_KV, first_n, gl.where(whole, seg_end, tile + 1), whole


@gluon.jit
def _example_queries(b, start_n, seg_start, seg_end, T, Q_START, Q_END, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr):
    """_bwd_query_range of the key tile from start_n cut to the example [seg_start, seg_end) (the tile may hold keys
    of its neighbours): (lo, steps per query head, inner_lo, inner_hi)."""
    lo, hi, inner_lo, inner_hi = _bwd_query_range(b, start_n, T, Q_START, Q_END, CAUSAL=CAUSAL, DOCS=True,
                                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    lo = gl.maximum(lo, seg_start // BLOCK_M * BLOCK_M)
    return lo, gl.cdiv(gl.minimum(hi, seg_end) - lo, BLOCK_M), inner_lo, inner_hi


@gluon.jit
def _ws_example_tile(start_n, b, h_kv, seg_start, seg_end, n, it, dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_2d,
                     v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars, done_bars, DK, DV, Q_START, Q_END,
                     stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, H, T, qk_scale, seed,
                     threshold, grad_scale, io, W: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                     GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr,
                     IN_ORDER: gl.constexpr):
    """_ws_dkdv_tile of the key tile from start_n for the rows and keys of the example [seg_start, seg_end) only."""
    lo, per_head, inner_lo, inner_hi = _example_queries(b, start_n, seg_start, seg_end, T, Q_START, Q_END, CAUSAL,
                                                        BLOCK_M, BLOCK_N)
    return _ws_dkdv_tile(start_n, h_kv, b, lo, per_head, inner_lo, inner_hi, seg_start, seg_end, n, it, dq_desc, q_smem,
                         do_smem, lse_smem, delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars,
                         done_bars, DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                         stride_dvt, H, T, qk_scale, seed, threshold, grad_scale, io, W, HEAD_DIM, CAUSAL, GROUP, True,
                         BLOCK_M, BLOCK_N, DROPOUT, IN_ORDER)


@gluon.jit
def _ws_example_producer(q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem, delta_smem,
                         k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars, SEGMENTS, Q_START, Q_END, pid,
                         n_programs, B, H, H_KV, T, CAUSAL: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr):
    """_ws_load_tile for each key tile of each item dealt to this program, in order, once both consumers are done
    with the last tile's K and V."""
    it = 0
    n = 0
    for r in range(_example_rounds(pid, SEGMENTS, H_KV, n_programs)):
        b, seg_start, seg_end, h_kv, first_n, end_n, _whole = _example(r, pid, SEGMENTS, H_KV, T, B * T,
                                                                     n_programs, BLOCK_N)
        for start_n in range(first_n, end_n, BLOCK_N):
            lo, per_head, _, _ = _example_queries(b, start_n, seg_start, seg_end, T, Q_START, Q_END, CAUSAL, BLOCK_M,
                                                  BLOCK_N)
            mbarrier.wait(kv_free, (n & 1) ^ 1)  # a fresh barrier passes the first round
            it = _ws_load_tile(start_n, h_kv, b, lo, per_head, it, q_desc, do_desc, lse_desc, delta_desc, k_desc,
                               v_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, kv_bar, q_bars,
                               done_bars, H, GROUP, BLOCK_M)
            n += 1


@gluon.jit
def _ws_example_consumer(dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem, kv_bar,
                         kv_free, q_bars, ds_bars, done_bars, DQ, DQ_ACC, DK, DV, KV_START, KV_END, Q_START, Q_END,
                         SEED, SEGMENTS, stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt,
                         stride_dvb, stride_dvh, stride_dvt, pid, n_programs, B, H, H_KV, T, qk_scale, sm_scale,
                         threshold, W: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr):
    """Warpgroup W: _ws_dkdv_tile for each key tile of each item of this program, in order, its dQ summed in
    place for a whole example (_in_order_rows) or added to the fp32 sums DQ_ACC for one key tile of a long one, and
    its dK, dV stored for the example's keys only."""
    k_2d, v_2d, seed, grad_scale = _persistent_consumer_setup(k_smem, v_smem, SEED, sm_scale, threshold, HEAD_DIM,
                                                              BLOCK_N, DROPOUT)
    it = 0
    n = 0
    for r in range(_example_rounds(pid, SEGMENTS, H_KV, n_programs)):
        b, seg_start, seg_end, h_kv, first_n, end_n, whole = _example(r, pid, SEGMENTS, H_KV, T, B * T,
                                                                    n_programs, BLOCK_N)
        if whole:  # the example's key tiles in order, its dQ rows summed in place
            h0 = h_kv * GROUP  # the item's dQ rows (of its GROUP query heads), bounds and example
            row = b.to(gl.int64) * T
            io = (DQ + b.to(gl.int64) * stride_dqb + h0.to(gl.int64) * stride_dqh,
                  DQ_ACC + (b * H + h0).to(gl.int64) * T * HEAD_DIM, KV_START + row, KV_END + row, stride_dqh,
                  stride_dqt, seg_start, seg_end)
            for start_n in range(first_n, end_n, BLOCK_N):
                it = _ws_example_tile(start_n, b, h_kv, seg_start, seg_end, n, it, dq_desc, q_smem, do_smem, lse_smem,
                                      delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars,
                                      done_bars, DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb,
                                      stride_dvh, stride_dvt, H, T, qk_scale, seed, threshold, grad_scale, io, W,
                                      HEAD_DIM, CAUSAL, GROUP, BLOCK_M, BLOCK_N, DROPOUT, True)
                n += 1
        else:  # one key tile of a long example, its dQ added to the sums by the copy engine
            it = _ws_example_tile(first_n, b, h_kv, seg_start, seg_end, n, it, dq_desc, q_smem, do_smem, lse_smem,
                                  delta_smem, k_2d, v_2d, ds_smem, dq_smem, kv_bar, kv_free, q_bars, ds_bars, done_bars,
                                  DK, DV, Q_START, Q_END, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                  stride_dvt, H, T, qk_scale, seed, threshold, grad_scale, None, W, HEAD_DIM, CAUSAL,
                                  GROUP, BLOCK_M, BLOCK_N, DROPOUT, False)
            n += 1
    tma.store_wait(0)


@gluon.jit
def _bwd_ws_example_kernel(Q, K, V, DO, DQ, DQ_ACC, DK, DV, LSE, DELTA, KV_START, KV_END, Q_START, Q_END, SEED,
                           SEGMENTS, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb,
                           stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh, stride_dqt,
                           stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, B, H, H_KV, T,
                           qk_scale, sm_scale, threshold, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                           GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DROPOUT: gl.constexpr,
                           num_warps: gl.constexpr):
    """The warp-specialised backward of packed rows by example: program p of P takes one item per round of SEGMENTS'
    items (the most work first) x key-value heads, dealt as _example says. An item is a whole example, whose key tiles
    the program walks in order: a query row's dQ then gets its key tiles' additions one after another from one
    program, the tile holding the row's first key storing its sum (fp32, DQ_ACC, not zeroed for these rows), later
    tiles adding to it from registers, and the tile holding its last key writing dQ itself in its dtype (no cast
    pass). Or, for an example too long to be one item, one key tile, whose dQ the copy engine adds to DQ_ACC (zeroed
    and cast for those rows around the kernel). Rows and keys outside the item's example are never written (the copy
    engine adds zeros to them): the tiles at its edges, shared with its neighbours, are visited by each neighbour's
    item for its own rows."""
    pid = gl.program_id(0)
    n_programs = gl.num_programs(0)
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc = _bwd_descriptors(
        Q, K, V, DO, LSE, DELTA, DQ_ACC, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb,
        stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, B, H, H_KV, T, HEAD_DIM, BLOCK_M, BLOCK_N)
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem = _bwd_tiles(
        q_desc, k_desc, lse_desc, dq_desc, HEAD_DIM, BLOCK_M, BLOCK_N)
    kv_bar, kv_free, q_bars, ds_bars, done_bars = _bwd_barriers()

    gl.warp_specialize([
        (_ws_example_producer, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_smem, do_smem, lse_smem,
                                delta_smem, k_smem, v_smem, kv_bar, kv_free, q_bars, done_bars, SEGMENTS, Q_START,
                                Q_END, pid, n_programs, B, H, H_KV, T, CAUSAL, GROUP, BLOCK_M, BLOCK_N)),
        (_ws_example_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                kv_bar, kv_free, q_bars, ds_bars, done_bars, DQ, DQ_ACC, DK, DV, KV_START, KV_END,
                                Q_START, Q_END, SEED, SEGMENTS, stride_dqb, stride_dqh, stride_dqt, stride_dkb,
                                stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, pid, n_programs, B, H,
                                H_KV, T, qk_scale, sm_scale, threshold, 0, HEAD_DIM, CAUSAL, GROUP, BLOCK_M,
                                BLOCK_N, DROPOUT)),
        (_ws_example_consumer, (dq_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, dq_smem,
                                kv_bar, kv_free, q_bars, ds_bars, done_bars, DQ, DQ_ACC, DK, DV, KV_START, KV_END,
                                Q_START, Q_END, SEED, SEGMENTS, stride_dqb, stride_dqh, stride_dqt, stride_dkb,
                                stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, pid, n_programs, B, H,
                                H_KV, T, qk_scale, sm_scale, threshold, 1, HEAD_DIM, CAUSAL, GROUP, BLOCK_M,
                                BLOCK_N, DROPOUT)),
    ], [4, 4], [240, 240])

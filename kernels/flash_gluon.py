"""FlashAttention's backward in one pass for Hopper (sm_90), written in Gluon: Triton's dialect with explicit register
layouts, shared memory, TMA copies and asynchronous wgmma. kernels/launch.py runs it at head dim 128 on Hopper
(FLASH_ATTN_GLUON; docs/kernel.md has the measurements); everywhere else the two Triton kernels of
kernels/flash_kernels.py compute the same gradients.

One program per (key tile, key-value head, batch) holds its K and V tiles in shared memory and dK, dV in registers, and
walks the query tiles of each query head that reads this key-value head (GROUP of them with grouped-query attention,
one otherwise) once, so dK and dV are summed over the group on chip. Per tile pair, with Δ = rowsum(O ∘ dO) from the
preprocess kernel:

    Sᵀ = K Qᵀ,   Pᵀ = exp2(qk_scale · Sᵀ − log2(e) · LSE),   dPᵀ = V dOᵀ,   dSᵀ = Pᵀ ∘ (dPᵀ − Δ)
    dV += Pᵀ dO,   dK += dSᵀ Q,   dQ[tile] += scale · dS K

Five matmuls where the two-kernel backward has seven (it recomputes S and dP for dQ). The dQ partial of every step is
added into an fp32 buffer by the copy engine (TMA reduce-add: no atomics in the program's own instructions); the
launcher zeroes that buffer and converts it at the end. The order of those additions varies from run to run, so dQ is
not bit-reproducible (the launcher keeps the two-kernel path under torch.use_deterministic_algorithms).

Pipelining: the Q, dO, LSE and Δ tiles of the next step arrive by TMA while this step computes its dV, dK and dQ
products (two slots). Sᵀ and dPᵀ are issued together and the exponentials run while dPᵀ is still on the tensor
cores. Pᵀ and dSᵀ feed the dV and dK products straight from registers; dSᵀ also goes to shared memory, as the A
operand of dQ = dS K. dQ is staged for the copy engine in the step's own Q and dO tiles (one column half each: those
tiles are no longer read), so a program needs about 105 KB of shared memory and 255 registers per thread, and two
programs share a multiprocessor, each running its exponentials while the other's matmuls run.
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

LOG2E = gl.constexpr(1.4426950408889634)  # log2(e)
BLOCK_M = 64  # query rows per step
BLOCK_N = 64  # keys per program
NUM_WARPS = 4  # one warpgroup

# Gluon renamed these in Triton 3.7; the kernel runs on 3.6 and later.
if hasattr(tma, "async_load"):
    _tma_load = tma.async_load
    _cta_barrier = gl.barrier
else:
    _tma_load = tma.async_copy_global_to_shared
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


# ----------------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_kernel(Q, K, V, DO, DQ_ACC, DK, DV, LSE, DELTA,
                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_dob, stride_doh, stride_dot, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                stride_dvt, H, T, qk_scale, sm_scale,
                HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
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

    q_desc = _group_slab(Q, b, h0, stride_qb, stride_qh, stride_qt, T, GROUP, HEAD_DIM, BLOCK_M)
    do_desc = _group_slab(DO, b, h0, stride_dob, stride_doh, stride_dot, T, GROUP, HEAD_DIM, BLOCK_M)
    k_desc = _slab(K, b, h_kv, stride_kb, stride_kh, stride_kt, T, HEAD_DIM, BLOCK_N)
    v_desc = _slab(V, b, h_kv, stride_vb, stride_vh, stride_vt, T, HEAD_DIM, BLOCK_N)
    lse_desc = _group_rows(LSE, bh0, T, GROUP, BLOCK_M)
    delta_desc = _group_rows(DELTA, bh0, T, GROUP, BLOCK_M)
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

    # Causal: queries before this key tile see none of its keys. Steps walk the query tiles of each head in turn.
    lo = start_n if CAUSAL else 0
    per_head = gl.cdiv(T - lo, BLOCK_M)
    n_steps = GROUP * per_head
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [start_n, 0], kv_bar, k_smem)
    _tma_load(v_desc, [start_n, 0], kv_bar, v_smem)
    _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem.index(0), do_smem.index(0), lse_smem.index(0),
               delta_smem.index(0), bars.index(0), 0, lo)

    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)  # ignored (use_acc=False): the accumulators' type
    dq_init = gl.zeros([BLOCK_M, HALF], gl.float32, dq_layout)
    mbarrier.wait(kv_bar, 0)

    for step in range(n_steps):
        g, start_m = _step_at(step, lo, per_head, GROUP, BLOCK_M)
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
        lse2 = lse_s.load(col_layout) * LOG2E
        pt = gl.exp2(st * qk_scale - lse2[None, :])  # Pᵀ
        if CAUSAL:
            if start_m < start_n + BLOCK_N:  # a diagonal tile: mask keys after the query
                queries = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
                pt = gl.where(queries[None, :] >= keys[:, None], pt, 0.0)
        dpt = warpgroup_mma_wait(0, deps=(dpt, ))
        delta = delta_s.load(col_layout)
        ds16 = (pt * (dpt - delta[None, :])).to(dtype)  # dSᵀ
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
            g_next, m_next = _step_at(step + 1, lo, per_head, GROUP, BLOCK_M)
            _load_step(q_desc, do_desc, lse_desc, delta_desc, q_smem.index(nxt), do_smem.index(nxt),
                       lse_smem.index(nxt), delta_smem.index(nxt), bars.index(nxt), g_next, m_next)

        # dQ = scale · dS K, one column half at a time, staged in this step's Q tile, then in its dO tile.
        for half in gl.static_range(2):
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(half * HALF, HALF, dim=1), dq_init,
                               use_acc=False, is_async=True)  # (BLOCK_M, HALF)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            stage = (q_smem if half == 0 else do_smem).index(slot)
            _cta_barrier()  # no warp still reads this tile
            _view(stage, gl.float32, [BLOCK_M, HALF], stage_layout).store(dq * sm_scale)
            fence_async_shared()
            _cta_barrier()
            _tma_reduce_add(dq_desc, [g, start_m, half * HALF], _view(stage, gl.float32, [1, BLOCK_M, HALF],
                                                                      dq_desc.layout))

    tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(kv_bar)

    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))[:, None]
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))[None, :]
    ok = keys < T
    dk_ptrs = DK + b.to(gl.int64) * stride_dkb + h_kv.to(gl.int64) * stride_dkh + keys * stride_dkt + dims
    dv_ptrs = DV + b.to(gl.int64) * stride_dvb + h_kv.to(gl.int64) * stride_dvh + keys * stride_dvt + dims
    gl.store(dk_ptrs, (dk * sm_scale).to(dtype), mask=ok)
    gl.store(dv_ptrs, dv.to(dtype), mask=ok)

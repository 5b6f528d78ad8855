"""Launch plumbing of the FlashAttention kernels: tuning tables and autotuning, TMA, output buffers, and launches with
little host time. `forward` and `backward` here are what the autograd layer (kernels/ops.py) calls.

Host time matters because it bounds small problems: each call signature is planned once (`_Plan`), and after its first
launches its kernels are called straight through their compiled launchers (`_launch`), skipping Triton's per-launch
argument binding.
"""

import contextlib
import functools
from collections.abc import Callable

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime.autotuner import Autotuner

from kernels import env
from kernels.flash_kernels import (
    LOG2E,
    _bwd_dkdv_kernel,
    _bwd_dq_kernel,
    _bwd_preprocess_kernel,
    _cast_rows_kernel,
    _dropout_mask_kernel,
    _fwd_kernel,
)

# Every block size divides this, so T % _MAX_BLOCK == 0 means no tile is ragged and the mask-free path is exact.
_MAX_BLOCK = 128

# ----------------------------------------------------------------------------------------------------------------------
# Autotuning candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), keyed by (head-dim class, fp32 inputs); class 64
# covers D = 16, 32, 64. BLOCK_M is always the query tile and BLOCK_N the key tile. The first entry of each list is the
# default (FLASH_ATTN_AUTOTUNE=0). fp32 operands take twice the shared memory and registers: smaller tiles.
# ----------------------------------------------------------------------------------------------------------------------
Tuning = dict[tuple[int, bool], list[tuple[int, int, int, int]]]

FWD_TUNING: Tuning = {
    (64, False): [(128, 64, 8, 4), (64, 64, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 4)],
    (128, False): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
    (256, False): [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
    (64, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (128, True): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
DQ_TUNING: Tuning = {
    (64, False): [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4), (64, 32, 4, 4)],
    (128, False): [(64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 4)],
    (256, False): [(64, 32, 8, 2), (64, 64, 8, 2)],
    (64, True): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (128, True): [(64, 32, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
DKDV_TUNING: Tuning = {  # the key tile BLOCK_N is the per-program tile, the query tile BLOCK_M is streamed
    (64, False): [(64, 64, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3), (64, 128, 4, 3), (32, 64, 4, 4)],
    (128, False): [(32, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 4), (64, 64, 4, 3)],
    (256, False): [(32, 64, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1)],
    (64, True): [(64, 64, 4, 2), (32, 64, 4, 2)],
    (128, True): [(32, 64, 4, 2), (32, 32, 4, 2)],
    (256, True): [(32, 32, 4, 1)],
}
# Interpreter: one small config, so that T = 17..257 exercises several tiles, ragged tiles and the diagonal masks.
_INTERPRET_QUERY_MAJOR = (64, 32, 4, 1)  # forward and dQ: BLOCK_M must be a multiple of BLOCK_N
_INTERPRET_KEY_MAJOR = (32, 64, 4, 1)  # dK/dV: BLOCK_N must be a multiple of BLOCK_M


def _autotune(kernel: triton.JITFunction, table: Tuning, interpret_shape: tuple[int, int, int, int]):
    """The kernel autotuned over its table's candidates for the call's head dim and dtype (in table order), keyed on
    (T, D, query heads per key-value head, causal, dropout, TMA, bounds) and the tensors' dtypes."""
    shapes = [interpret_shape] if env.INTERPRET else sorted({s for rows in table.values() for s in rows})
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in shapes]

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        q = named_args["Q"]
        wanted = table[(max(64, q.shape[-1]), q.dtype == torch.float32)]
        by_shape = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        return [by_shape[s] for s in (wanted if env.AUTOTUNE else wanted[:1])]

    return triton.autotune(configs=configs, key=["T", "HEAD_DIM", "GROUP", "CAUSAL", "DROPOUT", "USE_TMA", "DOCS"],
                           prune_configs_by={"early_config_prune": prune})(kernel)


_fwd = _autotune(_fwd_kernel, FWD_TUNING, _INTERPRET_QUERY_MAJOR)
_bwd_dq = _autotune(_bwd_dq_kernel, DQ_TUNING, _INTERPRET_QUERY_MAJOR)
_bwd_dkdv = _autotune(_bwd_dkdv_kernel, DKDV_TUNING, _INTERPRET_KEY_MAJOR)
AUTOTUNED = {"forward": _fwd, "dq": _bwd_dq, "dkdv": _bwd_dkdv}  # for reports of the configs chosen


# ----------------------------------------------------------------------------------------------------------------------
# TMA: in-kernel tensor descriptors (kernels/flash_kernels.py: _slab_desc) on Hopper
# ----------------------------------------------------------------------------------------------------------------------
def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether the kernels stream tiles of these (B, H, T, D) tensors through TMA descriptors (FLASH_ATTN_TMA; auto:
    16-bit inputs at D = 128 on Hopper). Each tensor must also fit a descriptor per (batch, head): unit stride along
    D, 16-byte aligned base and strides."""
    mode, t0 = env.tma_mode(), tensors[0]
    if mode == "auto":
        wanted = (not env.INTERPRET and t0.shape[-1] == 128 and t0.dtype != torch.float32
                  and torch.cuda.get_device_capability(t0.device)[0] == 9)
    else:
        wanted = mode == "on" and (env.INTERPRET or torch.cuda.get_device_capability(t0.device) >= (9, 0))
    return wanted and _tma_aligned(*tensors)


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """Each (B, H, T, D) tensor fits a descriptor per (batch, head): unit stride along D, 16-byte aligned base and
    strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(t.stride(i) * size % 16 for i in range(3)):
            return False
    return True


def _gluon(q: torch.Tensor, dropout: bool, auto_dims: tuple[int, ...] = (128,)) -> bool:
    """FLASH_ATTN_GLUON's answer for these inputs, before each kernel's own limits: the Gluon kernels of
    kernels/flash_gluon.py need a Hopper GPU, 16-bit inputs and, with dropout, the hashed mask
    (FLASH_ATTN_DROPOUT_RNG=hash: Philox's bytes would have to be exchanged between threads); bounds, for packed rows
    and windows, are fine. auto takes them at the head dims `auto_dims`, 1 at D = 64 and 128."""
    mode = env.gluon_mode()
    if mode == "off" or env.INTERPRET or not q.is_cuda or q.dtype == torch.float32:
        return False
    if dropout and env.dropout_rng() != env.DROPOUT_GENERATORS["hash"]:
        return False
    return (q.shape[-1] in (auto_dims if mode == "auto" else (64, 128))
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def use_gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, dropout: bool) -> bool:
    """Whether the forward runs as kernels/flash_gluon.py's warp-specialised kernel instead of the Triton forward
    (FLASH_ATTN_GLUON; auto: 16-bit inputs at D = 128 on Hopper); grouped-query heads are fine, every tensor must fit
    a TMA descriptor."""
    return _gluon(q, dropout) and _tma_aligned(q, k, v, o)


def use_persistent_forward() -> bool:
    """Whether the Gluon forward runs one program per multiprocessor, each walking many tiles of query rows (so one
    tile's output store overlaps the next tile's loads), instead of one program per tile (FLASH_ATTN_PERSISTENT; auto:
    yes, as it measured faster, its tiles dealt in folded pairs: FLASH_ATTN_PERSISTENT_ORDER)."""
    return env.persistent_mode() != "off"



@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for CPU tensors under the interpreter); looked up once."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def use_ws_backward() -> bool:
    """Whether the Gluon backward runs warp-specialised over 128 keys per program (kernels/flash_gluon.py:
    _bwd_ws_kernel) instead of one warpgroup over 64 keys (FLASH_ATTN_WS_BACKWARD; auto: yes, at D = 128 and 64, where
    it measured faster on every dense row)."""
    return env.ws_backward_mode() != "off"


def use_persistent_backward(docs: bool) -> bool:
    """Whether the warp-specialised Gluon backward runs one program per multiprocessor, each walking many key tiles
    (so one tile's dK/dV stores overlap the next tile's loads), instead of one program per key tile
    (FLASH_ATTN_PERSISTENT_BACKWARD; auto: without bounds, where it measured faster; with packed rows, whose key tiles
    differ in work in no order that shares dealt in advance can follow, it measured slower; queue: everywhere, the
    programs taking key tiles from a work queue)."""
    mode = env.persistent_backward_mode()
    return use_ws_backward() and (mode in ("on", "queue") or (mode == "auto" and not docs))


# auto runs the one-pass backward at D = 64 for plain causal attention (no bounds, no dropout) over this many keys or
# more, after the Triton forward: there it measured faster than the two Triton kernels, on shorter rows not.
D64_ONE_PASS_MIN_T = 2048


def use_one_pass_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, dropout: bool,
                          causal: bool = True, docs: bool = False) -> bool:
    """Whether the backward runs as kernels/flash_gluon.py's one kernel instead of the dQ and dK/dV kernels
    (FLASH_ATTN_GLUON; auto: 16-bit inputs on Hopper at D = 128, and at D = 64 for causal attention without bounds or
    dropout from D64_ONE_PASS_MIN_T keys on, or with bounds under FLASH_ATTN_BY_EXAMPLE=1; not under
    torch.use_deterministic_algorithms). It also needs T a multiple of 4 and every tensor fit for a TMA descriptor;
    grouped-query heads are fine."""
    if env.gluon_mode() == "auto" and torch.are_deterministic_algorithms_enabled():
        return False
    long_plain = causal and not docs and not dropout and q.shape[2] >= D64_ONE_PASS_MIN_T
    d64 = long_plain or (docs and use_ws_backward() and env.by_example())
    return (_gluon(q, dropout, auto_dims=(64, 128) if d64 else (128,)) and q.shape[2] % 4 == 0
            and _tma_aligned(q, k, v, do))


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for in-kernel TMA descriptors; Triton asks for it at each launch of a TMA kernel."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: launches run under its guard


def _set_tma_allocator() -> None:
    """Triton keeps its allocator per thread (a ContextVar), and autograd runs the backward in a thread of its own:
    every launching thread sets it."""
    triton.set_allocator(_tma_scratch)


# ----------------------------------------------------------------------------------------------------------------------
# Output buffers
# ----------------------------------------------------------------------------------------------------------------------
Alloc = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def empty_like_layout(t: torch.Tensor, dtype: torch.dtype, allocate: Alloc | None = None) -> torch.Tensor:
    """A (B, H, T, D) buffer of t's shape in `_memory_order(t)`, from `allocate` (default: `alloc`)."""
    allocate = allocate or alloc
    if t.is_contiguous():  # the common case, without the permutes (host time is what bounds small problems)
        return allocate(tuple(t.shape), dtype, t.device)
    order = _memory_order(t)
    buf = allocate(tuple(t.shape[i] for i in order), dtype, t.device)
    return buf.permute([order.index(i) for i in range(4)])


# ----------------------------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------------------------
def _device_guard(t: torch.Tensor):
    """Triton launches on the current CUDA device: switch to t's device only when it differs."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: only matters for fp32, where it follows torch's matmul tf32 switch."""
    if dtype == torch.float32 and not env.INTERPRET and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _constexprs(q: torch.Tensor, k: torch.Tensor, causal: bool, dropout: bool, tma: bool, docs: bool) -> dict:
    T, D = q.shape[2], q.shape[3]
    return dict(HEAD_DIM=D, GROUP=q.shape[1] // k.shape[1], CAUSAL=causal, RAGGED_T=T % _MAX_BLOCK != 0,
                PRECISION=_precision(q.dtype), USE_TMA=tma, DROPOUT=env.dropout_rng() if dropout else 0, DOCS=docs,
                UPCAST=env.INTERPRET and q.dtype != torch.float32)


def dropout_threshold(dropout_p: float) -> int:
    """The kernels keep an element when its 8-bit uniform is >= this: p rounded to a multiple of 1/256 (as
    FlashAttention-2 does), at most 255/256."""
    return min(round(dropout_p * 256), 255)


def dropout_rate(dropout_p: float) -> float:
    """The dropout probability the kernels apply for dropout_p (its threshold / 256)."""
    return dropout_threshold(dropout_p) / 256


# ----------------------------------------------------------------------------------------------------------------------
# Launch plans: what a call signature decides is decided once
# ----------------------------------------------------------------------------------------------------------------------
def _aligned(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """The 16-byte alignment of each tensor's data, which Triton specializes pointer arguments on. Buffers allocated
    here are always aligned; inputs and the packed gradient's slices may not be."""
    return tuple([t.data_ptr() % 16 == 0 for t in tensors])


class _Plan:
    """The decisions of one call signature, made at its first call. A signature is everything a compiled launch
    depends on: shapes, strides (integers are kept whole, finer than Triton's specialization on 1 and multiples of 16,
    and a handful of values per model), dtype, device, pointer alignment (`_aligned`), flags and the environment's
    modes. The decisions: the kernel path and the constexprs, and for each launch site the autotuned config, then the
    compiled kernel with its grid and constexpr values. Later calls of the signature find their plan with one dict
    lookup, allocate their outputs and call each compiled kernel's launcher directly."""

    def __init__(self, gluon: bool = False, tma: bool = False, constexprs: dict | None = None):
        self.gluon, self.tma, self.constexprs = gluon, tma, constexprs or {}
        self.configs: dict[str, triton.Config] = {}  # site -> the autotuner's choice
        self.compiled: dict[str, tuple[CompiledKernel, tuple, list]] = {}  # site -> (kernel, grid, constexpr values)


_PLANS: dict[tuple, _Plan] = {}


def _plan(key: tuple, decide: Callable[[], _Plan]) -> _Plan:
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = decide()
    return plan


def _direct() -> bool:
    """Whether launches may skip Triton's launch path: not when turned off, nor while a profiler hooks launches."""
    hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
    return env.DIRECT_LAUNCH and not any(getattr(h, "calls", h) for h in hooks)


def _launch(plan: _Plan, site: str, kernel, grid: Callable[[dict], tuple], *args, **constexprs) -> None:
    """Launch `kernel` (autotuned or plain) at `site` of `plan` with a few microseconds of host time.

    An autotuned kernel's first launch goes through the autotuner, which chooses its config. The next launch goes
    through the JIT, which returns the compiled kernel (not under the interpreter): the site keeps it with its grid
    and constexpr values, and later launches call its launcher directly, skipping `JITFunction.run`'s per-launch
    binding and cache-key work.
    """
    compiled = plan.compiled.get(site)
    if compiled is not None and _direct():
        kernel, xyz, values = compiled
        stream = triton.runtime.driver.active.get_current_stream(args[0].device.index)
        kernel.run(*xyz, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *values)
        return
    if isinstance(kernel, Autotuner):
        config = plan.configs.get(site)
        if config is None:
            kernel[grid](*args, **constexprs)  # autotunes (once per tuning key) and launches
            plan.configs[site] = kernel.best_config
            return
        kernel, constexprs = kernel.fn, {**constexprs, **config.all_kwargs()}
    compiled = kernel[grid](*args, **constexprs)  # compiles (or finds) and launches
    if _direct() and isinstance(compiled, CompiledKernel) and hasattr(compiled, "packed_metadata"):
        plan.compiled[site] = compiled, grid(constexprs), [constexprs[name] for name in kernel.arg_names[len(args):]]


# With FLASH_ATTN_TRACE_ITEMS=N, the last persistent Gluon forward's phase stamps: int64 (programs, 3, N, 8), partitions
# 0 and 1 the consumer warpgroups, 2 the producer (kernels/flash_gluon.py: _persistent_consumer, _persistent_producer)
last_forward_trace: torch.Tensor | None = None
# and the last warp-specialised backward's (one program per key tile): int64 (key tiles, KV heads, B, 2, N, 8), each
# consumer warpgroup's first N steps (kernels/flash_gluon.py: _ws_step)
last_backward_trace: torch.Tensor | None = None

# Bounded attention (packed rows, sliding windows): int32 (B, T) (KV_START, KV_END, Q_START, Q_END), query i sees keys
# [KV_START[i], KV_END[i]) and key j is seen by queries [Q_START[j], Q_END[j]) (kernels/flash_kernels.py; ops._bounds)
Bounds = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout_p: float = 0.0,
            seed: torch.Tensor | None = None, bounds: Bounds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O in q's layout where dense, fp32 LSE (B, H, T)) for q (B, H, T, D) and k, v (B, H / group, T, D). With
    dropout_p > 0, `seed` (a 1-element int64 tensor on q's device) seeds the keep-mask; the backward takes the same.
    `bounds`: bounded attention (packed rows, sliding windows), each query attends only to the keys within them."""
    B, H, T, D = q.shape
    o = empty_like_layout(q, q.dtype)
    lse = alloc((B, H, T), torch.float32, q.device)
    if q.numel() == 0:  # nothing to launch (a zero-size grid is an error)
        return o, lse
    dropout, docs = dropout_p > 0.0, bounds is not None
    seed = seed if dropout else lse  # a placeholder without dropout, never read; so are the bounds without DOCS
    kv_start, kv_end, _, _ = bounds if docs else (lse,) * 4

    def decide() -> _Plan:
        if use_gluon_forward(q, k, v, o, dropout):
            return _Plan(gluon=True)
        tma = use_tma(q, k, v, o)
        return _Plan(tma=tma, constexprs=_constexprs(q, k, causal, dropout, tma, docs))

    strides = q.stride(), k.stride(), v.stride(), o.stride()
    plan = _plan(("fwd", q.shape, k.shape[1], q.dtype, q.device, strides, causal, dropout_p, docs,
                  _aligned(q, k, v, seed, kv_start, kv_end), env.tma_mode(), env.gluon_mode(), env.persistent_mode(),
                  env.persistent_fold(), env.pingpong(), env.o_in_k(), env.rotate(), env.trace_items(),
                  env.dropout_rng() if dropout else 0, _precision(q.dtype)), decide)
    if plan.gluon or plan.tma:
        _set_tma_allocator()
    with _device_guard(q):
        if plan.gluon:
            _gluon_forward(plan, q, k, v, o, lse, causal, scale, kv_start, kv_end, docs, seed, dropout_p)
            return o, lse
        _launch(plan, "fwd", _fwd, lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B), q, k, v, o, lse, seed,
                kv_start, kv_end, *strides[0], *strides[1], *strides[2], *strides[3], H, T, scale * LOG2E.value,
                dropout_threshold(dropout_p), **plan.constexprs)
    return o, lse


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
             causal: bool, scale: float, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
             grads: tuple[torch.Tensor, ...] | None = None,
             bounds: Bounds | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), written into `grads` when given (the packed entry point's views of one dqkv buffer); dropout_p,
    seed and bounds as given to the forward."""
    B, H, T, D = q.shape
    delta = alloc((B, H, T), torch.float32, q.device)
    dq, dk, dv = grads or tuple(empty_like_layout(t, t.dtype) for t in (q, k, v))
    if q.numel() == 0:
        return dq, dk, dv
    dropout, docs = dropout_p > 0.0, bounds is not None
    seed = seed if dropout else lse  # a placeholder without dropout, never read; so are the bounds without DOCS
    kv_start, kv_end, q_start, q_end = bounds if docs else (lse,) * 4

    def decide() -> _Plan:
        if use_one_pass_backward(q, k, v, do, dropout, causal, docs):
            return _Plan(gluon=True)
        tma = use_tma(q, k, v, do)  # the tensors the backward streams: key-side tiles in dQ, query-side in dK/dV
        return _Plan(tma=tma, constexprs=_constexprs(q, k, causal, dropout, tma, docs))

    qs, ks, vs, os_, dos, dqs, dks, dvs = strides = tuple(t.stride() for t in (q, k, v, o, do, dq, dk, dv))
    plan = _plan(("bwd", q.shape, k.shape[1], q.dtype, q.device, strides, causal, dropout_p, docs,
                  _aligned(q, k, v, o, do, dq, dk, dv, seed, kv_start, kv_end, q_start, q_end), env.tma_mode(),
                  env.gluon_mode(), env.ws_backward_mode(), env.persistent_backward_mode(), env.persistent_fold(),
                  env.dropout_rng() if dropout else 0, _precision(q.dtype), env.trace_items(), env.by_example(),
                  torch.are_deterministic_algorithms_enabled()), decide)
    if plan.gluon or plan.tma:
        _set_tma_allocator()
    with _device_guard(q):
        if plan.gluon:
            _one_pass_backward(plan, do, q, k, v, o, lse, delta, causal, scale, dq, dk, dv, bounds if docs else None,
                               seed, dropout_p)
            return dq, dk, dv
        threshold = dropout_threshold(dropout_p)
        _launch(plan, "dq", _bwd_dq, lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B), q, k, v, o, do, dq, lse,
                delta, seed, kv_start, kv_end, *qs, *ks, *vs, *os_, *dos, *dqs, H, T, scale * LOG2E.value, scale,
                threshold, **plan.constexprs)
        _launch(plan, "dkdv", _bwd_dkdv, lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), k.shape[1], B),  # per KV head
                q, k, v, do, dk, dv, lse, delta, seed, q_start, q_end, *qs, *ks, *vs, *dos, *dks, *dvs, H, T,
                scale * LOG2E.value, scale, threshold, **plan.constexprs)
    return dq, dk, dv


def _gluon_forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   causal: bool, scale: float, kv_start: torch.Tensor, kv_end: torch.Tensor, docs: bool,
                   seed: torch.Tensor, dropout_p: float) -> None:
    """kernels/flash_gluon.py's forward into o and lse; with docs, query i sees keys [kv_start[i], kv_end[i]); with
    dropout_p > 0, the hashed keep-mask of `seed`."""
    from kernels import flash_gluon as fg  # Gluon is imported only where it runs

    B, H, T, D = q.shape
    group, dropout, threshold = H // k.shape[1], int(dropout_p > 0) * env.dropout_rng(), dropout_threshold(dropout_p)
    if use_persistent_forward():
        global last_forward_trace
        fold, items = env.persistent_fold(), env.trace_items()  # items dealt two at a time; phases traced
        programs = min(triton.cdiv(triton.cdiv(T, fg.FWD_BLOCK_M) * H * B, 1 + fold), sm_count(q.device))
        trace = torch.zeros((programs, 3, items, 8), dtype=torch.int64, device=q.device) if items else lse
        _launch(plan, "fwd", fg._fwd_persistent_kernel, lambda meta: (programs, 1, 1),
                q, k, v, o, lse, kv_start, kv_end, seed, trace, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *o.stride()[:3], B, H, k.shape[1], T, scale * LOG2E.value, threshold, HEAD_DIM=D, CAUSAL=causal,
                GROUP=group, DOCS=docs, BLOCK_N=fg.FWD_BLOCK_N, STAGES=fg.FWD_STAGES, DROPOUT=dropout,
                FOLD=fold, PINGPONG=env.pingpong(), O_IN_K=env.o_in_k(), ROTATE=env.rotate() and not items,
                TRACE_ITEMS=items, num_warps=fg.FWD_NUM_WARPS, maxnreg=fg.WS_MAXNREG)
        if items:
            last_forward_trace = trace
        return
    _launch(plan, "fwd", fg._fwd_kernel, lambda meta: (triton.cdiv(T, fg.FWD_BLOCK_M), H, B),
            q, k, v, o, lse, kv_start, kv_end, seed, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], H, T, scale * LOG2E.value, threshold, HEAD_DIM=D, CAUSAL=causal, GROUP=group, DOCS=docs,
            BLOCK_N=fg.FWD_BLOCK_N, STAGES=fg.FWD_STAGES, DROPOUT=dropout, num_warps=fg.FWD_NUM_WARPS,
            maxnreg=fg.WS_MAXNREG)


def _one_pass_backward(plan: _Plan, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal: bool, scale: float,
                       dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, bounds: Bounds | None,
                       seed: torch.Tensor, dropout_p: float) -> None:
    """kernels/flash_gluon.py's backward: delta and a zeroed fp32 dQ accumulator, the kernel, dQ cast into dq; with
    bounds, key j is seen by queries [q_start[j], q_end[j]) (and, FLASH_ATTN_BY_EXAMPLE, the kernel walks whole
    examples and writes their dq itself: the accumulator is zeroed and cast only for the rows of examples longer than
    FLASH_ATTN_BY_EXAMPLE_MAX); with dropout_p > 0, the hashed keep-mask of `seed`."""
    from kernels import flash_gluon as fg  # Gluon is imported only where it runs

    B, H, T, D = q.shape
    docs = bounds is not None
    kv_start, kv_end, q_start, q_end = bounds if docs else (lse,) * 4  # placeholders without bounds, never read
    by_example = docs and use_ws_backward() and env.by_example()
    acc = alloc((B * H * T * D + 4,), torch.float32, q.device)  # dQ's sums, then the persistent backward's queue
    dq_acc, queue = acc[:-4].view(B, H, T, D), acc[-4:].view(torch.int32)
    if by_example:  # the sums of long examples' rows only are zeroed (and cast below)
        examples, long_rows = _examples(kv_start, kv_end, env.by_example_max(), fg.WS_BLOCK_N)
    _launch(plan, "preprocess", _bwd_preprocess_kernel, lambda meta: (triton.cdiv(T, 64), H, B),
            o, do, delta, dq_acc, long_rows if by_example else delta, *o.stride(), *do.stride(), H, T, HEAD_DIM=D,
            BLOCK=64, ZERO=2 if by_example else 1)
    tensors = (q, k, v, do, dq_acc, dk, dv, lse, delta, q_start, q_end, seed, *q.stride()[:3], *k.stride()[:3],
               *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3])
    constexprs = dict(HEAD_DIM=D, CAUSAL=causal, GROUP=H // k.shape[1], DOCS=docs, BLOCK_M=fg.BLOCK_M,
                      DROPOUT=int(dropout_p > 0) * env.dropout_rng(), num_warps=fg.NUM_WARPS)
    scalars = (scale * LOG2E.value, scale, dropout_threshold(dropout_p))
    grad_scale = scale / (1 - dropout_rate(dropout_p))  # the kernels add dS K into the sums; dQ = grad_scale · sums
    if by_example:
        constexprs.pop("DOCS")
        _launch(plan, "bwd", fg._bwd_ws_example_kernel, lambda meta: (sm_count(q.device), 1, 1),
                q, k, v, do, dq, dq_acc, dk, dv, lse, delta, kv_start, kv_end, q_start, q_end, seed, examples,
                *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
                *dk.stride()[:3], *dv.stride()[:3], B, H, k.shape[1], T, *scalars, BLOCK_N=fg.WS_BLOCK_N,
                maxnreg=fg.WS_MAXNREG, **constexprs)
        _launch(plan, "cast", _cast_rows_kernel, lambda meta: (triton.cdiv(T, 64), H, B),
                dq_acc, dq, long_rows, *dq.stride(), H, T, grad_scale, HEAD_DIM=D, BLOCK=64)
        return
    if use_persistent_backward(docs):
        queued = env.persistent_backward_mode() == "queue"
        fold = env.persistent_fold() and not queued  # dealt two at a time; a queue hands out the heaviest first
        items = triton.cdiv(T, fg.WS_BLOCK_N) * k.shape[1] * B
        programs = min(triton.cdiv(items, 1 + fold), sm_count(q.device))
        _launch(plan, "bwd", fg._bwd_ws_persistent_kernel, lambda meta: (programs, 1, 1), *tensors[:12], queue,
                *tensors[12:], B, H, k.shape[1], T, *scalars, BLOCK_N=fg.WS_BLOCK_N, FOLD=fold, QUEUED=queued,
                maxnreg=fg.WS_MAXNREG, **constexprs)
    elif use_ws_backward():
        global last_backward_trace
        grid, steps = (triton.cdiv(T, fg.WS_BLOCK_N), k.shape[1], B), env.trace_items()  # per KV head
        trace = torch.zeros((*grid, 2, steps, 8), dtype=torch.int64, device=q.device) if steps else lse
        _launch(plan, "bwd", fg._bwd_ws_kernel, lambda meta: grid, *tensors[:12], trace, *tensors[12:], H, T,
                *scalars, BLOCK_N=fg.WS_BLOCK_N, TRACE_STEPS=steps, maxnreg=fg.WS_MAXNREG, **constexprs)
        if steps:
            last_backward_trace = trace
    else:
        _launch(plan, "bwd", fg._bwd_kernel, lambda meta: (triton.cdiv(T, fg.BLOCK_N), k.shape[1], B),  # per KV head
                *tensors, H, T, *scalars, BLOCK_N=fg.BLOCK_N, **constexprs)
    torch.mul(dq_acc, grad_scale, out=dq)


def _examples(kv_start: torch.Tensor, kv_end: torch.Tensor, longest: int,
              block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The by-example backward's work list from bounds (B, T) (each query's keys [kv_start, kv_end)), and which rows
    take their dQ from the fp32 accumulator, (B, T) int8. An example is a run of rows that sees no key outside it and
    whose keys no row outside it sees: one starts at row t when row t's keys start at t or later and row t - 1's end
    by t. An example of at most `longest` rows is one work item, walked whole; a longer one is one item per key tile
    of `block` keys (its rows are the flagged ones), so that no item holds up the others. The list, int32: the number
    of items, then B * T entries each (the unused ones last) of every item's b * T + example's first row, the
    example's end row, and the first key of the item's one key tile (-1: the whole example), the most work first.
    Computed on the device, no host synchronisation."""
    B, T = kv_start.shape
    t = torch.arange(T, device=kv_start.device, dtype=torch.int32)
    starts = kv_start >= t  # (B, T)
    starts[:, 1:] &= kv_end[:, :-1] <= t[1:]
    first = torch.where(starts, t, 0).cummax(dim=1).values  # each row's example: [first, end)
    later = torch.cat((torch.where(starts, t, T)[:, 1:], t.new_full((B, 1), T)), dim=1)
    end = later.flip(1).cummin(dim=1).values.flip(1)
    long = (end - first) > longest
    tile_head = long & (starts | (t % block == 0))
    head = tile_head | (starts & ~long)
    tile = torch.where(tile_head, t // block * block, -1)
    rows = (end - first).to(torch.int64)  # the work: query rows x keys of a causal example, or of one key tile
    work = torch.where(tile_head, block * (end - torch.maximum(tile, first)).to(torch.int64), rows * (rows + 1) // 2)
    order = torch.argsort(torch.where(head, work, -1).flatten(), descending=True, stable=True)
    n = B * T
    examples = torch.empty(1 + 3 * n, dtype=torch.int32, device=kv_start.device)
    examples[0] = head.sum()
    batch = torch.arange(B, device=t.device, dtype=torch.int32)[:, None]
    examples[1:1 + n] = (batch * T + first).flatten()[order]
    examples[1 + n:1 + 2 * n] = end.flatten()[order]
    examples[1 + 2 * n:] = tile.flatten()[order]
    return examples, long.to(torch.int8)


def dropout_mask(seed: torch.Tensor, B: int, H: int, T: int, dropout_p: float) -> torch.Tensor:
    """The keep-mask (B, H, T, T) that attention with this seed and dropout_p applies (with the generator of
    FLASH_ATTN_DROPOUT_RNG), as int8 0/1."""
    mask = alloc((B * H, T, T), torch.int8, seed.device)
    block = 32 if env.INTERPRET else 64
    with _device_guard(seed):
        _dropout_mask_kernel[(triton.cdiv(T, block), triton.cdiv(T, block), B * H)](
            mask, seed, T, dropout_threshold(dropout_p), BLOCK=block, DROPOUT=env.dropout_rng())
    return mask.view(B, H, T, T)

"""`flash_decode`: attention of a few new queries per row against a static KV cache (Flash-Decoding), for inference.

    from kernels import flash_decode
    o = flash_decode(q, k_cache, v_cache, lengths)   # q (B, Hq, Tq, D), caches (B, Hkv, S, D), lengths (B,) -> o like q

Row b attends to its first lengths[b] cached keys, which include its Tq new tokens; query t sits at position
lengths[b] - Tq + t (causal among the new tokens). D is any multiple of 8 up to 256: the kernels run a tile of the
next of 16, 32, 64, 128, 256 with the loads and stores masked to the real D, reading the caches in place. The kernels
are kernels/decode_kernels.py; this module holds the host side: input checks, the fixed launch configs, the split
count, the fp32 workspaces, the launches, and a `torch.library` custom op (`flashgpt::flash_decode`) that
torch.compile keeps as one opaque node.

Nothing here reads `lengths` on the host and every launch parameter follows from static shapes (S, B, Hkv, Hq, Tq, D,
dtype) and the GPU's SM count, so a call can be captured in a CUDA graph and replayed while the lengths change on the
device (torch.compile's mode="reduce-overhead" does that). Inference only: there is no backward.
"""

import dataclasses
import math

import torch
import triton

from kernels import env, launch
from kernels.decode_kernels import _decode_combine_kernel, _decode_split_kernel
from kernels.flash_kernels import LOG2E

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernels' tile widths; every multiple of 8 up to 256 runs at one
LENGTH_DTYPES = (torch.int32, torch.int64)

# ----------------------------------------------------------------------------------------------------------------------
# Launch configs: (BLOCK_N, num_warps, num_stages) of the split kernel by (tile-width class, fp32 inputs): class 64 for
# D <= 64 (tiles 16, 32, 64), 128 for D = 72..128, 256 for D = 136..256. Fixed, never autotuned at call time
# (autotuning syncs and benchmarks, which a CUDA graph capture cannot contain). The 16-bit entries and _PROGRAMS_PER_SM
# were picked by a sweep on an H200 (docs/kernel.md); the split kernel streams K/V tiles and is bound by memory. fp32
# operands take twice the space: smaller tiles.
# ----------------------------------------------------------------------------------------------------------------------
DECODE_CONFIGS: dict[tuple[int, bool], tuple[int, int, int]] = {
    (64, False): (64, 4, 3),
    (128, False): (32, 4, 4),
    (256, False): (32, 8, 2),
    (64, True): (64, 4, 2),
    (128, True): (32, 4, 2),
    (256, True): (32, 8, 1),
}
_INTERPRET_BLOCK_N = 16  # interpreter: small tiles, so that short test caches span several tiles and splits
_MAX_BLOCK_M = 64  # query rows (GROUP * Tq) per program; more take several row blocks, each reading the K/V tiles
_COMBINE_CHUNK = 2048  # fp32 elements of partial outputs the combine kernel holds at a time (BLOCK_S * tile width)
_COMBINE_WARPS = 4

# Split heuristic (see `split_plan`)
_PROGRAMS_PER_SM = 2  # aim for about this many split programs per SM: enough loads in flight, few partials
_MIN_SPLIT_TILES = 2  # never split the keys into ranges shorter than this many BLOCK_N tiles
MAX_SPLITS = 128


def tile_head_dim(head_dim: int) -> int:
    """The kernels' tile width for a head dim: the next of TILE_HEAD_DIMS >= it."""
    return next(d for d in TILE_HEAD_DIMS if d >= head_dim)


def launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel for this head dim (keyed by its tile width) and dtype."""
    block_n, warps, stages = DECODE_CONFIGS[(max(64, tile_head_dim(head_dim)), dtype == torch.float32)]
    return (_INTERPRET_BLOCK_N if env.INTERPRET else block_n), warps, stages


def query_blocking(group: int, tq: int) -> tuple[int, int]:
    """(BLOCK_M, row blocks) for GROUP * Tq query rows per key-value head: rows padded to a power of 2 >= 16 (tl.dot's
    minimum), at most _MAX_BLOCK_M per program."""
    rows = group * tq
    block_m = min(max(16, triton.next_power_of_2(rows)), _MAX_BLOCK_M)
    return block_m, triton.cdiv(rows, block_m)


def split_plan(S: int, programs: int, block_n: int, sm_count: int,
               num_splits: int | None = None) -> tuple[int, int]:
    """(n_splits, split_len): the keys [0, S) cut into n_splits ranges of split_len keys (the last one shorter).

    `programs` is the number of programs per split (B * Hkv * row blocks). Without `num_splits`, enough splits that
    the grid has about _PROGRAMS_PER_SM programs per SM, so a small batch with a long cache still fills the GPU, but
    none shorter than _MIN_SPLIT_TILES tiles (short ranges are mostly prologue, and each split adds a partial output
    to write and combine), and at most MAX_SPLITS; one split when the batch and heads alone fill the GPU.
    `num_splits` asks for a count instead (tests, benchmarks). Either way split_len is rounded up to whole tiles,
    which can leave fewer splits than asked for.

    Only static shapes enter: a CUDA graph captured with one plan stays valid whatever the lengths become, and rows
    shorter than S simply find their last splits empty.
    """
    if num_splits is None:
        wanted = triton.cdiv(_PROGRAMS_PER_SM * sm_count, programs)
        num_splits = max(1, min(wanted, S // (_MIN_SPLIT_TILES * block_n), MAX_SPLITS))
    split_len = triton.cdiv(triton.cdiv(max(S, 1), num_splits), block_n) * block_n
    return triton.cdiv(max(S, 1), split_len), split_len


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How `flash_decode` launches for given shapes: query tile, key tile, warps, stages and the key splits."""

    block_m: int  # query rows per program (GROUP * Tq padded)
    row_blocks: int  # programs per (row, key-value head, split) along the query rows
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    n_splits: int  # key ranges; 1: the split kernel writes the output, no combine
    split_len: int  # keys per range, a multiple of block_n


def decode_plan(q: torch.Tensor, k_cache: torch.Tensor, num_splits: int | None = None) -> DecodePlan:
    """The plan for q (B, Hq, Tq, D) and a cache (B, Hkv, S, D) on their device: static shapes only, never lengths."""
    B, Hq, Tq, D = q.shape
    H_kv, S = k_cache.shape[1], k_cache.shape[2]
    block_n, warps, stages = launch_config(D, q.dtype)
    block_m, row_blocks = query_blocking(Hq // H_kv, Tq)
    n_splits, split_len = split_plan(S, B * H_kv * row_blocks, block_n, launch.sm_count(q.device), num_splits)
    return DecodePlan(block_m, row_blocks, block_n, warps, stages, n_splits, split_len)


# ----------------------------------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------------------------------
def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
            num_splits: int | None, window: int = -1) -> torch.Tensor:
    """The output (B, Hq, Tq, D), in q's memory order when q is dense, else (the view of a fused projection) as a view
    of a (B, Tq, Hq, D)-contiguous buffer, like `flash_attention`'s."""
    B, Hq, Tq, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    out = launch.empty_like_layout(q, q.dtype)  # (B, Hq, Tq, D)
    if out.numel() == 0:  # nothing to launch (a zero-size grid is an error)
        return out
    plan = decode_plan(q, k, num_splits)
    single = plan.n_splits == 1  # the split kernel writes the output: no workspaces, no combine launch
    if single:
        o_part = lse_part = out  # placeholders, never accessed
    else:
        o_part = launch.alloc((B * Hq * Tq, plan.n_splits, D), torch.float32, q.device)  # partial outputs, real D
        lse_part = launch.alloc((B * Hq * Tq, plan.n_splits), torch.float32, q.device)  # their LSEs, base 2
    upcast = env.INTERPRET and q.dtype != torch.float32
    tile = tile_head_dim(D)  # the kernels' HEAD_DIM; channels >= D are masked
    # Triton's launch marks an int argument divisible by 16 or not at all: K/V row strides that are multiples of 8 but
    # not all of 16 (contiguous caches at D = 40, 136, ...) are declared to the kernel, so K/V still load as 16-byte
    # vectors (asynchronous copies) rather than element by element
    kv_strides = (*k.stride()[:3], *v.stride()[:3])
    align_kv = all(s % 8 == 0 for s in kv_strides) and any(s % 16 for s in kv_strides)
    with launch._device_guard(q):
        _decode_split_kernel[(B * H_kv, plan.n_splits, plan.row_blocks)](
            q, k, v, lengths, out, o_part, lse_part, *q.stride(), *k.stride(), *v.stride(), *out.stride(), H_kv, S,
            plan.split_len, scale * LOG2E.value, window, HEAD_DIM=tile, HEAD_DIM_REAL=D, GROUP=Hq // H_kv, TQ=Tq,
            SINGLE_SPLIT=single, UPCAST=upcast, PRECISION=launch._precision(q.dtype), WINDOW=window >= 0,
            ALIGN_KV=align_kv, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, num_warps=plan.num_warps,
            num_stages=plan.num_stages)
        if not single:
            splits_pow2 = triton.next_power_of_2(plan.n_splits)
            _decode_combine_kernel[(B * Hq * Tq,)](
                o_part, lse_part, out, *out.stride(), Hq, plan.n_splits, HEAD_DIM=tile, HEAD_DIM_REAL=D, TQ=Tq,
                SPLITS=splits_pow2, BLOCK_S=min(splits_pow2, max(1, _COMBINE_CHUNK // tile)),
                num_warps=_COMBINE_WARPS)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# torch.compile: one opaque op, whose fake implementation gives the output's shape and strides
# ----------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("flashgpt::flash_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float,
               num_splits: int | None, window: int) -> torch.Tensor:
    return _decode(q, k_cache, v_cache, lengths, scale, num_splits, window)


@_decode_op.register_fake
def _decode_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float,
                 num_splits: int | None, window: int) -> torch.Tensor:
    return launch.empty_like_layout(q, q.dtype, lambda shape, dtype, device: q.new_empty(shape, dtype=dtype))


# ----------------------------------------------------------------------------------------------------------------------
# Input checks and the public function
# ----------------------------------------------------------------------------------------------------------------------
def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
              num_splits: int | None) -> None:
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_decode: {name} must be 4-D, q (B, Hq, Tq, D) and the caches (B, Hkv, S, D), got "
                             f"shape {tuple(t.shape)}")
    B, Hq, Tq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or k.shape[1] < 1 or Hq % k.shape[1]:
        raise ValueError(f"flash_decode: q must be (B, Hq, Tq, D) and k_cache, v_cache (B, Hkv, S, D) with Hq a "
                         f"multiple of Hkv (grouped-query attention), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_decode: q, k_cache, v_cache must share one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (allocate the caches in the compute dtype: casting them would copy the whole "
                         f"cache at every step)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_decode: dtype {q.dtype} is not supported; supported dtypes are float16, bfloat16, "
                         f"float32")
    if D % 8 or not 8 <= D <= 256:
        raise ValueError(f"flash_decode: head dim {D} is not supported; supported head dims are the multiples of 8 "
                         f"up to 256")
    if lengths.shape != (B,) or lengths.dtype not in LENGTH_DTYPES:
        raise ValueError(f"flash_decode: lengths must be a (B,) = ({B},) int32 or int64 tensor, got shape "
                         f"{tuple(lengths.shape)} and dtype {lengths.dtype}")
    if not (q.device == k.device == v.device == lengths.device):
        raise ValueError(f"flash_decode: q, k_cache, v_cache and lengths must be on one device, got {q.device}, "
                         f"{k.device}, {v.device}, {lengths.device}")
    if q.device.type == "cpu" and not env.INTERPRET:
        raise ValueError("flash_decode: got CPU tensors but the Triton interpreter is off; "
                         "set TRITON_INTERPRET=1 to run on CPU, or move tensors to CUDA")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_decode: device {q.device} is not supported; move tensors to CUDA")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_decode: scale must be a finite positive number, got {scale}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"flash_decode: num_splits must be in [1, {MAX_SPLITS}] or None, got {num_splits}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError("flash_decode is inference-only (no backward): call it under torch.no_grad() or "
                         "torch.inference_mode(), or pass tensors that do not require grad")


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                 scale: float | None = None, *, num_splits: int | None = None,
                 window: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode attention against a static KV cache, split over the keys (Flash-Decoding); inference only.

    Args:
        q: (B, Hq, Tq, D), the new tokens' queries; Tq >= 1 and small (1 per step, a few for speculative decoding).
        k_cache, v_cache: (B, Hkv, S, D) preallocated buffers of capacity S, Hq a multiple of Hkv (grouped-query
            attention: query head h reads key-value head h // (Hq / Hkv) in place; Hkv = 1 is multi-query).
            q and the caches share one dtype (float16, bfloat16, float32) on one CUDA device (or CPU under
            TRITON_INTERPRET=1); any strides, e.g. q a view of a fused qkv projection. D any multiple of 8 up to 256
            (read in place at every D: no padded copy).
        lengths: (B,) int32 or int64 on the same device: row b attends to keys [0, lengths[b]), which include its Tq
            new tokens. Query t sits at position lengths[b] - Tq + t and sees keys up to that position (causal among
            the new tokens). Keys at index >= lengths[b] are never read; a query that sees no key outputs zeros.
            Never read on the host: values outside [0, S] cannot be checked and are clamped to it.
        scale: softmax scale, default 1 / sqrt(D).
        num_splits: for tests and benchmarks: split the keys into this many ranges (rounded so that each covers whole
            tiles; may give fewer). Default: chosen from the static shapes and the GPU's SM count.
        window: sliding window as `flash_attention`'s, (left, right) with -1 unbounded: a query at position p sees
            keys p - left .. p only (right is moot: the new tokens are causal); keys before the window are not read.

    Returns:
        (B, Hq, Tq, D) in q's dtype; in q's memory order when q is dense, else (a fused projection's view) as a view of
        a (B, Tq, Hq, D)-contiguous buffer, so merging heads is free.

    Raises ValueError for unsupported inputs, and for inputs that require grad while grad mode is on (there is no
    backward). Inputs are not cast under autocast: the caches are static buffers, allocate them in q's dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _validate(q, k_cache, v_cache, lengths, scale, num_splits)
    if window is not None and (len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window)):
        raise ValueError(f"flash_decode: window must be (left, right), ints >= -1 (-1: unbounded), got {window}")
    left = -1 if window is None else window[0]
    if torch.compiler.is_compiling():
        return _decode_op(q, k_cache, v_cache, lengths, float(scale), num_splits, left)
    return _decode(q, k_cache, v_cache, lengths, float(scale), num_splits, left)  # eager: no dispatcher host time

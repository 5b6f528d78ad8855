"""The public FlashAttention functions and their autograd: `flash_attention` and `flash_attention_qkvpacked`.

Two paths reach the same kernels (kernels/launch.py): in eager mode a `torch.autograd.Function` (the least host time
per call); under `torch.compile` a pair of `torch.library.custom_op`s per entry point with fake implementations and
registered autograd, which Dynamo and AOTAutograd keep as opaque nodes (no graph break; autotuning happens at run time,
outside tracing). Inputs are validated here, and cast like SDPA's under autocast.
"""

import math

import torch
import torch.nn.functional as F

from kernels import env, launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernels' tile widths; other multiples of 8 are zero-padded to one
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z (heads, batch)


# ----------------------------------------------------------------------------------------------------------------------
# Input checks and autocast
# ----------------------------------------------------------------------------------------------------------------------
def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (B, H, T, D) like scaled_dot_product_attention, "
                             f"got shape {tuple(t.shape)}")
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2]:
        raise ValueError(f"flash_attention: only Tq == Tk is supported (self-attention), got Tq={q.shape[2]}, "
                         f"Tk={k.shape[2]}, Tv={v.shape[2]}; use F.scaled_dot_product_attention for cross-attention")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"flash_attention: q must be (B, H, T, D) and k, v (B, H_kv, T, D) with H a multiple of H_kv "
                         f"(grouped-query attention), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} is not supported; supported dtypes are float16, bfloat16, "
                         f"float32 (cast with .to(torch.bfloat16))")
    if q.shape[3] % 8 or not 8 <= q.shape[3] <= 256:
        raise ValueError(f"flash_attention: head dim {q.shape[3]} is not supported; supported head dims are the "
                         "multiples of 8 up to 256")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "cpu" and not env.INTERPRET:
        raise ValueError("flash_attention: got CPU tensors but the Triton interpreter is off; "
                         "set TRITON_INTERPRET=1 to run on CPU, or move tensors to CUDA")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: device {q.device} is not supported; move tensors to CUDA")
    if q.shape[0] > _MAX_GRID_YZ or q.shape[1] > _MAX_GRID_YZ:
        raise ValueError(f"flash_attention: batch and head counts must be <= {_MAX_GRID_YZ} (CUDA grid limit), got "
                         f"B={q.shape[0]}, H={q.shape[1]}; split the batch")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_attention: scale must be a finite positive number, got {scale}")


def _check_device(q: torch.Tensor) -> None:
    """Checks that depend on the device at run time (kept out of the traced wrapper)."""
    if q.shape[3] == 256 and q.is_cuda and torch.cuda.get_device_capability(q.device) < (9, 0):
        raise ValueError("flash_attention: head dim 256 needs Hopper (sm_90) shared memory; "
                         "use head dim <= 128 on this GPU")


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Like SDPA (an autocast lower-precision op): eligible floating inputs are cast to the autocast dtype."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


# ----------------------------------------------------------------------------------------------------------------------
# q, k, v entry point: autograd.Function (eager) and custom ops (torch.compile). `seed` is None without dropout, else
# a 1-element int64 tensor drawn by the caller (an input, so that torch.compile keeps the draw in its graph); `bounds`
# is [] for plain attention, else the kernels' four (B, T) bounds (launch.Bounds, made by `_bounds`)
# ----------------------------------------------------------------------------------------------------------------------
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout_p: float,
             seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    _check_device(q)
    return launch.forward(q, k, v, causal, scale, dropout_p, seed, _launch_bounds(bounds))


def _launch_bounds(bounds: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> launch.Bounds | None:
    return tuple(bounds) if bounds else None


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, causal, scale, dropout_p, seed, bounds = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed, *bounds)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
    ctx.mark_non_differentiable(lse)


class _FlashAttentionFunction(torch.autograd.Function):
    """Eager autograd: the same forward/backward as the custom op below, without the custom-op dispatcher's host
    overhead (~100 us per forward + backward, visible at small problem sizes)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout_p: float,
                seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _forward(q, k, v, causal, scale, dropout_p, seed, bounds)
        _setup_context(ctx, (q, k, v, causal, scale, dropout_p, seed, bounds), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
        q, k, v, o, lse, seed, *bounds = ctx.saved_tensors
        grads = launch.backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.dropout_p, seed,
                                bounds=_launch_bounds(bounds))
        return (*grads, None, None, None, None, None)


def _fake_alloc(like: torch.Tensor) -> launch.Alloc:
    return lambda shape, dtype, device: like.new_empty(shape, dtype=dtype)


@torch.library.custom_op("flashgpt::flash_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout_p: float,
            seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, scale, dropout_p, seed, bounds)


@_fwd_op.register_fake
def _fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, dropout_p: float,
              seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    return launch.empty_like_layout(q, q.dtype, _fake_alloc(q)), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("flashgpt::flash_attention_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None,
            bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch.backward(do, q, k, v, o, lse, causal, scale, dropout_p, seed, bounds=_launch_bounds(bounds))


@_bwd_op.register_fake
def _bwd_fake(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None,
              bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(launch.empty_like_layout(t, t.dtype, _fake_alloc(t)) for t in (q, k, v))


def _backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
    q, k, v, o, lse, seed, *bounds = ctx.saved_tensors
    grads = _bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.dropout_p, seed, bounds)
    return (*grads, None, None, None, None, [None] * len(bounds))  # a custom op's gradients mirror its inputs' tree


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------------
# Packed entry point: the fused projection (B, T, H + 2 * H_kv, D) itself is the input, so its gradient is one buffer
# the kernels fill (no concatenation of three gradients)
# ----------------------------------------------------------------------------------------------------------------------
def _split(qkv: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, H + 2 * kv_heads, D) -> q (B, H, T, D), k and v (B, kv_heads, T, D), all views (no copies)."""
    q, k, v = qkv.split([qkv.shape[2] - 2 * kv_heads, kv_heads, kv_heads], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _packed_forward(qkv: torch.Tensor, kv_heads: int, causal: bool, scale: float, dropout_p: float,
                    seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _forward(*_split(qkv, kv_heads), causal, scale, dropout_p, seed, bounds)
    return o.transpose(1, 2), lse  # (B, T, H, D): contiguous, since o follows the strided q view's (B, T, H, D) order


def _packed_dqkv(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, kv_heads: int, causal: bool,
                 scale: float, dropout_p: float, seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> torch.Tensor:
    """dqkv (B, T, H + 2 * kv_heads, D): the kernels write dq, dk, dv straight into their slices of one buffer."""
    dqkv = launch.alloc(tuple(qkv.shape), qkv.dtype, qkv.device)
    launch.backward(do.transpose(1, 2), *_split(qkv, kv_heads), o.transpose(1, 2), lse, causal, scale, dropout_p,
                    seed, grads=_split(dqkv, kv_heads), bounds=_launch_bounds(bounds))
    return dqkv


def _packed_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    qkv, kv_heads, causal, scale, dropout_p, seed, bounds = inputs
    o, lse = output
    ctx.save_for_backward(qkv, o, lse, seed, *bounds)
    ctx.kv_heads, ctx.causal, ctx.scale, ctx.dropout_p = kv_heads, causal, scale, dropout_p
    ctx.mark_non_differentiable(lse)


class _FlashAttentionQKVPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: torch.Tensor, kv_heads: int, causal: bool, scale: float, dropout_p: float,
                seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = _packed_forward(qkv, kv_heads, causal, scale, dropout_p, seed, bounds)
        _packed_setup_context(ctx, (qkv, kv_heads, causal, scale, dropout_p, seed, bounds), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
        qkv, o, lse, seed, *bounds = ctx.saved_tensors
        dqkv = _packed_dqkv(do, qkv, o, lse, ctx.kv_heads, ctx.causal, ctx.scale, ctx.dropout_p, seed, bounds)
        return dqkv, None, None, None, None, None, None


@torch.library.custom_op("flashgpt::flash_attention_qkvpacked_fwd", mutates_args=())
def _packed_fwd_op(qkv: torch.Tensor, kv_heads: int, causal: bool, scale: float, dropout_p: float,
                   seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _packed_forward(qkv, kv_heads, causal, scale, dropout_p, seed, bounds)


@_packed_fwd_op.register_fake
def _packed_fwd_fake(qkv: torch.Tensor, kv_heads: int, causal: bool, scale: float, dropout_p: float,
                     seed: torch.Tensor | None, bounds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    q = _split(qkv, kv_heads)[0]
    B, H, T, D = q.shape
    o = launch.empty_like_layout(q, q.dtype, _fake_alloc(q))
    return o.transpose(1, 2), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("flashgpt::flash_attention_qkvpacked_bwd", mutates_args=())
def _packed_bwd_op(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, kv_heads: int,
                   causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None,
                   bounds: list[torch.Tensor]) -> torch.Tensor:
    return _packed_dqkv(do, qkv, o, lse, kv_heads, causal, scale, dropout_p, seed, bounds)


@_packed_bwd_op.register_fake
def _packed_bwd_fake(do: torch.Tensor, qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, kv_heads: int,
                     causal: bool, scale: float, dropout_p: float, seed: torch.Tensor | None,
                     bounds: list[torch.Tensor]) -> torch.Tensor:
    return qkv.new_empty(qkv.shape)


def _packed_backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None) -> tuple:
    qkv, o, lse, seed, *bounds = ctx.saved_tensors
    dqkv = _packed_bwd_op(do, qkv, o, lse, ctx.kv_heads, ctx.causal, ctx.scale, ctx.dropout_p, seed, bounds)
    return dqkv, None, None, None, None, None, [None] * len(bounds)


_packed_fwd_op.register_autograd(_packed_backward, setup_context=_packed_setup_context)


# ----------------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------------
def _dropout_seed(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """One draw from torch's default generator of the device (torch.manual_seed reproduces it), or None."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flash_attention: dropout_p must be in [0, 1), got {dropout_p}")
    if 0.0 < dropout_p < 0.5 / 256:
        raise ValueError(f"flash_attention: dropout_p={dropout_p} rounds to 0 (the kernels apply p in steps of 1/256): "
                         "use 0, or at least 0.002")
    return torch.randint(0, 2**62, (1,), device=device) if dropout_p > 0.0 else None


def document_bounds(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `documents` argument for packed rows, from positions (B, T) (any integer dtype): each token's position in
    its example, 0 at an example's first token (token 0 of a row always starts one). Returns (first, end), int32
    (B, T): the row index of the first token of each token's example, and one past its last. Computed on the device
    with no host synchronisation (so once per batch, not per layer, and inside CUDA graphs)."""
    if positions.dim() != 2 or positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"document_bounds: positions must be an integer (B, T) tensor, got {positions.dtype} of "
                         f"shape {tuple(positions.shape)}")
    B, T = positions.shape
    t = torch.arange(T, device=positions.device)
    starts = (positions == 0) | (t == 0)  # (B, T): an example begins here
    first = torch.where(starts, t, 0).cummax(dim=1).values  # (B, T): the latest start at or before each token
    later = torch.where(starts, t, T)[:, 1:].flip(1).cummin(dim=1).values.flip(1)  # the next start after each token
    end = torch.cat((later, later.new_full((B, 1), T)), dim=1)  # (B, T)
    return first.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _bounds(documents: tuple[torch.Tensor, torch.Tensor] | None, window: tuple[int, int] | None, q: torch.Tensor,
            causal: bool) -> list[torch.Tensor]:
    """The kernels' bounds of packed rows and/or a sliding window (launch.Bounds: each query's keys [KV_START,
    KV_END), each key's queries [Q_START, Q_END)), or [] for plain attention."""
    B, T = q.shape[0], q.shape[2]
    left, right = _window(window, causal)
    if documents is not None and (len(documents) != 2 or any(
            d.shape != (B, T) or d.dtype != torch.int32 or d.device != q.device or not d.is_contiguous()
            for d in documents)):
        raise ValueError(f"flash_attention: documents must be the pair document_bounds(positions) returns, two "
                         f"contiguous int32 ({B}, {T}) tensors on {q.device}")
    if left == -1 and (causal or right == -1):  # no window: the examples alone bound each side
        return [] if documents is None else [documents[0], documents[1], documents[0], documents[1]]
    # the window: query i sees keys i - left .. i + right, so key j is seen by queries j - right .. j + left
    t = torch.arange(T, device=q.device, dtype=torch.int32)
    reach = lambda n: T if n == -1 else n  # noqa: E731  (-1: unbounded)
    kv_start, kv_end = (t - reach(left)).clamp(min=0), (t + reach(right) + 1).clamp(max=T)  # (T,): one example a row
    q_start, q_end = (t - reach(right)).clamp(min=0), (t + reach(left) + 1).clamp(max=T)
    if documents is not None:
        first, end = documents
        kv_start, kv_end = torch.maximum(first, kv_start), torch.minimum(end, kv_end)
        q_start, q_end = torch.maximum(first, q_start), torch.minimum(end, q_end)
    return [x.expand(B, T).contiguous() for x in (kv_start, kv_end, q_start, q_end)]


def _window(window: tuple[int, int] | None, causal: bool) -> tuple[int, int]:
    """(left, right): how many keys before and after its own a query sees under `window` (flash-attn's window_size;
    -1: unbounded; causal: right is 0)."""
    if window is None:
        return -1, 0 if causal else -1
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        raise ValueError(f"flash_attention: window must be (left, right), ints >= -1 (-1: unbounded), got {window}")
    return window[0], 0 if causal else window[1]


def _kernel_head_dim(D: int) -> int:
    """The tile width the kernels run head dim D at: D itself, or the next of SUPPORTED_HEAD_DIMS."""
    return next(d for d in SUPPORTED_HEAD_DIMS if d >= D)


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                             scale: float | None = None, dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                             documents: tuple[torch.Tensor, torch.Tensor] | None = None,
                             window: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention` that also returns the fp32 (B, H, T) log-sum-exp of the scaled, masked scores (before
    dropout; not differentiable). `seed` (a 1-element int64 tensor) fixes the dropout mask instead of a fresh draw:
    `dropout_mask(seed, ...)` returns the same mask."""
    q, k, v = _autocast(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    _validate(q, k, v, scale)
    bounds = _bounds(documents, window, q, causal)
    if seed is None:
        seed = _dropout_seed(dropout_p, q.device)
    D = q.shape[-1]
    padded = _kernel_head_dim(D) != D
    if padded:  # zero channels change no score, and give output channels that are cut off
        q, k, v = (F.pad(t, (0, _kernel_head_dim(D) - D)) for t in (q, k, v))
    if torch.compiler.is_compiling():
        o, lse = _fwd_op(q, k, v, causal, float(scale), float(dropout_p), seed, bounds)
    else:
        o, lse = _FlashAttentionFunction.apply(q, k, v, causal, float(scale), float(dropout_p), seed, bounds)
    return (o[..., :D] if padded else o), lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, dropout_p: float = 0.0, *,
                    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
                    window: tuple[int, int] | None = None) -> torch.Tensor:
    """Fused exact attention, a drop-in for `F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
    is_causal=causal, scale=scale, enable_gqa=True)`.

    Args:
        q: (B, H, T, D); k, v: (B, H_kv, T, D) with H a multiple of H_kv (grouped-query attention: query head h reads
            key-value head h // (H / H_kv) in place; H_kv = 1 is multi-query, H_kv = H multi-head). One dtype
            (float16, bfloat16, float32) on one CUDA device (or CPU under TRITON_INTERPRET=1); any strides. D any
            multiple of 8 up to 256 (> 128: Hopper; other than 16, 32, 64, 128, 256 zero-padded to the next of
            those, a copy); Tq == Tk; any B, H, T >= 1.
        causal: mask keys after the query position.
        scale: softmax scale, default 1 / sqrt(D).
        dropout_p: attention dropout, applied to the probabilities inside the kernels (rounded to a multiple of
            1/256: `kernels.launch.dropout_rate`); its seed is one draw from torch's default generator of the
            device, so torch.manual_seed reproduces it. Pass 0 in evaluation, as SDPA expects too.
        documents: packed rows, `document_bounds(positions)`: each row holds several examples one after another
            and a query attends only to the keys of its own example (causal or not); tiles wholly outside every
            example are skipped, so the work follows the examples' own Σ lenᵢ²/2 (causal) or Σ lenᵢ².
        window: sliding-window attention as flash-attn's window_size, (left, right) with -1 for unbounded: query i
            sees keys i - left .. i + right (causal: right is then moot, keys after i stay masked); tiles outside
            the window are skipped. With documents, both apply.

    Returns:
        (B, H, T, D) attention output in q's dtype, differentiable with respect to q, k and v. It comes back in q's
        memory order when q is dense, else (the strided views of a fused QKV projection) as a (B, H, T, D) view of a
        (B, T, H, D)-contiguous buffer, so `o.transpose(1, 2).reshape(B, T, H * D)` is free; gradients likewise.
    """
    return flash_attention_with_lse(q, k, v, causal, scale, dropout_p, documents=documents, window=window)[0]


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, causal: bool = True, scale: float | None = None, dropout_p: float = 0.0,
                           window: tuple[int, int] | None = None) -> torch.Tensor:
    """Variable-length sequences concatenated along the tokens, flash-attn's `flash_attn_varlen_func` layout: q
    (total, H, D), k and v (total, H_kv, D), int32 cu_seqlens (num_seqs + 1) with the sequences' cumulative
    lengths (0 first, total last; on the device: no host synchronisation); max_seqlen is accepted for
    flash-attn's signature and not needed. Returns (total, H, D). The kernels run it as one packed row
    (`documents`), so tiles across sequences are skipped; causal, window and dropout as `flash_attention`."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"flash_attention_varlen: q, k, v must be (total, heads, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(f"flash_attention_varlen: cu_seqlens must be a 1-D int32 tensor on {q.device}")
    t = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens, t, right=True)  # (total,): 1 + each token's sequence
    # each token's sequence start and end: document_bounds' pair (tokens past cu_seqlens[-1] form one more sequence)
    total = torch.full((1,), q.shape[0], dtype=torch.int32, device=q.device)  # filled on the device: no copy
    bounds = torch.cat((cu_seqlens, total))
    documents = (bounds[seq - 1][None].contiguous(), bounds[seq][None].contiguous())  # (1, total) each
    view = lambda x: x.transpose(0, 1)[None]  # noqa: E731  (total, heads, D) -> (1, heads, total, D), a view
    o = flash_attention(view(q), view(k), view(v), causal, scale, dropout_p, documents=documents, window=window)
    return o[0].transpose(0, 1)  # (total, H, D)


def flash_attention_qkvpacked(qkv: torch.Tensor, causal: bool = True, scale: float | None = None,
                              dropout_p: float = 0.0, *, kv_heads: int | None = None,
                              documents: tuple[torch.Tensor, torch.Tensor] | None = None,
                              window: tuple[int, int] | None = None) -> torch.Tensor:
    """`flash_attention` on a fused QKV projection's output, read in place; returns (B, T, H, D), contiguous.

    qkv is (B, T, 3, H, D) (multi-head attention, flash-attn's layout), or with `kv_heads` (B, T, H + 2 * kv_heads, D):
    H query heads, then kv_heads key and kv_heads value heads (grouped-query attention), e.g. a projection's
    (B, T, (H + 2 * kv_heads) * D) output viewed as such. The backward writes dq, dk and dv into one gradient of
    qkv's shape, which saves autograd the concatenation of three separate gradients (a read and write of the whole
    qkv gradient per layer). Support matrix, dropout, documents and window as `flash_attention` (a head dim the
    kernels pad runs as separate q, k, v)."""
    if kv_heads is None:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"flash_attention_qkvpacked: qkv must be (B, T, 3, H, D), or (B, T, H + 2 * kv_heads, D) "
                             f"with kv_heads given, got shape {tuple(qkv.shape)}")
        kv_heads, qkv = qkv.shape[3], qkv.flatten(2, 3)  # (B, T, 3H, D): a view of a fused projection's output
    elif qkv.dim() != 4 or kv_heads < 1 or qkv.shape[2] <= 2 * kv_heads:
        raise ValueError(f"flash_attention_qkvpacked: with kv_heads={kv_heads}, qkv must be (B, T, H + 2 * kv_heads, "
                         f"D) with H >= 1, got shape {tuple(qkv.shape)}")
    (qkv,) = _autocast(qkv)
    scale = 1.0 / math.sqrt(qkv.shape[-1]) if scale is None else scale
    q, k, v = _split(qkv, kv_heads)
    if _kernel_head_dim(qkv.shape[-1]) != qkv.shape[-1]:
        o = flash_attention(q, k, v, causal, scale, dropout_p, documents=documents, window=window)
        return o.transpose(1, 2).contiguous()  # (B, T, H, D)
    _validate(q, k, v, scale)
    bounds = _bounds(documents, window, q, causal)
    seed = _dropout_seed(dropout_p, qkv.device)
    if torch.compiler.is_compiling():
        return _packed_fwd_op(qkv, kv_heads, causal, float(scale), float(dropout_p), seed, bounds)[0]
    return _FlashAttentionQKVPackedFunction.apply(qkv, kv_heads, causal, float(scale), float(dropout_p), seed,
                                                  bounds)[0]


def dropout_mask(seed: torch.Tensor, B: int, H: int, T: int, dropout_p: float) -> torch.Tensor:
    """The keep-mask (B, H, T, T), bool, that the kernels apply for this seed and dropout_p (for tests and
    inspection): attention with dropout equals attention whose probabilities are multiplied by mask / (1 - p)."""
    return launch.dropout_mask(seed, B, H, T, dropout_p).bool()

"""Attention backends behind one registry: the contract every backend keeps, and the functions that keep it.

Every backend is one function with the same signature, `(q, k, v, *, causal=True, dropout_p=0.0, documents=None) ->
y`, the options passed by keyword, q and y shaped (B, nh, T, hs), k and v (B, n_kv_head, T, hs) with nh a multiple of
n_kv_head (grouped-query attention: each key-value head serves nh / n_kv_head query heads; naive repeats them, sdpa
passes enable_gqa, triton reads them in place). A new backend is one function here, added to BACKENDS, plus one file
in conf/attention/: the run config's schema, sample.py and the benchmark scripts take their choices from these dicts.

    naive   from scratch: materialises the (T, T) scores, masks, softmaxes, drops out, multiplies by V
    sdpa    torch.nn.functional.scaled_dot_product_attention, optionally pinned to one kernel of SDPA_BACKENDS;
            packed rows through FlexAttention (torch.nn.attention.flex_attention) with a document mask
    triton  our FlashAttention kernel (kernels/), dropout inside the kernel, packed rows natively

Packed rows (data.packing): several examples one after another in a row, given by positions (B, T), each token's
position in its example (0 at its first token). Causal attention must then stay within each example. A backend's
DOCUMENT_MASKS entry turns the positions into its own form of that mask once per forward, `documents`, which every
layer's call receives: naive a (B, 1, T, T) bool mask, sdpa on a GPU a FlexAttention BlockMask (which also lets it
skip the blocks across examples; on the CPU, where FlexAttention has no backward, SDPA with naive's mask), triton the
kernel's per-token example bounds (kernels.document_bounds).

A backend may also have a packed form in PACKED_BACKENDS, `(qkv, n_kv_head, *, causal, dropout_p, documents) -> y`
with qkv (B, T, nh + 2 * n_kv_head, hs) (query heads, then key heads, then value heads) and y (B, T, nh, hs): the
model then hands it the fused projection unsplit (triton: one qkv gradient, no concat).
`get_attention` resolves a run's settings to its function; every check of those settings lives there. Which SDPA
kernel a run used is found where its metrics are made (training/metrics.py: detect_sdpa_kernel).

With a KV cache (model/generate.py) the prefill is ordinary causal self-attention (Tq == Tk). A decode step has its
own form in DECODE_BACKENDS, `(q, k_cache, v_cache, positions) -> y`: q (B, nh, Tq, hs) are the newest tokens at
positions (B, Tq) of each row, k_cache and v_cache the static buffers (B, n_kv_head, S, hs) they were just written
into, and query t of row b sees the cached keys 0..positions[b, t]; the rest of the buffer (other rows' lengths,
unwritten slots) is never read into the result. naive and sdpa mask the whole buffer; triton runs our split-KV
decode kernel (kernels/decode.py; every head dim of the triton backend, the multiples of 8 up to 256), which reads
only each row's keys.
"""

import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


class AttentionFn(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, dropout_p: float = 0.0,
                 documents: Any = None) -> Tensor: ...


class PackedAttentionFn(Protocol):
    def __call__(self, qkv: Tensor, n_kv_head: int, *, causal: bool = True, dropout_p: float = 0.0,
                 documents: Any = None) -> Tensor: ...


DocumentMaskFn = Callable[[Tensor], Any]  # positions (B, T) -> the backend's `documents`


DecodeAttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def example_ids(positions: Tensor) -> Tensor:
    """(B, T) int64: which example of its row each token belongs to (0, 1, ...), from positions (B, T)."""
    starts = positions == 0
    starts[:, 0] = True  # a row always starts an example
    return starts.cumsum(dim=1)


def naive_documents(positions: Tensor) -> Tensor:
    """(B, 1, T, T) bool: query i sees key j iff j <= i and both are tokens of one example."""
    ids = example_ids(positions)  # (B, T)
    T = ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


def naive_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, dropout_p: float = 0.0,
                    documents: Tensor | None = None) -> Tensor:
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, S, hs): a copy if group > 1
    T, S = q.size(-2), k.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, S)
    if documents is not None:  # causal within each example
        att = att.masked_fill(~documents, float("-inf"))
    elif causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    if dropout_p > 0.0:
        att = F.dropout(att, p=dropout_p)
    return att @ v  # (B, nh, T, hs)


def sdpa_documents(positions: Tensor) -> BlockMask | Tensor:
    """On a GPU FlexAttention's BlockMask (flex_documents), on the CPU naive's bool mask for SDPA's attn_mask."""
    return flex_documents(positions) if positions.is_cuda else naive_documents(positions)


@torch.compiler.disable  # built eagerly, once per forward; the compiled layers take the BlockMask as an input
def flex_documents(positions: Tensor) -> BlockMask:
    """FlexAttention's BlockMask of causal attention within each example; blocks across examples are skipped."""
    ids = example_ids(positions)  # (B, T)
    B, T = ids.shape

    def same_example_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    return create_block_mask(same_example_causal, B, None, T, T, device=ids.device)


_compiled_flex: Callable[..., Tensor] | None = None


def _flex(q: Tensor) -> Callable[..., Tensor]:
    """flex_attention: inside a compiled model as it is (compiled with the model), else compiled on its own on a GPU
    (uncompiled it runs an unfused reference there); eager on the CPU."""
    global _compiled_flex
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, dropout_p: float = 0.0,
                   documents: BlockMask | Tensor | None = None) -> Tensor:
    if isinstance(documents, BlockMask):
        if dropout_p > 0.0:
            raise ValueError("attention=sdpa runs packed rows through FlexAttention, which has no attention dropout: "
                             "set model.dropout=0, data.packing=false, or attention=triton")
        return _flex(q)(q, k, v, block_mask=documents, enable_gqa=k.size(1) != q.size(1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents, dropout_p=dropout_p,
                                          is_causal=causal and documents is None, enable_gqa=k.size(1) != q.size(1))


def pinned_sdpa(backend: str, attend: Callable[..., Tensor] = sdpa_attention) -> Callable[..., Tensor]:
    """attend (an SDPA call) restricted to one SDPA backend: if that backend cannot run the inputs, a clear error,
    never a fallback."""
    pinned = SDPA_BACKENDS[backend]

    def attention(q: Tensor, *args: Tensor, **options: Any) -> Tensor:
        if isinstance(options.get("documents"), BlockMask):
            raise ValueError(f"packed rows run FlexAttention, not an SDPA kernel: attention.sdpa_backend={backend} "
                             "does not apply; set attention.sdpa_backend=auto or data.packing=false")
        with warnings.catch_warnings(record=True) as why, sdpa_kernel(pinned):
            try:
                return attend(q, *args, **options)
            except torch.cuda.OutOfMemoryError:
                raise  # a RuntimeError too, but not this backend's refusal
            except RuntimeError as e:
                reasons = "; ".join(str(w.message) for w in why) or str(e)
                raise RuntimeError(
                    f"attention.sdpa_backend={backend} cannot run this configuration "
                    f"(q {tuple(q.shape)} {q.dtype} on {q.device.type}): {reasons}. "
                    "Use attention.sdpa_backend=auto, pin another backend, or change dtype/device."
                ) from e

    return attention


def triton_documents(positions: Tensor) -> tuple[Tensor, Tensor]:
    from kernels import document_bounds  # imported on use: the model must load where triton is missing

    return document_bounds(positions)


def triton_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, dropout_p: float = 0.0,
                     documents: tuple[Tensor, Tensor] | None = None) -> Tensor:
    from kernels import flash_attention

    return flash_attention(q, k, v, causal=causal, dropout_p=dropout_p, documents=documents)


def triton_attention_qkvpacked(qkv: Tensor, n_kv_head: int, *, causal: bool = True, dropout_p: float = 0.0,
                               documents: tuple[Tensor, Tensor] | None = None) -> Tensor:
    from kernels import flash_attention_qkvpacked

    return flash_attention_qkvpacked(qkv, causal=causal, dropout_p=dropout_p, kv_heads=n_kv_head,
                                     documents=documents)


BACKENDS: dict[str, AttentionFn] = {"naive": naive_attention, "sdpa": sdpa_attention, "triton": triton_attention}
DOCUMENT_MASKS: dict[str, DocumentMaskFn] = {"naive": naive_documents, "sdpa": sdpa_documents,
                                             "triton": triton_documents}
# Backends that also take the fused projection itself, qkv (B, T, nh + 2 * n_kv_head, hs) -> y (B, T, nh, hs): their
# backward writes one qkv gradient, which saves the concatenation of separate q, k, v gradients (measured in
# docs/results/).
PACKED_BACKENDS: dict[str, PackedAttentionFn] = {"triton": triton_attention_qkvpacked}


def _grouped(q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The queries of a decode step with each key-value head's query heads as rows, (B, n_kv_head, group·Tq, hs), and
    which cached keys each row sees, (B, 1, group·Tq, S): the cache is attended as it is, never repeated per head."""
    B, nh, Tq, hs = q.shape
    group = nh // k.size(1)
    visible = torch.arange(k.size(2), device=q.device) <= positions[:, :, None]  # (B, Tq, S)
    return q.reshape(B, k.size(1), group * Tq, hs), visible.repeat(1, group, 1)[:, None]


def naive_decode(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    rows, visible = _grouped(q, k, positions)  # (B, nkv, group·Tq, hs), (B, 1, group·Tq, S)
    att = (rows @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nkv, group·Tq, S)
    att = F.softmax(att.masked_fill(~visible, float("-inf")), dim=-1)
    return (att @ v).view(q.shape)  # (B, nh, Tq, hs)


def sdpa_decode(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    rows, visible = _grouped(q, k, positions)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=visible).reshape(q.shape)  # (B, nh, Tq, hs)


def triton_decode(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    from kernels import flash_decode

    return flash_decode(q, k, v, positions[:, -1] + 1)  # row b holds its keys 0..positions[b, -1]


# The backends' KV-cache decode steps (module docstring); a backend without one decodes with SDPA's.
DECODE_BACKENDS: dict[str, DecodeAttentionFn] = {"naive": naive_decode, "sdpa": sdpa_decode, "triton": triton_decode}


def get_attention(name: str, sdpa_backend: str = "auto") -> AttentionFn:
    """The attention function of a run's settings (attention.name, attention.sdpa_backend). Every check of them is
    here, so a bad combination fails where the config is built (GPTConfig, training/config.py: validate), before any
    work, with the key to change."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend attention.name={name!r}: choose one of {', '.join(BACKENDS)}")
    if sdpa_backend == "auto":
        return BACKENDS[name]
    if sdpa_backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown attention.sdpa_backend={sdpa_backend!r}: choose one of "
                         f"{', '.join(['auto', *SDPA_BACKENDS])}")
    if name != "sdpa":
        raise ValueError(f"attention.sdpa_backend={sdpa_backend} only applies to attention=sdpa (this run uses "
                         f"attention={name}): drop it or set attention.sdpa_backend=auto")
    return pinned_sdpa(sdpa_backend)


def get_document_mask(name: str) -> DocumentMaskFn | None:
    """The backend's builder of `documents` for packed rows (module docstring), if it has one."""
    return DOCUMENT_MASKS.get(name)


def get_packed_attention(name: str) -> PackedAttentionFn | None:
    """The backend's packed-qkv form, if it has one (the model then skips splitting q, k, v). The name is validated
    by `get_attention`, which the model calls first."""
    return PACKED_BACKENDS.get(name)


def get_decode_attention(name: str, sdpa_backend: str = "auto") -> DecodeAttentionFn:
    """The backend's KV-cache decode step (DECODE_BACKENDS, else SDPA's), pinned like its attention for
    attention.sdpa_backend."""
    get_attention(name, sdpa_backend)  # the same checks
    if sdpa_backend == "auto":
        return DECODE_BACKENDS.get(name, sdpa_decode)
    return pinned_sdpa(sdpa_backend, sdpa_decode)

"""Our Triton FlashAttention, importable on its own (nothing here depends on the rest of the project).

    from kernels import flash_attention, flash_attention_qkvpacked, flash_decode
    o = flash_attention(q, k, v, causal=True)   # q (B, H, T, D), k and v (B, H_kv, T, D) -> (B, H, T, D)
    y = flash_attention_qkvpacked(qkv)          # (B, T, 3, H, D) -> (B, T, H, D): one gradient for a fused projection
    y = flash_attention_qkvpacked(qkv, kv_heads=H_kv)   # (B, T, H + 2 * H_kv, D) -> (B, T, H, D)
    o = flash_decode(q, k_cache, v_cache, lengths)       # inference: q (B, H, Tq, D) against (B, H_kv, S, D) caches
    o = flash_attention(q, k, v, documents=document_bounds(positions))  # packed rows: each example on its own
    o = flash_attention(q, k, v, window=(256, 0))        # sliding window: each query sees its 256 previous keys
    o = flash_attention_varlen(q, k, v, cu_seqlens, max_seqlen)  # flash-attn's varlen layout: (total, H, D)

H_kv divides H (grouped-query attention; H_kv = H is multi-head), as in F.scaled_dot_product_attention(enable_gqa=True).

Modules: flash_kernels.py (the Triton kernels), flash_gluon.py (the Hopper forward and one-pass backward, in
Gluon), launch.py (tuning, TMA, launches, which kernels run), ops.py (autograd, custom ops for torch.compile, input
checks, these functions), env.py (environment knobs); decode_kernels.py and decode.py (the split-KV decode kernels
and `flash_decode`); swiglu.py (the Llama MLP's activation, forward and backward, which model/swiglu.py uses).
docs/kernel.md describes the algorithms, the support matrix and the knobs.
"""

from pathlib import Path
from typing import NoReturn

from kernels.decode import flash_decode
from kernels.ops import document_bounds, flash_attention, flash_attention_qkvpacked, flash_attention_varlen

__all__ = ["document_bounds", "flash_attention", "flash_attention_qkvpacked", "flash_attention_varlen", "flash_decode"]


def __getattr__(name: str) -> NoReturn:
    # Run from the repository root, this package shadows Hugging Face's `kernels` distribution (same import name),
    # which transformers >= 5.25 imports at load time: say so instead of a bare "cannot import name".
    if name.startswith("_") or (Path(__file__).parent / f"{name}.py").exists():  # dunders; submodules not yet imported
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    raise ImportError(f"kernels.{name}: `kernels` here is this project's Triton kernel package, which shadows Hugging "
                      "Face's `kernels` package of the same name; transformers >= 5.25 needs that one. Install "
                      "transformers<5.25 (pip install -e . pins it)")

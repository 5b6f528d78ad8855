"""Our Triton FlashAttention, importable on its own (nothing here depends on the rest of the project).

    from kernels import flash_attention, flash_attention_qkvpacked
    o = flash_attention(q, k, v, causal=True)   # q (B, H, T, D), k and v (B, H_kv, T, D) -> (B, H, T, D)
    y = flash_attention_qkvpacked(qkv)          # (B, T, 3, H, D) -> (B, T, H, D): one gradient for a fused projection
    y = flash_attention_qkvpacked(qkv, kv_heads=H_kv)   # (B, T, H + 2 * H_kv, D) -> (B, T, H, D)

H_kv divides H (grouped-query attention; H_kv = H is multi-head), as in F.scaled_dot_product_attention(enable_gqa=True).

Modules: flash_kernels.py (the Triton kernels), launch.py (tuning, TMA, launches), ops.py (autograd, custom ops for
torch.compile, input checks, these functions), env.py (environment knobs). docs/kernel.md describes the algorithm,
the support matrix and the knobs.
"""

from kernels.ops import flash_attention, flash_attention_qkvpacked

__all__ = ["flash_attention", "flash_attention_qkvpacked"]

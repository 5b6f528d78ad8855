"""Custom GPU kernels. Importable on its own: nothing here depends on the rest of the project."""

from kernels.flash_attention import flash_attention, flash_attention_qkvpacked

__all__ = ["flash_attention", "flash_attention_qkvpacked"]

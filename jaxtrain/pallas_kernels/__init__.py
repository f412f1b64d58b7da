"""Pallas kernels (Triton backend on GPU, interpret mode on CPU)."""
from jaxtrain.pallas_kernels.flash_attention import (
    FlashAttentionError,
    flash_attention,
    reference_attention,
)

__all__ = ["FlashAttentionError", "flash_attention", "reference_attention"]

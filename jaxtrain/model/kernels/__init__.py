"""Pallas kernels (Triton backend on GPU, interpret mode on CPU)."""
from jaxtrain.model.kernels.flash_attention import (
    FlashAttentionError,
    block_counts,
    flash_attention,
    flash_attention_backward,
    reference_attention,
)

__all__ = ["FlashAttentionError", "block_counts", "flash_attention", "flash_attention_backward",
           "reference_attention"]

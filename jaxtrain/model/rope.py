"""Rotary position embedding: the frequencies (Llama 3.1's scaling when configured), the
cos/sin tables of a batch's positions, and the rotation. Over `model.rope_head_dim` dims: the
whole head, or under MLA only its decoupled rope part."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxtrain.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [E/2], with Llama 3.1's frequency-dependent scaling when configured."""
    e = cfg.rope_head_dim  # the head dim, or MLA's rope part
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BS):
    inv_freq = jnp.asarray(rope_frequencies(cfg))
    angles_BSe = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles_BSe), jnp.sin(angles_BSe)


def apply_rope(x_BSNE, cos_BSe, sin_BSe):
    """Rotate-half RoPE (the Hugging Face Llama convention), computed in fp32."""
    x = x_BSNE.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BSe[:, :, None, :], sin_BSe[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNE.dtype)

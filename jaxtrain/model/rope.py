"""Rotary position embedding: the frequencies (Llama 3.1's scaling, or under MLA YaRN's
interpolation, when configured), the cos/sin tables of a batch's positions, and the rotation.
Over `model.rope_head_dim` dims: the whole head, or under MLA only its decoupled rope part."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxtrain.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [E/2], with Llama 3.1's frequency-dependent scaling when configured."""
    e = cfg.rope_head_dim  # the head dim, or MLA's rope part
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    if cfg.mla is not None and cfg.mla.yarn:
        return yarn_frequencies(inv_freq, cfg).astype(np.float32)
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


def yarn_frequencies(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """YaRN's "NTK-by-parts" blend (HF's `_compute_yarn_parameters`, truncated range): pair i
    of the e rope dims turns (L / wavelength_i) times over the original context L. Pairs that
    turn more than beta_fast times keep their frequency (extrapolated: position resolution
    kept), those under beta_slow are divided by the factor (interpolated: the long context
    maps into the trained angles), and a linear ramp over the pair index blends between."""
    a, e = cfg.mla, cfg.rope_head_dim
    base, length = cfg.rope_theta, a.yarn_original_max_position

    def pair_turning(rotations):   # the (fractional) pair index that turns `rotations` times
        return e * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(a.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_turning(a.yarn_beta_slow)), e - 1)
    if low == high:
        high += 0.001   # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(e // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / a.yarn_factor * ramp + inv_freq * (1.0 - ramp)


def rope_tables(cfg: ModelConfig, positions_BS):
    """cos/sin [B, S, e/2] of the positions; under YaRN scaled by its attention factor (HF
    scales cos and sin, so the rope part of every score by its square)."""
    inv_freq = jnp.asarray(rope_frequencies(cfg))
    angles_BSe = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    cos_BSe, sin_BSe = jnp.cos(angles_BSe), jnp.sin(angles_BSe)
    factor = cfg.mla.attention_factor if cfg.mla is not None else 1.0
    if factor != 1.0:
        cos_BSe, sin_BSe = cos_BSe * factor, sin_BSe * factor
    return cos_BSe, sin_BSe


def apply_rope(x_BSNE, cos_BSe, sin_BSe):
    """Rotate-half RoPE (the Hugging Face Llama convention), computed in fp32."""
    x = x_BSNE.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BSe[:, :, None, :], sin_BSe[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNE.dtype)

"""The attention core behind `model.attention`: causal, grouped-query, segment-masked.

`xla` is plain jnp (the reference and the CPU path). Inputs are [B, S, H, E] queries and
[B, S, K, E] keys/values with H a multiple of K; query head h reads KV head h // (H/K).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


class AttentionConfigError(ValueError):
    pass


def xla_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, *, causal=True, sm_scale=None):
    b, s, h, e = q_BSHE.shape
    k_heads = k_BSKE.shape[2]
    if h % k_heads:
        raise AttentionConfigError(f"{h} query heads are not divisible by {k_heads} KV heads")
    g = h // k_heads
    scale = sm_scale if sm_scale is not None else e ** -0.5
    q_BSKGE = q_BSHE.reshape(b, s, k_heads, g, e)
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BSKE,
                              preferred_element_type=jnp.float32) * scale
    mask_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
    if causal:
        mask_BST &= jnp.tril(jnp.ones((s, s), dtype=bool))[None]
    scores_BKGST = jnp.where(mask_BST[:, None, None], scores_BKGST, -1e30)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1)
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", probs_BKGST.astype(v_BSKE.dtype), v_BSKE,
                           preferred_element_type=jnp.float32)
    return out_BSKGE.reshape(b, s, h, e).astype(q_BSHE.dtype)


def select(model_cfg):
    """The attention implementation for `model.attention` (auto: pallas on GPU, xla elsewhere)."""
    impl = model_cfg.attention
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        return xla_attention
    if impl == "cudnn":
        return cudnn_attention
    raise AttentionConfigError(
        f"model.attention={impl}: the Pallas kernel is not wired in yet; use xla or cudnn")


def cudnn_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
    if jax.default_backend() != "gpu":
        raise AttentionConfigError("model.attention=cudnn needs an NVIDIA GPU; use xla on CPU")
    # cuDNN takes packed documents as a mask; causal is fused.
    mask_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BSHE, k_BSKE, v_BSKE, mask=mask_B1ST, is_causal=True,
                                        implementation="cudnn")

"""Auxiliary-loss-free balancing's step (DeepSeek-V3 §2.1.2): the loads out, the bias moved.

The router's balancing bias (`blocks/moe/expert_bias` [L, E], model.moe.expert_bias) is a
parameter leaf only so that it is stored, sharded, stacked per stage, checkpointed and restored
with the params; it is never trained. Its cotangent slot carries each layer's tokens per expert
instead of a gradient (router.biased_choice), summed like gradients over microbatches, stages
and data/expert replicas, and divided by the token count in contract.normalise. `take_loads`
takes them out there, leaving the bias a zero gradient (so clipping, the gradient norm and
AdamW never see them: Adam's update of an always-zero gradient is exactly zero, and the bias has
no weight decay); `update` moves the bias after the optimizer by rate·sign(mean_e load - load_e)
per layer (Megatron's get_updated_expert_bias). The loads' common scale (1/tokens) does not
change a sign, so every rank, holding the same reduced loads, makes the same update.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BIAS = "expert_bias"


def is_bias(path) -> bool:
    """Whether a tree path names a balancing-bias leaf."""
    return bool(path) and str(getattr(path[-1], "key", path[-1])) == BIAS


def has_bias(tree: Any) -> bool:
    """Whether a params-shaped pure dict holds a balancing bias."""
    return any(is_bias(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def take_loads(grads: Any) -> tuple[Any, Any]:
    """(loads, grads): the bias leaves' cotangents (per-expert loads, a params-shaped tree
    with None elsewhere) and the gradients with zeros in their place."""
    loads = jax.tree_util.tree_map_with_path(lambda p, g: g if is_bias(p) else None, grads)
    grads = jax.tree_util.tree_map_with_path(
        lambda p, g: jnp.zeros_like(g) if is_bias(p) else g, grads)
    return loads, grads


def update(params: Any, loads: Any, rate: float) -> Any:
    """The params with every bias leaf moved by rate·sign(mean load - load) along its last
    (expert) axis; the other leaves as they are."""
    def one(path, p, load):
        if not is_bias(path):
            return p
        load = load.astype(jnp.float32)
        error = jnp.mean(load, axis=-1, keepdims=True) - load
        return (p + rate * jnp.sign(error)).astype(p.dtype)
    return jax.tree_util.tree_map_with_path(one, params, loads, is_leaf=lambda x: x is None)

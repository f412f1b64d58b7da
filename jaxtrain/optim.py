"""The optax chain: global-norm clipping, AdamW on fp32 masters, warmup + cosine decay.

Weight decay skips norms and embeddings (Megatron and most Llama recipes do the same).
"""
from __future__ import annotations

import jax
import optax

from jaxtrain.config import TrainConfig


def learning_rate(t: TrainConfig) -> optax.Schedule:
    """Linear warmup, then cosine decay to lr * min_lr_ratio over train.lr_decay_steps
    (default train.steps), constant after it."""
    decay_steps = max(t.lr_decay_steps or t.steps, t.warmup_steps + 1)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
        decay_steps=decay_steps, end_value=t.lr * t.min_lr_ratio)
    return lambda count: schedule(count + 1)  # step 0 already learns (Megatron counts from 1)


def decay_mask(params):
    """True for the matrices that get weight decay: projections and the untied lm_head."""
    def decays(path, _):
        names = [str(getattr(k, "key", k)) for k in path]
        return names[-1] in ("kernel", "lm_head")
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(learning_rate(t), b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps,
                    weight_decay=t.weight_decay, mask=decay_mask),
    )

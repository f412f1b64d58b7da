"""The loss as sums: what a microbatch gives both executors, and what they add up.

A loss function returns `(objective, LossSums)` (jax.value_and_grad's has_aux form): the
executors differentiate the objective, a sum over tokens, and add up the LossSums over
microbatches, pipeline stages and replicas; the train step divides once, after everything
(jaxtrain.step). Sums rather than means, so any split of the batch combines exactly.

`aux` is the slot for what a model adds to its loss: each entry a `Mean` kept as its two sums,
added up like the loss and logged per step (the train step's metrics) as total / count. The
language-model loss adds none (an entry costs a loop carry and a scalar all-reduce per step);
a mixture-of-experts layer adds its load-balancing and z-loss terms and router statistics
here, and its weighted terms to the objective, so they reach the gradients of both executors
(tests/test_pipeline_model.py runs such a loss through both).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Mean:
    """A mean as its two sums: microbatches, stages and replicas add them exactly."""
    total: jax.Array
    count: jax.Array

    @property
    def value(self) -> jax.Array:
        return self.total / jnp.maximum(self.count, 1.0)


@flax.struct.dataclass
class LossSums:
    """One microbatch's (or, added up, one step's) loss as sums."""
    loss: jax.Array          # summed token cross entropy (fp32)
    tokens: jax.Array        # the tokens counted in it: the step's one normaliser
    aux: dict                # name -> Mean, logged per step


def cross_entropy_sum(logits_BSV, targets_BS, mask_BS):
    """Summed token cross entropy in fp32 and the number of counted tokens.

    Sums (not means) so microbatches and data shards combine exactly. The target logit is
    picked with a one-hot product so a vocab-sharded logits array is reduced where it lives
    instead of being gathered onto one device (Megatron's vocab-parallel cross entropy)."""
    mask_BS = mask_BS.astype(jnp.float32)
    return jnp.sum(token_cross_entropy(logits_BSV, targets_BS) * mask_BS), jnp.sum(mask_BS)


def token_cross_entropy(logits_BSV, targets_BS):
    """[B, S] fp32 cross entropy per position (unmasked)."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    onehot_BSV = jax.nn.one_hot(targets_BS, logits_BSV.shape[-1], dtype=jnp.float32)
    return lse_BS - jnp.sum(logits_BSV * onehot_BSV, axis=-1)


def token_loss(logits_BSV, targets_BS, mask_BS) -> tuple[jax.Array, LossSums]:
    """(objective, LossSums) of the language-model loss on one microbatch (or a replica's or
    context rank's part of it)."""
    loss, tokens = cross_entropy_sum(logits_BSV, targets_BS, mask_BS)
    return loss, LossSums(loss, tokens, {})

"""What both executors return for one global batch, and the step's one normalisation of it.

An executor runs every microbatch of a global batch (replica.py: a scan per data replica;
pipeline.py: the lock-step schedule) and returns `Sums`: the model's loss as sums
(model/loss.py's LossSums: summed token loss, token count and the auxiliary metrics' sums),
the fp32 sums of the objective's gradients w.r.t. the compute params, and the FP8 metas'
observations, combined by the converter's rule ({} without FP8). Sums over microbatches,
stages and replicas, never means: `normalise` divides once, by the token count, so both
executors give the same step up to float rounding, whatever the split.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtrain.model import loss as loss_lib
from jaxtrain.model import moe, moe_balance, mtp
from jaxtrain.model.loss import LossSums


class Sums(NamedTuple):
    losses: LossSums   # loss, tokens and aux, summed
    grads: Any         # fp32 gradient sums of the objective, in the compute params' layout
    fp8: Any           # FP8 observations (the converter's to turn into the next metas)


def model_loss(output, mb) -> tuple[jax.Array, LossSums]:
    """(objective, LossSums) of the model's output on microbatch `mb`: the token loss; with
    MoE layers (output = (logits, MoeStats, ...)) their statistics as the aux Means; with
    multi-token prediction (an mtp.DepthLogits in the output) its weighted cross entropy
    added to the objective and `mtp_loss` as an aux Mean. The layers' auxiliary terms reach
    the gradients through moe.attach_loss."""
    logits, *rest = output if isinstance(output, tuple) else (output,)
    objective, sums = loss_lib.token_loss(logits, mb["targets"], mb["loss_mask"])
    aux = dict(sums.aux)   # what the token loss itself reports stays beside the layers'
    for part in rest:
        if isinstance(part, moe.MoeStats):
            aux.update(moe.means(part, sums.tokens))
        elif isinstance(part, mtp.DepthLogits):
            term, aux["mtp_loss"] = mtp.losses(part, mb, sums.tokens,
                                               loss_lib.token_cross_entropy)
            objective = objective + term
    return objective, sums.replace(aux=aux)


class Normalised(NamedTuple):
    """A step's means: what the optimizer and the logs take."""
    loss: jax.Array    # mean token loss
    tokens: jax.Array  # tokens counted
    grads: Any         # gradients of the mean loss (fp32, where `shardings` put them)
    fp8: Any           # the FP8 observations, as the executor combined them
    metrics: dict      # name -> value of every auxiliary Mean
    loads: Any = None  # the MoE balancing bias's per-expert loads (model/moe_balance.py)


def normalise(sums: Sums, shardings) -> Normalised:
    """The one normalisation of a step: loss and gradients divided by the token count (at
    least 1: a batch of padding gives zeros, not NaN), each auxiliary metric by its own count;
    the gradients placed where `shardings` put them (the master params'). The balancing bias's
    cotangent slot holds loads, not a gradient: they leave as `loads`, the bias's gradient 0."""
    losses = sums.losses
    total = jnp.maximum(losses.tokens, 1.0)
    grads = jax.tree.map(lambda g, sh: jax.lax.with_sharding_constraint(g / total, sh),
                         sums.grads, shardings)
    metrics = {name: mean.value for name, mean in losses.aux.items()}
    loads, grads = moe_balance.take_loads(grads)
    return Normalised(losses.loss / total, losses.tokens, grads, sums.fp8, metrics, loads)

"""Multi-token prediction (DeepSeek-V3 §2.2, Megatron's multi_token_prediction.py): D modules
after the layer stack, module k predicting the token k+1 past the next.

Module k (k = 1..D) takes h^{k-1} (k = 1: the stack's output before the final norm) and the
shared embedding of the inputs shifted left by k (position i sees token t_{i+k}):
    h'  = eh_proj([RMSNorm_e(emb(t_{i+k})); RMSNorm_h(h^{k-1})])   (embedding first, as the
          checkpoints' eh_proj and Megatron's concatenation order it)
    h^k = Block(h')                                                  (one dense block)
    logits_k = the shared head (embedding table or lm_head) of RMSNorm_k(h^k)
and its cross entropy is against t_{i+k+1}: the main targets shifted left by k. Position i
counts at depth k only where that target is real and in the same document (`depth_mask`).
The objective adds (lambda/D) * sum_k CE_k (lambda per token: the train step's `mtp_weight`,
so a schedule change does not recompile); the logged `mtp_loss` is the mean over depths, both
normalised, like the main loss, by the main token count.

The block runs under `Ops.run_layer` (the stack's remat policy, one layer apart from it). The
model returns the depths' logits (`DepthLogits`); contract.model_loss turns them into loss.
"""
from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import ModelConfig
from jaxtrain.model.layers import Dense, RMSNorm
from jaxtrain.model.loss import Mean

WEIGHT_KEY = "mtp_weight"   # the batch key of lambda per token (step.py adds it)


@flax.struct.dataclass
class DepthLogits:
    """The MTP modules' fp32 logits [B, S, V], depth 1 first."""
    logits: tuple


class MtpDepth(nnx.Module):
    """One MTP module: the two norms, eh_proj, its block and its output norm."""

    def __init__(self, cfg: ModelConfig, ops, rngs, block):
        d = cfg.hidden_size
        self.enorm = RMSNorm(cfg, rngs)
        self.hnorm = RMSNorm(cfg, rngs)
        # [2, D] -> D: the output joins the residual stream (replicated over tensor)
        self.eh_proj = Dense((2, d), (d,), (None, "embed", None), std=1.0 / math.sqrt(2 * d),
                             name="mtp/eh_proj", cfg=cfg, ops=ops, rngs=rngs)
        self.block = block
        self.norm = RMSNorm(cfg, rngs)
        self.ops = ops

    def __call__(self, h_BSD, e_BSD, cos, sin, segment_ids_BS):
        """(h^k, RMSNorm_k(h^k)) from h^{k-1} and the shifted embedding."""
        c = self.ops.constrain
        residual = ("batch", "length", "embed")
        x_BS2D = jnp.stack([self.enorm(e_BSD), self.hnorm(h_BSD)], axis=-2)
        x_BSD = c(self.eh_proj(x_BS2D), residual)
        graphdef, state = nnx.split(self.block)

        def block_fn(s, x):
            return nnx.merge(graphdef, s)(x, cos, sin, segment_ids_BS)
        run = self.ops.run_layer or (lambda fn, x, s: fn(s, x))
        h_BSD = run(block_fn, x_BSD, state)
        return h_BSD, self.norm(h_BSD)


class MultiTokenPrediction(nnx.Module):
    """The D modules (attributes depth1..depthD); `make_block()` builds one dense block."""

    def __init__(self, cfg: ModelConfig, ops, rngs, make_block):
        self.depths = cfg.mtp_depths
        for k in range(1, self.depths + 1):
            setattr(self, f"depth{k}", MtpDepth(cfg, ops, rngs, make_block()))
        self.ops = ops

    def __call__(self, x_BSD, emb_BSD, cos, sin, segment_ids_BS, head) -> DepthLogits:
        """`x_BSD`: the stack's output (before the final norm); `emb_BSD`: the embedded inputs;
        `head(h_BSD) -> logits_BSV`: the shared output head (no norm)."""
        h_BSD, out = x_BSD, []
        for k in range(1, self.depths + 1):
            e_BSD = self.ops.constrain(shift_left(emb_BSD, k), ("batch", "length", "embed"))
            h_BSD, normed_BSD = getattr(self, f"depth{k}")(h_BSD, e_BSD, cos, sin,
                                                           segment_ids_BS)
            out.append(head(normed_BSD))
        return DepthLogits(tuple(out))


def shift_left(a, k: int, fill=0):
    """a[:, i + k] at position i along dim 1; `fill` past the end."""
    tail = jnp.full((a.shape[0], k, *a.shape[2:]), fill, a.dtype)
    return jnp.concatenate([a[:, k:], tail], axis=1)


def depth_mask(mb, k: int):
    """[B, S] fp32: 1 where position i counts at depth k: target t_{i+k+1} (targets[i+k]) is a
    real target (loss_mask[i+k]) and token i+k is in position i's document."""
    seg_BS = mb["segment_ids"]
    same_BS = shift_left(seg_BS, k, fill=-1) == seg_BS
    return shift_left(mb["loss_mask"].astype(jnp.float32), k) * same_BS


def losses(depths: DepthLogits, mb, tokens, token_ce) -> tuple[jax.Array, Mean]:
    """(the objective's MTP term, the `mtp_loss` Mean) of one microbatch. `token_ce(logits_BSV,
    targets_BS) -> ce_BS` (fp32); `tokens`: the microbatch's main token count, the normaliser.
    The term is sum_k sum_i weight_i/D * ce_k,i over the counted positions (weight: the batch's
    `mtp_weight`, lambda; 0 where the batch has none, as in evaluation)."""
    d = len(depths.logits)
    weight_BS = mb.get(WEIGHT_KEY)
    total, objective = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    for k, logits_BSV in enumerate(depths.logits, start=1):
        ce_BS = token_ce(logits_BSV, shift_left(mb["targets"], k)) * depth_mask(mb, k)
        total = total + jnp.sum(ce_BS)
        if weight_BS is not None:
            objective = objective + jnp.sum(ce_BS * weight_BS.astype(jnp.float32)) / d
    return objective, Mean(total / d, tokens)


def factor(cfg: ModelConfig, step) -> jax.Array:
    """lambda at `step` (traced): model.mtp.loss_scaling_factor, then the schedule's factors."""
    t = cfg.mtp
    value = jnp.asarray(t.loss_scaling_factor, jnp.float32)
    for boundary, later in t.boundaries:
        value = jnp.where(step >= boundary, jnp.float32(later), value)
    return value

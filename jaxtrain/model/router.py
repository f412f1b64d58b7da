"""The MoE router (fp32, mesh-free): scores, the top-k choice, the weights, the router losses.

    logits = x·W_router (fp32)
    softmax (Mixtral, Megatron's default): top-k of the softmax, or the softmax of the top-k
      logits (pre_softmax=false: the top-k renormalised)
    sigmoid (DeepSeek-V3, Megatron's --moe-router-score-function sigmoid):
      s = sigmoid(logits); choice = s + expert_bias (the bias only steers the choice);
      group-limited (n_group groups of E/n_group experts, each scored by the sum of its top-2
      choice scores; the topk_group best groups stay) then the top-k within them; the weights
      are the chosen experts' unbiased s, normalised to sum 1 (norm_topk_prob) and scaled by
      routed_scaling_factor (Megatron's --moe-router-topk-scaling-factor)

Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2). `expert_bias` [E] enters only the choice:
never the weights, never the gradient. The choice runs under a custom VJP whose backward hands
the scores the cotangent of the picked (unbiased) scores, as a gather would (a top-k index has
no derivative), and hands the bias, in place of a gradient, this pass's tokens per expert.
That is flax's "overwrite with gradient" pattern, as fp8_matmul uses for its amaxes: the
loads then travel wherever gradients travel, summed over
microbatches, pipeline stages and data/expert replicas by the executors' one reduction, so
every rank sees the same loads. The train step takes them out of the gradients before the
optimizer (moe_balance.py) and moves the bias by rate·sign(mean load - load).

The masked-out groups' choice scores are -inf (Megatron, transformers' DeepseekV3 5.x;
DeepSeek's released code writes 0.0, which differs only when a biased score is negative).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxtrain.config import MoeConfig

F32 = jnp.float32


class Routing(NamedTuple):
    experts_TK: jax.Array   # int32: each token's experts, best first
    weights_TK: jax.Array   # fp32: what each expert's output is weighted by
    scores_TE: jax.Array    # fp32: per-token scores summing to 1 (the load-balancing losses' P)
    logits_TE: jax.Array    # fp32


def _group_limited_top_k(choice_TE, top_k: int, n_group: int, topk_group: int):
    """Experts [T, K] (best first) of the top-k within each token's topk_group best groups
    (a group's score: the sum of its top-2 choice scores; one group: a plain top-k)."""
    t, e = choice_TE.shape
    if n_group > 1 and topk_group < n_group:
        grouped_TGX = choice_TE.reshape(t, n_group, e // n_group)
        best_TGX, _ = jax.lax.top_k(grouped_TGX, min(2, e // n_group))
        _, groups_TK = jax.lax.top_k(jnp.sum(best_TGX, axis=-1), topk_group)
        keep_TG = jnp.sum(jax.nn.one_hot(groups_TK, n_group, dtype=F32), axis=1) > 0
        keep_TE = jnp.repeat(keep_TG, e // n_group, axis=1)
        choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
    return jax.lax.top_k(choice_TE, top_k)[1].astype(jnp.int32)


def tokens_per_expert(experts_TK, num_experts: int):
    """[E] fp32: how many tokens chose each expert (before any drop)."""
    return jnp.sum(jax.nn.one_hot(experts_TK, num_experts, dtype=F32), axis=(0, 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def biased_choice(scores_TE, bias_E, top_k: int, n_group: int, topk_group: int):
    """(experts [T, K] chosen by scores + bias, their unbiased scores [T, K]). The backward
    gives the scores the gather's cotangent and the bias this choice's tokens per expert (its
    load, not a gradient: see the module docstring). The picked scores ride on the result so
    the backward runs wherever the weights reach the loss (an index alone has no cotangent)."""
    experts_TK = _group_limited_top_k(scores_TE + bias_E.astype(F32), top_k, n_group,
                                      topk_group)
    return experts_TK, jnp.take_along_axis(scores_TE, experts_TK, axis=1)


def _choice_fwd(scores_TE, bias_E, top_k, n_group, topk_group):
    experts_TK, picked_TK = biased_choice(scores_TE, bias_E, top_k, n_group, topk_group)
    load_E = tokens_per_expert(experts_TK, scores_TE.shape[1]).astype(bias_E.dtype)
    return (experts_TK, picked_TK), (experts_TK, load_E)


def _choice_bwd(top_k, n_group, topk_group, res, cts):
    del top_k, n_group, topk_group
    experts_TK, load_E = res
    _, ct_picked_TK = cts
    t = experts_TK.shape[0]
    ct_scores_TE = jnp.zeros((t, load_E.shape[0]), ct_picked_TK.dtype).at[
        jnp.arange(t)[:, None], experts_TK].add(ct_picked_TK)
    return ct_scores_TE, load_E


biased_choice.defvjp(_choice_fwd, _choice_bwd)


def _softmax(logits_TE, e: MoeConfig, bias_E):
    del bias_E   # refused by config/rules.py: Megatron's expert bias is the sigmoid router's
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    if e.n_group > 1:   # group-limited (DeepSeek-V2's device-limited routing), then weights
        experts_TK = _group_limited_top_k(jax.lax.stop_gradient(probs_TE), e.top_k, e.n_group,
                                          e.topk_group)
        weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=1)
        if not e.pre_softmax:
            weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    elif e.pre_softmax:   # the top-k of the full softmax, as they are
        weights_TK, experts_TK = jax.lax.top_k(probs_TE, e.top_k)
    else:                 # Mixtral: softmax over the top-k logits (the top-k renormalised)
        top_TK, experts_TK = jax.lax.top_k(logits_TE, e.top_k)
        weights_TK = jax.nn.softmax(top_TK, axis=-1)
    return probs_TE, weights_TK, experts_TK


def _sigmoid(logits_TE, e: MoeConfig, bias_E):
    scores_TE = jax.nn.sigmoid(logits_TE)
    if bias_E is None:
        experts_TK = _group_limited_top_k(jax.lax.stop_gradient(scores_TE), e.top_k,
                                          e.n_group, e.topk_group)
        weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=1)
    else:
        experts_TK, weights_TK = biased_choice(scores_TE, bias_E, e.top_k, e.n_group,
                                               e.topk_group)
    if e.norm_topk_prob:
        weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    # the load-balancing losses' P: each token's scores normalised to sum 1 (Megatron)
    return scores_TE / (jnp.sum(scores_TE, axis=-1, keepdims=True) + 1e-20), weights_TK, \
        experts_TK


# model.moe.score_function -> (logits, cfg, bias or None) -> (P for the losses, weights, experts)
SCORE_FUNCTIONS = {"softmax": _softmax, "sigmoid": _sigmoid}


def route(x_TD, router_DE, e: MoeConfig, expert_bias_E: Optional[jax.Array] = None) -> Routing:
    """Top-k routing in fp32 (Megatron's moe_router_dtype=fp32), whatever the compute dtype;
    `expert_bias_E`: the balancing bias (model.moe.expert_bias), steering the choice only."""
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(F32), router_DE.astype(F32))
    scores_TE, weights_TK, experts_TK = SCORE_FUNCTIONS[e.score_function](logits_TE, e,
                                                                          expert_bias_E)
    weights_TK = weights_TK * e.routed_scaling_factor
    return Routing(experts_TK.astype(jnp.int32), weights_TK, scores_TE, logits_TE)


def load_balancing_loss(scores_TE, counts_E, top_k: int):
    """Switch/GShard as Megatron computes it: E/(k·T²)·Σ_e (Σ_t p_te)·c_e (no coefficient)."""
    t, e = scores_TE.shape
    return jnp.sum(jnp.sum(scores_TE, axis=0) * counts_E) * (e / (top_k * t * t))


def sequence_aux_loss(scores_TE, experts_TK, batch: int):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20, no coefficient), averaged over the
    `batch` sequences of the T = batch·S tokens: per sequence Σ_e f_e·P_e with
    f_e = E/(K·S)·(tokens of the sequence choosing e) and P_e = mean_t s'_te (s': each token's
    scores normalised to sum 1, as `Routing.scores_TE` holds them). 1 when balanced."""
    t, e = scores_TE.shape
    k = experts_TK.shape[1]
    s = t // batch
    chosen_BSE = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=F32), axis=1).reshape(batch, s, e)
    f_BE = jnp.sum(chosen_BSE, axis=1) * (e / (k * s))
    p_BE = jnp.mean(scores_TE.reshape(batch, s, e), axis=1)
    return jnp.mean(jnp.sum(f_BE * p_BE, axis=-1))


def z_loss(logits_TE):
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)² (no coefficient)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))

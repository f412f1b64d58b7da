"""Mixture-of-experts layer (mesh-free: logical axis names only, like llama.py).

    x [B, S, D] -> T = B·S tokens -> router (router.py, fp32): each token's top-k experts and
      weights (softmax or DeepSeek-V3's sigmoid, group-limited, the balancing bias)
      dropless:  permute (rows sorted by expert) -> SwiGLU experts as grouped GEMMs
                 (Ops.grouped_dot, lax.ragged_dot by default) -> unpermute (each token's k
                 outputs summed with the router's weights)
      capacity:  each expert keeps at most C = ceil(T·k/E · capacity_factor) tokens (drop
                 policy: lowest router weight, or latest position); pad_to_capacity runs the
                 experts on fixed [E, C] buffers (a batched einsum), otherwise on the kept rows
                 sorted as in dropless
    + shared experts (a dense SwiGLU every token passes through), tagged `shared_experts`

`permute`, `expert_swiglu` and `unpermute` are separate so expert parallelism can put an
all-to-all between them (Megatron's alltoall dispatcher: permute by expert, all-to-all, grouped
GEMM, all-to-all back, unpermute, weight by the router); `to_capacity` / `from_capacity` are
the fixed-size transport's pair.

Auxiliary losses (Megatron's semantics, per layer): the Switch/GShard load-balancing loss
E/(k·T²)·Σ_e P_e·c_e (P_e: summed softmax probability of expert e over the tokens, c_e: tokens
whose top-k holds e; 1 when perfectly balanced) times `aux_loss_coeff`, DeepSeek-V3's
sequence-wise loss (router.sequence_aux_loss) times `seq_aux_loss_coeff`, and the ST-MoE z-loss
mean_t logsumexp(logits_t)² times `z_loss_coeff`. The executors' loss is a sum over tokens
divided once by the token count (docs/design.md §8 "Loss as sums"), so a layer's term is
T·(coeff·loss), as Megatron scales it under calculate_per_token_loss: after the one division
it is the layer's loss averaged over microbatches and replicas. `attach_loss` (Megatron's
MoEAuxLossAutoScaler) ties the term to the layer's output: identity forward, and the backward
seeds the term's gradient with 1 (the executors seed the summed loss with 1 too), so no layer
runner has to carry the losses for the gradient. Their values, for logging, leave through
`MoeStats` (small sums the layer runner carries next to x).

Shape letters: B batch, S sequence, T tokens, D hidden, F expert mlp, E experts, K experts
per token (top_k), N = T·K assignments (rows of the sorted buffer), C capacity.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.config import ModelConfig, MoeConfig
from jaxtrain.model.fp8_grouped import fp8_grouped_dot
from jaxtrain.model.layers import normal, param, swiglu
from jaxtrain.model.loss import Mean
from jaxtrain.model.router import (SCORE_FUNCTIONS, Routing, load_balancing_loss,  # noqa: F401
                                   route, sequence_aux_loss, tokens_per_expert, z_loss)

# Remat tags of the MoE layer (Megatron's recompute vocabulary: moe_act, moe, shared_experts;
# remat.MODULES maps those onto these): the router's choices, the experts' in-projections
# (sorted rows), their SwiGLU, their out-projections, the shared experts' gate/up, SwiGLU and
# down projection (llama.Mlp with tag "shared") and output, and the layer's output.
REMAT_TAGS = ("moe_router", "moe_in", "moe_act", "moe_out", "shared_in", "shared_act",
              "shared_out", "shared_experts", "moe")

F32 = jnp.float32


def ragged_dot(lhs_ND, rhs_EDF, group_sizes_E):
    """The default Ops.grouped_dot: `lax.ragged_dot` (XLA; on GPU at jax 0.10 an E-fold dense
    GEMM, see kernels/grouped_matmul.py for the Hopper kernel with the same contract)."""
    return jax.lax.ragged_dot(lhs_ND, rhs_EDF, group_sizes_E)


# ----------------------------------------------------------------------------- the router
# (model/router.py; its names stay importable from here)

@jax.custom_vjp
def attach_loss(y, loss):
    """y, with `loss` (a scalar) riding on it: the backward hands y's cotangent through and
    seeds `loss` with 1, as if it had been added to the summed loss (Megatron's
    MoEAuxLossAutoScaler)."""
    del loss
    return y


def _attach_fwd(y, loss):
    return y, jnp.zeros_like(loss)


def _attach_bwd(zero_loss, ct_y):
    return ct_y, jnp.ones_like(zero_loss)


attach_loss.defvjp(_attach_fwd, _attach_bwd)


# ----------------------------------------------------------------------------- statistics

class MoeStats(NamedTuple):
    """Sums over the MoE layer passes of a forward (and, added, over microbatches and data
    replicas): every field combines by addition. `summary` turns them into the logged means."""
    layers: jax.Array               # MoE layer passes
    loss: jax.Array                 # Σ T·(aux_loss_coeff·lb + seq_aux_loss_coeff·seq +
    #                                        z_loss_coeff·z): the summed-loss term
    load_balancing_loss: jax.Array  # Σ lb (1 when balanced)
    seq_aux_loss: jax.Array         # Σ seq (DeepSeek-V3's sequence-wise loss, 1 when balanced)
    z_loss: jax.Array               # Σ z
    load_max: jax.Array             # Σ max_e c_e / mean_e c_e
    load_min: jax.Array             # Σ min_e c_e / mean_e c_e
    load_cv: jax.Array              # Σ std_e c_e / mean_e c_e (coefficient of variation)
    dropped: jax.Array              # Σ assignments dropped for capacity
    routed: jax.Array               # Σ assignments (T·k)

    @classmethod
    def zeros(cls) -> "MoeStats":
        return cls(*(jnp.zeros((), F32) for _ in cls._fields))

    def __add__(self, other):  # a NamedTuple's + would concatenate
        return MoeStats(*(a + b for a, b in zip(self, other)))


def layer_stats(routing: Routing, e: MoeConfig, dropped, batch: int = 1) -> MoeStats:
    """One layer pass's MoeStats over its `batch` sequences (the tokens, `batch` x S)."""
    counts_E = tokens_per_expert(routing.experts_TK, e.num_experts)
    t = routing.experts_TK.shape[0]
    lb = load_balancing_loss(routing.scores_TE, counts_E, e.top_k)
    seq = sequence_aux_loss(routing.scores_TE, routing.experts_TK, batch)
    z = z_loss(routing.logits_TE)
    mean = jnp.mean(counts_E)
    one = jnp.ones((), F32)
    return MoeStats(
        layers=one,
        loss=t * (e.aux_loss_coeff * lb + e.seq_aux_loss_coeff * seq + e.z_loss_coeff * z),
        load_balancing_loss=lb, seq_aux_loss=seq, z_loss=z, load_max=jnp.max(counts_E) / mean,
        load_min=jnp.min(counts_E) / mean, load_cv=jnp.std(counts_E) / mean,
        dropped=jnp.asarray(dropped, F32), routed=one * (t * e.top_k))


def means(stats: MoeStats, tokens) -> dict[str, Mean]:
    """What a step logs, as Means the executors add up (LossSums.aux): the aux term in the
    loss's units (over the loss's token count, as the executors divide the summed loss), the
    raw losses and loads averaged over layer passes, the fraction of assignments dropped."""
    per_layer = lambda total: Mean(total, stats.layers)  # noqa: E731
    return {"moe_aux_loss": Mean(stats.loss, jnp.asarray(tokens, F32)),
            "moe_load_balancing_loss": per_layer(stats.load_balancing_loss),
            "moe_seq_aux_loss": per_layer(stats.seq_aux_loss),
            "moe_z_loss": per_layer(stats.z_loss), "moe_load_max": per_layer(stats.load_max),
            "moe_load_min": per_layer(stats.load_min), "moe_load_cv": per_layer(stats.load_cv),
            "moe_dropped_fraction": Mean(stats.dropped, stats.routed)}


def summary(stats: MoeStats, tokens) -> dict:
    """The logged values of `means`."""
    return {name: mean.value for name, mean in means(stats, tokens).items()}


# ----------------------------------------------------------------------------- capacity

def capacity(num_tokens: int, e: MoeConfig) -> int:
    """Tokens an expert takes under dispatch=capacity (Megatron's get_capacity)."""
    return math.ceil(num_tokens * e.top_k / e.num_experts * e.capacity_factor)


def capacity_slots(routing: Routing, cap: int, policy: str):
    """(slot_TK, keep_TK): each assignment's place in its expert's queue and whether it is
    within `cap`. policy "probs": the queue runs from the highest router weight down;
    "position": in token order. Ties go to the earlier token."""
    e = routing.scores_TE.shape[1]
    chosen_TKE = jax.nn.one_hot(routing.experts_TK, e, dtype=F32)
    chosen_TE = jnp.sum(chosen_TKE, axis=1)              # a token picks an expert at most once
    if policy == "position":
        rank_TE = jnp.cumsum(chosen_TE, axis=0) - 1
    else:
        weight_TE = jnp.einsum("tke,tk->te", chosen_TKE, routing.weights_TK)
        key_TE = jnp.where(chosen_TE > 0, -weight_TE, jnp.inf)
        order_TE = jnp.argsort(key_TE, axis=0, stable=True)
        rank_TE = jnp.argsort(order_TE, axis=0, stable=True).astype(F32)
    slot_TK = jnp.take_along_axis(rank_TE, routing.experts_TK, axis=1).astype(jnp.int32)
    return slot_TK, slot_TK < cap


def to_capacity(x_TD, experts_TK, slot_TK, keep_TK, num_experts: int, cap: int):
    """[E, C, D]: each expert's kept tokens in their slots, zeros in the empty ones."""
    t, k = experts_TK.shape
    slot_TK = jnp.where(keep_TK, slot_TK, cap)            # out of range: dropped by the scatter
    x_TKD = jnp.broadcast_to(x_TD[:, None, :], (t, k, x_TD.shape[1]))
    return jnp.zeros((num_experts, cap, x_TD.shape[1]), x_TD.dtype).at[
        experts_TK, slot_TK].set(x_TKD, mode="drop")


def from_capacity(y_ECD, experts_TK, slot_TK, weights_TK):
    """[T, D] fp32: each token's slot outputs weighted and summed (a dropped assignment's
    weight must be zero)."""
    y_TKD = y_ECD[experts_TK, jnp.minimum(slot_TK, y_ECD.shape[1] - 1)]
    return jnp.einsum("tkd,tk->td", y_TKD.astype(F32), weights_TK)


# ----------------------------------------------------------------------------- sorted rows

class Permutation(NamedTuple):
    order_N: jax.Array          # int32: row n of the sorted buffer holds assignment order_N[n]
    group_sizes_E: jax.Array    # int32: kept rows per expert (dropped rows come after them)


def permute(x_TD, experts_TK, num_experts: int, keep_TK=None):
    """(x_ND, Permutation): the tokens' rows, one per assignment (t·K + j), sorted by expert
    (stable: token order within an expert); dropped assignments (keep_TK false) last."""
    e_N = experts_TK.reshape(-1)
    if keep_TK is not None:
        e_N = jnp.where(keep_TK.reshape(-1), e_N, num_experts)  # sorts after every expert
    order_N = jnp.argsort(e_N, stable=True).astype(jnp.int32)
    sizes_E = jnp.sum(jax.nn.one_hot(e_N, num_experts, dtype=jnp.int32), axis=0)
    return x_TD[order_N // experts_TK.shape[1]], Permutation(order_N, sizes_E)


def expert_swiglu(x, w_gate_EDF, w_up_EDF, w_down_EFD, matmul):
    """The experts' SwiGLU: `matmul(x, w_E..)` multiplies every expert's rows of x by its
    matrix (the grouped GEMM on rows sorted by expert, or a batched einsum on [E, C]
    buffers)."""
    gate = checkpoint_name(matmul(x, w_gate_EDF), "moe_in")
    up = checkpoint_name(matmul(x, w_up_EDF), "moe_in")
    h = checkpoint_name(swiglu(gate, up), "moe_act")
    return checkpoint_name(matmul(h, w_down_EFD), "moe_out")


def _batched(x_ECD, w_EDF):
    return jnp.einsum("ecd,edf->ecf", x_ECD, w_EDF)


def local_dispatch(x_TD, experts_TK, weights_TK, keep_TK, num_experts: int, experts_fn,
                   params):
    """The default Ops.dispatch (every expert here): permute, `experts_fn(params, x_ND,
    group_sizes_E)` on the rows sorted by expert (`params`: the experts' weights, a tree of
    [experts, ...] leaves), unpermute. Expert parallelism's (parallel/expert_dispatch.py) has
    the same contract and puts its all-to-alls between; under folding it splits `params`."""
    x_ND, perm = permute(x_TD, experts_TK, num_experts, keep_TK)
    return unpermute(experts_fn(params, x_ND, perm.group_sizes_E), perm.order_N, weights_TK)


def unpermute(y_ND, order_N, weights_TK):
    """[T, D] fp32: each token's K expert outputs (rows of the sorted buffer) weighted and
    summed (a dropped assignment's weight must be zero)."""
    t, k = weights_TK.shape
    inverse_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(order_N.shape[0],
                                                                    dtype=order_N.dtype))
    y_TKD = y_ND[inverse_N].reshape(t, k, y_ND.shape[1])
    return jnp.einsum("tkd,tk->td", y_TKD.astype(F32), weights_TK)


# ----------------------------------------------------------------------------- the layer

class MoeLayer(nnx.Module):
    """Router, routed SwiGLU experts stacked [E, ...] (logical axis `experts`), and the shared
    experts when the config has them (`shared`: a dense SwiGLU module the block builds)."""

    def __init__(self, cfg: ModelConfig, ops, rngs: nnx.Rngs, shared: Optional[Callable] = None):
        e = cfg.moe
        d, f, n = cfg.hidden_size, cfg.expert_mlp_size, e.num_experts
        pdt = jnp.dtype(cfg.param_dtype)
        self.router = param(rngs, normal(1.0 / math.sqrt(d)), (d, n), ("embed", None), pdt)
        self.w_gate = param(rngs, normal(1.0 / math.sqrt(d)), (n, d, f),
                            ("experts", "embed", "mlp"), pdt)
        self.w_up = param(rngs, normal(1.0 / math.sqrt(d)), (n, d, f),
                          ("experts", "embed", "mlp"), pdt)
        self.w_down = param(rngs, normal(1.0 / math.sqrt(f * 2 * cfg.num_layers)), (n, f, d),
                            ("experts", "mlp", "embed"), pdt)
        if e.pad_to_capacity:
            ops.fp8.refuse("Ops.fp8 with model.moe.pad_to_capacity: the [experts, capacity] "
                           "buffers have no FP8 path; set model.moe.pad_to_capacity=false")
        # FP8 (None when off): one meta per expert per projection, stacked [E] like the weights
        self.fp8_gate, self.fp8_up, self.fp8_down = (ops.fp8.new_meta((n,)) for _ in range(3))
        if e.expert_bias:   # the balancing bias: fp32 state the train step moves (moe_balance)
            self.expert_bias = param(rngs, jax.nn.initializers.zeros, (n,), (None,), F32)
        self.shared = shared
        self.moe_cfg = e
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.ops = ops

    def _grouped_matmul(self, fp8: bool, group_sizes):
        """(x, w) -> the experts' grouped product; in FP8 `w` is (weights, per-expert meta),
        the meta sliced to the experts the weights hold (this rank's under expert
        parallelism: `Ops.dispatch.local_experts`)."""
        if not fp8:
            return lambda x, w: self.ops.grouped_dot(x, w, group_sizes)
        recipe = self.ops.fp8.recipe

        def matmul(x, w_meta):
            w, meta = w_meta
            if meta.x.scale.shape[0] != w.shape[0]:
                meta = self.ops.dispatch.local_experts(meta, meta.x.scale.shape[0])
            return fp8_grouped_dot(x, w, group_sizes, meta=meta, recipe=recipe,
                                   grouped_dot=self.ops.grouped_dot, name="blocks/moe/experts")
        return matmul

    def __call__(self, x_BSD, fp8: bool = False) -> tuple[jax.Array, MoeStats]:
        """x_BSD: the norm output. Returns the layer's output (compute dtype, its auxiliary
        losses attached) and this pass's MoeStats. `fp8`: the experts' grouped GEMMs (and the
        shared experts' projections) in FP8 with their per-expert metas; the router stays
        fp32."""
        e, c = self.moe_cfg, self.ops.constrain
        x_BSD = c(x_BSD, ("batch", "sequence", "embed"))
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d).astype(self.compute_dtype)
        routing = route(x_TD, self.router[...], e,
                        self.expert_bias[...] if e.expert_bias else None)
        experts_TK = checkpoint_name(routing.experts_TK, "moe_router")
        weights_TK = checkpoint_name(routing.weights_TK, "moe_router")
        weights = [w[...].astype(self.compute_dtype) for w in (self.w_gate, self.w_up,
                                                             self.w_down)]
        keep_TK, dropped = None, 0.0
        if e.dispatch == "capacity":
            cap = capacity(b * s, e)
            slot_TK, keep_TK = capacity_slots(routing, cap, e.drop_policy)
            weights_TK = jnp.where(keep_TK, weights_TK, 0.0)
            dropped = jnp.sum(~keep_TK)
        if e.dispatch == "capacity" and e.pad_to_capacity:
            x_ECD = to_capacity(x_TD, experts_TK, slot_TK, keep_TK, e.num_experts, cap)
            y_ECD = expert_swiglu(x_ECD, *weights, _batched)
            y_TD = from_capacity(y_ECD, experts_TK, slot_TK, weights_TK)
        else:   # dropless, or the kept rows sorted the same way (weights: this rank's experts)
            if fp8:
                metas = [self.ops.fp8.meta_value(m) for m in (self.fp8_gate, self.fp8_up,
                                                              self.fp8_down)]
                weights = list(zip(weights, metas))

            def experts_fn(weights, x_ND, group_sizes):
                return expert_swiglu(x_ND, *weights, self._grouped_matmul(fp8, group_sizes))
            y_TD = self.ops.dispatch(x_TD, experts_TK, weights_TK, keep_TK, e.num_experts,
                                     experts_fn, weights)
        y_BSD = y_TD.reshape(b, s, d).astype(self.compute_dtype)
        if self.shared is not None:
            y_BSD = y_BSD + checkpoint_name(self.shared(x_BSD, fp8), "shared_experts")
        stats = layer_stats(routing, e, dropped, b)
        if e.aux_loss_coeff or e.seq_aux_loss_coeff or e.z_loss_coeff:
            y_BSD = attach_loss(y_BSD, stats.loss)
        stats = jax.tree.map(jax.lax.stop_gradient, stats)
        return checkpoint_name(c(y_BSD, ("batch", "length", "embed")), "moe"), stats

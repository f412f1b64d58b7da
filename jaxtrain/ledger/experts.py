"""Mixture-of-experts terms of the ledger: expert weights per rank, an MoE layer's stored
activations by remat tag, the dispatch's all-to-all bytes and buffers (docs/design.md §5).

Conventions:
- Expert parallelism carves `expert` ranks out of the data-parallel ones (Megatron's
  --expert-model-parallel-size): an MoE layer's experts are split E/expert per rank (their
  SwiGLU also over `tensor`, as the dense MLP), its attention, norms, router and shared
  experts stay whole. Expert weights are data-parallel over the other data·context/expert
  ranks: their gradients are reduced there, ZeRO-1 shards their optimizer state there.
- Rows: the expert GEMMs run on T·r rows for T tokens, r = top_k (dropless, and what Megatron's
  FLOP count assumes), top_k·capacity_factor with pad_to_capacity (every [E, C] slot runs),
  min(top_k, top_k·capacity_factor) for the kept rows of capacity without padding. With the
  load balanced, an expert rank receives as many rows as it sends.
- Buffers: the executor's shapes are static, so the expert GEMMs run on (and store for the
  backward) a buffer of fixed rows, not the routed ones: T·top_k sorted rows without expert
  parallelism (capacity's dropped rows sort last, still in it); with it, a rank's receive
  buffer of ep blocks of T·top_k rows (any sender may route all its rows to one rank:
  dropless' worst case, parallel/expert_dispatch.py), of which T·r arrive when the load is
  balanced. The kernels skip row tiles in no group, so FLOPs follow the routed rows and
  memory the buffer's (`buffer_rows_per_token`); with pad_to_capacity both are the [E, C]
  slots.
- MoE parallel folding (parallel.expert_tensor=1, `Layout.folded`): `expert` counts the tensor
  ranks too (expert/t carved out of data); each expert is whole on its rank (E/ep experts, no
  /t), and each tensor rank routes its T/t of the layer's tokens, so rows, buffers and
  all-to-all bytes per device take T/t tokens over the ep-rank group, whose span is the
  unfolded group's (t·c·fsdp·ep/t devices).
- All-to-all (the alltoall dispatcher): a forward pass sends the rows out and their outputs
  back, two all-to-alls of (ep-1)/ep · rows · h in the compute dtype; the backward pass the
  same two with cotangents. The expert ranks are the fastest-varying part of `data` (device
  order tensor, context, fsdp, expert, data, stage), so the group spans t·c·fsdp·ep devices.
- Stored per MoE layer per microbatch (compute dtype, fp32 where said), by tag: moe_router the
  experts (int32) and weights (fp32) of each token, moe_in gate and up (2 x rows·F/t),
  moe_act their SwiGLU (rows·F/t), moe_out the expert outputs before the combine (rows·h: the
  router weights' gradient needs them), shared_in / shared_act the shared experts' gate, up
  and SwiGLU (tokens·F_s/t); without a checkpoint also the permuted input rows (rows·h, the
  experts' weight gradient). The layer output (tag moe) and shared_out feed only adds: the
  backward keeps neither. The all-to-all's send and receive buffers (2 x rows·h) are a working
  set of one layer at a time.
"""
from __future__ import annotations

from jaxtrain.config import Config, RematConfig, expert_from_data
from jaxtrain.ledger.flops import expert_rows_per_token
from jaxtrain.ledger.layout import Layout

# Tags that no selective choice needs stored (only an add reads them).
_UNSTORED = ("moe", "shared_out", "shared_experts")

# remat.modules of Megatron's MoE vocabulary -> the tags it stops saving (remat.MODULES has
# them; here so the jax-free ledger prices the same choice): moe_act the experts' SwiGLU
# (recomputed from gate and up, no matmul), moe the whole routed part (router, in, SwiGLU,
# out: its dispatch re-runs too), shared_experts the shared experts' insides.
MODULE_TAGS = {"moe_act": ("moe_act",),
               "moe": ("moe_router", "moe_in", "moe_act", "moe_out", "moe"),
               "shared_experts": ("shared_in", "shared_act", "shared_out", "shared_experts")}


def moe_fraction(cfg: Config) -> float:
    """The share of layers that are MoE layers."""
    kinds = cfg.model.moe_layers
    return sum(kinds) / len(kinds)


def rows_per_token(cfg: Config) -> float:
    """Expert GEMM rows per token (module docstring)."""
    return expert_rows_per_token(cfg.model)


def buffer_rows_per_token(cfg: Config, layout: Layout) -> float:
    """Rows per token of the buffers the expert GEMMs run on and store (module docstring)."""
    e = cfg.model.moe
    if e is None:
        return 0.0
    if e.dispatch == "capacity" and e.pad_to_capacity:
        return rows_per_token(cfg)
    return float(e.top_k * layout.expert)


def layer_tokens(cfg: Config, layout: Layout, seq_len: int) -> float:
    """Tokens an MoE layer routes per device per microbatch (s/c · b)."""
    return seq_len / layout.context * layout.micro_batch


def dispatched_tokens(cfg: Config, layout: Layout, seq_len: int) -> float:
    """Tokens a device dispatches to the experts per MoE layer and microbatch: the routed
    ones, under folding its tensor rank's 1/t of them."""
    return layer_tokens(cfg, layout, seq_len) / (layout.tensor if layout.folded else 1)


def expert_params_local(cfg: Config, layout: Layout) -> float:
    """One MoE layer's routed expert parameters held per device: E/ep experts' SwiGLU / t
    (whole under folding)."""
    m = cfg.model
    return (m.moe.num_experts / layout.expert * 3 * m.hidden_size * m.expert_mlp_size
            / layout.expert_tensor_degree)


def moe_layer_params_local(cfg: Config, layout: Layout, attention_and_norms: float) -> float:
    """One MoE layer per device: attention and norms (as a dense layer's), router, E/ep
    experts, shared experts / t."""
    m = cfg.model
    return (attention_and_norms + m.hidden_size * m.moe.num_experts
            + expert_params_local(cfg, layout)
            + 3 * m.hidden_size * m.shared_mlp_size / layout.tensor)


def expert_data_ranks(layout: Layout) -> int:
    """The ranks an expert's weights are data-parallel over (their gradient's reduction):
    data·context over the expert ranks carved out of data."""
    return layout.data * layout.context // expert_from_data(layout.expert, layout.tensor,
                                                            layout.expert_tensor)


def activation_bytes_by_tag(cfg: Config, layout: Layout, seq_len: int) -> dict[str, float]:
    """What one MoE layer stores per microbatch, by remat tag ("rows" is the untagged permuted
    input, stored only without a checkpoint); see the module docstring."""
    m, t = cfg.model, layout.tensor
    c = 4 if m.compute_dtype == "float32" else 2
    tokens = layer_tokens(cfg, layout, seq_len)
    rows = dispatched_tokens(cfg, layout, seq_len) * buffer_rows_per_token(cfg, layout)
    f, fs, h = m.expert_mlp_size / layout.expert_tensor_degree, m.shared_mlp_size / t, m.hidden_size
    return {"moe_router": tokens * m.moe.top_k * (4 + 4), "moe_in": 2 * c * rows * f,
            "moe_act": c * rows * f, "moe_out": c * rows * h,
            "shared_in": 2 * c * tokens * fs, "shared_act": c * tokens * fs,
            **{tag: 0.0 for tag in _UNSTORED}, "rows": c * rows * h}


def stored_bytes(cfg: Config, layout: Layout, seq_len: int, dropped: frozenset[str],
                 checkpointed: bool) -> float:
    """One MoE layer's stored MLP-side activations when the tags in `dropped` are recomputed;
    `checkpointed`: the layer runs under a jax.checkpoint policy (the untagged rows are then
    recomputed from the layer input)."""
    by_tag = activation_bytes_by_tag(cfg, layout, seq_len)
    return sum(v for k, v in by_tag.items()
               if k not in dropped and not (k == "rows" and checkpointed))


def dispatch_buffer_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """The all-to-all's send and receive buffers of one MoE layer (0 without expert ranks):
    T·top_k rows sent, the ep·T·top_k rows of the receive buffer."""
    if layout.expert == 1 or not any(cfg.model.moe_layers):
        return 0.0
    c = 4 if cfg.model.compute_dtype == "float32" else 2
    rows = dispatched_tokens(cfg, layout, seq_len) * cfg.model.moe.top_k
    return c * (1 + layout.expert) * rows * cfg.model.hidden_size


def all_to_all_pass_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """One MoE layer pass's (forward, or backward: the same) all-to-all bytes per device: the
    rows out and back, (ep-1)/ep of them leaving the rank, bf16 convention."""
    ep = layout.expert
    if ep == 1:
        return 0.0
    rows = dispatched_tokens(cfg, layout, seq_len) * rows_per_token(cfg)
    return 2 * (ep - 1) / ep * rows * cfg.model.hidden_size * 2


def all_to_all_bytes(cfg: Config, layout: Layout, remat: RematConfig, seq_len: int,
                     passes) -> float:
    """The MoE layers' all-to-alls per device per step over `passes` (comm.Passes: full
    recompute's forwards included): two a pass, and the forward's again in each backward that
    selective `moe` recomputes."""
    if layout.expert == 1 or not any(cfg.model.moe_layers):
        return 0.0
    again = passes.backward if (remat.granularity == "selective"
                                and "moe" in remat.modules) else 0.0
    return (moe_fraction(cfg) * all_to_all_pass_bytes(cfg, layout, seq_len)
            * (passes.forward + passes.backward + again))

"""Parameters one device holds and computes with, per layout (after TP, PP and expert
parallelism, before FSDP and ZeRO-1 divide them): a layer's by kind, the layers a pipeline
rank holds (v chunks of the largest chunk, padding included) and how many are MoE, the vocab
tables and the edge row (rank 0 the embedding, rank p-1 the head and the final norm), the
MTP modules', and whose fp32 masters and moments it keeps (with stages 1/p of the tables:
parallel/sharding.stage_state_axis). ledger.memory turns them into bytes; comm into traffic.
"""
from __future__ import annotations

from jaxtrain.config import Config, padded_vocab
from jaxtrain.ledger import experts, latent
from jaxtrain.ledger.flops import mtp_extra_params, param_counts
from jaxtrain.ledger.layout import Layout


def _layer_kinds_local(cfg: Config, tensor: int, expert: int, expert_tensor: int = 0
                       ) -> tuple[float, float]:
    """(a dense layer's, an MoE layer's) parameters per device (KV replicated when
    kv_heads < t; an MoE layer's E/expert experts, ledger.experts; `expert_tensor` 1:
    folded, each expert whole)."""
    m = cfg.model
    per = param_counts(m).per_layer
    attention = latent.attention_params_local(m, tensor)   # GQA or MLA
    dense = attention + (per["gate"] + per["up"] + per["down"]) / tensor
    if m.moe is None:
        return dense, dense
    layout = Layout(tensor=tensor, expert=expert, expert_tensor=expert_tensor)
    return dense, experts.moe_layer_params_local(cfg, layout, attention)


def layer_params_local(cfg: Config, tensor: int, expert: int = 1, expert_tensor: int = 0
                       ) -> float:
    """Parameters of one layer held per tensor rank; with MoE layers averaged over the dense
    and MoE ones (exact when every layer, or none, is MoE)."""
    dense, moe = _layer_kinds_local(cfg, tensor, expert, expert_tensor)
    frac = experts.moe_fraction(cfg) if cfg.model.moe is not None else 0.0
    return (1 - frac) * dense + frac * moe


def held_moe_layers(cfg: Config, layout: Layout, stage_layers: tuple[int, ...]) -> int:
    """The most MoE layers a device holds: pipeline chunk c (layer order) of
    stage_layers[c % p] / v layers sits on rank c % p; a padded rank's padding counted as MoE
    (an upper bound)."""
    kinds = cfg.model.moe_layers
    if not any(kinds):
        return 0
    p, v = layout.stage, layout.virtual_stages
    counts, start = [0] * p, 0
    for c in range(p * v):
        size = stage_layers[c % p] // v
        counts[c % p] += sum(kinds[start:start + size])
        start += size
    held = held_layers(layout, stage_layers)
    return max(n + held - stage_layers[r] for r, n in enumerate(counts))


def expert_params_held(cfg: Config, layout: Layout, stage_layers: tuple[int, ...]) -> float:
    """Routed expert parameters one device holds (its MoE layers' E/expert experts)."""
    if cfg.model.moe is None:
        return 0.0
    return (held_moe_layers(cfg, layout, stage_layers)
            * experts.expert_params_local(cfg, layout))


def vocab_params_local(cfg: Config, tensor: int) -> float:
    """Embedding + head (one table when tied) + final norm per tensor rank (vocab-parallel)."""
    m = cfg.model
    table = padded_vocab(m.vocab_size, tensor) * m.hidden_size / tensor
    return table * (1 if m.tie_embeddings else 2) + m.hidden_size


def edge_params_local(cfg: Config, tensor: int) -> float:
    """One vocab table + the final norm per tensor rank: a pipeline rank's edge row."""
    m = cfg.model
    return padded_vocab(m.vocab_size, tensor) * m.hidden_size / tensor + m.hidden_size


def edge_row_local(cfg: Config, layout: Layout) -> float:
    """A pipeline rank's edge row (edge_params_local) under stages, 0 without them."""
    return edge_params_local(cfg, layout.tensor) if layout.stage > 1 else 0.0


def held_layers(layout: Layout, stage_layers: tuple[int, ...]) -> int:
    """Layers a device holds: v chunks of the largest chunk (padding included)."""
    v = layout.virtual_stages
    return v * (max(stage_layers) // v)


def _layers_local(cfg: Config, layout: Layout, stage_layers: tuple[int, ...]) -> float:
    """The layers' parameters on the device holding the most MoE layers."""
    dense, moe = _layer_kinds_local(cfg, layout.tensor, layout.expert, layout.expert_tensor)
    n_moe = held_moe_layers(cfg, layout, stage_layers)
    return n_moe * moe + (held_layers(layout, stage_layers) - n_moe) * dense


def params_local(cfg: Config, layout: Layout, stage_layers: tuple[int, ...]) -> float:
    """Parameters one device computes with (after TP and PP, before FSDP): the same on every
    pipeline rank, which holds v chunks of the largest chunk (padding included) and its edge
    row (one vocab table); without stages the layers and both tables."""
    vocab = edge_row_local(cfg, layout) or vocab_params_local(cfg, layout.tensor)
    return _layers_local(cfg, layout, stage_layers) + vocab + mtp_params_local(cfg, layout.tensor)


def state_params_local(cfg: Config, layout: Layout, stage_layers: tuple[int, ...]) -> float:
    """Parameters whose fp32 master and Adam moments one device holds: its layers, and with
    stages 1/p of both vocab tables and the final norm (the masters of what the compute copy
    has replicated over stage split over it: parallel/sharding.stage_state_axis; with Megatron
    N/(t·p) on average over the ranks)."""
    return (_layers_local(cfg, layout, stage_layers)
            + vocab_params_local(cfg, layout.tensor) / vocab_state_shards(cfg, layout)
            + mtp_params_local(cfg, layout.tensor))


def vocab_state_shards(cfg: Config, layout: Layout) -> int:
    """Over how many stage ranks the vocab tables' masters and moments split: p where a tensor
    rank's vocab rows divide by it (the largest dim takes `stage`), else 1 (replicated)."""
    rows = padded_vocab(cfg.model.vocab_size, layout.tensor) // layout.tensor
    return layout.stage if rows % layout.stage == 0 else 1


def mtp_params_local(cfg: Config, tensor: int) -> float:
    """The MTP modules' parameters per tensor rank: a dense layer each, split as the stack's,
    and eh_proj and the norms whole (model/mtp.py; 0 without MTP, which runs unpipelined)."""
    m = cfg.model
    if not m.mtp_depths:
        return 0.0
    return m.mtp_depths * (_layer_kinds_local(cfg, tensor, 1)[0] + mtp_extra_params(m))

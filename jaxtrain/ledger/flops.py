"""Parameter counts, model FLOPs (Megatron/MaxText convention), recompute FLOPs, MFU and HFU.

Model FLOPs per token = 6·N + 6·L·(H·E)·s (docs/design.md §5): N counts every parameter except
the input embedding (the lm_head is a matmul, so it counts; with tied embeddings the one table
is the lm_head and N equals the total; of an MoE layer's experts only the top_k a token
activates, as Megatron's num_floating_point_operations counts them: router h·E, top_k x the
expert SwiGLU 3·h·F_e, the shared experts' 3·h·F_s, so MFU counts activated work, never every
expert), H·E is the query width (the hidden size for Llama; under MLA H·(E + F)/2, QK^T over
the q/k head size E and PV over the value head size F: ledger.latent),
s the sequence length. The attention term counts the causal half of the s×s products, as
Megatron-LM's and MaxText's FLOP counters now do; `causal=False` gives the full square of
PaLM's and Megatron's papers (12·L·(H·E)·s), which is also what XLA's attention computes, so
comparisons with compiled FLOPs use it. MFU divides model FLOPs by peak; HFU adds what is run
again: the remat config's recompute, attention counted the same way. The pipeline executor
runs nothing again on top (ledger.pipeline: a B applies the pullback its F stashed).
"""
from __future__ import annotations

import dataclasses

from jaxtrain.config import Config, ConfigError, ModelConfig, RematConfig
from jaxtrain.ledger import latent
from jaxtrain.ledger.layout import stage_layer_counts


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    per_layer: dict            # q, k, v, o, gate, up, down, norms -> parameters of a dense layer
    embedding: int             # input table, V·h
    lm_head: int               # V·h, 0 when tied to the embedding
    final_norm: int
    num_layers: int
    # An MoE layer's (model.moe): q, k, v, o, norms, router (h·E), experts (all E of them:
    # E·3·h·F_e), shared (3·h·F_s), router_bias (E with expert_bias); empty without MoE layers.
    per_moe_layer: dict = dataclasses.field(default_factory=dict)
    moe_layers: int = 0
    active_expert_fraction: float = 1.0   # top_k / num_experts: what a token runs of "experts"
    # Multi-token prediction (model.mtp): the D modules' parameters (a dense layer, eh_proj's
    # 2·h·h and three norms each), and the shared head's V·h that each module multiplies by
    # again (not stored: counted in the FLOPs' N only).
    mtp: int = 0
    mtp_head: int = 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def layers(self) -> int:
        return self.dense_layers * sum(self.per_layer.values()) + self.moe_layers * sum(
            self.per_moe_layer.values())

    @property
    def layers_active(self) -> float:
        """The layers' parameters a token's forward multiplies by: the top_k experts only."""
        idle = self.per_moe_layer.get("experts", 0) * (1 - self.active_expert_fraction)
        return self.layers - self.moe_layers * idle

    @property
    def layer(self) -> float:
        """A layer's parameters, averaged over the dense and MoE layers."""
        return self.layers / self.num_layers

    @property
    def layer_active(self) -> float:
        return self.layers_active / self.num_layers

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.lm_head + self.final_norm + self.mtp

    @property
    def non_embedding(self) -> int:
        """N without the input embedding unless it doubles as lm_head (every expert counted)."""
        return self.total - (self.embedding if self.lm_head else 0)

    @property
    def active_non_embedding(self) -> float:
        """N of the FLOPs formula: non_embedding with only the activated experts, and the
        head once more per MTP module."""
        return self.non_embedding - self.layers + self.layers_active + self.mtp_head


def param_counts(model: ModelConfig) -> ParamCounts:
    h, F = model.hidden_size, model.mlp_size
    attention = latent.attention_params(model)   # GQA's q, k, v, o or MLA's (ledger.latent)
    per_layer = {**attention, "gate": h * F, "up": h * F, "down": F * h}
    table = model.vocab_size * h
    moe, n_moe, active = {}, sum(model.moe_layers), 1.0
    if n_moe:
        e = model.moe
        moe = {**attention, "router": h * e.num_experts,
               "experts": e.num_experts * 3 * h * model.expert_mlp_size,
               "shared": 3 * h * model.shared_mlp_size,
               # the balancing bias: an fp32 param leaf, never trained (model/moe_balance.py)
               "router_bias": e.num_experts if e.expert_bias else 0}
        active = e.top_k / e.num_experts
    d = model.mtp_depths
    return ParamCounts(per_layer=per_layer, embedding=table,
                       lm_head=0 if model.tie_embeddings else table, final_norm=h,
                       num_layers=model.num_layers, per_moe_layer=moe, moe_layers=n_moe,
                       active_expert_fraction=active,
                       mtp=d * (sum(per_layer.values()) + mtp_extra_params(model)),
                       mtp_head=d * table)


def mtp_extra_params(model: ModelConfig) -> int:
    """What an MTP module holds beside its dense block: eh_proj (2·h·h) and its three norms
    (embedding, hidden, output)."""
    h = model.hidden_size
    return 2 * h * h + 3 * h


def projection_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int, str]]:
    """{projection param path: (K contracting size, N output size, which of them tensor shards)}
    of one layer's GEMMs (what FP8 must align: config_check.check_fp8_layout)."""
    d, h, k, e, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim,
                     cfg.mlp_size)
    return {"blocks/attn/wq": (d, h * e, "N"), "blocks/attn/wk": (d, k * e, "N"),
            "blocks/attn/wv": (d, k * e, "N"), "blocks/attn/wo": (h * e, d, "K"),
            "blocks/mlp/w_gate": (d, f, "N"), "blocks/mlp/w_up": (d, f, "N"),
            "blocks/mlp/w_down": (f, d, "K")}


# The share of the s×s score and PV products a causal mask keeps (the lower triangle).
CAUSAL_FRACTION = 0.5


def _attention_fraction(causal: bool) -> float:
    return CAUSAL_FRACTION if causal else 1.0


def attention_flops_per_token(model: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """QK^T and PV, forward (4) plus backward (8), per token: 12·L·(H·E)·s for the full square,
    half of it causal; L counts the MTP modules' blocks."""
    return (12.0 * (model.num_layers + model.mtp_depths) * latent.attention_width(model)
            * seq_len * _attention_fraction(causal))


def model_flops_per_token(cfg: Config, seq_len: int | None = None, *,
                          causal: bool = True) -> float:
    """6·N + 6·L·h·s (causal; 12·L·h·s with causal=False), forward plus backward, no
    recompute; N with the activated experts only (ParamCounts.active_non_embedding)."""
    seq_len = seq_len or cfg.train.seq_len
    return (6.0 * param_counts(cfg.model).active_non_embedding
            + attention_flops_per_token(cfg.model, seq_len, causal=causal))


# Forward FLOPs per token per layer that recomputing each tagged activation re-runs
# (docs/design.md §3 tags; "mlp" and "layernorm" are Megatron's --recompute-modules names),
# for a dense layer and for an MoE layer (no dense MLP; "moe_act", "moe" and "shared_experts"
# are Megatron's MoE modules, ledger.experts.MODULE_TAGS), beside what every selective
# policy re-runs whichever modules it names (`base`). Norms, RoPE and the SwiGLU product are
# elementwise: not counted, as in model FLOPs. The causal count is a flash kernel's, the
# full square XLA's core's (as estimate.py pairs them); measured against both compiled
# programs (tests/test_remat.py; a flash kernel's re-run forward on the H100 compile).
def _module_flops(model: ModelConfig, seq_len: int, causal: bool,
                  rows_per_token: float = 0.0) -> tuple[dict[str, float], dict[str, float],
                                                         float, float]:
    h, F = model.hidden_size, model.mlp_size
    attn = 4.0 * latent.attention_width(model) * seq_len * _attention_fraction(causal)
    # The core's internals carry no tag, so every selective policy re-runs them: a flash
    # kernel's forward (QK^T and PV: its logsumexp is not saved), or XLA's QK^T and softmax
    # (the probabilities' backward reads them; the context is kept unless core_attn_out).
    base = attn if causal else attn / 2
    shared = {"layer_input": 0.0, "attn_norm": 0.0, "mlp_norm": 0.0, "layernorm": 0.0,
              **latent.projection_flops(model),   # qkv_proj, mla_up_proj
              "core_attn": 0.0, "core_attn_out": 0.0 if causal else attn / 2,
              "attn_out": 2.0 * model.num_heads * model.v_head_dim * h}
    # the down projection's output feeds nothing the backward needs: mlp re-runs gate and up
    mlp = {"mlp_act": 0.0, "mlp_in": 4.0 * h * F, "mlp_out": 0.0, "mlp": 4.0 * h * F}
    fe, fs, r = model.expert_mlp_size, model.shared_mlp_size, rows_per_token
    # moe_out and moe re-run the down projection: the router weights' gradient reads its rows.
    # The router's GEMM (2·h·E) re-runs under every selective policy, as the attention core's
    # insides do (its untagged logits feed the softmax's backward): no module's own.
    router = 2.0 * h * model.moe.num_experts if model.moe else 0.0
    moe = {"moe_router": 0.0, "moe_in": 4.0 * h * fe * r, "moe_act": 0.0,
           "moe_out": 2.0 * fe * h * r, "moe": 6.0 * h * fe * r,
           "shared_in": 4.0 * h * fs, "shared_act": 0.0, "shared_out": 2.0 * fs * h,
           "shared_experts": 4.0 * h * fs}
    dense = {**shared, **mlp, **dict.fromkeys(moe, 0.0)}
    return dense, {**shared, **dict.fromkeys(mlp, 0.0), **moe}, base, base + router


def layer_forward_flops_per_token(model: ModelConfig, seq_len: int, *,
                                  causal: bool = True) -> float:
    """One layer's forward per token: 2·(layer params) + 4·(H·E)·s (QK^T and PV; half causal),
    the activated params averaged over dense and MoE layers."""
    return (2.0 * param_counts(model).layer_active + 4.0 * latent.attention_width(model)
            * seq_len * _attention_fraction(causal))


def context_attention_imbalance(context: int, load_balanced: bool, flash: bool) -> float:
    """The busiest context rank's causal attention work over the average rank's: 1 when the
    sequence is load-balanced (rank r holds chunks r and 2c-1-r: 1/c each) or the core skips no
    masked tile (XLA computes every square), else (2c-1)/c (contiguous shards: the last rank's
    queries see (2c-1)/c² of the scores, and it sets the pace)."""
    if context == 1 or load_balanced or not flash:
        return 1.0
    return (2 * context - 1) / context


def context_block_flops(model: ModelConfig, seq_len: int, context: int, micro_batch: int,
                        tensor: int, *, flash: bool) -> float:
    """Forward FLOPs of one ring step per device: a shard's queries against one shard of keys,
    4·(H/t)·E·b·(s/c)² (QK^T and PV), half of it with a flash kernel (load-balanced, every step
    has half its tiles masked, the local causal one too)."""
    s = seq_len / context
    return (4.0 * latent.attention_width(model) / tensor * micro_batch * s * s
            * _attention_fraction(flash))


def recomputed_layers(remat: RematConfig, stage_layers: tuple[int, ...],
                      virtual_stages: int = 1) -> int:
    """Layers that full recompute re-runs: all for "uniform"; for "block" the first
    remat.num_layers of every pipeline chunk (0 means all)."""
    if remat.method == "uniform" or remat.num_layers == 0:
        return sum(stage_layers)
    chunk_layers = [c // virtual_stages for c in stage_layers]
    return sum(min(remat.num_layers, c) * virtual_stages for c in chunk_layers)


def recompute_flops_per_token(cfg: Config, remat: RematConfig | None = None,
                              stage_layers: tuple[int, ...] | None = None,
                              virtual_stages: int = 1, seq_len: int | None = None, *,
                              causal: bool = True) -> float:
    """Extra forward FLOPs per token that the remat config re-runs in the backward pass.

    Full: one forward of each recomputed layer, 2·(layer params) + 4·(H·E)·s, less the last
    projection a one-layer checkpoint drops (_dead_last_matmul_flops). Selective: in every
    layer what every selective policy re-runs (the attention core's untagged insides) and the
    forward of each listed module (_module_flops).
    """
    remat = remat or cfg.remat
    seq_len = seq_len or cfg.train.seq_len
    m = cfg.model
    if remat.granularity == "none":
        return 0.0
    counts = param_counts(m)
    if remat.granularity == "full":
        stage_layers = stage_layers or (m.num_layers,)
        n = recomputed_layers(remat, stage_layers, virtual_stages)
        # each MTP block is checkpointed whole (remat.single_layer_runner); eh_proj is not
        mtp_block = (2.0 * sum(counts.per_layer.values()) + 4.0 * latent.attention_width(m)
                     * seq_len * _attention_fraction(causal))
        dense_down, moe_down = _dead_last_matmul_flops(m)
        if remat.method == "block" or remat.num_layers == 1:
            # one layer per checkpoint: its last projection's output feeds nothing the
            # backward needs, so XLA drops it from the re-run (uniform:N>1 scans N layers
            # in one checkpoint, whose body's down projection feeds the next layer)
            share = counts.moe_layers / max(counts.num_layers, 1)
            n_dropped = n * ((1.0 - share) * dense_down + share * moe_down)
        else:
            n_dropped = 0.0
        return (n * layer_forward_flops_per_token(m, seq_len, causal=causal) - n_dropped
                + m.mtp_depths * (mtp_block - dense_down))
    dense, moe, base, moe_base = _module_flops(m, seq_len, causal, expert_rows_per_token(m))
    unknown = [x for x in remat.modules if x not in dense]
    if unknown:
        raise ConfigError(f"remat.modules has unknown {unknown}; known: {', '.join(dense)}")
    # offloaded modules come back from host memory: only the base re-runs
    listed = () if remat.offload else set(remat.modules)
    return sum(n * (b + sum(table[x] for x in listed))
               for n, table, b in ((counts.dense_layers + m.mtp_depths, dense, base),
                                   (counts.moe_layers, moe, moe_base)))


def _dead_last_matmul_flops(m: ModelConfig) -> tuple[float, float]:
    """Forward FLOPs per token of the projection a one-layer checkpoint's re-run drops, for a
    dense and for an MoE layer: the dense MLP's down projection (2·F·h); an MoE layer's shared
    experts' down projection (the routed experts' outputs stay: the combine's weight gradient
    reads them, so their down projection re-runs)."""
    return 2.0 * m.mlp_size * m.hidden_size, 2.0 * m.shared_mlp_size * m.hidden_size


def expert_rows_per_token(m: ModelConfig) -> float:
    """Expert GEMM rows per token (0 without MoE): top_k dropless (Megatron's FLOP count),
    top_k·capacity_factor when every [E, C] slot runs, min(top_k, that) for capacity's kept
    rows."""
    e = m.moe
    if e is None:
        return 0.0
    if e.dispatch == "dropless":
        return float(e.top_k)
    return e.top_k * (e.capacity_factor if e.pad_to_capacity else min(1.0, e.capacity_factor))


def hfu_flops_per_token(cfg: Config, remat: RematConfig | None = None,
                        stage_layers: tuple[int, ...] | None = None, virtual_stages: int = 1,
                        seq_len: int | None = None, *, causal: bool = True) -> float:
    """Model FLOPs + the remat config's recompute.

    stage_layers: layers per pipeline stage (block recompute counts per chunk); None takes
    the config's parallel.stage and virtual_stages (the trainer's metrics)."""
    if stage_layers is None and cfg.parallel.stage > 1:
        virtual_stages = cfg.parallel.virtual_stages
        stage_layers = stage_layer_counts(cfg, cfg.parallel.stage, virtual_stages)
    return (model_flops_per_token(cfg, seq_len, causal=causal)
            + recompute_flops_per_token(cfg, remat, stage_layers, virtual_stages, seq_len,
                                        causal=causal))


def tokens_per_step(cfg: Config) -> int:
    return cfg.train.global_batch * cfg.train.seq_len


def mfu(cfg: Config, tokens_per_sec: float, n_devices: int, peak_flops: float,
        seq_len: int | None = None, *, causal: bool = True) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over n_devices · peak."""
    return (tokens_per_sec * model_flops_per_token(cfg, seq_len, causal=causal)
            / (n_devices * peak_flops))


def hfu(cfg: Config, tokens_per_sec: float, n_devices: int, peak_flops: float,
        stage_layers: tuple[int, ...] | None = None, virtual_stages: int = 1,
        seq_len: int | None = None, *, causal: bool = True) -> float:
    """Hardware FLOPs utilisation: as mfu, counting what remat and the pipeline re-run."""
    return (tokens_per_sec * hfu_flops_per_token(cfg, None, stage_layers, virtual_stages, seq_len,
                                                 causal=causal)
            / (n_devices * peak_flops))

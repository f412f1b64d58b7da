"""Communication volume per device per step, the link each axis rides on, and the bubble.

Conventions (docs/design.md §5), N_local = parameters one device holds after TP and PP:
- DP: the step reduces its fp32 gradient sums (Megatron's default for bf16, not its
  --grad-reduce-in-bf16): ZeRO-1 reduce-scatters them and all-gathers the bf16 params,
  N_local·(4 + 2) bytes; plain DP all-reduces them, 2·N_local·4; with FSDP the shard
  N_local/fsdp is reduced.
- Layer collectives are counted per layer pass (`Passes`: forward and backward passes of one
  layer for one microbatch per device per step): without stages L·m of each; with stages the
  pipeline executor's (ledger.pipeline): each rank's m·v chunk forwards and backwards, of the
  largest chunk (idle ranks run none). Full recompute re-runs the forward (and its
  collectives) of the layers it recomputes in each backward pass; selective recompute
  re-runs no collective.
- FSDP: per layer pass for the layers (a forward pass gathers N_layer·2, N_layer·1 for FP8
  layers' projections (cast on the shard, gathered in FP8), a backward one
  gathers and reduce-scatters); the head (and final norm) gathered once per step (outside
  the microbatch loop) and reduce-scattered per microbatch; the embedding table never moves
  (its lookup gathers token ids and trades activations: two all-to-alls of s·b·h·2 per
  microbatch, sharded_kernels.ShardedLookup).
- TP with SP: per layer per microbatch 10 sequence-sized collectives of (t-1)/t·s·b·h·2 (the
  forward's 2 all-gathers + 2 reduce-scatters; the backward's 2 all-gathers of the output
  cotangents, 2 re-gathers of the norm outputs for the weight gradients, 2 reduce-scatters:
  Megatron-SP's). Without SP, 4 all-reduces of 2·(t-1)/t·s·b·h·2, half in each pass. A
  forward that full recompute re-runs skips its last collective (the layer's output) and,
  with SP, spares the backward its 2 re-gathers: 11 per layer per microbatch with SP, not 14
  (measured on the unpipelined step; estimate.py leaves the pipelined one at 14). Outside
  the layers, with SP, 5 per microbatch: the embedding's and the head's (`tp_rest_bytes`;
  unpipelined only: on a pipeline the embedding and head ranks are not yet modelled apart).
- PP: the executor's 2 sends (activation right, cotangent left) per table step, idle steps
  included, of one chunk input (s·b·h in the compute dtype, /t under SP).
- Vocab (stages only): the tables' and the final norm's masters are split over stage
  (parallel/sharding.stage_state_axis), so the embedding's gradient (rank 0) and the head's
  (+ final norm, rank p-1) are reduce-scattered over stage to the masters' shards in fp32
  and the compute-dtype copy is all-gathered once per step: ring (p-1)/p·(2 tables + h)·
  (4 + 2) bytes (one table's when tied: its two copies' gradients sum in the one
  reduce-scatter), where replicated masters took an fp32 all-reduce, 2·(p-1)/p·...·4; of the
  ZeRO-1 shard (/data): XLA reduce-scatters over data first, and under ZeRO-1 the copy's
  gather runs over (stage, data) at once (the GPU compiler's program, tests/
  test_gpu_compile_parallel.py: exact at p=2 and p=4).
- CP (context_attention.py), per layer pass, with a shard's K/V = 2·(s/c)·b·(K·E/t)·2 bytes
  (KV heads only; K·E/t is one head when KV heads are fewer than t): all_gather receives the
  other c-1 shards in a forward pass; a backward one gathers them again and reduce-scatters
  dK, dV (compute dtype). ring sends c-1 K/V hops in a forward pass; a backward one c-1 K/V
  hops, c-1 hops of the fp32 dK/dV accumulators and the one that brings them home, finished,
  in the compute dtype. The int32
  segment ids and positions that travel with K/V (4 bytes a token against 4·K·E/t) are left
  out. The ring's hops overlap the blocks' attention (estimate.py times each hop against its
  block).
- EP (ledger.experts): per MoE layer pass two all-to-alls (the rows out to their experts'
  ranks and back) of (ep-1)/ep · rows · h · 2, rows = tokens x top_k (dropless); full recompute
  and selective `moe` re-run the forward's. The experts' gradients are reduced over the
  data·context/ep ranks that hold the same experts (none when that is 1).
Sequence lengths are per context rank (s/c). Volumes are in bytes; seconds use nominal links:
an axis whose devices sit in one node (device order tensor, context, fsdp, data, stage; tensor
fastest) uses NVLink, otherwise the node's NIC.
"""
from __future__ import annotations

from typing import NamedTuple

from jaxtrain.config import Config, padded_vocab
from jaxtrain.ledger import experts as experts_lib, latent
from jaxtrain.ledger.hardware import Gpu
from jaxtrain.ledger.layout import Layout
from jaxtrain.ledger.pipeline import Executor, chunk_input_bytes


class Passes(NamedTuple):
    """Layer passes per device per step (one layer, one microbatch each)."""
    forward: float
    backward: float


def layer_passes(layout: Layout, stage_layers: tuple[int, ...], ex: Executor | None,
                 recomputed: float = 0.0) -> Passes:
    """L·m each without stages; the executor's chunk passes x its largest chunk with them.

    recomputed: the fraction of layers whose forward full recompute re-runs in the backward."""
    if ex is None:
        fwd = bwd = max(stage_layers) * layout.microbatches
    else:
        fwd, bwd = ex.forward_passes * ex.chunk_layers, ex.backward_passes * ex.chunk_layers
    return Passes(fwd + recomputed * bwd, bwd)


def bubble_fraction(stage: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(m·v): Megatron's pipeline idle time relative to the ideal compute time."""
    return (stage - 1) / (microbatches * virtual_stages) if stage > 1 else 0.0


def dp_split(layout: Layout, n_local: float, n_experts_local: float = 0.0,
             n_edge: float = 0.0) -> tuple[float, float]:
    """(dense, experts) DP payloads: params are replicated over data and context, so both
    reduce gradients: the fp32 gradient sums (4 bytes, what the step reduces), then ZeRO-1's
    bf16 params gathered. With expert ranks the `n_experts_local` expert parameters are
    reduced only over the data·context/expert ranks that hold the same experts (none when
    that is 1), the rest over all data·context ranks. The `n_edge` parameters of a pipeline
    rank's edge row (among `n_local`) are all-reduced in fp32 under ZeRO-1 too (8 bytes):
    their masters split over stage, so the executor sums the rows over data before they
    reduce-scatter over stage (vocab_terms; the H100 program of the 70B recipe and of
    Mixtral's)."""
    if layout.data * layout.context == 1:
        return 0.0, 0.0
    per = (4 + 2) if layout.zero1 else 2.0 * 4
    experts = n_experts_local if layout.expert > 1 else 0.0
    expert_ranks = experts_lib.expert_data_ranks(layout)
    return (((n_local - experts - n_edge) * per + n_edge * 2.0 * 4) / layout.fsdp,
            experts / layout.fsdp * per if expert_ranks > 1 else 0.0)


def dp_bytes(layout: Layout, n_local: float, n_experts_local: float = 0.0,
             n_edge: float = 0.0) -> float:
    """Both of dp_split's payloads."""
    return sum(dp_split(layout, n_local, n_experts_local, n_edge))


def fsdp_rest_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """Outside the layers: the head and final norm gathered once per step, reduce-scattered
    per microbatch; the embedding lookup's two all-to-alls per microbatch (ids are tiny)."""
    if layout.fsdp == 1:
        return 0.0
    m, t = cfg.model, layout.tensor
    head = (0 if m.tie_embeddings else padded_vocab(m.vocab_size, t) * m.hidden_size / t) \
        + m.hidden_size
    lookup = 2 * (seq_len / layout.context) * layout.micro_batch * m.hidden_size * 2 \
        / (t if layout.sequence_parallel else 1)
    return head * 2 * (1 + layout.microbatches) + lookup * layout.microbatches


def fsdp_layer_bytes(layout: Layout, layer_params: float, passes: Passes,
                     gather_bytes: float = 2.0) -> float:
    """A layer's weights gathered in every forward pass, gathered and their gradient
    reduce-scattered (compute dtype) in every backward one (= fsdp_bytes of the layers without
    stages); `gather_bytes` per parameter a gather moves (`fsdp_gather_bytes`)."""
    if layout.fsdp == 1:
        return 0.0
    return layer_params * (gather_bytes * (passes.forward + passes.backward)
                           + 2 * passes.backward)


def fsdp_gather_bytes(cfg: Config, layout: Layout, layer_params: float) -> float:
    """Bytes per layer parameter (averaged over the layers) that an FSDP gather moves: 2 (the
    compute dtype), 1 for the projections of an FP8 layer, which are cast on their shard and
    gathered in FP8 (model/fp8_matmul.py, parallel/sharding.WeightGather). MoE layers count
    only their attention as FP8 (the grouped experts' gathers are not measured), and with
    stages nothing is (the pipeline's per-rank branches take no weight constraint)."""
    m, f = cfg.model, cfg.fp8
    if not f.enabled or layout.stage > 1 or not layer_params:
        return 2.0
    fp8_layers = max(0, m.num_layers - f.bf16_first_layers - f.bf16_last_layers)
    share = 1.0 if m.moe is None else min(
        1.0, latent.attention_params_local(m, layout.tensor) / layer_params)
    return 2.0 - share * fp8_layers / m.num_layers


def tp_pass_bytes(cfg: Config, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(forward pass, backward pass) TP bytes of one layer for one microbatch: with SP 4 and 6
    sequence-sized collectives of (t-1)/t·s·b·h·2, without it 2 all-reduces each."""
    t = layout.tensor
    if t == 1:
        return 0.0, 0.0
    one = (t - 1) / t * seq_len / layout.context * layout.micro_batch * cfg.model.hidden_size * 2
    return (4 * one, 6 * one) if layout.sequence_parallel else (4 * one, 4 * one)


def tp_bytes_per_layer_microbatch(cfg: Config, layout: Layout, seq_len: int) -> float:
    """One layer's forward and backward for one microbatch: 10 (SP) or 8 (t-1)/t·s·b·h·2."""
    return sum(tp_pass_bytes(cfg, layout, seq_len))


def tp_rest_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """TP outside the layers with SP, per microbatch: the embedding's output reduce-scattered
    to the sequence shards and its cotangent gathered; the head's input gathered, its
    cotangent reduce-scattered and the input gathered again for the head's weight gradient:
    5 sequence-sized collectives (the GPU compiler's Llama 3 8B step at TP 2)."""
    if layout.tensor == 1 or not layout.sequence_parallel:
        return 0.0
    return 5 * tp_pass_bytes(cfg, layout, seq_len)[0] / 4 * layout.microbatches


def tp_bytes(cfg: Config, layout: Layout, seq_len: int, passes: Passes,
             recomputed: float = 0.0) -> float:
    """`recomputed`: the forward passes of `passes` that full recompute re-runs. Such a pass
    drops its last collective (the layer's output, which the next checkpoint holds) and, with
    SP, leaves its gathered norm outputs to the backward (2 re-gathers fewer): 3 fewer."""
    fwd, bwd = tp_pass_bytes(cfg, layout, seq_len)
    saved = 3 * fwd / 4 if layout.sequence_parallel else fwd / 2
    return fwd * passes.forward + bwd * passes.backward - saved * recomputed


def pp_bytes(cfg: Config, layout: Layout, seq_len: int, ex: Executor | None) -> float:
    return 0.0 if ex is None else ex.sends * chunk_input_bytes(cfg, layout, seq_len)


def vocab_terms(cfg: Config, layout: Layout) -> tuple[float, float]:
    """Wire bytes per device of the vocab tables and the final norm, whose masters split over
    stage (parallel/sharding.stage_state_axis): (over stage alone, over stage and the
    data-parallel group at once). Without ZeRO-1 their fp32 gradients reduce-scatter over
    stage and the compute-dtype copy gathers back, ring (p-1)/p each: 4 + 2 bytes a
    parameter where the all-reduce of replicated masters was 8. With ZeRO-1 (masters split
    over stage x data·context) each data rank reduce-scatters its 1/g share over stage, and
    the copy gathers from all p·g shards at once: the joint term (the H100 program)."""
    p, t, m = layout.stage, layout.tensor, cfg.model
    if p == 1:
        return 0.0, 0.0
    table = padded_vocab(m.vocab_size, t) * m.hidden_size / t
    held = (1 if m.tie_embeddings else 2) * table + m.hidden_size
    compute = 4 if m.compute_dtype == "float32" else 2
    g = layout.data * layout.context
    if not layout.zero1 or g == 1:
        return (p - 1) / p * held * (4 + compute), 0.0
    return (p - 1) / p * held * 4 / g, (p * g - 1) / (p * g) * held * compute


def vocab_bytes(cfg: Config, layout: Layout) -> float:
    """Both of vocab_terms' (the ledger's `vocab` kind, on the stage axis's link)."""
    return sum(vocab_terms(cfg, layout))


class CpPass(NamedTuple):
    """CP bytes of one layer pass per device: `kv` in the compute dtype (counted as bf16, the
    convention above), `fixed` always 4 bytes an element (the ring's fp32 dK/dV)."""
    kv: float = 0.0
    fixed: float = 0.0

    @property
    def total(self) -> float:
        return self.kv + self.fixed


class CpHops(NamedTuple):
    """The ring's hops of one layer pass (what all_gather moves is the same shards)."""
    forward: int         # K/V hops of a forward pass
    backward_kv: int     # K/V hops of a backward pass (+1 K/V-sized: dK/dV going home)
    backward_grads: int  # fp32 dK/dV accumulator hops of a backward pass
    kv: float            # one shard's K and V (bf16 convention)
    grads: float         # one shard's fp32 dK, dV


def cp_hops(cfg: Config, layout: Layout, seq_len: int) -> CpHops:
    c = layout.context
    m = cfg.model
    kv_shards = layout.tensor if m.num_kv_heads % layout.tensor == 0 else m.num_kv_heads
    kv_width = latent.kv_width(m) / kv_shards   # MLA: the up-projected K/V, not the latent
    tokens = seq_len / c * layout.micro_batch
    return CpHops(c - 1, c - 1, c - 1, 2 * tokens * kv_width * 2, 2 * tokens * kv_width * 4)


def cp_pass_bytes(cfg: Config, layout: Layout, seq_len: int) -> tuple[CpPass, CpPass]:
    """(forward, backward) CP bytes of one layer pass per device (module docstring)."""
    c = layout.context
    if c == 1:
        return CpPass(), CpPass()
    h = cp_hops(cfg, layout, seq_len)
    if cfg.parallel.context_strategy == "ring":
        return (CpPass(h.forward * h.kv),
                CpPass((h.backward_kv + 1) * h.kv, h.backward_grads * h.grads))
    return CpPass((c - 1) * h.kv), CpPass(2 * (c - 1) * h.kv)   # gather again + reduce-scatter


def cp_bytes(cfg: Config, layout: Layout, seq_len: int, passes: Passes,
             recomputed: float = 0.0) -> float:
    """CP bytes per device per step; `recomputed`: the forward passes full recompute re-runs
    (part of passes.forward), whose K/V transfers the backward pass next to them reuses (the
    GPU compiler merges the identical ones: all_gather's whole gather, the ring's first hop;
    XLA:CPU merges every ring hop)."""
    fwd, bwd = cp_pass_bytes(cfg, layout, seq_len)
    shared = 0.0
    if layout.context > 1:
        h = cp_hops(cfg, layout, seq_len)
        shared = h.kv if cfg.parallel.context_strategy == "ring" else (layout.context - 1) * h.kv
    return fwd.total * passes.forward + bwd.total * passes.backward - shared * recomputed


def axis_in_node(layout: Layout, axis: str, gpu: Gpu) -> bool:
    """True when every group along `axis` sits inside one node (NVLink)."""
    return layout.span(axis) <= gpu.gpus_per_node


def link(layout: Layout, axes: tuple[str, ...], gpu: Gpu) -> tuple[str, float]:
    """("nvlink" | "nic", bytes/s) for a collective over `axes` (the slowest used axis decides)."""
    used = [a for a in axes if layout.degree(a) > 1] or list(axes)
    slowest = max(used, key=layout.span)
    if axis_in_node(layout, slowest, gpu):
        return "nvlink", gpu.nvlink_bandwidth
    return "nic", gpu.nic_bandwidth


# Which mesh axes each kind of traffic crosses.
COMM_AXES = {"dp": ("context", "data"), "fsdp": ("fsdp",), "tp": ("tensor",),
             "pp": ("stage",), "vocab": ("stage",), "cp": ("context",), "ep": ("expert",)}

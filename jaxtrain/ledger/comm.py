"""Communication volume per device per step, the link each axis rides on, and the bubble.

Conventions (DESIGN.md §5), N_local = parameters one device holds after TP and PP:
- DP (ZeRO-1 or plain): reduce-scatter grads + all-gather params ≈ 2·N_local·2 bytes (bf16
  reduction, Megatron's --grad-reduce-in-bf16); with FSDP the shard N_local/fsdp is reduced.
- Layer collectives are counted per layer pass (`Passes`: forward and backward passes of one
  layer for one microbatch per device per step): without stages L·m of each; with stages the
  pipeline executor's (ledger.pipeline): its chunk forward in every F and B step, its
  backward in every B step, of the largest chunk, idle ranks included (lock-step). Full
  recompute re-runs the forward (and its collectives) of the layers it recomputes in each
  backward pass; selective recompute re-runs no collective.
- FSDP ≈ 3·N_local·2 bytes per microbatch (AG forward, AG backward, RS): per layer pass for
  the layers (a forward pass gathers N_layer·2, a backward one gathers and reduce-scatters),
  per microbatch for the rest (embedding, head).
- TP (+SP): 8·(t-1)/t·s·b·h·2 bytes per layer per microbatch, half in each pass (forward 2
  all-gathers + 2 reduce-scatters, backward the same; without SP, all-reduces move the same).
- PP: the executor's 2 sends (activation right, cotangent left) per table step, idle steps
  included, of one chunk input (s·b·h in the compute dtype, /t under SP).
- Vocab (stages only): the executor replicates the embedding and the head (+ final norm) on
  every stage rank and all-reduces their fp32 gradients over stage once per step: ring
  2·(p-1)/p·(2 tables + h)·4 bytes (both tables' gradients, also when tied).
- CP (ring attention, not in DESIGN.md's list): K and V chunks pass c-1 hops forward, and K, V
  plus their gradients backward: (c-1)·2·(s/c)·b·(K·E/t)·2 bytes per forward layer pass and
  twice that per backward one.
Sequence lengths are per context rank (s/c). Volumes are in bytes; seconds use nominal links:
an axis whose devices sit in one node (device order tensor, context, fsdp, data, stage; tensor
fastest) uses NVLink, otherwise the node's NIC.
"""
from __future__ import annotations

from typing import NamedTuple

from jaxtrain.config import Config
from jaxtrain.ledger.hardware import Gpu
from jaxtrain.ledger.layout import AXES_FAST_TO_SLOW, Layout
from jaxtrain.ledger.memory import padded_vocab
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


def dp_bytes(layout: Layout, n_local: float) -> float:
    # Params are replicated over data and context, so both reduce gradients.
    if layout.data * layout.context == 1:
        return 0.0
    return 2.0 * (n_local / layout.fsdp) * 2


def fsdp_bytes(layout: Layout, n_local: float) -> float:
    """Parameters gathered once per microbatch (AG forward, AG backward, RS): 3·N·2 each."""
    return 3.0 * n_local * 2 * layout.microbatches if layout.fsdp > 1 else 0.0


def fsdp_layer_bytes(layout: Layout, layer_params: float, passes: Passes) -> float:
    """A layer's weights gathered in every forward pass, gathered and their gradient
    reduce-scattered in every backward one (= fsdp_bytes of the layers without stages)."""
    if layout.fsdp == 1:
        return 0.0
    return layer_params * 2 * (passes.forward + 2 * passes.backward)


def tp_bytes_per_layer_microbatch(cfg: Config, layout: Layout, seq_len: int) -> float:
    """8·(t-1)/t·s·b·h·2: one layer's forward and backward for one microbatch."""
    t = layout.tensor
    if t == 1:
        return 0.0
    sbh = seq_len / layout.context * layout.micro_batch * cfg.model.hidden_size
    return 8.0 * (t - 1) / t * sbh * 2


def tp_bytes(cfg: Config, layout: Layout, seq_len: int, passes: Passes) -> float:
    # a forward pass and a backward pass move the same bytes
    per_pass = tp_bytes_per_layer_microbatch(cfg, layout, seq_len) / 2
    return per_pass * (passes.forward + passes.backward)


def pp_bytes(cfg: Config, layout: Layout, seq_len: int, ex: Executor | None) -> float:
    return 0.0 if ex is None else ex.sends * chunk_input_bytes(cfg, layout, seq_len)


def vocab_bytes(cfg: Config, layout: Layout) -> float:
    """Ring all-reduce over stage of the replicated embedding/head gradients (fp32)."""
    p, t, m = layout.stage, layout.tensor, cfg.model
    if p == 1:
        return 0.0
    table = padded_vocab(m.vocab_size, t) * m.hidden_size / t
    return 2.0 * (p - 1) / p * (2 * table + m.hidden_size) * 4


def cp_bytes(cfg: Config, layout: Layout, seq_len: int, passes: Passes) -> float:
    c = layout.context
    if c == 1:
        return 0.0
    m = cfg.model
    kv_shards = layout.tensor if m.num_kv_heads % layout.tensor == 0 else m.num_kv_heads
    kv_width = m.num_kv_heads * m.resolved_head_dim / kv_shards
    per_pass = (c - 1) * 2 * (seq_len / c) * layout.micro_batch * kv_width * 2
    return per_pass * (passes.forward + 2 * passes.backward)


def axis_in_node(layout: Layout, axis: str, gpu: Gpu) -> bool:
    """True when every group along `axis` sits inside one node (NVLink)."""
    span = 1
    for a in AXES_FAST_TO_SLOW:
        span *= layout.degree(a)
        if a == axis:
            return span <= gpu.gpus_per_node
    raise ValueError(f"unknown mesh axis {axis!r}")


def link(layout: Layout, axes: tuple[str, ...], gpu: Gpu) -> tuple[str, float]:
    """("nvlink" | "nic", bytes/s) for a collective over `axes` (the slowest used axis decides)."""
    used = [a for a in axes if layout.degree(a) > 1] or list(axes)
    slowest = max(used, key=AXES_FAST_TO_SLOW.index)
    if axis_in_node(layout, slowest, gpu):
        return "nvlink", gpu.nvlink_bandwidth
    return "nic", gpu.nic_bandwidth


# Which mesh axes each kind of traffic crosses.
COMM_AXES = {"dp": ("context", "data"), "fsdp": ("fsdp",), "tp": ("tensor",),
             "pp": ("stage",), "vocab": ("stage",), "cp": ("context",)}

"""Communication volume per device per step, the link each axis rides on, and the bubble.

Conventions (DESIGN.md §5), N_local = parameters one device holds after TP and PP:
- DP (ZeRO-1 or plain): reduce-scatter grads + all-gather params ≈ 2·N_local·2 bytes (bf16
  reduction, Megatron's --grad-reduce-in-bf16); with FSDP the shard N_local/fsdp is reduced.
- FSDP: 3·N_local·2 bytes per microbatch (all-gather forward and backward, reduce-scatter).
- TP (+SP): 8·(t-1)/t·s·b·h·2 bytes per layer per microbatch (2 all-gathers + 2 reduce-scatters
  forward, the same backward; without SP, 4 all-reduces move the same bytes).
- PP: 2·s·b·h·2/t bytes per microbatch (activation out, gradient back), ×v when interleaved.
- CP (ring attention, not in DESIGN.md's list): K and V chunks pass c-1 hops forward, and K, V
  plus their gradients backward: 3·(c-1)·2·(s/c)·b·(K·E/t)·2 bytes per layer per microbatch.
Sequence lengths are per context rank (s/c). Volumes are in bytes; seconds use nominal links:
an axis whose devices sit in one node (device order tensor, context, fsdp, data, stage; tensor
fastest) uses NVLink, otherwise the node's NIC.
"""
from __future__ import annotations

from jaxtrain.config import Config
from jaxtrain.ledger.hardware import Gpu
from jaxtrain.ledger.layout import AXES_FAST_TO_SLOW, Layout


def bubble_fraction(stage: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(m·v): pipeline idle time relative to the ideal compute time."""
    return (stage - 1) / (microbatches * virtual_stages) if stage > 1 else 0.0


def dp_bytes(layout: Layout, n_local: float) -> float:
    # Params are replicated over data and context, so both reduce gradients.
    if layout.data * layout.context == 1:
        return 0.0
    return 2.0 * (n_local / layout.fsdp) * 2


def fsdp_bytes(layout: Layout, n_local: float) -> float:
    return 3.0 * n_local * 2 * layout.microbatches if layout.fsdp > 1 else 0.0


def tp_bytes_per_layer_microbatch(cfg: Config, layout: Layout, seq_len: int) -> float:
    t = layout.tensor
    if t == 1:
        return 0.0
    sbh = seq_len / layout.context * layout.micro_batch * cfg.model.hidden_size
    return 8.0 * (t - 1) / t * sbh * 2


def tp_bytes(cfg: Config, layout: Layout, seq_len: int, n_layers: int) -> float:
    return tp_bytes_per_layer_microbatch(cfg, layout, seq_len) * n_layers * layout.microbatches


def pp_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    if layout.stage == 1:
        return 0.0
    sbh = seq_len / layout.context * layout.micro_batch * cfg.model.hidden_size
    return 2.0 * sbh * 2 / layout.tensor * layout.microbatches * layout.virtual_stages


def cp_bytes(cfg: Config, layout: Layout, seq_len: int, n_layers: int) -> float:
    c = layout.context
    if c == 1:
        return 0.0
    m = cfg.model
    kv_shards = layout.tensor if m.num_kv_heads % layout.tensor == 0 else m.num_kv_heads
    kv_width = m.num_kv_heads * m.resolved_head_dim / kv_shards
    per_layer = 3.0 * (c - 1) * 2 * (seq_len / c) * layout.micro_batch * kv_width * 2
    return per_layer * n_layers * layout.microbatches


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
             "pp": ("stage",), "cp": ("context",)}

"""The parallel layout the ledger reasons about: mesh degrees plus how a step is split.

`layout_from_config` resolves the config's -1 fill and derives the micro-batch size
(docs/design.md §3: global_batch = data·fsdp × micro_batch × microbatches); `validate_layout`
checks everything that must divide, with messages that name the keys to change. `expert` (MoE
expert parallelism) has no devices of its own: its ranks are carved out of `data`, the
fastest-varying part of it (`Layout.span`).
"""
from __future__ import annotations

import dataclasses
import math

from jaxtrain.config import (Config, ConfigError, check_batch_split, check_context_split,
                             check_expert_split, check_fill, folds)
from jaxtrain.ledger.pipeline_schedule import ScheduleError, validate as schedule_rules

# Fastest-varying first: device order puts tensor innermost (Megatron's tp-cp-dp-pp).
AXES_FAST_TO_SLOW = ("tensor", "context", "fsdp", "data", "stage")


class LayoutError(ConfigError):
    """A layout that cannot run this config on these devices; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor: int = 1
    stage: int = 1
    data: int = 1
    fsdp: int = 1
    context: int = 1
    virtual_stages: int = 1
    micro_batch: int = 1      # sequences per data-parallel rank per microbatch
    microbatches: int = 1     # gradient-accumulation / pipeline microbatches per step
    sequence_parallel: bool = False
    zero1: bool = False
    schedule: str = "1f1b"    # gpipe | 1f1b | interleaved_1f1b (the one with virtual_stages > 1)
    expert: int = 1           # expert ranks, carved out of data (no devices of their own)
    expert_tensor: int = 0    # 1: MoE parallel folding (expert counts the tensor ranks too)

    @property
    def n_devices(self) -> int:
        return self.tensor * self.stage * self.data * self.fsdp * self.context

    @property
    def folded(self) -> bool:
        """MoE parallel folding: each expert whole on one of expert ranks that span the tensor
        ranks (parallel.expert_tensor=1 with tensor > 1)."""
        return self.expert > 1 and folds(self.tensor, self.expert_tensor)

    @property
    def expert_tensor_degree(self) -> int:
        """The tensor split of each expert's SwiGLU: 1 when folded, else the tensor degree."""
        return 1 if self.folded else self.tensor

    @property
    def global_batch(self) -> int:
        return self.data * self.fsdp * self.micro_batch * self.microbatches

    def degree(self, axis: str) -> int:
        return getattr(self, axis)

    def span(self, axis: str) -> int:
        """Consecutive devices one group along `axis` covers (device order AXES_FAST_TO_SLOW;
        the expert ranks are the fastest part of data, as Megatron orders tp-cp-ep-dp-pp)."""
        if axis == "expert":   # folded: the tensor ranks are expert ranks already
            return self.tensor * self.context * self.fsdp * self.expert // (
                self.tensor if self.folded else 1)
        span = 1
        for a in AXES_FAST_TO_SLOW:
            span *= self.degree(a)
            if a == axis:
                return span
        raise ValueError(f"unknown mesh axis {axis!r}")

    def short(self) -> str:
        parts = [f"tensor={self.tensor}{'+SP' if self.sequence_parallel else ''}",
                 f"stage={self.stage}" + (f"x{self.virtual_stages}v" if self.virtual_stages > 1
                                          else ""),
                 f"data={self.data}{'(ZeRO-1)' if self.zero1 and self.data > 1 else ''}"]
        if self.fsdp > 1:
            parts.append(f"fsdp={self.fsdp}")
        if self.context > 1:
            parts.append(f"context={self.context}")
        if self.expert > 1:
            parts.append(f"expert={self.expert}{'(folded)' if self.folded else ''}")
        parts.append(f"micro_batch={self.micro_batch} x {self.microbatches} microbatches")
        return " ".join(parts)


def resolve_degrees(cfg: Config, n_devices: int) -> dict[str, int]:
    """Mesh degrees with the one -1 filled so their product is n_devices."""
    if n_devices < 1:
        raise LayoutError(f"--devices={n_devices}: need at least one device")
    p = cfg.parallel
    check_fill(p, LayoutError)
    sizes = {a: getattr(p, a) for a in ("stage", "data", "fsdp", "context", "tensor")}
    fill = [a for a, v in sizes.items() if v == -1]
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if n_devices % fixed:
            fixed_str = " x ".join(f"{k}={v}" for k, v in sizes.items() if v != -1)
            raise LayoutError(
                f"{n_devices} devices are not divisible by {fixed_str} = {fixed} ({fill[0]} fills "
                f"the rest); use a multiple of {fixed} devices or change those degrees")
        sizes[fill[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise LayoutError(
            f"the layout {_fmt(sizes)} needs {math.prod(sizes.values())} devices but there are "
            f"{n_devices}; set one degree to -1 to fill, or make the product {n_devices}")
    return sizes


def layout_from_config(cfg: Config, n_devices: int) -> Layout:
    """The layout `cfg.parallel` describes on n_devices, validated."""
    sizes = resolve_degrees(cfg, n_devices)
    p = cfg.parallel
    filled = next((a for a in ("data", "fsdp") if getattr(p, a) == -1), "")
    check_batch_split(cfg.train.global_batch, sizes["data"], sizes["fsdp"], p.microbatches,
                      filled, LayoutError)
    per_step = sizes["data"] * sizes["fsdp"] * p.microbatches
    layout = Layout(tensor=sizes["tensor"], stage=sizes["stage"], data=sizes["data"],
                    fsdp=sizes["fsdp"], context=sizes["context"],
                    virtual_stages=p.virtual_stages,
                    micro_batch=cfg.train.global_batch // per_step, microbatches=p.microbatches,
                    sequence_parallel=p.sequence_parallel and sizes["tensor"] > 1,
                    zero1=p.zero1, schedule=p.schedule, expert=p.expert,
                    expert_tensor=p.expert_tensor)
    validate_layout(cfg, layout, n_devices)
    return layout


def validate_layout(cfg: Config, layout: Layout, n_devices: int | None = None,
                    seq_len: int | None = None) -> None:
    """Raise LayoutError when the layout does not divide the model, batch or devices."""
    m, L = cfg.model, layout
    seq_len = seq_len or cfg.train.seq_len
    for name in ("tensor", "stage", "data", "fsdp", "context", "virtual_stages", "micro_batch",
                 "microbatches", "expert"):
        if getattr(L, name) < 1:
            raise LayoutError(f"{name}={getattr(L, name)} must be a positive integer")
    if n_devices is not None and L.n_devices != n_devices:
        raise LayoutError(
            f"tensor*stage*data*fsdp*context = {L.n_devices} but there are {n_devices} devices; "
            f"choose degrees whose product is {n_devices}")
    t = L.tensor
    if m.num_heads % t:
        raise LayoutError(f"model.num_heads={m.num_heads} is not divisible by tensor={t}; choose "
                          f"a tensor degree among {divisors(m.num_heads)}")
    if m.num_kv_heads % t and t % m.num_kv_heads:
        raise LayoutError(f"model.num_kv_heads={m.num_kv_heads} and tensor={t}: one must divide "
                          "the other (KV heads are sharded, or replicated when fewer than t)")
    if m.mlp_size % t:
        raise LayoutError(f"model.mlp_size={m.mlp_size} is not divisible by tensor={t}")
    check_expert_split(m, L.expert, L.data, t, L.expert_tensor, LayoutError, key="")
    tokens = L.micro_batch * seq_len // L.context     # one MoE layer call's tokens a rank
    if L.folded and tokens % t:
        raise LayoutError(f"micro_batch x seq_len/context = {tokens} tokens is not divisible "
                          f"by tensor={t}: under parallel.expert_tensor=1 each tensor rank "
                          "dispatches its share; change the micro-batch or the sequence")
    for axis in ("stage", "context") if m.mtp_depths else ():
        if getattr(L, axis) > 1:
            raise LayoutError(f"parallel.{axis}={getattr(L, axis)} with model.mtp.num_layers="
                              f"{m.mtp_depths}: multi-token prediction runs only without {axis} "
                              f"parallelism yet; set parallel.{axis}=1 or model.mtp.num_layers=0")
    check_context_split(seq_len, L.context, cfg.parallel.context_load_balance, LayoutError)
    if L.sequence_parallel and (seq_len // L.context) % t:
        raise LayoutError(f"seq_len/context={seq_len // L.context} is not divisible by tensor={t}"
                          " (sequence parallelism splits the sequence over the tensor axis)")
    stage_layer_counts(cfg, L.stage, L.virtual_stages)
    if L.virtual_stages > 1:
        if L.stage == 1:
            raise LayoutError(f"virtual_stages={L.virtual_stages} needs stage > 1 (interleaving "
                              "splits each pipeline stage into chunks)")
        try:  # virtual stages run the interleaved schedule (ledger.pipeline, the trainer)
            schedule_rules("interleaved_1f1b", L.stage, L.microbatches, L.virtual_stages)
        except ScheduleError as err:
            raise LayoutError(str(err)) from None
    if L.global_batch != cfg.train.global_batch:
        raise LayoutError(
            f"data*fsdp*micro_batch*microbatches = {L.data}*{L.fsdp}*{L.micro_batch}*"
            f"{L.microbatches} = {L.global_batch} but train.global_batch="
            f"{cfg.train.global_batch}; change the micro-batch, the microbatches or the batch")


def mixed_pipeline_problem(cfg: Config, stage: int) -> str | None:
    """Why the pipeline executor cannot run `stage` stages of this model (None: it can): its
    chunks are stacks of one kind of layer, so dense layers among MoE ones (DeepSeek's first
    dense layers) are refused by config_check, while the ledger prices such a layout as
    Megatron runs it (the kinds per chunk: device_params.held_moe_layers) and notes the refusal."""
    e = cfg.model.moe
    if stage == 1 or e is None or all(cfg.model.moe_layers):
        return None
    return (f"stage={stage} with dense layers among the MoE ones (model.moe.first_k_dense="
            f"{e.first_k_dense}, layer_freq={e.layer_freq}): the pipeline's chunks run one kind "
            "of layer; make every layer MoE (first_k_dense=0, layer_freq=1) or stage=1")


def stage_layer_counts(cfg: Config, stage: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Layers per physical pipeline stage.

    The config's uneven split (parallel.first/last_stage_layers, Megatron's
    decoder-first/last-pipeline-num-layers) applies when `stage` is the configured degree;
    otherwise layers split evenly and must divide by stage x virtual_stages.
    """
    L = cfg.model.num_layers
    first, last = cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers
    if stage > 1 and (first or last) and stage == cfg.parallel.stage:
        middle = stage - (first > 0) - (last > 0)
        rest = L - first - last
        if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
            raise LayoutError(
                f"model.num_layers={L} with parallel.first_stage_layers={first} and "
                f"last_stage_layers={last} does not split evenly over the other {middle} stages")
        mid = rest // middle if middle else 0
        counts = tuple([first or mid] + [mid] * (stage - 2) + [last or mid])
        if any(c < 1 or c % virtual_stages for c in counts):
            raise LayoutError(f"stage layer counts {counts} are not divisible by "
                              f"virtual_stages={virtual_stages}")
        return counts
    if L % (stage * virtual_stages):
        raise LayoutError(
            f"model.num_layers={L} is not divisible by stage={stage} x virtual_stages="
            f"{virtual_stages}; choose stage*virtual_stages among {divisors(L)}")
    return (L // stage,) * stage


def layers_per_chunk(cfg: Config, stage: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Layers in each stage's pipeline chunks (what remat block/uniform count in)."""
    return tuple(c // virtual_stages for c in stage_layer_counts(cfg, stage, virtual_stages))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_splits_model(m, t: int) -> bool:
    """Tensor degree t splits the heads and the MLP, and the KV heads split or replicate
    (`validate_layout` names whichever fails)."""
    return (m.num_heads % t == 0 and m.mlp_size % t == 0
            and (m.num_kv_heads % t == 0 or t % m.num_kv_heads == 0))


def _fmt(sizes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sizes.items())

"""Which of the config's mesh axes a torch process group spans, from its ranks.

Ranks are laid out as the config's mesh, stage slowest and tensor fastest (Megatron's
tp-cp-dp-pp order and torchtitan's device mesh alike), so a group's ranks differ exactly in the
coordinates of the axes it spans: `default_pg` of a 2-GPU FSDP run is `fsdp`, not a group of its
own; a group whose ranks fit no sub-mesh of the layout is named by its description
(`mesh_tp`, `TENSOR_MODEL_PARALLEL_GROUP`). `parallel.expert`, where the config has it, is carved out of the data-parallel ranks as
their fastest-varying factor (Megatron's tp-cp-ep-dp-pp); a group over those ranks alone is
`expert`. Where the config has no expert axis, an all-to-all over data-parallel or FSDP ranks
(Megatron carves experts out of data, torchtitan out of dp_shard), or such a group whose
description names experts (Megatron's EXPERT_MODEL_PARALLEL_GROUP, torchtitan's `ep` mesh
dimension), is the expert dispatch and is labelled `expert` too: exposed communication on the
expert axis, never pipeline bubble. An all-to-all over context ranks stays `context` (Ulysses).
"""
from __future__ import annotations

import math
import re

from jaxtrain.ledger.layout import AXES_FAST_TO_SLOW

MESH_ORDER = tuple(reversed(AXES_FAST_TO_SLOW))   # stage, data, fsdp, context, tensor
# a description's words -> the axis (torchtitan's mesh_<dim>, Megatron's *_PARALLEL_GROUP),
# first match wins: dp_shard before dp; Megatron's EXPERT_DATA_PARALLEL_GROUP reduces expert
# gradients over the data ranks that hold the same experts: data
_DESC_AXES = [(re.compile(p, re.I), axis) for p, axis in (
    (r"expert_data|edp", "data"),
    (r"(^|[^a-z])(ep|expert|moe)([^a-z]|$)", "expert"),
    (r"(^|[^a-z])(tp|tensor)([^a-z]|$)", "tensor"),
    (r"(^|[^a-z])(pp|pipe\w*)([^a-z]|$)", "stage"),
    (r"(^|[^a-z])(cp|context)([^a-z]|$)", "context"),
    (r"dp_shard|fsdp|(^|[^a-z])shard", "fsdp"),
    (r"(^|[^a-z])(dp|dp_replicate|data)([^a-z]|$)", "data"))]


def expert_degree(cfg) -> int:
    """parallel.expert where the config has it (another issue adds it), else 1."""
    return max(int(getattr(cfg.parallel, "expert", 1) or 1), 1)


def rank_axes(degrees: dict, expert: int = 1) -> list[tuple[str, int]]:
    """(axis, size) slowest first, `data` split into its expert-parallel inner factor."""
    out = []
    for axis in MESH_ORDER:
        size = degrees[axis]
        if axis == "data" and expert > 1 and size % expert == 0:
            out += [("data", size // expert), ("expert", expert)]
        else:
            out.append((axis, size))
    return out


def coords(rank: int, axes: list[tuple[str, int]]) -> list[int]:
    out = []
    for _, size in reversed(axes):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def group_label(ranks, degrees: dict, *, expert: int = 1, kind: str = "",
                desc: str = "") -> str | None:
    """The mesh axes ("fsdp", "data+fsdp", "expert") a group of global ranks spans, None when
    the ranks are not a sub-mesh of this layout (or a rank lies outside it)."""
    axes = rank_axes(degrees, expert)
    n = math.prod(size for _, size in axes)
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks or ranks[-1] >= n:
        return None
    points = [coords(r, axes) for r in ranks]
    varying = [i for i in range(len(axes)) if len({p[i] for p in points}) > 1]
    names = [axes[i][0] for i in varying]
    if expert == 1 and names and set(names) <= {"data", "fsdp"} and (
            kind == "all-to-all" or desc_axis(desc) == "expert"):
        return "expert"   # the expert dispatch over data-parallel ranks (no expert axis)
    if len(ranks) != math.prod(axes[i][1] for i in varying):
        return None   # not every combination of the varying coordinates: no sub-mesh
    if names == ["data", "expert"] or (names == ["expert"] and kind != "all-to-all"
                                       and dict(axes)["data"] == 1):
        names = ["data"]   # the whole data axis (a gradient reduction, not the dispatch)
    return "+".join(dict.fromkeys(names)) or "none"


def desc_axis(desc: str) -> str | None:
    """The mesh axis a process group's description names (None: none, or `default_pg`)."""
    return next((axis for pattern, axis in _DESC_AXES if pattern.search(desc or "")), None)


def parse_ranks(value) -> list[int] | None:
    """A process group's ranks as torch writes them: a list, or a string "[0, 1]"."""
    if isinstance(value, (list, tuple)):
        return [int(r) for r in value]
    if isinstance(value, str):
        found = re.findall(r"-?\d+", value)
        return [int(r) for r in found] if found else None
    return None

"""Read a compiled step: collectives by kind and mesh axis, FLOPs, memory.

This is the measured side of the ledger (docs/design.md §5). Everything here works on
`compiled.as_text()` (the optimized, SPMD-partitioned HLO of one device), so the numbers are
what the compiler actually emitted, not what the sharding annotations suggest.

Byte conventions (per device, per execution of the op):

- ``bytes`` is the *payload*: the full buffer the collective acts on. all-reduce,
  reduce-scatter, all-to-all and collective-permute: the operand size (for reduce-scatter the
  unreduced input, i.e. the whole gradient, not the shard). all-gather: the result size (the
  gathered buffer). This matches §5's "RS of gradients + AG of params = 2·N·2 bytes" and makes
  payloads backend-agnostic: CPU's all-reduce-then-slice and GPU's reduce-scatter carry the
  same payload.
- ``wire_bytes`` is what one device sends under the ring algorithm (the bus-bandwidth
  convention): all-reduce 2·(n−1)/n·payload, all-gather / reduce-scatter / all-to-all
  (n−1)/n·payload, collective-permute payload × (non-self pairs / devices), a mean over devices.

The CPU backend has no reduce-scatter creator pass (see shared/notes/xla-cpu-collectives.md):
gradients of FSDP-sharded params show up as an all-reduce whose result is only dynamic-sliced
per device. Such all-reduces carry ``sliced=True``; `reclassify_sliced_all_reduce` relabels
them as reduce-scatters, and `payload_by_axis` compares backends without caring about kinds.

Replica-group device ids in SPMD HLO are positions in the executable's device assignment,
which for a program sharded over ``mesh`` is ``mesh.devices.flat`` — not ``Device.id``. Pass
the mesh the step was compiled with.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from jaxtrain.tools.hlo_groups import MeshIndex, parse_replica_groups, parse_source_target_pairs
from jaxtrain.tools.hlo_module import (Computation, HloError, HloParseError, Instr, callees,
                                       parsed, shape_bytes)

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class HloAnalysisUnavailable(HloError):
    """The backend did not provide cost or memory analysis."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the compiled step (async start/done pairs count once).

    axes: mesh axes whose device groups equal the op's groups, in mesh order; () when every
      group is a single device; None when the groups match no subset of mesh axes (e.g. a
      sub-axis), in which case `replica_groups` says what they are.
    bytes / wire_bytes: per device per execution, see the module docstring.
    count: executions per step (product of the known trip counts of enclosing while loops).
    count_exact: False when some enclosing loop had no known trip count (counted as 1).
      Every branch of a conditional counts as if it ran, so counts there are upper bounds.
    sliced: an all-reduce whose every user only takes this device's slice (CPU's stand-in
      for a reduce-scatter).
    """

    kind: str
    axes: tuple[str, ...] | None
    bytes: int
    wire_bytes: float
    count: int
    in_loop: bool
    computation: str
    op: str
    group_size: int
    shape: str
    replica_groups: tuple[tuple[int, ...], ...] = ()
    count_exact: bool = True
    sliced: bool = False

    @property
    def bytes_per_step(self) -> int:
        return self.bytes * self.count

    @property
    def wire_bytes_per_step(self) -> float:
        return self.wire_bytes * self.count


# ----------------------------------------------------------------------------- collectives

def _base_kind(opcode: str) -> str | None:
    kind = opcode.removesuffix("-start")
    return kind if kind in KINDS else None


def _operand_bytes(instr: Instr, comp: Computation) -> int:
    total = 0
    operands = list(zip(instr.operands, instr.operand_shapes))
    if instr.opcode.startswith("collective-permute") and "slice_sizes=" in instr.attrs:
        operands = operands[:1]  # in-place form: (input, output buffer, offsets...) moves input
    for name, shape in operands:
        if shape is None:
            src = comp.by_name.get(name)
            if src is None:
                raise HloParseError(f"operand %{name} of %{instr.name} not defined in "
                                    f"computation {comp.name}")
            shape = src.shape
        total += shape_bytes(shape)
    return total


def _permute_groups(pairs: Sequence[tuple[int, int]]) -> list[set[int]]:
    """Connected components of the source→target graph."""
    comps: list[set[int]] = []
    for a, b in pairs:
        touching = [c for c in comps if a in c or b in c]
        merged = {a, b}.union(*touching)
        comps = [c for c in comps if c not in touching] + [merged]
    return comps


def _is_sliced(instr: Instr, comp: Computation, comps: dict[str, Computation],
               group_size: int) -> bool:
    """True when every user of an all-reduce only keeps a 1/group_size dynamic slice."""
    if group_size < 2:
        return False
    users = [u for u in comp.instrs if instr.name in u.operands]
    if not users:
        return False
    full = shape_bytes(instr.shape)
    for user in users:
        if shape_bytes(user.shape) * group_size != full:
            return False
        if user.opcode == "dynamic-slice":
            continue
        called = [n for n, _, _ in callees(user)] if user.opcode == "fusion" else []
        if not any(i.opcode == "dynamic-slice" for n in called if n in comps
                   for i in comps[n].instrs):
            return False
    return True


def _wire_bytes(kind: str, payload: int, group_size: int) -> float:
    if group_size <= 1:
        return 0.0
    frac = (group_size - 1) / group_size
    return 2 * frac * payload if kind == "all-reduce" else frac * payload


def collectives_from_text(text: str, mesh: Any) -> list[Collective]:
    """Collectives of an optimized HLO module text (see `collectives`)."""
    comps, reach = parsed(text)
    index = MeshIndex(mesh)
    out = []
    for comp in comps.values():
        for instr in comp.instrs:
            kind = _base_kind(instr.opcode)
            if kind is None:
                continue
            payload = _operand_bytes(instr, comp)
            groups: tuple[tuple[int, ...], ...] = ()
            sliced = False
            if kind == "collective-permute":
                pairs = parse_source_target_pairs(instr.attrs)
                if pairs is None:
                    raise HloParseError(f"collective-permute %{instr.name} has no "
                                        f"source_target_pairs")
                index.check((d for p in pairs for d in p), instr.attrs)
                axes = index.axes_for_pairs(pairs)
                moving = sum(a != b for a, b in pairs)
                group_size = max((len(c) for c in _permute_groups(pairs)), default=1)
                wire = payload * moving / index.size
            else:
                groups = parse_replica_groups(instr.attrs, index.size)
                if groups is None:  # no attribute at all means every device
                    groups = (tuple(range(index.size)),)
                index.check((d for g in groups for d in g), instr.attrs)
                axes = index.axes_for_groups(groups)
                group_size = len(groups[0])
                if kind == "all-gather":
                    payload *= group_size
                if kind == "all-reduce":
                    sliced = _is_sliced(instr, comp, comps, group_size)
                wire = _wire_bytes(kind, payload, group_size)
            r = reach[comp.name]
            out.append(Collective(
                kind=kind, axes=axes, bytes=payload, wire_bytes=wire, count=r.count,
                in_loop=r.in_loop, computation=comp.name, op=instr.name,
                group_size=group_size, shape=instr.shape,
                replica_groups=groups if axes is None else (),
                count_exact=r.exact, sliced=sliced))
    return out


def collectives(compiled: Any, mesh: Any) -> list[Collective]:
    """Every collective in a compiled step, with mesh axes, payload bytes and executions.

    `compiled` is a `jax.stages.Compiled` (``jax.jit(f).lower(...).compile()``); `mesh` the
    `jax.sharding.Mesh` its shardings use (device groups are positions in ``mesh.devices``).
    """
    return collectives_from_text(compiled.as_text(), mesh)


def reclassify_sliced_all_reduce(colls: Iterable[Collective]) -> list[Collective]:
    """Relabel CPU's all-reduce-then-slice as the reduce-scatter a GPU would emit.

    Payload bytes are unchanged (both are the full unreduced operand); wire bytes become a
    reduce-scatter's (n−1)/n·payload.
    """
    return [dataclasses.replace(c, kind="reduce-scatter", sliced=False,
                                wire_bytes=_wire_bytes("reduce-scatter", c.bytes, c.group_size))
            if c.kind == "all-reduce" and c.sliced else c for c in colls]


def _as_axes(axes: str | Iterable[str]) -> set[str]:
    return {axes} if isinstance(axes, str) else set(axes)


def loop_collectives(colls: Iterable[Collective], axes: str | Iterable[str],
                     kinds: Iterable[str] | None = None) -> list[Collective]:
    """Collectives inside while bodies whose groups span any of `axes` (optionally of `kinds`).

    E.g. ``loop_collectives(colls, ('data', 'fsdp'), kinds=('all-reduce', 'reduce-scatter'))``
    must be empty when gradients are reduced once per step, after the microbatch loop.
    """
    wanted = _as_axes(axes)
    kinds = set(kinds) if kinds is not None else None
    return [c for c in colls if c.in_loop and c.axes and wanted & set(c.axes)
            and (kinds is None or c.kind in kinds)]


# ----------------------------------------------------------------------------- summaries

def summary(colls: Iterable[Collective], wire: bool = False
            ) -> dict[tuple[str, tuple[str, ...] | None], float]:
    """Bytes per step by (kind, axes): payload bytes, or ring wire bytes when `wire`."""
    out: dict[tuple[str, tuple[str, ...] | None], float] = {}
    for c in colls:
        key = (c.kind, c.axes)
        out[key] = out.get(key, 0) + (c.wire_bytes_per_step if wire else c.bytes_per_step)
    return out


def payload_by_axis(colls: Iterable[Collective]) -> dict[tuple[str, ...] | None, int]:
    """Payload bytes per step by mesh axes, whatever the kind (agrees across backends)."""
    out: dict[tuple[str, ...] | None, int] = {}
    for c in colls:
        out[c.axes] = out.get(c.axes, 0) + c.bytes_per_step
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_summary(colls: Sequence[Collective]) -> str:
    """Table of collectives per step: kind, axes, ops, executions, payload and wire bytes."""
    rows: dict[tuple[str, Any], list[float]] = {}
    for c in colls:
        row = rows.setdefault((c.kind, c.axes), [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += c.count
        row[2] += c.bytes_per_step
        row[3] += c.wire_bytes_per_step
    header = ("kind", "axes", "ops", "runs/step", "payload/step", "wire/step")
    lines = [(k, "?" if a is None else (",".join(a) or "-"), str(r[0]), str(r[1]),
              _human(r[2]), _human(r[3]))
             for (k, a), r in sorted(rows.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
    total = ("total", "", str(sum(r[0] for r in rows.values())),
             str(sum(r[1] for r in rows.values())),
             _human(sum(r[2] for r in rows.values())), _human(sum(r[3] for r in rows.values())))
    table = [header, *lines, total]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def fmt(row):  # text columns left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, lines), rule, fmt(total)])


# ----------------------------------------------------------------------------- flops, memory

# ----------------------------------------------------------------------------- matmul FLOPs

_DIMS_RE = re.compile(r"\b[a-z][a-z0-9]*\[([^\]]*)\]")
_DOT_CONTRACT_RE = re.compile(r"lhs_contracting_dims=\{([\d,\s]*)\}")
_GEMM_CONTRACT_RE = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_GEMM_TARGET_RE = re.compile(r'custom_call_target="[^"]*(?:gemm|matmul)', re.IGNORECASE)


def _dims(shape: str | None) -> list[int] | None:
    m = _DIMS_RE.search(shape or "")  # the first array of a tuple (a GEMM's result)
    if not m:
        return None
    return [int(d.strip().removeprefix("<=")) for d in m.group(1).split(",") if d.strip()]


def matmul_flops_of(instr, comp) -> int:
    if instr.opcode == "dot":
        contract = _DOT_CONTRACT_RE.search(instr.attrs)
    elif instr.opcode == "custom-call" and _GEMM_TARGET_RE.search(instr.attrs):
        contract = _GEMM_CONTRACT_RE.search(instr.attrs)
    else:
        return 0
    lhs_shape = instr.operand_shapes[0] if instr.operand_shapes else None
    if lhs_shape is None and instr.operands and instr.operands[0] in comp.by_name:
        lhs_shape = comp.by_name[instr.operands[0]].shape
    out, lhs = _dims(instr.shape), _dims(lhs_shape)
    if out is None or lhs is None or contract is None:
        raise HloParseError(f"cannot size the matmul %{instr.name} in {comp.name}")
    k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contract.group(1)))
    return 2 * math.prod(out) * k


def matmul_flops_from_text(text: str) -> float:
    """Matmul FLOPs of one execution of an optimized HLO module, loops counted by trip count."""
    comps, reach = parsed(text)
    return float(sum(matmul_flops_of(i, c) * reach[c.name].count
                     for c in comps.values() for i in c.instrs))


def matmul_flops(compiled) -> float:
    """Per-device matmul FLOPs of a compiled step, every loop counted by its trip count.

    XLA's own `cost_analysis()` counts a while body once, so it undercounts scanned layers
    (`compiled_flops`); this counts dots and cuBLAS GEMM custom calls only, not elementwise
    work or matmuls hidden inside Pallas/cuDNN kernels."""
    return matmul_flops_from_text(compiled.as_text())


def compiled_flops(compiled: Any) -> float:
    """FLOPs of one execution of the compiled (per-device, partitioned) program."""
    try:
        analysis = compiled.cost_analysis()
    except Exception as e:  # backends without a cost model raise various errors
        raise HloAnalysisUnavailable(f"cost_analysis() failed on this backend: {e}") from e
    # Older jax returns a list with one dict per program, newer a single dict.
    parts = analysis if isinstance(analysis, (list, tuple)) else [analysis]
    flops = [p["flops"] for p in parts if p and "flops" in p]
    if not flops:
        raise HloAnalysisUnavailable(
            "cost_analysis() reported no 'flops'; use the ledger's model FLOPs instead")
    return float(sum(flops))


_MEMORY_FIELDS = {
    "temp_bytes": "temp_size_in_bytes",
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "peak_bytes": "peak_memory_in_bytes",
}


def memory(compiled: Any) -> dict[str, int | None]:
    """Per-device buffer sizes from `memory_analysis()`; values are None when unavailable.

    `total_bytes` = argument + output + temp − alias, the usual footprint estimate (donated
    arguments alias outputs and are not counted twice).
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends raise instead of returning None
        stats = None
    out = {k: (getattr(stats, attr, None) if stats is not None else None)
           for k, attr in _MEMORY_FIELDS.items()}
    parts = [out["argument_bytes"], out["output_bytes"], out["temp_bytes"], out["alias_bytes"]]
    out["total_bytes"] = (None if any(p is None for p in parts)
                          else parts[0] + parts[1] + parts[2] - parts[3])
    return out

"""The matmul FLOPs a pipelined step executes per device, read from its compiled program.

`hlo.matmul_flops` counts every branch of every conditional: for the executor's lock-step
loop that is each step's F and B switch with all their branches (idle, from the inbox, from
the pipeline input; the stashed pullback, the last stage's forward + head + backward, ...).
A rank runs one branch of each per step, and which one is in the schedule's table. Here each
branch's matmul FLOPs (dots and GEMM custom calls reachable from it, loops by trip count) are
weighted by how many steps rank r takes it; everything outside the two switches counts as
it runs. Conditionals nested inside a chunk (uneven stages' per-layer switch, mixed FP8/bf16
chunks) still count every branch. The switches are found by the name scopes the executor puts
on them (pipeline_executor.F_SCOPE, B_SCOPE) in the HLO's op_name metadata.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxtrain.tools import hlo, hlo_module
from jaxtrain.parallel.pipeline_executor import B_SCOPE, F_SCOPE

_OP_NAME_RE = re.compile(r'^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\bop_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class ExecutedFlops:
    per_rank: tuple          # matmul FLOPs per step on a device of each pipeline rank
    every_branch: float      # what hlo.matmul_flops counts (every branch of every step)
    branches: dict           # "f" / "b" -> matmul FLOPs of one run of each switch branch

    @property
    def mean(self) -> float:
        return float(np.mean(self.per_rank))

    @property
    def max(self) -> float:
        return float(max(self.per_rank))


def branch_counts(columns: dict, stages: int, virtual_stages: int) -> dict:
    """"f" / "b" -> int [p, branches]: how many steps each rank takes each branch of the
    executor's F switch (idle, inbox, pipeline input) and B switch (idle, stashed, stashed +
    input gradient, last stage, last stage + input gradient)."""
    p, num_v = stages, stages * virtual_stages
    g_of = lambda j: j * p + np.arange(p)[None, :]  # noqa: E731
    f, b = columns["f_chunk"], columns["b_chunk"]
    f_index = np.where(f >= 0, 1 + (g_of(f) == 0), 0)
    b_first, b_last = g_of(b) == 0, g_of(b) == num_v - 1
    b_index = np.where(b >= 0, 1 + b_first + 2 * b_last, 0)
    return {"f": np.stack([(f_index == i).sum(0) for i in range(3)], 1),
            "b": np.stack([(b_index == i).sum(0) for i in range(5)], 1)}


def _flops_under(comps, name: str, memo: dict) -> float:
    """Matmul FLOPs of one run of computation `name` and what it calls (loops by trip count,
    every branch of nested conditionals)."""
    if name in memo:
        return memo[name]
    comp, total = comps[name], 0.0
    for instr in comp.instrs:
        total += hlo.matmul_flops_of(instr, comp)
        for callee, trips, _ in hlo_module.callees(instr):
            if callee in comps:
                total += (trips or 1) * _flops_under(comps, callee, memo)
    memo[name] = total
    return total


def _op_names(text: str) -> dict:
    return {m.group(1): m.group(2) for m in map(_OP_NAME_RE.match, text.splitlines()) if m}


def executed_matmul_flops(text: str, columns: dict, stages: int,
                          virtual_stages: int) -> ExecutedFlops:
    """Per-rank executed matmul FLOPs of a compiled pipelined step (`text`: its HLO) whose
    schedule loop ran the lock-step table `columns` (Schedule.table.columns)."""
    comps, reach = hlo_module.parsed(text)
    names, memo = _op_names(text), {}
    counts = branch_counts(columns, stages, virtual_stages)
    num_steps = columns["f_chunk"].shape[0]
    every = hlo.matmul_flops_from_text(text)
    per_rank = np.full(stages, every)
    branches = {}
    for comp in comps.values():
        for instr in comp.instrs:
            if instr.opcode != "conditional":
                continue
            # the switch itself, not a conditional nested in its branches
            scope = names.get(instr.name, "").rsplit("/", 2)[-2:]
            kind = {F_SCOPE: "f", B_SCOPE: "b"}.get(scope[0]) if scope[-1:] == ["cond"] else None
            if kind is None:
                continue
            flops = np.asarray([_flops_under(comps, c, memo)
                                for c, _, _ in hlo_module.callees(instr)])
            if len(flops) != counts[kind].shape[1]:
                raise hlo_module.HloParseError(
                    f"the {kind.upper()} switch %{instr.name} has {len(flops)} branches, the "
                    f"executor's {counts[kind].shape[1]}: pass the HLO of a pipelined step")
            runs = reach[comp.name].count / num_steps   # the schedule loop's steps
            per_rank += runs * (counts[kind] @ flops - num_steps * flops.sum())
            branches[kind] = tuple(float(x) for x in flops)
    return ExecutedFlops(tuple(float(x) for x in per_rank), float(every), branches)


def for_step(text: str, ex) -> ExecutedFlops:
    """executed_matmul_flops of a compiled train step whose schedule is the ledger's
    Executor `ex` (its table is rebuilt from the schedule)."""
    from jaxtrain.ledger.pipeline_schedule import build_schedule
    table = build_schedule(ex.schedule, ex.stages, ex.microbatches, ex.virtual_stages).table
    return executed_matmul_flops(text, table.columns, ex.stages, ex.virtual_stages)

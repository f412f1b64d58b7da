"""What a step executes per device, read from its compiled program: matmul FLOPs and
collective wire bytes, per pipeline rank.

`hlo.matmul_flops` and `hlo.collectives` count every branch of every conditional: for the
executor's lock-step loop that is each step's F and B switch with all their branches (idle,
from the inbox, from the pipeline input; the stashed pullback, the last stage's forward +
head + backward, ...). A rank runs one branch of each per step, and which one is in the
schedule's table. Here every computation's executions are counted with each switch branch
weighted by how many steps rank r takes it (`executed_runs`); everything outside the two
switches counts as it runs. The FLOPs are the matmuls' (dots, GEMM custom calls) and the
attention kernels' (kernel_flops); the bytes are ring wire bytes per mesh axes.
Conditionals nested inside a chunk (uneven stages' per-layer switch, mixed FP8/bf16 chunks)
still count every branch. The switches are found by the name scopes the executor puts on
them (pipeline_executor.F_SCOPE, B_SCOPE) in the HLO's op_name metadata.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxtrain.tools import hlo_module, kernel_flops
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


def _flops_under(comps, name: str, memo: dict, share: float = 1.0, head_dims=None) -> float:
    """Matmul FLOPs of one run of computation `name` and what it calls (loops by trip count,
    every branch of nested conditionals; grouped GEMM kernels at `share` of their rows,
    attention kernels at `head_dims`)."""
    if name in memo:
        return memo[name]
    comp, total = comps[name], 0.0
    for instr in comp.instrs:
        total += kernel_flops.executed_flops_of(instr, comp, share, head_dims)
        for callee, trips, _ in hlo_module.callees(instr):
            if callee in comps:
                total += (trips or 1) * _flops_under(comps, callee, memo, share, head_dims)
    memo[name] = total
    return total


def _op_names(text: str) -> dict:
    return {m.group(1): m.group(2) for m in map(_OP_NAME_RE.match, text.splitlines()) if m}


def _switches(text: str, comps: dict) -> dict:
    """op name -> "f" / "b": the executor's F and B switches (not conditionals nested in
    their branches), found by their name scopes."""
    names, out = _op_names(text), {}
    for comp in comps.values():
        for instr in comp.instrs:
            if instr.opcode != "conditional":
                continue
            scope = names.get(instr.name, "").rsplit("/", 2)[-2:]
            kind = {F_SCOPE: "f", B_SCOPE: "b"}.get(scope[0]) if scope[-1:] == ["cond"] else None
            if kind is not None:
                out[instr.name] = (kind, instr)
    return out


def executed_runs(text: str, columns: dict | None, stages: int = 1,
                  virtual_stages: int = 1) -> dict:
    """computation -> float [stages]: its executions per step on a device of each pipeline
    rank, each F / B switch branch weighted by the steps the table `columns`
    (Schedule.table.columns) takes it; without a table (None) every computation as it runs
    (no switches: one rank)."""
    comps, entry = hlo_module.module(text)
    if columns is None:
        return {k: np.ones(1) * v for k, v in
                hlo_module.weighted_runs(comps, entry, {}).items()}
    counts = branch_counts(columns, stages, virtual_stages)
    num_steps = columns["f_chunk"].shape[0]
    weights = {}
    for name, (kind, instr) in _switches(text, comps).items():
        branches = len(hlo_module.callees(instr))
        if branches != counts[kind].shape[1]:
            raise hlo_module.HloParseError(
                f"the {kind.upper()} switch %{name} has {branches} branches, the "
                f"executor's {counts[kind].shape[1]}: pass the HLO of a pipelined step")
        weights[name] = [counts[kind][:, i] / num_steps for i in range(branches)]
    runs = hlo_module.weighted_runs(comps, entry, weights)
    return {k: np.ones(stages) * v for k, v in runs.items()}


def executed_matmul_flops(text: str, columns: dict | None, stages: int = 1,
                          virtual_stages: int = 1, grouped_rows_share: float = 1.0,
                          head_dims: tuple[int, int] | None = None) -> ExecutedFlops:
    """Per-rank executed matmul FLOPs (GEMMs, dots, attention kernels at the model's
    `head_dims` (q/k, v), grouped GEMM kernels at `grouped_rows_share` of their buffer rows:
    kernel_flops) of a compiled step (`text`:
    its HLO); pipelined, its schedule loop ran the lock-step table `columns`
    (Schedule.table.columns), else None."""
    comps, reach = hlo_module.parsed(text)
    runs = executed_runs(text, columns, stages, virtual_stages)
    per_rank, every = np.zeros(stages if columns is not None else 1), 0.0
    for comp in comps.values():
        for instr in comp.instrs:
            flops = kernel_flops.executed_flops_of(instr, comp, grouped_rows_share, head_dims)
            if flops:
                per_rank += flops * runs[comp.name]
                every += flops * reach[comp.name].count
    memo, branches = {}, {}
    for kind, instr in (_switches(text, comps).values() if columns is not None else ()):
        branches[kind] = tuple(_flops_under(comps, c, memo, grouped_rows_share, head_dims)
                               for c, _, _ in hlo_module.callees(instr))
    return ExecutedFlops(tuple(float(x) for x in per_rank), every, branches)


def executed_wire_bytes(collectives, runs: dict) -> dict:
    """mesh axes -> float [stages]: ring wire bytes per step on a device of each pipeline rank
    of `collectives` (hlo.Collective of a step), each run as often as its computation
    executes (`runs`: executed_runs of the same step), not in every branch."""
    out: dict = {}
    for c in collectives:
        out[c.axes] = out.get(c.axes, 0.0) + c.wire_bytes * runs[c.computation]
    return out


def table_of(ex) -> tuple:
    """(columns, stages, virtual stages) of the ledger's Executor `ex` (its lock-step table
    rebuilt from the schedule), the arguments the readers above take; (None, 1, 1) without."""
    if ex is None:
        return None, 1, 1
    from jaxtrain.ledger.pipeline_schedule import build_schedule
    table = build_schedule(ex.schedule, ex.stages, ex.microbatches, ex.virtual_stages).table
    return table.columns, ex.stages, ex.virtual_stages


def for_step(text: str, ex) -> ExecutedFlops:
    """executed_matmul_flops of a compiled train step whose schedule is the ledger's
    Executor `ex` (None: unpipelined)."""
    return executed_matmul_flops(text, *table_of(ex))

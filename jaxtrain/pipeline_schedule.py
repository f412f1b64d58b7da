"""Pipeline schedules as per-rank op orders, simulated once into a lock-step table.

A schedule says, for each pipeline rank, in which order it runs forward (F) and backward (B)
ops on (virtual stage, microbatch) pairs. Rank r owns virtual stages g = j*p + r (j < v), so
an activation always moves one rank to the right and a cotangent one rank to the left.

The executor (jaxtrain.pipeline) is one SPMD program: every rank advances one step at a time,
so each order is simulated here, in Python, into a table of steps. A step holds at most one F
and one B per rank ("fused" steps, like JaxPP's fuse_steady_state): in the steady state every
rank does F+B together, which keeps lock-step from inflating the bubble when B costs more than
F. Values in flight (chunk inputs waiting for their B, cotangents waiting to be used) get
static buffer slots by interval colouring, so the executor's memory is a number known before
compiling, and for 1F1B it does not grow with the number of microbatches.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class ScheduleError(ValueError):
    """A pipeline schedule that cannot be built; the message says what to change."""


class Op(NamedTuple):
    kind: str        # "F" or "B"
    vstage: int      # virtual stage g in [0, p*v), owned by rank g % p as its chunk g // p
    microbatch: int


# Columns of a step table, each int32 [num_steps, stages]; -1 means "nothing".
TABLE_COLUMNS = (
    "recv_x",    # stash slot that stores the activation arriving at the start of the step
    "recv_g",    # cotangent slot that stores the cotangent arriving at the start of the step
    "f_chunk",   # local chunk j of this step's F
    "f_mb",      # microbatch of this step's F
    "f_slot",    # stash slot holding the F's input (-1: virtual stage 0 reads the input x)
    "b_chunk",   # local chunk j of this step's B
    "b_mb",
    "b_slot",    # stash slot holding the B's chunk input (-1: virtual stage 0 reads x)
    "b_gslot",   # cotangent slot for the B (-1: the last virtual stage seeds it from the loss)
)


@dataclasses.dataclass(frozen=True, eq=False)
class StepTable:
    """A lock-step table and the static buffer sizes it needs."""
    columns: dict            # name -> np.int32 [num_steps, stages]
    stash_slots: tuple       # per rank: chunk inputs held at once (its peak; the buffer size)
    grad_slots: tuple        # per rank: cotangents held at once

    @property
    def num_steps(self) -> int:
        return int(self.columns["f_chunk"].shape[0])


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A simulated schedule: `steps[t][r]` are the ops rank r runs at step t (F before B).

    `table` drives training (F and B); `forward_table` drives forward-only evaluation and the
    autodiff reference (the F ops of the same orders).
    """
    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    steps: tuple
    table: StepTable
    forward_table: StepTable

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def stash_slots(self) -> tuple:
        """Per rank, the chunk inputs the training table stashes at once (static bound)."""
        return self.table.stash_slots

    def bubble(self, fwd_cost: float = 1.0, bwd_cost: float = 1.0) -> float:
        """Idle fraction under lock-step, (time - ideal) / ideal with ideal = m*v*(F+B).

        The executor runs a step's F on every rank when any rank has one, and likewise B, so
        a step costs F if any rank runs an F plus B if any rank runs a B. This is Megatron's
        convention, whose value for these schedules is (p-1)/(m*v).
        """
        total = sum(fwd_cost * any(o.kind == "F" for ops in row for o in ops)
                    + bwd_cost * any(o.kind == "B" for ops in row for o in ops)
                    for row in self.steps)
        ideal = self.microbatches * self.virtual_stages * (fwd_cost + bwd_cost)
        return (total - ideal) / ideal


def validate(kind: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ScheduleError when (kind, p, m, v) cannot be scheduled."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {kind!r}; choose one of {SCHEDULES}")
    for name, val in (("stages", stages), ("microbatches", microbatches),
                      ("virtual_stages", virtual_stages)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ScheduleError(f"pipeline {name}={val!r} must be a positive integer")
    if virtual_stages > 1 and kind != "interleaved_1f1b":
        raise ScheduleError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b' (schedule "
            f"{kind!r} runs one chunk per rank); set virtual_stages=1 or switch the schedule")
    if kind == "interleaved_1f1b" and virtual_stages > 1 and microbatches % stages:
        raise ScheduleError(
            f"interleaved_1f1b needs microbatches divisible by stages (as Megatron): "
            f"microbatches={microbatches}, stages={stages}; use a multiple of {stages}")


def rank_orders(kind: str, stages: int, microbatches: int, virtual_stages: int) -> list:
    """Per rank, the list of Ops in the order that rank runs them."""
    validate(kind, stages, microbatches, virtual_stages)
    p, m, v = stages, microbatches, virtual_stages
    orders = []
    for r in range(p):
        if kind == "gpipe":
            orders.append([Op("F", r, k) for k in range(m)] + [Op("B", r, k) for k in range(m)])
            continue
        if v == 1:
            fwd = [Op("F", r, k) for k in range(m)]
            bwd = [Op("B", r, k) for k in range(m)]
        else:
            # Megatron's interleaving: groups of p microbatches sweep the chunks in turn,
            # forward through chunks 0..v-1 and backward through v-1..0.
            def op(kind_, n, backward):
                j = (n // p) % v
                j = v - 1 - j if backward else j
                return Op(kind_, j * p + r, (n // (p * v)) * p + n % p)
            fwd = [op("F", n, False) for n in range(m * v)]
            bwd = [op("B", n, True) for n in range(m * v)]
        # Warm-up forwards before the first backward. Under lock-step with fused steps, a
        # microbatch travels one rank per step both ways, so the round trip from rank r to the
        # last rank and back is 2(p-1-r) steps (Megatron's asynchronous 1F1B needs p-1-r).
        warm = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
        order = fwd[:warm]
        for f_op, b_op in zip(fwd[warm:], bwd):
            order += [f_op, b_op]
        order += bwd[len(fwd) - warm:]
        orders.append(order)
    return orders


def simulate(orders: list, stages: int, virtual_stages: int) -> list:
    """Run per-rank orders in lock-step; returns steps[t][r] = tuple of Ops.

    A rank runs its next op when the op's inputs exist: a value made by another rank at step
    t is usable at t+1 (one ppermute). A step may also take the following op when it is of the
    other kind (one F and one B per step). The last virtual stage's B may follow its own F in
    the same step, because nothing crosses ranks between them.
    """
    p, num_v = stages, stages * virtual_stages
    done = {}
    ptr = [0] * p
    steps = []
    total = sum(len(o) for o in orders)
    while sum(ptr) < total:
        t = len(steps)

        def ready(op):
            if op.kind == "F":
                return op.vstage == 0 or done.get(("F", op.vstage - 1, op.microbatch), t) < t
            f_at = done.get(("F", op.vstage, op.microbatch), t + 1)
            if op.vstage == num_v - 1:
                return f_at <= t
            return f_at < t and done.get(("B", op.vstage + 1, op.microbatch), t) < t

        row = []
        for r in range(p):
            ops = []
            while ptr[r] < len(orders[r]) and len(ops) < 2:
                op = orders[r][ptr[r]]
                if any(o.kind == op.kind for o in ops) or not ready(op):
                    break
                ops.append(op)
                done[(op.kind, op.vstage, op.microbatch)] = t
                ptr[r] += 1
            # F runs before B inside a step (the executor's order).
            row.append(tuple(sorted(ops, key=lambda o: o.kind != "F")))
        if not any(row):
            stuck = {r: orders[r][ptr[r]] for r in range(p) if ptr[r] < len(orders[r])}
            raise ScheduleError(f"pipeline schedule deadlocks at step {t}; waiting ops: {stuck}")
        steps.append(tuple(row))
    return steps


def _colour(intervals):
    """Interval colouring by start time (optimal for intervals): key -> slot, slot count."""
    free_at, slot_of = [], {}
    for start, end, key in sorted(intervals, key=lambda z: z[:2]):
        for s, f in enumerate(free_at):
            if f <= start:
                free_at[s], slot_of[key] = end + 1, s
                break
        else:
            slot_of[key] = len(free_at)
            free_at.append(end + 1)
    return slot_of, len(free_at)


def build_table(steps: list, stages: int, virtual_stages: int, microbatches: int,
                backward: bool = True) -> StepTable:
    """Turn simulated steps into the executor's table (see TABLE_COLUMNS)."""
    p, v, m = stages, virtual_stages, microbatches
    num_v, num_t = p * v, len(steps)
    at = {(op.kind, op.vstage, op.microbatch): t
          for t, row in enumerate(steps) for ops in row for op in ops}
    # A chunk input is stashed from its arrival until its B (forward-only: until its F);
    # virtual stage 0 reads the pipeline input x instead. A cotangent waits from its arrival
    # until the B that consumes it.
    x_iv, g_iv = [[] for _ in range(p)], [[] for _ in range(p)]
    for g in range(1, num_v):
        for k in range(m):
            end = at[("B", g, k)] if backward else at[("F", g, k)]
            x_iv[g % p].append((at[("F", g - 1, k)] + 1, end, (g, k)))
    if backward:
        for g in range(num_v - 1):
            for k in range(m):
                g_iv[g % p].append((at[("B", g + 1, k)] + 1, at[("B", g, k)], (g, k)))
    x_slot, g_slot, x_count, g_count = {}, {}, [], []
    for r in range(p):
        s, n = _colour(x_iv[r])
        x_slot.update(s)
        x_count.append(n)
        s, n = _colour(g_iv[r])
        g_slot.update(s)
        g_count.append(n)

    cols = {c: np.full((num_t, p), -1, np.int32) for c in TABLE_COLUMNS}
    for t, row in enumerate(steps):
        for r, ops in enumerate(row):
            for op in ops:
                g, k = op.vstage, op.microbatch
                if op.kind == "F":
                    cols["f_chunk"][t, r], cols["f_mb"][t, r] = g // p, k
                    cols["f_slot"][t, r] = x_slot.get((g, k), -1)
                    if g < num_v - 1:
                        cols["recv_x"][t + 1, (r + 1) % p] = x_slot[(g + 1, k)]
                elif backward:
                    cols["b_chunk"][t, r], cols["b_mb"][t, r] = g // p, k
                    cols["b_slot"][t, r] = x_slot.get((g, k), -1)
                    cols["b_gslot"][t, r] = g_slot.get((g, k), -1)
                    if g > 0:
                        cols["recv_g"][t + 1, (r - 1) % p] = g_slot[(g - 1, k)]
    return StepTable(cols, tuple(x_count), tuple(g_count))


def step_flags(table: StepTable, stages: int, virtual_stages: int, backward: bool) -> dict:
    """Per-step booleans [num_steps], the same on every rank: whether the step runs the F
    (`any_f`) and the B (`any_b`) conditional. In training the last virtual stage's F is done
    by its B (one vjp for both), so a step whose only F is that one skips the F."""
    p, cols = stages, table.columns
    f_last = (cols["f_chunk"] >= 0) & (cols["f_chunk"] * p + np.arange(p)[None, :]
                                       == p * virtual_stages - 1)
    f_work = (cols["f_chunk"] >= 0) & ~f_last if backward else cols["f_chunk"] >= 0
    return {"any_f": f_work.any(1), "any_b": (cols["b_chunk"] >= 0).any(1)}


def build_schedule(kind: str, stages: int, microbatches: int,
                   virtual_stages: int = 1) -> Schedule:
    """Simulate `kind` for p stages, m microbatches, v virtual stages per rank."""
    orders = rank_orders(kind, stages, microbatches, virtual_stages)
    steps = simulate(orders, stages, virtual_stages)
    fwd_orders = [[op for op in o if op.kind == "F"] for o in orders]
    fwd_steps = simulate(fwd_orders, stages, virtual_stages)
    return Schedule(
        kind=kind, stages=stages, microbatches=microbatches, virtual_stages=virtual_stages,
        steps=tuple(steps),
        table=build_table(steps, stages, virtual_stages, microbatches, backward=True),
        forward_table=build_table(fwd_steps, stages, virtual_stages, microbatches,
                                  backward=False))

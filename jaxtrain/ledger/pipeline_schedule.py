"""Pipeline schedules as per-rank op orders, simulated once into a lock-step table.

A schedule says, for each pipeline rank, in which order it runs forward (F) and backward (B)
ops on (virtual stage, microbatch) pairs. Rank r owns virtual stages g = j*p + r (j < v), so
an activation always moves one rank to the right and a cotangent one rank to the left.

The executor (jaxtrain.parallel.pipeline_executor) is one SPMD program: every rank advances one
step at a time, so each order is simulated here, in Python, into a table of steps (numpy only:
the ledger prices the same tables). A step holds at most one F and one B per rank ("fused"
steps, like JaxPP's fuse_steady_state): in the steady state every rank does F+B together,
which keeps lock-step from inflating the bubble when B costs more than F. Values in flight (activations waiting for their F, what an F saved for its B, cotangents
waiting for their B) get static buffer slots by interval colouring, so the executor's memory is
a number known before compiling, and for 1F1B it does not grow with the number of microbatches.
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


# Columns of a step table, each int32 [num_steps, stages]; -1 means "nothing". Three kinds of
# slots: the inbox holds an activation from its arrival until the F that reads it (the last
# virtual stage's until its B, which runs that chunk's forward too); the stash holds what an F
# saves for its B; the cotangent slots hold a cotangent from its arrival until its B.
TABLE_COLUMNS = (
    "recv_x",    # inbox slot that stores the activation arriving at the start of the step
    "recv_g",    # cotangent slot that stores the cotangent arriving at the start of the step
    "f_chunk",   # local chunk j of this step's F
    "f_mb",      # microbatch of this step's F
    "f_in",      # inbox slot of the F's input (-1: virtual stage 0 reads the pipeline input)
    "f_res",     # stash slot the F saves its residuals in (-1: forward-only, or folded)
    "b_chunk",   # local chunk j of this step's B
    "b_mb",
    "b_in",      # the last virtual stage's inbox slot: its B runs the chunk forward too
    "b_res",     # stash slot the B reads (-1: the last virtual stage)
    "b_gslot",   # cotangent slot for the B (-1: the last virtual stage seeds it from the loss)
)


@dataclasses.dataclass(frozen=True, eq=False)
class StepTable:
    """A lock-step table and the static buffer sizes it needs (per rank: its peak)."""
    columns: dict            # name -> np.int32 [num_steps, stages]
    stash_slots: tuple       # per rank: residual sets an F saved and its B has not used yet
    inbox_slots: tuple       # per rank: activations waiting for their F (or last-stage B)
    grad_slots: tuple        # per rank: cotangents waiting for their B

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
        """Per rank, the residual sets the training table stashes at once (static bound)."""
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


def _colour(intervals, reuse_at_end: bool = False):
    """Interval colouring by start time (optimal for intervals): key -> slot, slot count.

    An interval (start, end, key) holds its slot over steps start..end; with `reuse_at_end`
    another may take it at step `end` (its user reads it before the next writer writes)."""
    free_at, slot_of = [], {}
    gap = 0 if reuse_at_end else 1
    for start, end, key in sorted(intervals, key=lambda z: z[:2]):
        for s, f in enumerate(free_at):
            if f <= start:
                free_at[s], slot_of[key] = end + gap, s
                break
        else:
            slot_of[key] = len(free_at)
            free_at.append(end + gap)
    return slot_of, len(free_at)


def _slots(intervals_by_rank, reuse_at_end=False):
    slot_of, counts = {}, []
    for iv in intervals_by_rank:
        s, n = _colour(iv, reuse_at_end)
        slot_of.update(s)
        counts.append(n)
    return slot_of, tuple(counts)


def build_table(steps: list, stages: int, virtual_stages: int, microbatches: int,
                backward: bool = True) -> StepTable:
    """Turn simulated steps into the executor's table (see TABLE_COLUMNS).

    Within a step the executor runs the B before the F (they never depend on each other: a
    B needs its F from an earlier step, and the last virtual stage's F is done by its B), so a
    stash slot a B frees is the one the same step's F fills."""
    p, v, m = stages, virtual_stages, microbatches
    num_v, last = p * v, p * v - 1
    at = {(op.kind, op.vstage, op.microbatch): t
          for t, row in enumerate(steps) for ops in row for op in ops}
    inbox, stash, grads = ([[] for _ in range(p)] for _ in range(3))
    for k in range(m):
        for g in range(num_v):
            if g > 0:   # an activation waits from its arrival for the op that reads it
                use = at[("B", g, k)] if backward and g == last else at[("F", g, k)]
                inbox[g % p].append((at[("F", g - 1, k)] + 1, use, (g, k)))
            if backward and g < last:
                stash[g % p].append((at[("F", g, k)], at[("B", g, k)], (g, k)))
                grads[g % p].append((at[("B", g + 1, k)] + 1, at[("B", g, k)], (g, k)))
    in_slot, in_count = _slots(inbox)
    res_slot, res_count = _slots(stash, reuse_at_end=True)
    g_slot, g_count = _slots(grads)

    cols = {c: np.full((len(steps), p), -1, np.int32) for c in TABLE_COLUMNS}
    for t, row in enumerate(steps):
        for r, ops in enumerate(row):
            for op in ops:
                g, k = op.vstage, op.microbatch
                if op.kind == "F":
                    if backward and g == last:
                        continue    # done by its B
                    cols["f_chunk"][t, r], cols["f_mb"][t, r] = g // p, k
                    cols["f_in"][t, r] = in_slot.get((g, k), -1)
                    cols["f_res"][t, r] = res_slot.get((g, k), -1)
                    if g < last:
                        cols["recv_x"][t + 1, (r + 1) % p] = in_slot[(g + 1, k)]
                elif backward:
                    cols["b_chunk"][t, r], cols["b_mb"][t, r] = g // p, k
                    cols["b_in"][t, r] = in_slot.get((g, k), -1) if g == last else -1
                    cols["b_res"][t, r] = res_slot.get((g, k), -1)
                    cols["b_gslot"][t, r] = g_slot.get((g, k), -1)
                    if g > 0:
                        cols["recv_g"][t + 1, (r - 1) % p] = g_slot[(g - 1, k)]
    return StepTable(cols, res_count, in_count, g_count)


def step_flags(table: StepTable) -> dict:
    """Per-step booleans [num_steps], the same on every rank: whether some rank runs an F
    (`any_f`, the last virtual stage's folded F excluded) or a B (`any_b`). A rank without
    one skips its work, but lock-step makes the step last as long as the busiest rank."""
    cols = table.columns
    return {"any_f": (cols["f_chunk"] >= 0).any(1), "any_b": (cols["b_chunk"] >= 0).any(1)}


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

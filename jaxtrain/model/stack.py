"""A stack of two layer kinds (dense and MoE blocks) as scans over repeated units.

The MoE layers are stored stacked in one module (`Llama.blocks`) and the dense layers of a
mixed model in another (`Llama.dense_blocks`), each in layer order. A scan body must be one
fixed program, so the stack runs as groups: maximal runs of a unit of layer kinds repeated
back to back. Every layer MoE (Mixtral): one group, unit (moe,). The first k dense
(DeepSeek): (dense,) x k, then (moe,) x (L - k). Every n-th MoE (Megatron's moe_layer_freq):
(moe, dense, ..., dense) x L/n, the remainder as groups of its own. A group's scan slices each
kind's rows of that group (no copy when one group holds a whole stack); a unit of several
layers scans [repeats, layers of that kind in the unit, ...] views, so a layer runner (remat)
sees one row per unit, not per layer.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax

MOE, DENSE = True, False


@dataclasses.dataclass(frozen=True)
class Group:
    start: int                  # its first layer
    unit: tuple[bool, ...]      # layer kinds (MOE / DENSE) of one repeat, in order
    repeats: int
    rows: dict                  # kind -> its first row in that kind's stack

    @property
    def stop(self) -> int:
        return self.start + len(self.unit) * self.repeats

    def count(self, kind: bool) -> int:
        """Layers of `kind` in one unit."""
        return sum(k == kind for k in self.unit)


def layer_groups(kinds: Sequence[bool], period: int) -> list[Group]:
    """The stack's groups, greedily: at each layer the unit (of length 1 or `period`) whose
    back-to-back repeats cover the most layers (the shorter on a tie)."""
    kinds, groups, i = tuple(kinds), [], 0
    rows = {MOE: 0, DENSE: 0}
    while i < len(kinds):
        best = None
        for p in sorted({1, period}):
            unit = kinds[i:i + p]
            if len(unit) < p:
                continue
            r = 1
            while kinds[i + r * p:i + (r + 1) * p] == unit:
                r += 1
            if best is None or r * p > best[1] * len(best[0]):
                best = (unit, r)
        unit, r = best
        groups.append(Group(i, unit, r, dict(rows)))
        for kind in (MOE, DENSE):
            rows[kind] += r * sum(k == kind for k in unit)
        i += r * len(unit)
    return groups


def group_state(group: Group, states: dict, stack_rows: dict):
    """What the group's scan runs over: its rows of each kind's stacked state, leading dim
    `repeats` ([repeats, per-unit, ...] for a unit of several layers)."""
    def rows(kind):
        start, n = group.rows[kind], group.repeats * group.count(kind)
        part = states[kind] if (start, n) == (0, stack_rows[kind]) else jax.tree.map(
            lambda a: a[start:start + n], states[kind])
        if len(group.unit) == 1:
            return part
        return jax.tree.map(lambda a: a.reshape(group.repeats, group.count(kind), *a.shape[1:]),
                            part)
    if len(group.unit) == 1:
        return rows(group.unit[0])
    return {("moe" if kind else "dense"): rows(kind) for kind in set(group.unit)}


def unit_fn(group: Group, apply: dict[bool, Callable]) -> Callable:
    """(unit state, carry) -> carry for one repeat of the group's unit. `apply[kind](layer
    state, carry) -> carry` runs one layer."""
    if len(group.unit) == 1:
        return apply[group.unit[0]]

    def run(s, carry):
        seen = {MOE: 0, DENSE: 0}
        for kind in group.unit:
            j = seen[kind]
            seen[kind] += 1
            carry = apply[kind](jax.tree.map(lambda a: a[j], s["moe" if kind else "dense"]),
                                carry)
        return carry
    return run

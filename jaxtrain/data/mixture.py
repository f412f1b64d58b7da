"""Mixtures (Megatron's blend): which component each sequence of a run comes from.

The weights of `data.mixture` are read as exact fractions ("0.3" is 3/10) and scaled to the
smallest integer shares p_i (total P). Sequence k of the run is assigned by nested splits: the
first component keeps ceil(k·p_0/P) of the first k sequences and passes the others on as a
substream, in which the second component keeps its share of what remains, and so on. So every
P consecutive sequences from a multiple of P hold exactly p_i of component i, and every prefix
is within one sequence per component of exact. The assignment has no randomness: the seed
shuffles the windows inside each component, so the blend is the same for every seed, every
restart and every layout, and a position in the run is one integer.
"""
from __future__ import annotations

import fractions
import math
import sys
from typing import Sequence


def shares(weights: Sequence[str]) -> list[int]:
    """Exact integer proportions of decimal weights: ("0.3", "0.7") -> [3, 7]."""
    exact = [fractions.Fraction(w) for w in weights]
    scale = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * scale) for f in exact]
    g = math.gcd(*ints)
    return [i // g for i in ints]


class Blend:
    """Run position k -> (component, index within that component's own sequence stream).

    grain's DatasetSelectionMap interface (len, getitem), not its subclass, so that importing
    the data package (e.g. in prepare's worker processes) does not import grain."""

    def __init__(self, shares_: Sequence[int]):
        if not shares_ or min(shares_) <= 0:
            raise ValueError(f"blend shares must be positive, got {list(shares_)}")
        self.shares = tuple(int(s) for s in shares_)

    def __len__(self) -> int:
        return sys.maxsize  # components repeat forever

    def __getitem__(self, k: int) -> tuple[int, int]:
        total = sum(self.shares)
        for c, share in enumerate(self.shares[:-1]):
            rest = total - share
            passed_before, passed_upto = k * rest // total, (k + 1) * rest // total
            if passed_upto == passed_before:  # k is not passed on: it is component c's
                return c, k - passed_before
            k, total = passed_before, rest  # k's position in the substream
        return len(self.shares) - 1, k

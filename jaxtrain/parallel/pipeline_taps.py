"""How a pipeline rank's chunk trees split when its B taps the weights (Fns.taps).

A tapped leaf's gradient goes into the rank's fp32 accumulator inside the chunk's layer scan
(parallel/grad_accumulation.py): the accumulator holds the rank's v chunks as rows [v·Lc,
...] (a local reshape of [v, Lc, ...]), so chunk j's layer i is row j·Lc + i and no chunk is
sliced out of it. Untapped leaves (FP8 metas, layer modes) keep the executor's [v, ...] sums.
Trees here keep the chunk parameters' structure with None where a leaf belongs to the other
part, which is the structure grad_accumulation matches by path.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax


def split_taps(params, taps: Sequence[bool]) -> tuple:
    """(tapped leaves, the others, merge(tapped, others) -> params) of a parameter tree."""
    leaves, tree = jax.tree.flatten(params)

    def merge(w, r):
        w, r = iter(w), iter(r)
        return jax.tree.unflatten(tree, [next(w) if t else next(r) for t in taps])
    return ([a for a, t in zip(leaves, taps) if t], [a for a, t in zip(leaves, taps) if not t],
            merge)


def untapped(params, taps: Sequence[bool], leaves=None) -> Any:
    """The untapped `leaves` (in leaf order; default `params`' own) in `params`' structure,
    None where tapped."""
    _, rest, merge = split_taps(params, taps)
    return merge([None] * sum(taps), rest if leaves is None else leaves)


def accumulator_rows(chunks, taps: Sequence[bool]) -> Any:
    """The rank's tapped leaves [v, Lc, ...] as rows [v·Lc, ...], None where untapped."""
    w, r, merge = split_taps(chunks, taps)
    return merge([a.reshape((-1,) + a.shape[2:]) for a in w], [None] * len(r))


def gradients(chunks, taps: Sequence[bool], d_acc, d_untapped) -> Any:
    """fp32 [v, ...] sums of every chunk leaf: the accumulator's rows back as [v, Lc, ...]
    beside the untapped leaves' sums."""
    v = jax.tree.leaves(chunks)[0].shape[0]
    acc = [a.reshape((v, -1) + a.shape[1:]) for a in jax.tree.leaves(d_acc)]
    return split_taps(chunks, taps)[2](acc, jax.tree.leaves(d_untapped))

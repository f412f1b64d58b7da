"""Where each layer's rows live in the train state: natural order, or the pipeline's chunk order.

Layer-stacked leaves (everything under a "blocks" key: parameters, Adam moments, FP8 metas)
lead with a layers dim. Unpipelined that dim is [L] in model order. With pipeline stages it is
[p * v * Lc] in chunk order: rank r's chunks j = 0..v-1, each of Lc rows (the largest chunk;
shorter chunks of uneven first/last stages end in zero padding rows). Sharding that dim over
`stage` then gives every rank exactly its own chunks, so the executor's [p, v, Lc] view is a
local reshape: no layer moves between stages in a step. (In model order, the interleaved
schedule's chunk g = j*p + r would need other ranks' layers: measured on the 70B dry run, an
all-to-all of every moved layer's parameters and gradients per step.)

`LayerOrder.rows[i]` is the model layer stored in row i, or -1 for padding. For v = 1 with even
stages the chunk order is the natural order. Checkpoints record the rows they were written in,
so a run restores them under any other layout (`convert`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

BLOCKS = "blocks"
PAD = -1


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    rows: tuple[int, ...]

    @classmethod
    def natural(cls, num_layers: int) -> "LayerOrder":
        return cls(tuple(range(num_layers)))

    @classmethod
    def chunks(cls, counts_PV: np.ndarray) -> "LayerOrder":
        """Chunk order for [p, v] layers per chunk: rows (r, j, i), virtual stage g = j*p + r
        holding the layers after those of virtual stages 0..g-1."""
        counts_PV = np.asarray(counts_PV)
        p, v = counts_PV.shape
        lc = int(counts_PV.max())
        start_G = np.concatenate([[0], np.cumsum(counts_PV.T.reshape(-1))])[:-1]
        index_PVC = start_G.reshape(v, p).T[..., None] + np.arange(lc)
        real_PVC = np.arange(lc) < counts_PV[..., None]
        return cls(tuple(np.where(real_PVC, index_PVC, PAD).reshape(-1).tolist()))

    @property
    def num_layers(self) -> int:
        return sum(r != PAD for r in self.rows)

    @property
    def is_natural(self) -> bool:
        return self.rows == tuple(range(len(self.rows)))

    def from_natural(self, a_L):
        """[L, ...] in model order -> [rows, ...] in this order (padding rows zero)."""
        if self.is_natural:
            return a_L
        rows = np.asarray(self.rows)
        xp = np if isinstance(a_L, np.ndarray) else jnp
        taken = a_L[np.maximum(rows, 0)]
        real = (rows != PAD).reshape((-1,) + (1,) * (taken.ndim - 1))
        return xp.where(real, taken, xp.zeros((), taken.dtype))

    def to_natural(self, a_R):
        """[rows, ...] in this order -> [L, ...] in model order (padding dropped)."""
        if self.is_natural:
            return a_R
        rows = np.asarray(self.rows)
        return a_R[np.flatnonzero(rows != PAD)[np.argsort(rows[rows != PAD])]]


def _is_blocks(path) -> bool:
    return any(getattr(k, "key", None) == BLOCKS for k in path)


def map_blocks(fn, tree: Any) -> Any:
    """Apply fn to every leaf under a "blocks" key (layer-stacked); leave the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: fn(a) if _is_blocks(path) and getattr(a, "ndim", 0) >= 1 else a, tree)


def convert(tree: Any, src: LayerOrder, dst: LayerOrder) -> Any:
    """Layer-stacked leaves of `tree` (params, optimizer state, FP8 metas) from src to dst."""
    if src == dst:
        return tree
    if src.num_layers != dst.num_layers:
        raise ValueError(f"the stored layers hold {src.num_layers} model layers but this model "
                         f"has {dst.num_layers}")
    return map_blocks(lambda a: dst.from_natural(src.to_natural(a)), tree)


def stored_rows(tree: Any) -> Optional[int]:
    """The leading dim of the layer-stacked leaves of `tree` (None when it has none)."""
    sizes = set()
    map_blocks(lambda a: sizes.add(a.shape[0]), tree)
    return sizes.pop() if len(sizes) == 1 else None


def to_json(order: LayerOrder) -> dict:
    return {"layer_rows": list(order.rows)}


def from_json(d: Optional[dict], num_layers: int) -> LayerOrder:
    """The order a checkpoint recorded; checkpoints without one are in natural order."""
    if not d or "layer_rows" not in d:
        return LayerOrder.natural(num_layers)
    return LayerOrder(tuple(int(r) for r in d["layer_rows"]))


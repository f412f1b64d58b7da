"""Where the pipeline executor's arguments and results live on the mesh: its manual axes and
its shard_map specs.

`stage` is manual, and so are the data-replica axes that have replicas: `data`, and `expert`
(expert parallelism: its ranks are data replicas for every weight but the experts'). Inputs
[m, batch, ...] split their rows (dim 1) over the replica axes; chunk parameters [p, v, ...]
over `stage`, and a leaf with an experts dim (`expert_dims`) over `expert` on it too (each
rank runs its own experts; the MoE dispatch brings the tokens). Gradients leave stacked
[replicas, p, ...] over the replica axes, the experts' over those but `expert`, so the
caller's one reduction of the replica dim reduces each weight over its own data-parallel
group.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel.mesh_axes import DATA, EXPERT, STAGE


def replica_axes(mesh) -> tuple:
    """The data-replica axes the executor makes manual: `data` and `expert` when they have
    replicas (a size-1 axis would only add a no-op reduction)."""
    return tuple(a for a in (DATA, EXPERT) if mesh.shape.get(a, 1) > 1)


def manual_axes(mesh) -> tuple:
    """The mesh axes the executor makes manual: `stage` and replica_axes."""
    return (STAGE,) + replica_axes(mesh)


def _axes(axes: tuple):
    return axes[0] if len(axes) == 1 else (axes or None)


def batch_specs(tree, mesh):
    """Inputs are [m, batch, ...]: data replicas take their rows of dim 1."""
    rows = replica_axes(mesh)
    return jax.tree.map(lambda a: P(None, _axes(rows)) if rows and a.ndim >= 2 else P(), tree)


def stacked(mesh) -> P:
    """[replicas, p, ...]: a gradient stacked per data replica and stage rank."""
    return P(_axes(replica_axes(mesh)), STAGE)


def chunk_specs(chunk_params, expert_dims: Any, mesh):
    """(in specs of the chunk parameters, out specs of their stacked gradients).
    `expert_dims`: per chunk leaf, the dim (counting [p, v, ...]) of its experts, or None."""
    rows = replica_axes(mesh)
    leaves, tree = jax.tree.flatten(chunk_params)
    dims = [None] * len(leaves)
    if EXPERT in rows and expert_dims is not None:
        dims = jax.tree.leaves(expert_dims, is_leaf=lambda d: d is None)
    rest = _axes(tuple(a for a in rows if a != EXPERT))

    def spec(dim, lead=()):
        return P(*lead, STAGE, *(None,) * (dim - 1), EXPERT)
    in_specs = [P(STAGE) if d is None else spec(d) for d in dims]
    out_specs = [stacked(mesh) if d is None else spec(d, (rest,)) for d in dims]
    return jax.tree.unflatten(tree, in_specs), jax.tree.unflatten(tree, out_specs)

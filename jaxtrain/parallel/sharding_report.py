"""The notebook's and `train.py --inspect-sharding`'s table: where every parameter lives."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.parallel import sharding


def describe(logical_tree, shape_tree, mesh: Mesh, spec_tree=None) -> str:
    """A table of every parameter: path, shape, logical axes, PartitionSpec, bytes per device,
    replication factor (how many devices hold each byte)."""
    spec_tree = (spec_tree if spec_tree is not None
                 else sharding.param_specs(logical_tree, shape_tree, mesh))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    flat_names = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=is_spec)[0]
    flat_shapes = jax.tree.leaves(shape_tree)
    flat_specs = jax.tree.leaves(spec_tree, is_leaf=is_spec)
    rows = [("path", "shape", "logical axes", "spec", "bytes/device", "replicated")]
    total = 0
    for (path, names), x, spec in zip(flat_names, flat_shapes, flat_specs):
        shard_factor = math.prod(mesh.shape[a] for axes in spec
                                 for a in sharding.flat_axes(axes))
        per_device = math.prod(x.shape) * np.dtype(x.dtype).itemsize // shard_factor
        total += per_device
        rows.append(("/".join(str(getattr(k, "key", k)) for k in path),
                     "x".join(map(str, x.shape)) or "()",
                     ",".join(str(n) for n in names), str(spec), f"{per_device:,}",
                     str(mesh.size // shard_factor)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    mesh_txt = " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    lines.append(f"total parameter bytes per device: {total:,} (mesh {mesh_txt})")
    return "\n".join(lines)

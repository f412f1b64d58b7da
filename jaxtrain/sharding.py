"""The device mesh, the one logical->mesh rules table, and the shardings derived from it.

Only this module knows mesh axes. The model names logical axes (DESIGN.md §3); the table below
says where each lives, once for parameters and once for activations. All mesh axes are `Auto`
(GSPMD propagation between the constraints we place), chosen on purpose: jax 0.10's
`make_mesh` would otherwise default to Explicit.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.config import Config, ParallelConfig
from jaxtrain.ledger.layout import LayoutError, layout_from_config, resolve_degrees

MESH_AXES = ("stage", "data", "fsdp", "context", "tensor")  # outermost first; tensor fastest

# logical axis -> (mesh axes for parameters, mesh axes for activations)
RULES: dict[str, tuple] = {
    "batch":    (None,     ("data", "fsdp")),
    "length":   (None,     None),       # "tensor" in the residual stream under sequence parallelism
    "embed":    ("fsdp",   None),
    "heads":    ("tensor", "tensor"),
    "kv_heads": ("tensor", "tensor"),
    "mlp":      ("tensor", "tensor"),
    "vocab":    ("tensor", "tensor"),
    "head_dim": (None,     None),
    "norm":     (None,     None),
    "layers":   ("stage",  None),     # pipeline: each stage holds its layers
}


def mesh_shape(parallel_cfg: Config | ParallelConfig, n_devices: int) -> dict[str, int]:
    """Mesh degrees with the -1 filled (the ledger's arithmetic, so the two always agree)."""
    cfg = parallel_cfg if isinstance(parallel_cfg, Config) else Config(parallel=parallel_cfg)
    return resolve_degrees(cfg, n_devices)


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(parallel, len(devices))
    device_grid = np.asarray(devices).reshape(tuple(shape[a] for a in MESH_AXES))
    return Mesh(device_grid, MESH_AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def validate_layout(cfg: Config, n_devices: int) -> dict[str, int]:
    """Everything about the layout that can be checked before compiling; the mesh degrees."""
    layout_from_config(cfg, n_devices)  # divisibility of heads, MLP, batch, sequence, layers
    shape = mesh_shape(cfg, n_devices)
    if shape["context"] > 1:
        raise LayoutError("parallel.context > 1: context parallelism is not implemented yet; "
                          "set parallel.context=1")
    return shape


def varying_axes(a) -> frozenset:
    """The manual mesh axes (inside shard_map) over which `a` may differ between devices."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10 and 0.11 spell it differently
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


# ----------------------------------------------------------------------------- specs

def _mesh_axes_for(name, column, mesh, dim):
    if name is None:
        return None
    if name not in RULES:
        raise KeyError(f"logical axis {name!r} has no rule; known: {', '.join(RULES)}")
    axes = RULES[name][column]
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    if not axes or dim % math.prod(mesh.shape[a] for a in axes):
        return None  # not divisible (e.g. 8 KV heads on tensor=16): replicate this dim
    return axes[0] if len(axes) == 1 else axes


def logical_to_spec(names: Iterable, shape, mesh: Mesh, *, params: bool, overrides=None) -> P:
    column = 0 if params else 1
    out, used = [], set()
    for name, dim in zip(names, shape):
        if overrides and name in overrides:
            axes = overrides[name]
        else:
            axes = _mesh_axes_for(name, column, mesh, dim)
        flat = (axes,) if isinstance(axes, str) else (axes or ())
        if any(a in used for a in flat):
            axes = None
        used.update(flat)
        out.append(axes)
    return P(*out)


def logical_axes(abstract_state):
    """Pure-dict tree of P(logical names...) from an nnx.State's `sharding_names` metadata."""
    from flax import nnx
    names = jax.tree.map(lambda v: P(*(v.get_metadata().get("out_sharding") or (None,) * v.ndim)),
                         abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(names) if hasattr(names, "flat_state") or isinstance(names, nnx.State) else names


def param_specs(logical_tree, shape_tree, mesh: Mesh, *, zero1: bool = False):
    """Mesh PartitionSpecs for parameter-shaped arrays; with `zero1`, also sharded over data."""
    def one(names, x):
        spec = logical_to_spec(tuple(names), x.shape, mesh, params=True)
        return add_data_axis(spec, x.shape, mesh) if zero1 else spec
    return jax.tree.map(one, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, P))


def add_data_axis(spec: P, shape, mesh: Mesh) -> P:
    """ZeRO-1: shard a (parameter-shaped) optimizer array over `data` as well, on the first dim
    that is divisible; arrays with no such dim stay replicated over data."""
    n = mesh.shape["data"]
    if n == 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for i, (axes, dim) in enumerate(zip(parts, shape)):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if dim % (n * math.prod(mesh.shape[a] for a in flat)) == 0:
            # `data` minor: each compute shard (say tensor block i) is then the contiguous run
            # of data sub-blocks, so gathering over `data` needs no device permutation.
            parts[i] = (*flat, "data") if flat else "data"
            return P(*parts)
    return spec


def named(mesh: Mesh, spec_tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- activations

@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """The `constrain(x, logical_names)` the model calls, bound to a mesh.

    `inside_data_vmap`: the train step vmaps over the `data` axis (so data-parallel gradient
    reduction happens once per step); inside it `batch` maps to `fsdp` only.
    """
    mesh: Mesh
    sequence_parallel: bool = False
    inside_data_vmap: bool = False

    def __call__(self, x, names):
        overrides = {}
        if self.sequence_parallel and not any(_uses_tensor(n) for n in names):
            # Only the residual stream ([batch, length, embed]) is split over the sequence;
            # arrays with a tensor-parallel dim (logits: vocab) keep tensor on that dim.
            overrides["length"] = "tensor" if self.mesh.shape["tensor"] > 1 else None
        if self.inside_data_vmap:
            overrides["batch"] = "fsdp" if self.mesh.shape["fsdp"] > 1 else None
        spec = logical_to_spec(names, x.shape, self.mesh, params=False, overrides=overrides)
        if self.sequence_parallel and "length" in names:
            spec = _drop_if_indivisible(spec, x.shape, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def _uses_tensor(name) -> bool:
    axes = RULES.get(name, (None, None))[1] if name is not None else None
    return axes == "tensor" or (isinstance(axes, tuple) and "tensor" in axes)


def _drop_if_indivisible(spec, shape, mesh):
    parts = []
    for axes, dim in zip(spec, shape):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        parts.append(axes if not flat or dim % math.prod(mesh.shape[a] for a in flat) == 0 else None)
    return P(*parts)


def batch_spec(mesh: Mesh) -> P:
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    return P(axes if len(axes) > 1 else (axes[0] if axes else None), None)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a global [B, S] batch lives: rows over (data, fsdp)."""
    return NamedSharding(mesh, batch_spec(mesh))


# ----------------------------------------------------------------------------- inspection

def describe(logical_tree, shape_tree, mesh: Mesh, spec_tree=None) -> str:
    """A table of every parameter: path, shape, logical axes, PartitionSpec, bytes per device,
    replication factor (how many devices hold each byte)."""
    spec_tree = spec_tree if spec_tree is not None else param_specs(logical_tree, shape_tree, mesh)
    flat_names = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=lambda x: isinstance(x, P))[0]
    flat_shapes = jax.tree.leaves(shape_tree)
    flat_specs = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, P))
    rows = [("path", "shape", "logical axes", "spec", "bytes/device", "replicated")]
    total = 0
    for (path, names), x, spec in zip(flat_names, flat_shapes, flat_specs):
        shard_factor = math.prod(mesh.shape[a] for axes in spec
                                 for a in ((axes,) if isinstance(axes, str) else (axes or ())))
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

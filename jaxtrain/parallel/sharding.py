"""The device mesh, the one logical->mesh rules table, and the shardings derived from it.

Only this module maps logical axes to mesh axes (the kernels' shard_map wrappers,
sharded_kernels.py, ask it through `mesh_axes_for`; the notebook's table is
sharding_report.py). The model names logical axes (docs/design.md §3); the table below
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

from jaxtrain import compat
from jaxtrain.parallel.mesh_axes import (CONTEXT, DATA, EXPERT, FSDP, MESH_AXES, REPLICA_AXES,
                                         ROW_AXES, STAGE)
from jaxtrain.config import Config, ParallelConfig, expert_from_data
from jaxtrain.ledger.layout import layout_from_config, resolve_degrees

# logical axis -> (mesh axes for parameters, mesh axes for activations)
RULES: dict[str, tuple] = {
    "batch":    (None,     ("data", "expert", "fsdp")),
    # The sequence of every activation is split over `context` (context parallelism); under
    # sequence parallelism the residual stream's `length` is split over (context, tensor),
    # while `sequence` names the dims SP leaves whole (inside attention and the MLP).
    "length":   (None,     "context"),
    "sequence": (None,     "context"),
    "embed":    ("fsdp",   None),
    "heads":    ("tensor", "tensor"),
    "kv_heads": ("tensor", "tensor"),
    "mlp":      ("tensor", "tensor"),
    "vocab":    ("tensor", "tensor"),
    "head_dim": (None,     None),
    # MLA's latents (model/mla.py): per position, never split over tensor; the
    # up-projections' latent dim takes fsdp (the down-projections' embed has it first).
    "latent":   ("fsdp",   None),
    "norm":     (None,     None),
    "layers":   ("stage",  None),     # pipeline: each stage holds its layers
    "experts":  ("expert", None),     # expert parallelism: each expert rank its experts
}
# MoE parallel folding (parallel.expert_tensor=1): the experts split over expert x tensor,
# each whole on its rank; their mlp dim then finds `tensor` taken and stays whole.
FOLDED_RULES: dict[str, tuple] = {**RULES, "experts": (("expert", "tensor"), None)}


def rules(folded: bool = False) -> dict[str, tuple]:
    """The logical->mesh table: RULES, or FOLDED_RULES under MoE parallel folding."""
    return FOLDED_RULES if folded else RULES


def mesh_shape(parallel_cfg: Config | ParallelConfig, n_devices: int) -> dict[str, int]:
    """Mesh degrees with the -1 filled (the ledger's arithmetic, so the two always agree), in
    MESH_AXES order: parallel.data's ranks split into `data` x `expert` (the expert ranks are
    carved out of the data-parallel ones, under folding expert/tensor of them;
    config_check.check_expert says it divides)."""
    cfg = parallel_cfg if isinstance(parallel_cfg, Config) else Config(parallel=parallel_cfg)
    degrees = resolve_degrees(cfg, n_devices)
    expert = expert_from_data(cfg.parallel.expert, degrees["tensor"], cfg.parallel.expert_tensor)
    degrees.update(data=degrees["data"] // expert, expert=expert)
    return {a: degrees[a] for a in MESH_AXES}


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(parallel, len(devices))
    device_grid = np.asarray(devices).reshape(tuple(shape[a] for a in MESH_AXES))
    return Mesh(device_grid, MESH_AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def validate_layout(cfg: Config, n_devices: int) -> dict[str, int]:
    """The mesh degrees, once the layout's rules pass (the ledger's: heads, MLP, batch,
    sequence, layers vs the degrees; config_check.check runs these and every other rule)."""
    layout_from_config(cfg, n_devices)
    return mesh_shape(cfg, n_devices)


# ----------------------------------------------------------------------------- specs

def flat_axes(axes) -> tuple:
    """A spec entry (None, one axis name or a tuple of them) as a tuple of axis names."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def mesh_axes_for(name, column, mesh, dim, folded: bool = False):
    """The mesh axes (one name, a tuple, or None) that logical axis `name` maps to for a dim of
    size `dim`: column 0 for parameters, 1 for activations (`folded`: FOLDED_RULES). Axes of
    size 1, the context mesh's manual axes and splits that do not divide `dim` are left out."""
    if name is None:
        return None
    table = rules(folded)
    if name not in table:
        raise KeyError(f"logical axis {name!r} has no rule; known: {', '.join(table)}")
    axes = table[name][column]
    if axes is None:
        return None
    axes = flat_axes(axes)
    manual = set(mesh.manual_axes)  # inside a shard_map: those are the caller's, not ours
    axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in manual)
    if not axes or dim % math.prod(mesh.shape[a] for a in axes):
        return None  # not divisible (e.g. 8 KV heads on tensor=16): replicate this dim
    return axes[0] if len(axes) == 1 else axes


def logical_to_spec(names: Iterable, shape, mesh: Mesh, *, params: bool, overrides=None,
                    folded: bool = False) -> P:
    column = 0 if params else 1
    out, used = [], set()
    for name, dim in zip(names, shape):
        if overrides and name in overrides:
            axes = overrides[name]
        else:
            axes = mesh_axes_for(name, column, mesh, dim, folded)
        flat = flat_axes(axes)
        if any(a in used for a in flat):
            axes = None
        used.update(flat)
        out.append(axes)
    return P(*out)


def logical_axes(abstract_state):
    """Pure-dict tree of P(logical names...) from an nnx.State's sharding metadata."""
    return compat.logical_partition_specs(abstract_state)


def param_specs(logical_tree, shape_tree, mesh: Mesh, *, zero1: bool = False,
                folded: bool = False, state: bool = False):
    """Mesh PartitionSpecs for parameter-shaped arrays; with `zero1`, also sharded over the
    data-parallel group (data x context); `folded`: the experts by FOLDED_RULES. `state`: the
    specs of the fp32 masters and the optimizer state, which under pipeline stages also split
    over `stage` what the compute copy has replicated over it (`stage_state_axis`)."""
    def one(names, x):
        spec = logical_to_spec(tuple(names), x.shape, mesh, params=True, folded=folded)
        # `stage` minor to ZeRO-1's group, on the same dim: a master shard is then a block of
        # the data-reduced gradient's shard (the gradient reduce-scatters over data, then over
        # stage; with stage major XLA all-reduced whole tables over stage)
        group = (replica_axes(mesh) if zero1 else ()) + (
            stage_state_axis(spec, mesh) if state else ())
        return add_axes(spec, x.shape, mesh, group)
    return jax.tree.map(one, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, P))


def stage_state_axis(spec: P, mesh: Mesh) -> tuple[str, ...]:
    """(`stage`,) when the mesh has stages and a parameter's compute spec leaves it whole over
    them (the vocab tables and the final norm: the pipeline executor computes them on its edge
    ranks only), else (). Such a parameter's master and optimizer state are split over `stage`
    for storage (1/p per rank where Megatron keeps them on the first and last stage) and its
    compute copy is gathered once per step, when the step casts the masters."""
    used = {a for axes in spec for a in flat_axes(axes)}
    return (STAGE,) if mesh.shape.get(STAGE, 1) > 1 and STAGE not in used else ()


def add_axes(spec: P, shape, mesh: Mesh, axes: tuple[str, ...]) -> P:
    """`spec` also split over those of `axes` it does not use yet (ranks that hold the same
    values), on the first dim that is divisible; arrays with no such dim stay as they are."""
    used = {a for axes in spec for a in flat_axes(axes)}
    group = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in group)
    if n == 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for i, (axes, dim) in enumerate(zip(parts, shape)):
        flat = flat_axes(axes)
        if dim % (n * math.prod(mesh.shape[a] for a in flat)) == 0:
            # the group minor: each compute shard (say tensor block i) is then the contiguous
            # run of its sub-blocks, so gathering over the group needs no device permutation.
            joined = (*flat, *group)
            parts[i] = joined[0] if len(joined) == 1 else joined
            return P(*parts)
    return spec


def named(mesh: Mesh, spec_tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                        is_leaf=lambda x: isinstance(x, P))


# ----------------------------------------------------------------------------- activations

def context_mesh(mesh):
    """The mesh that shardings must name here: inside a shard_map the context's abstract mesh
    (whose manual axes the caller owns and specs leave out), else `mesh`."""
    ctx = jax.sharding.get_abstract_mesh()
    return ctx if not ctx.empty and ctx.manual_axes else mesh


def platform(mesh) -> str:
    """'gpu', 'cpu', ... of the devices a mesh is made of (compile-only GPUs included), so code
    that picks an implementation follows the program's target, not the process's backend."""
    if mesh is None:
        return jax.default_backend()
    return mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else mesh.abstract_mesh.platform


def compute_capability(mesh) -> str | None:
    """'9.0', ... of a mesh's GPUs (compile-only ones report theirs too); None otherwise: what
    picks a GPU kernel by architecture (attention.choose)."""
    if not isinstance(mesh, Mesh):
        return None
    return getattr(mesh.devices.flat[0], "compute_capability", None)


def constrain(x, named_sharding: NamedSharding):
    """with_sharding_constraint to `named_sharding`'s spec, valid inside a shard_map too: there
    the spec is re-targeted at the context mesh with the manual axes left out."""
    mesh = context_mesh(named_sharding.mesh)
    if mesh is named_sharding.mesh:
        return jax.lax.with_sharding_constraint(x, named_sharding)
    manual = set(mesh.manual_axes)
    parts = []
    for axes in named_sharding.spec:
        flat = tuple(a for a in flat_axes(axes) if a not in manual)
        parts.append(flat[0] if len(flat) == 1 else (flat or None))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*parts)))


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """The `constrain(x, logical_names)` the model calls, bound to a mesh.

    Inside a shard_map (the train step's over `data`, the pipeline's over `stage` and `data`)
    the constraint names the context mesh and leaves its manual axes to the caller: `batch`
    then means `fsdp` alone. `constrain_weights=False` leaves weights (arrays without a
    `batch` dim: the embedding table, lm_head) to GSPMD: inside the pipeline's per-rank
    conditionals a constraint on a weight puts a sharding on its gradient in one branch only,
    which XLA rejects ("Inconsistent conditional sharding").
    """
    mesh: Mesh
    sequence_parallel: bool = False
    constrain_weights: bool = True

    def __call__(self, x, names):
        if not self.constrain_weights and "batch" not in names:
            return x
        mesh = context_mesh(self.mesh)
        overrides = {}
        if self.sequence_parallel and not any(_uses_tensor(n) for n in names):
            # Only the residual stream ([batch, length, embed]) is split over the sequence;
            # arrays with a tensor-parallel dim (logits: vocab) keep tensor on that dim.
            # Tensor is minor to context: a context shard splits further over tensor.
            manual = set(mesh.manual_axes)
            seq = tuple(a for a in ("context", "tensor") if mesh.shape[a] > 1
                        and a not in manual)
            overrides["length"] = seq[0] if len(seq) == 1 else (seq or None)
        spec = logical_to_spec(names, x.shape, mesh, params=False, overrides=overrides)
        if self.sequence_parallel and "length" in names:
            spec = _drop_if_indivisible(spec, x.shape, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """`gather(w, names)`: a weight as a GEMM reads it, whole over `fsdp` (FSDP's all-gather)
    and still split as its rules say over every other axis (tensor, expert, stage).

    FP8 projections apply it to the FP8-cast kernel (fp8_matmul: cast on the FSDP shard with
    the delayed scale, then gather), so the gather moves 1 byte per element and the forward,
    the recompute and the backward read one gather (GSPMD left alone gathers the dequantized
    kernel once per GEMM that reads it; XLA's collective quantizer then narrows each gather to
    FP8 but does not merge the recompute's with the backward's). Without fsdp it is the
    identity: the program is then left exactly as GSPMD makes it.
    """
    mesh: Mesh

    def __call__(self, w, names):
        mesh = context_mesh(self.mesh)
        if FSDP not in mesh.shape or mesh.shape[FSDP] == 1 or FSDP in set(mesh.manual_axes):
            return w
        spec = logical_to_spec(tuple(names), w.shape, mesh, params=True)
        parts = []
        for axes in spec:
            kept = tuple(a for a in flat_axes(axes) if a != FSDP)
            parts.append(one_or_tuple(kept))
        return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*parts)))


def _uses_tensor(name) -> bool:
    axes = RULES.get(name, (None, None))[1] if name is not None else None
    return axes == "tensor" or (isinstance(axes, tuple) and "tensor" in axes)


def _drop_if_indivisible(spec, shape, mesh):
    parts = []
    for axes, dim in zip(spec, shape):
        flat = flat_axes(axes)
        parts.append(axes if not flat or dim % math.prod(mesh.shape[a] for a in flat) == 0 else None)
    return P(*parts)


def one_or_tuple(axes: tuple):
    """A spec entry for mesh axes `axes`: None, one name or the tuple."""
    return axes[0] if len(axes) == 1 else (axes or None)


def batch_spec(mesh: Mesh) -> P:
    return P(one_or_tuple(tuple(a for a in ROW_AXES if mesh.shape[a] > 1)),
             CONTEXT if mesh.shape[CONTEXT] > 1 else None)


def batch_row_shards(mesh: Mesh) -> int:
    """How many blocks of rows a global batch splits into (data x expert x fsdp)."""
    return math.prod(mesh.shape.get(a, 1) for a in ROW_AXES)


def replica_axes(mesh: Mesh) -> tuple[str, ...]:
    """The REPLICA_AXES this mesh really splits (size > 1), in mesh order."""
    return tuple(a for a in REPLICA_AXES if mesh.shape[a] > 1)


def replica_rows_spec(mesh: Mesh) -> P:
    """A [B, S] batch's blocks as one replica (of replica_axes) takes them: rows over data x
    expert, the sequence over context."""
    rows = tuple(a for a in (DATA, EXPERT) if mesh.shape[a] > 1)
    return P(one_or_tuple(rows), CONTEXT if mesh.shape[CONTEXT] > 1 else None)


def expert_dim(names) -> int | None:
    """The dim of a parameter's logical names that holds its experts (None: not an expert
    weight)."""
    names = tuple(names)
    return names.index("experts") if "experts" in names else None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a global [B, S] batch lives: rows over (data, fsdp), the sequence over context."""
    return NamedSharding(mesh, batch_spec(mesh))

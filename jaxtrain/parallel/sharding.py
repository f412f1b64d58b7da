"""The device mesh, the one logical->mesh rules table, and the shardings derived from it.

Only this module knows mesh axes. The model names logical axes (docs/design.md §3); the table below
says where each lives, once for parameters and once for activations. All mesh axes are `Auto`
(GSPMD propagation between the constraints we place), chosen on purpose: jax 0.10's
`make_mesh` would otherwise default to Explicit.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import compat
from jaxtrain.parallel.mesh_axes import CONTEXT, DATA, FSDP, MESH_AXES, REPLICA_AXES
from jaxtrain.config import Config, ParallelConfig
from jaxtrain.ledger.layout import layout_from_config, resolve_degrees

if TYPE_CHECKING:
    from jaxtrain.parallel import context_attention


# logical axis -> (mesh axes for parameters, mesh axes for activations)
RULES: dict[str, tuple] = {
    "batch":    (None,     ("data", "fsdp")),
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
    """The mesh degrees, once the layout's rules pass (the ledger's: heads, MLP, batch,
    sequence, layers vs the degrees; config_check.check runs these and every other rule)."""
    layout_from_config(cfg, n_devices)
    return mesh_shape(cfg, n_devices)


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
    manual = set(mesh.manual_axes)  # inside a shard_map: those are the caller's, not ours
    axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in manual)
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
    """Pure-dict tree of P(logical names...) from an nnx.State's sharding metadata."""
    return compat.logical_partition_specs(abstract_state)


def param_specs(logical_tree, shape_tree, mesh: Mesh, *, zero1: bool = False):
    """Mesh PartitionSpecs for parameter-shaped arrays; with `zero1`, also sharded over the
    data-parallel group (data x context)."""
    def one(names, x):
        spec = logical_to_spec(tuple(names), x.shape, mesh, params=True)
        return add_data_axis(spec, x.shape, mesh) if zero1 else spec
    return jax.tree.map(one, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, P))


def add_data_axis(spec: P, shape, mesh: Mesh) -> P:
    """ZeRO-1: shard a (parameter-shaped) optimizer array over the data-parallel group as well
    (`data`, and `context`, whose ranks hold the same parameters: Megatron's distributed
    optimizer), on the first dim that is divisible; arrays with no such dim stay replicated."""
    group = replica_axes(mesh)
    n = math.prod(mesh.shape[a] for a in group)
    if n == 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for i, (axes, dim) in enumerate(zip(parts, shape)):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
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
        flat = tuple(a for a in ((axes,) if isinstance(axes, str) else (axes or ()))
                     if a not in manual)
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
    axes = tuple(a for a in (DATA, FSDP) if mesh.shape[a] > 1)
    return P(axes if len(axes) > 1 else (axes[0] if axes else None),
             CONTEXT if mesh.shape[CONTEXT] > 1 else None)


def batch_row_shards(mesh: Mesh) -> int:
    """How many blocks of rows a global batch splits into (data x fsdp)."""
    return mesh.shape.get(DATA, 1) * mesh.shape.get(FSDP, 1)


def replica_axes(mesh: Mesh) -> tuple[str, ...]:
    """The REPLICA_AXES this mesh really splits (size > 1), in mesh order."""
    return tuple(a for a in REPLICA_AXES if mesh.shape[a] > 1)


def replica_rows_spec(mesh: Mesh) -> P:
    """A [B, S] batch's blocks as one replica (of replica_axes) takes them."""
    return P(*(a if mesh.shape[a] > 1 else None for a in REPLICA_AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a global [B, S] batch lives: rows over (data, fsdp), the sequence over context."""
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


# ----------------------------------------------------------------------------- kernels

@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An attention kernel (opaque to GSPMD) run per shard with jax.shard_map: batch and heads
    split where the rules table puts them (`batch`, `heads`, `kv_heads` activations) over the
    context mesh's automatic axes — so it runs the same in the train step, inside the
    pipeline's shard_map and on compile-only devices. When KV heads are fewer than the head
    shards, K/V stay whole and each shard slices the KV heads its query heads read (before
    anything moves over `context`). With `context` > 1 the sequence is split too and each
    shard runs `context` plan's strategy (context_attention.py) on the core, with its
    tokens' global positions. Hashable by value (nnx keeps it in the graph definition
    through `Ops`)."""
    kernel: Callable
    mesh: Mesh
    context: Optional["context_attention.ContextPlan"] = None

    def __call__(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
        from jaxtrain.parallel import context_attention
        from jaxtrain.model.attention import local_kv_heads
        mesh = context_mesh(self.mesh)
        b, s, n_heads, _ = q_BSHE.shape
        batch = _mesh_axes_for("batch", 1, mesh, b)
        heads = _mesh_axes_for("heads", 1, mesh, n_heads)
        kv_heads = _mesh_axes_for("kv_heads", 1, mesh, k_BSKE.shape[2]) if heads else None
        kv_heads = kv_heads if kv_heads == heads else None
        head_shards = math.prod(mesh.shape[a] for a in _flat(heads))
        # The sequence is split over `context` here (seq), or the caller's shard_map holds
        # `context` manual and q.. are already its rank's part (the train step's per_replica).
        seq = _mesh_axes_for("sequence", 1, mesh, s) if self.context else None
        outer = bool(self.context) and "context" in mesh.manual_axes
        c = mesh.shape["context"] if seq or outer else 1
        if self.context and mesh.shape["context"] > 1 and c == 1:
            raise context_attention.ContextAttentionError(
                f"a sequence of {s} tokens does not split over context={mesh.shape['context']}"
                "; use a length divisible by it (2x it under causal load balancing)")
        q_spec, kv_spec = P(batch, seq, heads, None), P(batch, seq, kv_heads, None)
        args = [q_BSHE, k_BSKE, v_BSKE, segment_ids_BS]
        if c > 1:  # each token's global position, split like the sequence
            order_CS = self.context.positions(s * (c if outer else 1), c).reshape(c, -1)
            args.append(jnp.asarray(order_CS if outer else order_CS.reshape(-1)))

        def per_shard(q, k, v, seg, *pos):
            if heads and not kv_heads:
                k, v = local_kv_heads(k, v, n_heads, head_shards, jax.lax.axis_index(heads))
            if c == 1:
                return self.kernel(q, k, v, seg)
            pos_S = pos[0][jax.lax.axis_index("context")] if outer else pos[0]
            return context_attention.attend(self.kernel, self.context, c, q, k, v, seg, seg,
                                            pos_S, pos_S)

        # check_vma=False: a pallas_call carries no varying-axes types for the checker (and
        # jax 0.10's Pallas interpreter cannot type its loops). The specs are exact, and
        # autodiff still sums replicated K/V's cotangents over `tensor`.
        inner = {a for a in mesh.axis_names if a not in set(mesh.manual_axes)}
        in_specs = (q_spec, kv_spec, kv_spec, P(batch, seq)) + ((P(seq),) if c > 1 else ())
        return jax.shard_map(per_shard, mesh=mesh, axis_names=inner, in_specs=in_specs,
                             out_specs=q_spec, check_vma=False)(*args)


def _flat(axes) -> tuple:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def shard_attention(core: Callable, mesh: Mesh | None,
                    context: Optional["context_attention.ContextPlan"] = None) -> Callable:
    """`ops.attention` on `mesh`: an opaque kernel per shard (ShardedAttention); the xla core
    as it is (GSPMD partitions it like the rest of the model). With `context` > 1 every core
    runs per shard with `context`'s strategy (default: all_gather, load-balanced); a core
    that lacks the strategy fails here, before anything compiles."""
    from jaxtrain.parallel import context_attention
    from jaxtrain.model.attention import check_interpretable, is_kernel
    check_interpretable(core, 1 if mesh is None else mesh.size)
    if mesh is not None and mesh.shape.get("context", 1) > 1:
        context = context or context_attention.ContextPlan()
        context_attention.check_supported(core, context.strategy)
        return ShardedAttention(core, mesh, context)
    if mesh is None or mesh.size == 1 or not is_kernel(core):
        return core
    return ShardedAttention(core, mesh)


@dataclasses.dataclass(frozen=True)
class ShardedLookup:
    """The embedding lookup that never gathers the table (Megatron's vocab-parallel embedding,
    MaxText's): each device looks up, in its own [V/t, D/f] block of the table (vocab over
    `tensor`, embed over `fsdp`, as the parameter is stored), the tokens of every row its fsdp
    group holds — gathering only their ids — sums the vocab shards' parts over `tensor`
    (reduce-scattered over the sequence under SP), and trades its D-slice of all rows for all
    of D of its own rows (one all-to-all). The backward runs the transposes: an all-to-all of
    the cotangent and a local scatter-add, so the table's gradient needs no reduction over
    fsdp. Per microbatch: token ids and two activation-sized all-to-alls, where gathering the
    table moves V·D (128256 x 4096 bf16: 1 GB) each way."""
    mesh: Mesh
    sequence_parallel: bool = False

    def __call__(self, table_VD, tokens_BS):
        mesh = context_mesh(self.mesh)
        (V, D), (B, S) = table_VD.shape, tokens_BS.shape
        vocab = _flat(_mesh_axes_for("vocab", 0, mesh, V))
        embed = _flat(_mesh_axes_for("embed", 0, mesh, D))
        batch = _flat(_mesh_axes_for("batch", 1, mesh, B))
        context = _flat(_mesh_axes_for("length", 1, mesh, S))   # context parallelism
        c = math.prod(mesh.shape[a] for a in context)
        seq = ("tensor",) if (self.sequence_parallel and vocab == ("tensor",)
                              and (S // c) % mesh.shape["tensor"] == 0) else ()
        if not vocab and not embed and not context:
            return jnp.take(table_VD, tokens_BS, axis=0)
        trade = bool(embed) and embed == batch      # all-to-all rows for D, else gather D
        v_shard = V // math.prod(mesh.shape[a] for a in vocab)

        def per_shard(table, ids):
            if embed and batch:
                ids = jax.lax.all_gather(ids, batch, axis=0, tiled=True)
            if vocab:
                local = ids - jax.lax.axis_index(vocab) * v_shard
                inside = (local >= 0) & (local < v_shard)
                x = jnp.where(inside[..., None],
                              jnp.take(table, jnp.clip(local, 0, v_shard - 1), axis=0), 0)
                x = (jax.lax.psum_scatter(x, vocab, scatter_dimension=1, tiled=True) if seq
                     else jax.lax.psum(x, vocab))
            else:
                x = jnp.take(table, ids, axis=0)
            if trade:
                return jax.lax.all_to_all(x, embed, 0, 2, tiled=True)
            if embed:
                x = jax.lax.all_gather(x, embed, axis=2, tiled=True)
            if batch:  # back to this device's rows
                n = math.prod(mesh.shape[a] for a in batch)
                x = x.reshape(n, -1, *x.shape[1:])[jax.lax.axis_index(batch)]
            return x

        inner = {a for a in mesh.axis_names if a not in set(mesh.manual_axes)}
        spec = lambda axes: axes[0] if len(axes) == 1 else (axes or None)  # noqa: E731
        # Each context rank looks up its own part of the sequence (split further over tensor
        # under SP: tensor is minor to context).
        return jax.shard_map(
            per_shard, mesh=mesh, axis_names=inner,
            in_specs=(P(spec(vocab), spec(embed)), P(spec(batch), spec(context))),
            out_specs=P(spec(batch), spec(context + seq), None))(table_VD, tokens_BS)

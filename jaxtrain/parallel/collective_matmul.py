"""Tensor-parallel collective matmul under sequence parallelism (parallel.collective_matmul):
the SP all-gather -> column-parallel GEMM and row-parallel GEMM -> reduce-scatter pairs
decomposed into a ring of `tensor` steps with jax.lax.ppermute, so each step's GEMM runs while
the next sequence shard (or the running partial sum) moves to the neighbour (Wang et al.,
"Overlap communication with dependent computation via decomposition"; the collective-matmul
pattern of jax's shard_map docs). GSPMD left alone issues one blocking all-gather or
reduce-scatter per pair that nothing can hide (31% static overlap on TP8+SP 8B,
BENCHMARKS.md).

The ring runs in a shard_map over `tensor` only: every other axis stays automatic, so FSDP's
weight gathers and the batch split are GSPMD's as in the plain program. The specs come from
the rules table (the weights' logical axes through `mesh_axes_for`). Autodiff transposes the
ring: the all-gather ring's backward is a reduce-scatter ring for the input's gradient (and
the all-gather ring again for the weights', recomputed rather than kept: a layer keeps its
sequence shard, as Megatron-SP), the reduce-scatter ring's backward an all-gather ring.
A projection whose weight is not split over `tensor` (GQA's K/V when kv_heads < tensor, MLA's
latent down-projections) needs no gather: it runs on the sequence shard it has, and its output
is gathered by the caller's constraint (K/V's output is smaller than their input). FP8 and
context parallelism are refused by the config rules (config/rules.py)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.parallel.mesh_axes import STAGE, TENSOR
from jaxtrain.parallel.sharding import context_mesh, flat_axes, mesh_axes_for, platform

SEQ = 1   # the sequence dim of every projection's input and output: [batch, sequence, ...]


class CollectiveMatmulError(ValueError):
    pass


def _tensor_dim(projection, kernel) -> int | None:
    """The dim of `kernel` (the weight of `projection`, a layers.Dense) split over `tensor`
    by the rules table, or None when it is replicated over `tensor`."""
    mesh = context_mesh(projection.ops.collective_matmul.mesh)
    for d, (name, size) in enumerate(zip(projection.axes, kernel.shape)):
        if TENSOR in flat_axes(mesh_axes_for(name, 0, mesh, size)):
            return d
    return None


def _refuse_fp8(fp8: bool) -> None:
    if fp8:   # the config rules refuse it first; a model built by hand meets this
        raise CollectiveMatmulError("parallel.collective_matmul does not run FP8 projections; "
                                    "set fp8.enabled=false or parallel.collective_matmul=false")


def _to_left(t: int) -> list[tuple[int, int]]:
    """ppermute's pairs: every rank sends to its left neighbour on the ring."""
    return [(j, (j - 1) % t) for j in range(t)]


def _spec(ndim: int, dim: int | None) -> P:
    return P(*[TENSOR if d == dim else None for d in range(ndim)])


@dataclasses.dataclass(frozen=True)
class CollectiveMatmul:
    """Ops.collective_matmul: `gathered` replaces layers.project_gathered and `scattered`
    layers.project_scattered on `mesh` (hashable by value: nnx keeps it in the graph
    definition through Ops). `full_remat`: the layer is recomputed whole (remat.granularity
    full), so the ring's own recompute may share its permutes with the layer's re-run
    (prevent_cse off: 8B TP8+SP, 13.39 -> 11.51 GB, the plain program's bytes); without it,
    keeping the barriers hides more (79.7% against 68.2% statically overlapped)."""
    mesh: Mesh
    full_remat: bool = False

    def _shards(self, x, what: str) -> int:
        t = context_mesh(self.mesh).shape[TENSOR]
        if x.shape[SEQ] % t:
            raise CollectiveMatmulError(
                f"parallel.collective_matmul: {what}'s sequence of {x.shape[SEQ]} positions "
                f"does not split over tensor={t}; use a length divisible by it or set "
                "parallel.collective_matmul=false")
        return t

    def gathered(self, x_BsD, projections, fp8: bool):
        """The projections (layers.Dense, column-parallel) of x gathered over the sequence,
        as a ring: step i multiplies the shard that rank (r + i) holds while ppermute brings
        the next. x_BsD: split over the sequence by `tensor` (SP's residual stream)."""
        _refuse_fp8(fp8)
        t = self._shards(x_BsD, projections[0].name)
        s = x_BsD.shape[SEQ] // t
        kernels = tuple(p.weights()[0] for p in projections)   # FP8 is refused: no metas
        dims = [_tensor_dim(p, k) for p, k in zip(projections, kernels)]

        def out_spec(p, k, d):
            ndim = x_BsD.ndim + k.ndim - 2 * p.n_in
            if d is None:   # computed on this rank's sequence shard only
                return _spec(ndim, SEQ)
            return _spec(ndim, x_BsD.ndim - 2 * p.n_in + d)

        def per_shard(x, ws):
            r = jax.lax.axis_index(TENSOR)
            local = [p.apply(x, (w, None), False) if d is None else None
                     for p, w, d in zip(projections, ws, dims)]
            ring = [i for i, d in enumerate(dims) if d is not None]
            outs = {i: None for i in ring}
            chunk = x
            for step in range(t):
                nxt = (jax.lax.ppermute(chunk, TENSOR, _to_left(t))
                       if step < t - 1 else None)
                at = ((r + step) % t) * s
                for i in ring:
                    y = projections[i].apply(chunk, (ws[i], None), False)
                    if outs[i] is None:
                        outs[i] = jnp.zeros(y.shape[:SEQ] + (s * t,) + y.shape[SEQ + 1:],
                                            y.dtype)
                    outs[i] = jax.lax.dynamic_update_slice_in_dim(outs[i], y, at, SEQ)
                chunk = nxt
            return tuple(outs[i] if d is not None else local[i]
                         for i, d in enumerate(dims))

        w_specs = tuple(_spec(k.ndim, d) for k, d in zip(kernels, dims))
        mesh = context_mesh(self.mesh)
        ring = jax.shard_map(per_shard, mesh=mesh, axis_names={TENSOR},
                             in_specs=(_spec(x_BsD.ndim, SEQ), w_specs),
                             out_specs=tuple(map(out_spec, projections, kernels, dims)))
        # Recomputed in the backward: the weights' gradients gather x again (the ring's
        # ppermutes; its forward GEMMs are dead there) instead of keeping the whole sequence.
        return jax.checkpoint(ring, policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=not self.full_remat)(
            x_BsD, kernels)

    def scattered(self, h_BSF, projection, fp8: bool):
        """A row-parallel projection reduce-scattered over the sequence, as a ring: step i
        adds this rank's partial product for the block its sum is bound for to the running
        sum that ppermute brought."""
        _refuse_fp8(fp8)
        kernel = projection.weights()[0]
        d = _tensor_dim(projection, kernel)
        if d is None or d >= projection.n_in:
            raise CollectiveMatmulError(
                f"parallel.collective_matmul: {projection.name}'s input dim is not split over "
                "tensor (nothing to reduce-scatter); set parallel.collective_matmul=false")
        t = self._shards(h_BSF, projection.name)
        s = h_BSF.shape[SEQ] // t

        def per_shard(h, w):
            r = jax.lax.axis_index(TENSOR)
            acc = None
            for step in range(t):   # the block reaching rank r after the last hop is r's own
                blk = jax.lax.dynamic_slice_in_dim(h, ((r + step + 1) % t) * s, s, SEQ)
                y = projection.apply(blk, (w, None), False)
                acc = y if acc is None else y + jax.lax.ppermute(acc, TENSOR, _to_left(t))
            return acc

        x_dim = h_BSF.ndim - projection.n_in + d
        out_ndim = h_BSF.ndim + kernel.ndim - 2 * projection.n_in
        return jax.shard_map(
            per_shard, mesh=context_mesh(self.mesh), axis_names={TENSOR},
            in_specs=(_spec(h_BSF.ndim, x_dim),
                      _spec(kernel.ndim, d)),
            out_specs=_spec(out_ndim, SEQ))(h_BSF, kernel)


def collective_matmul_for(parallel_cfg, mesh, full_remat: bool = False
                          ) -> CollectiveMatmul | None:
    """Ops.collective_matmul for the run: the ring when parallel.collective_matmul is on (the
    config rules have checked it applies: SP, tensor > 1, no context parallelism, no FP8),
    else None (the GSPMD projections). Refused under pipeline stages on XLA:CPU, which
    crashes running collective-permutes that sit in the executor's per-stage branches (as
    ring attention's, context_attention.check_backend); the GPU compiler's program is fine."""
    if not parallel_cfg.collective_matmul or mesh is None:
        return None
    if mesh.shape[STAGE] > 1 and platform(mesh) == "cpu":
        raise CollectiveMatmulError(
            "parallel.collective_matmul=true with parallel.stage > 1 crashes XLA:CPU (the "
            "rings' collective-permutes sit in per-stage branches); on CPU set "
            "parallel.collective_matmul=false, or run on GPUs")
    return CollectiveMatmul(mesh, full_remat)

"""Pipeline parallelism: the public API over pipeline_executor.py's lock-step program.

The model is cut into p*v chunks of equal shape; rank r of the `stage` mesh axis owns virtual
stages g = j*p + r (j < v). Chunk parameters are stacked with leading dims [p, v, ...] and
sharded over `stage` on dim 0. Stages may hold different numbers of layers (Megatron's
decoder-first/last-pipeline-num-layers): stack_stages then pads every chunk to the largest
with zero rows, and the chunk function must skip them (e.g. by a per-layer flag stacked with the
layers, zero in the padding).

Mesh axes. `stage` is manual, and so is `data` when the mesh has it: each data replica runs
the schedule on its rows of every microbatch (dim 1 of the inputs) and keeps its own fp32
gradient sums through the loop; they are reduced over `data` once, after it (Megatron's
behaviour; left automatic, GSPMD all-reduces every B's weight gradient inside the loop).
Every other axis (fsdp, tensor, ...) stays automatic, so the chunk's sharding constraints and
FSDP/TP collectives work unchanged inside; they must not name `data`.

Training (`pipelined_value_and_grad`) runs the schedule's F and B ops: an F keeps the chunk's
VJP residuals for its microbatch in the schedule's stash slots (what the remat config saves:
every saved activation without remat, each group's input under full recompute; never the
values of the parameters alone), and a B applies that pullback to the cotangent from the next
rank, recomputing only what the remat policy dropped (Megatron's schedule, no forced
recompute). The model is three functions (`Fns`): the first virtual stage embeds the raw
inputs (token ids) itself (Megatron's layout: nothing of activation size is held per
microbatch outside the stash, and 1F1B's memory does not grow with the number of
microbatches); the last runs the head, which returns (objective, sums): the B seeds the
objective's cotangent with 1 and the executor adds the sums (any pytree of scalars) over
microbatches and data replicas. Sums, never means: the caller divides. `pipelined_forward`
runs the forward ops only (evaluation).

Where the embedding and the head live. `edge_params` gives each rank its own row (leading dim
[p], sharded over `stage`): rank 0's row is what the embedding reads, rank p-1's what the head
reads, so a model keeps its embedding and head on their ranks only (executors/pipeline.py
packs both tables into one row per rank).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.ledger.pipeline_schedule import Schedule, ScheduleError, build_schedule
from jaxtrain.parallel import pipeline_executor as ex
from jaxtrain.parallel import pipeline_specs as specs
from jaxtrain.parallel.layer_order import LayerOrder
from jaxtrain.parallel.pipeline_executor import (DATA_AXIS, STAGE_AXIS, SUM, Fns, GradCombine,
                                                 PipelineError)
from jaxtrain.parallel.pipeline_specs import manual_axes

__all__ = ["PipelineError", "ScheduleError", "STAGE_AXIS", "DATA_AXIS", "build_schedule",
           "Schedule", "Fns", "pipelined_value_and_grad", "pipelined_forward", "stack_stages",
           "unstack_stages", "chunk_layer_counts", "manual_axes", "GradCombine", "SUM"]


# ----------------------------------------------------------------------------- layout helpers
def chunk_layer_counts(num_layers: int, stages: int, virtual_stages: int = 1,
                       stage_layers: Optional[Sequence[int]] = None) -> np.ndarray:
    """Real layers per chunk, [p, v]: each physical stage's layers split evenly over its v chunks.

    stage_layers: layers per physical stage (uneven first/last stages, Megatron's
    decoder-first/last-pipeline-num-layers); None splits num_layers evenly.
    """
    p, v = stages, virtual_stages
    if stage_layers is None:
        if num_layers % (p * v):
            raise PipelineError(f"{num_layers} layers do not split into stages={p} x "
                                f"virtual_stages={v} equal chunks; pick a divisor of the layers")
        stage_layers = (num_layers // p,) * p
    counts = tuple(int(c) for c in stage_layers)
    if len(counts) != p or sum(counts) != num_layers or any(c < 1 or c % v for c in counts):
        raise PipelineError(f"stage layers {counts} must be {p} positive multiples of "
                            f"virtual_stages={v} summing to the {num_layers} layers")
    return np.repeat(np.asarray(counts)[:, None] // v, v, axis=1)


def stack_stages(layers: Any, stages: int, virtual_stages: int = 1,
                 stage_layers: Optional[Sequence[int]] = None) -> Any:
    """Leaves [L, ...] -> [p, v, Lc, ...]; the layers of virtual stage g = j*p + r go to [r, j].

    With uneven stage_layers every chunk is padded to the largest (Lc); padding rows are zero
    and chunk_fn must skip them. (A pipelined train state stores its layers in this order
    already, see layer_order: there this is a local reshape.)"""
    p, v = stages, virtual_stages
    L = jax.tree.leaves(layers)[0].shape[0]
    order = LayerOrder.chunks(chunk_layer_counts(L, p, v, stage_layers))
    return jax.tree.map(lambda a: order.from_natural(a).reshape((p, v, -1) + a.shape[1:]),
                        layers)


def unstack_stages(chunks: Any, stage_layers: Optional[Sequence[int]] = None) -> Any:
    """Inverse of stack_stages: [p, v, Lc, ...] -> [L, ...] (padding dropped)."""
    p, v, lc = jax.tree.leaves(chunks)[0].shape[:3]
    L = p * v * lc if stage_layers is None else sum(stage_layers)
    order = LayerOrder.chunks(chunk_layer_counts(L, p, v, stage_layers))
    return jax.tree.map(lambda a: order.to_natural(a.reshape((-1,) + a.shape[3:])), chunks)


# ----------------------------------------------------------------------------- validation
def _check(schedule: Schedule, mesh, chunk_params, edge_params, inputs, aux, chunk_aux) -> None:
    if not isinstance(schedule, Schedule):
        raise PipelineError(f"schedule must be a Schedule from build_schedule, got "
                            f"{type(schedule).__name__}")
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
    if STAGE_AXIS not in mesh.shape:
        raise PipelineError(f"the mesh has axes {tuple(mesh.shape)} but no {STAGE_AXIS!r} axis; "
                            f"build it with a {STAGE_AXIS!r} axis of size {p}")
    if mesh.shape[STAGE_AXIS] != p:
        raise PipelineError(f"mesh axis {STAGE_AXIS!r} has size {mesh.shape[STAGE_AXIS]} but the "
                            f"schedule has stages={p}; make them equal")
    for path, a in jax.tree_util.tree_leaves_with_path(chunk_params):
        if a.shape[:2] != (p, v):
            raise PipelineError(
                f"chunk param {jax.tree_util.keystr(path)} has shape {a.shape}; it needs leading "
                f"dims [stages={p}, virtual_stages={v}] (see stack_stages)")
    for path, a in jax.tree_util.tree_leaves_with_path(edge_params):
        if a.shape[:1] != (p,):
            raise PipelineError(f"edge param {jax.tree_util.keystr(path)} has shape {a.shape}; "
                                f"it needs a leading dim [stages={p}] (rank r's row is its own)")
    replicas = specs.replica_axes(mesh)
    n_data = int(np.prod([mesh.shape[a] for a in replicas]))
    over = " x ".join(f"{a}={mesh.shape[a]}" for a in replicas)
    for what, tree in (("inputs", inputs), ("aux", aux), ("chunk_aux", chunk_aux)):
        for path, a in jax.tree_util.tree_leaves_with_path(tree):
            name = what + jax.tree_util.keystr(path)
            if a.ndim < 1 or a.shape[0] != m:
                raise PipelineError(f"{name} has shape {a.shape}; its leading dim must be the "
                                    f"schedule's microbatches={m}")
            if a.ndim >= 2 and a.shape[1] % n_data:
                raise PipelineError(
                    f"{name} has shape {a.shape}: its batch dim {a.shape[1]} does not split over "
                    f"{over} replicas; use a microbatch size divisible by {n_data}")


# ----------------------------------------------------------------------------- public API
def pipelined_value_and_grad(fns: Fns, chunk_params: Any, edge_params: Any, inputs: Any,
                             aux: Any, chunk_aux: Any, *, schedule: Schedule, mesh,
                             combine: GradCombine = SUM, bubble_fill: float = 0.0,
                             expert_dims: Any = None):
    """Run the schedule's F and B ops once: (sums, (d_chunk_params, d_edge_params), stats).

    `fns.chunk(chunk_params[r, j], x, chunk_aux[k]) -> x`, `fns.embed(edge row, inputs[k]) ->
    x` (rank 0's row) and `fns.head_loss(edge row, y, aux[k]) -> (objective, sums)` (rank
    p-1's row). chunk_params lead with [p, v] (see stack_stages), edge_params with [p];
    leaves of inputs, aux and chunk_aux with [microbatches, batch, ...], and on a mesh with a
    `data` axis each replica gets its rows of dim 1. `sums` are the heads' sums over
    microbatches and data replicas, the gradients fp32 sums of the objectives' (reduced over
    the replicas once, after the loop, with `combine`: how chunk-parameter cotangents add up;
    FP8 metas, whose cotangents are amax observations, need maxima). stats = {"peak_stash":
    int32[p]}: the residual sets each rank held at once, measured in the loop (<=
    schedule.stash_slots). The functions must not close over values being differentiated.
    `bubble_fill` is what empty buffers and idle sends hold; tests set NaN to show it never
    reaches a result. A chunk may return (x, side sums): `sums` is then (the heads', the
    chunks' over every F). `expert_dims` (executor.execute): the experts' dims of chunk leaves.
    """
    _check(schedule, mesh, chunk_params, edge_params, inputs, aux, chunk_aux)
    sums, d_chunk, d_edge, peak = ex.execute(
        fns, chunk_params, edge_params, inputs, aux, chunk_aux, schedule=schedule, mesh=mesh,
        backward=True, fill=bubble_fill, combine=combine, expert_dims=expert_dims)
    # the one data-parallel reduction of the step (a reduce-scatter where the caller's
    # sharding of the gradients splits them over `data`, as ZeRO-1 does)
    d_chunk = combine.reduce(d_chunk, 0)
    d_edge = jax.tree.map(lambda d: jnp.sum(d, axis=0), d_edge)
    return sums, (d_chunk, d_edge), {"peak_stash": peak}


def pipelined_forward(fns: Fns, chunk_params: Any, edge_params: Any, inputs: Any, aux: Any,
                      chunk_aux: Any, *, schedule: Schedule, mesh,
                      bubble_fill: float = 0.0, expert_dims: Any = None) -> Any:
    """The heads' sums over microbatches and data replicas from the forward ops only
    (evaluation); the arguments are pipelined_value_and_grad's."""
    _check(schedule, mesh, chunk_params, edge_params, inputs, aux, chunk_aux)
    return ex.execute(fns, chunk_params, edge_params, inputs, aux, chunk_aux,
                      schedule=schedule, mesh=mesh, backward=False, fill=bubble_fill,
                      expert_dims=expert_dims)[0]

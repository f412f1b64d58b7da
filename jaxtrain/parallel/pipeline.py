"""Pipeline parallelism: the public API over jaxtrain.parallel.pipeline_executor's lock-step program.

The model is cut into p*v chunks of equal shape; rank r of the `stage` mesh axis owns virtual
stages g = j*p + r (j < v). Chunk parameters are stacked with leading dims [p, v, ...] and
sharded over `stage` on dim 0. Stages may hold different numbers of layers (Megatron's
decoder-first/last-pipeline-num-layers): stack_stages then pads every chunk to the largest
with zero rows, and chunk_fn must skip them (e.g. by a per-layer flag stacked with the
layers, zero in the padding).

Mesh axes. `stage` is manual, and so is `data` when the mesh has it: each data replica runs
the schedule on its rows of every microbatch (dim 1 of the inputs) and keeps its own fp32
gradient sums through the loop; they are reduced over `data` once, after it (Megatron's
behaviour; left automatic, GSPMD all-reduces every B's weight gradient inside the loop).
Every other axis (fsdp, tensor, ...) stays automatic, so the chunk's sharding constraints and
FSDP/TP collectives work unchanged inside; they must not name `data`.

Training (`pipelined_loss`, `pipelined_value_and_grad`) runs the schedule's F and B ops: an F
keeps the chunk's VJP residuals for its microbatch in the schedule's stash slots (what the
remat config saves: every saved activation without remat, each group's input under full
recompute; never the values of the parameters alone), and a B applies that pullback to the
cotangent from the next rank, recomputing only what the remat policy dropped (Megatron's
schedule, no forced recompute). The last virtual stage runs `head_loss_fn` and seeds the
cotangent. The pipeline input is either activations x (their gradient comes back as d_x) or,
with `embed_fn`, raw inputs such as token ids that the first virtual stage embeds itself
(Megatron's layout): then nothing of activation size is held per microbatch outside the
stash, and 1F1B's memory does not grow with the number of microbatches.

Where the embedding and the head live. `head_params` / `embed_params` are replicated over
`stage` and used on the last / first rank. `edge_params` instead gives each rank its own row
(leading dim [p], sharded over `stage`): rank 0's row is what `embed_fn` reads, rank p-1's
what `head_loss_fn` reads, so a model can keep its embedding and head on their ranks only
(pipeline_model packs both tables into one row per rank).

`gpipe_loss` runs only the forward ops and lets autodiff produce the backward: the reference
for tests. Called without a grad, `pipelined_loss` runs the same forward ops (evaluation).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.parallel import pipeline_executor as ex
from jaxtrain.parallel.layer_order import LayerOrder
from jaxtrain.parallel.pipeline_executor import (DATA_AXIS, STAGE_AXIS, SUM, GradCombine, PipelineError,
                                        manual_axes)
from jaxtrain.parallel.pipeline_schedule import Schedule, ScheduleError, build_schedule

__all__ = ["PipelineError", "ScheduleError", "STAGE_AXIS", "DATA_AXIS", "build_schedule",
           "Schedule", "pipelined_loss", "pipelined_value_and_grad", "gpipe_loss",
           "stack_stages", "unstack_stages", "chunk_layer_counts", "manual_axes", "GradCombine",
           "SUM"]

# (one chunk's params, x[, chunk_aux of one microbatch]) -> x
ChunkFn = Callable[..., jax.Array]
HeadLossFn = Callable[[Any, jax.Array, Any], jax.Array]     # (head params, x, aux_mb) -> scalar
EmbedFn = Callable[[Any, Any], jax.Array]                   # (embed params, inputs_mb) -> x
# "mean": over microbatches and data replicas; "sum": their sum (a model whose head returns
# summed token losses divides by the token count itself, as jaxtrain.step does)
REDUCTIONS = ("mean", "sum")


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
def _check(schedule: Schedule, mesh, chunk_params, x, aux, chunk_aux, embed_fn) -> None:
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
    if embed_fn is None and not (isinstance(x, jax.Array) or hasattr(x, "shape")):
        raise PipelineError("without embed_fn the pipeline input x must be one array "
                            "[microbatches, ...] of activations; pass embed_fn for raw inputs")
    n_data = mesh.shape.get(DATA_AXIS, 1)
    for what, tree in (("x", x), ("aux", aux), ("chunk_aux", chunk_aux)):
        for path, a in jax.tree_util.tree_leaves_with_path(tree):
            name = what + jax.tree_util.keystr(path)
            if a.ndim < 1 or a.shape[0] != m:
                raise PipelineError(f"{name} has shape {a.shape}; its leading dim must be the "
                                    f"schedule's microbatches={m}")
            if a.ndim >= 2 and a.shape[1] % n_data:
                raise PipelineError(
                    f"{name} has shape {a.shape}: its batch dim {a.shape[1]} does not split over "
                    f"{DATA_AXIS}={n_data} replicas; use a microbatch size divisible by "
                    f"{n_data}")


# ----------------------------------------------------------------------------- public API
class _Model:
    """The caller's functions and parameters as the executor takes them: one edge tree whose
    rows lead with [p] (the caller's own, or the replicated head/embedding broadcast)."""

    def __init__(self, chunk_fn, head_loss_fn, embed_fn, chunk_aux, edge_params, p):
        self.per_rank = edge_params is not None
        self.p = p
        chunk = ((lambda w, x, a: chunk_fn(w, x, a)) if chunk_aux is not None
                 else (lambda w, x, a: chunk_fn(w, x)))
        if self.per_rank:
            self.fns = ex.Fns(chunk, head_loss_fn, embed_fn)
        else:
            embed = None if embed_fn is None else (lambda e, i: embed_fn(e["embed"], i))
            self.fns = ex.Fns(chunk, lambda e, y, a: head_loss_fn(e["head"], y, a), embed)

    def edge(self, head_params, embed_params, edge_params):
        if self.per_rank:
            return edge_params
        edge = {"head": head_params, "embed": embed_params}
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.p,) + jnp.shape(a)), edge)

    def edge_grads(self, d_edge):
        """d_edge [p, ...] -> (d_head, d_embed), or itself for per-rank edges."""
        if self.per_rank:
            return d_edge
        d = jax.tree.map(lambda a: jnp.sum(a, axis=0), d_edge)
        return d["head"], d["embed"]


def _replicas(schedule: Schedule, mesh, reduction: str) -> int:
    """How many (microbatch, data replica) losses a mean divides by; 1 for a sum."""
    if reduction not in REDUCTIONS:
        raise PipelineError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    if reduction == "sum":
        return 1
    return schedule.microbatches * (mesh.shape[DATA_AXIS] if DATA_AXIS in manual_axes(mesh)
                                    else 1)


def _value_and_grad(model: _Model, chunk_params, edge, x, aux, chunk_aux, *, schedule, mesh,
                    fill, combine, reduction):
    """(loss, d_chunk, d_edge [p, ...], d_x, peak): fp32 gradients of the mean (or summed)
    loss."""
    combine = combine or SUM
    n = _replicas(schedule, mesh, reduction)
    caux = () if chunk_aux is None else chunk_aux
    loss, d_chunk, d_edge, d_x, peak = ex.execute(
        model.fns, chunk_params, edge, x, aux, caux, schedule=schedule, mesh=mesh,
        backward=True, fill=fill, combine=combine)
    # the one data-parallel reduction of the step (a reduce-scatter where the caller's
    # sharding of the gradients splits them over `data`, as ZeRO-1 does)
    d_chunk = combine.reduce(d_chunk, 0)
    d_edge = jax.tree.map(lambda d: jnp.sum(d, axis=0), d_edge)
    if reduction == "mean":
        mean = 1.0 / n
        loss = loss / n
        d_chunk, d_edge, d_x = jax.tree.map(lambda d: d * mean, (d_chunk, d_edge, d_x))
    return loss, d_chunk, d_edge, d_x, peak


def _checked(model_args, schedule, mesh, chunk_params, x, aux, chunk_aux, embed_fn,
             edge_params):
    _check(schedule, mesh, chunk_params, x, aux, chunk_aux, embed_fn)
    p = schedule.stages
    for path, a in jax.tree_util.tree_leaves_with_path(edge_params or ()):
        if a.shape[:1] != (p,):
            raise PipelineError(f"edge param {jax.tree_util.keystr(path)} has shape {a.shape}; "
                                f"it needs a leading dim [stages={p}] (rank r's row is its own)")
    return _Model(*model_args, edge_params, p)


def pipelined_value_and_grad(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                             head_params: Any, x_MBSD: Any, aux: Any, *, schedule: Schedule,
                             mesh, embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
                             chunk_aux: Any = None, bubble_fill: float = 0.0,
                             combine: Optional[GradCombine] = None, edge_params: Any = None,
                             reduction: str = "mean"):
    """Run the schedule's F and B ops once.

    Returns (loss, (d_chunk_params, d_head_params, d_in), stats): loss is the mean of
    head_loss_fn over microbatches and data replicas (their sum with reduction="sum"), the
    gradients are that loss's; d_in is d_embed_params with `embed_fn`,
    else d_x; with `edge_params` the gradients are (d_chunk_params, d_edge_params, d_x or ()).
    Gradients are fp32 (the accumulators'). stats = {"peak_stash": int32[p]}: the residual
    sets each rank held at once, measured in the loop (<= schedule.stash_slots). See
    `pipelined_loss` for the arguments.
    """
    model = _checked((chunk_fn, head_loss_fn, embed_fn, chunk_aux), schedule, mesh,
                     chunk_params, x_MBSD, aux, chunk_aux, embed_fn, edge_params)
    edge = model.edge(head_params, embed_params, edge_params)
    loss, d_chunk, d_edge, d_x, peak = _value_and_grad(
        model, chunk_params, edge, x_MBSD, aux, chunk_aux, schedule=schedule, mesh=mesh,
        fill=bubble_fill, combine=combine, reduction=reduction)
    stats = {"peak_stash": peak}
    if model.per_rank:
        return loss, (d_chunk, d_edge, d_x), stats
    d_head, d_embed = model.edge_grads(d_edge)
    return loss, (d_chunk, d_head, d_embed if embed_fn is not None else d_x), stats


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def _cast_like(d, primal):
    return jax.tree.map(lambda g, a: g.astype(a.dtype), d, primal)


def pipelined_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                   head_params: Any, x_MBSD: Any, aux: Any, *, schedule: Schedule, mesh,
                   embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
                   chunk_aux: Any = None, bubble_fill: float = 0.0,
                   combine: Optional[GradCombine] = None, edge_params: Any = None,
                   reduction: str = "mean") -> jax.Array:
    """Mean over microbatches k (and data replicas) of head_loss_fn(head_params, y_k, aux[k])
    (their sum with reduction="sum"),
    with y_k the chunks applied in order to x_k = x_MBSD[k], or to embed_fn(embed_params,
    x_MBSD[k]) when `embed_fn` is given (x_MBSD is then any pytree of raw inputs, e.g. tokens).

    chunk_fn(chunk_params[r, j], x) -> x, or chunk_fn(params, x, chunk_aux[k]) when
    `chunk_aux` (per-microbatch side inputs such as positions) is given. Leaves of x_MBSD, aux
    and chunk_aux lead with [microbatches, batch, ...]; on a mesh with a `data` axis each
    replica gets its rows of dim 1 (leaves of rank 1 are replicated), so head_loss_fn sees a
    replica's share of a microbatch. With `edge_params` (leaves [p, ...], sharded over
    `stage`; head_params and embed_params unused), head_loss_fn and embed_fn get their rank's
    row instead: rank p-1's and rank 0's.

    Differentiable w.r.t. chunk_params [p, v, ...], head_params, embed_params, edge_params and
    a float x with jax.grad: the gradient comes from the schedule's manual backward
    (custom_vjp). aux and chunk_aux get zero cotangents. Called without a grad it runs the
    forward ops only. The functions must not close over values being differentiated; pass
    them as params. `bubble_fill` is what empty buffers and idle sends hold; tests set NaN to
    show it never reaches a result. `combine` says how chunk-parameter cotangents add up over
    microbatches and data replicas (default: sums; FP8 metas, whose cotangents are amax
    observations, need maxima).
    """
    model = _checked((chunk_fn, head_loss_fn, embed_fn, chunk_aux), schedule, mesh,
                     chunk_params, x_MBSD, aux, chunk_aux, embed_fn, edge_params)
    run = functools.partial(_value_and_grad, model, schedule=schedule, mesh=mesh,
                            fill=bubble_fill, combine=combine, reduction=reduction)
    n = _replicas(schedule, mesh, reduction)

    @jax.custom_vjp
    def loss_fn(cp, hp, ep, edge, x, aux_, caux):
        edge_ = model.edge(hp, ep, edge)
        return ex.execute(model.fns, cp, edge_, x, aux_, () if caux is None else caux,
                          schedule=schedule, mesh=mesh, backward=False, fill=bubble_fill)[0] / n

    def loss_fwd(cp, hp, ep, edge, x, aux_, caux):
        loss, d_cp, d_edge, d_x, _ = run(cp, model.edge(hp, ep, edge), x, aux_, caux)
        return loss, (d_cp, d_edge, d_x, (cp, hp, ep, edge, x, aux_, caux))

    def loss_bwd(res, g):
        d_cp, d_edge, d_x, primals = res
        cp, hp, ep, edge, x, aux_, caux = primals
        scale = lambda tree, like: _cast_like(jax.tree.map(lambda d: d * g, tree), like)  # noqa
        zeros = lambda tree: jax.tree.map(_zero_cotangent, tree)  # noqa: E731
        if model.per_rank:
            d_hp, d_ep, d_edge = zeros(hp), zeros(ep), scale(d_edge, edge)
        else:
            d_head, d_embed = model.edge_grads(d_edge)
            d_hp, d_ep, d_edge = scale(d_head, hp), scale(d_embed, ep), zeros(edge)
        d_x = scale(d_x, x) if embed_fn is None else zeros(x)
        return scale(d_cp, cp), d_hp, d_ep, d_edge, d_x, zeros(aux_), zeros(caux)

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(chunk_params, head_params, embed_params, edge_params, x_MBSD, aux, chunk_aux)


def gpipe_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any, head_params: Any,
               x_MBSD: Any, aux: Any, *, schedule: Schedule, mesh,
               embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
               chunk_aux: Any = None, bubble_fill: float = 0.0,
               edge_params: Any = None, reduction: str = "mean") -> jax.Array:
    """Same loss as pipelined_loss from the forward ops only; jax.grad differentiates the scan.

    The reference for the manual backward and the evaluation path. Under grad its memory is
    GPipe's: autodiff keeps every step's residuals (wrap chunk_fn in jax.checkpoint to keep
    only chunk inputs).
    """
    model = _checked((chunk_fn, head_loss_fn, embed_fn, chunk_aux), schedule, mesh,
                     chunk_params, x_MBSD, aux, chunk_aux, embed_fn, edge_params)
    edge = model.edge(head_params, embed_params, edge_params)
    n = _replicas(schedule, mesh, reduction)
    return ex.execute(model.fns, chunk_params, edge, x_MBSD, aux,
                      () if chunk_aux is None else chunk_aux, schedule=schedule, mesh=mesh,
                      backward=False, fill=bubble_fill)[0] / n

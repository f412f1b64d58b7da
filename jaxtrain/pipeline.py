"""Pipeline-parallel executor: runs a Schedule's lock-step table in one shard_map over 'stage'.

The model is cut into p*v chunks of equal shape; rank r of the `stage` mesh axis owns virtual
stages g = j*p + r (j < v). Chunk parameters are stacked with leading dims [p, v, ...] and
sharded over `stage` on dim 0. Stages may hold different numbers of layers (Megatron's
decoder-first/last-pipeline-num-layers): stack_stages then pads every chunk to the largest
with zero rows, and chunk_fn must skip them (e.g. by a per-layer flag stacked with the
layers, zero in the padding).

Mesh axes. `stage` is manual, and so is `data` when the mesh has it: each data replica runs
the schedule on its rows of every microbatch (dim 1 of the inputs), keeps its own fp32
gradient sums through the loop, and the data-parallel reduction is one psum after the loop
(Megatron's behaviour; left automatic, GSPMD all-reduces every B step's weight gradient over
`data` inside the loop). Every other axis (fsdp, tensor, ...) stays automatic, so the chunk's
sharding constraints and FSDP/TP collectives work unchanged inside; they must not name `data`.

Training (`pipelined_loss`, `pipelined_value_and_grad`) runs forward and backward ops in the
schedule's order: a B op recomputes its chunk from the stashed chunk input and applies the
chunk's `jax.vjp` to the cotangent that arrived from the next rank; the last virtual stage also
runs `head_loss_fn` and seeds the cotangent. The pipeline input is either activations x
(their gradient comes back as d_x, an [m, ...] buffer) or, with `embed_fn`, raw inputs such as
token ids that the first virtual stage embeds itself (Megatron's layout): then nothing of
activation size is held per microbatch outside the stash, and 1F1B's memory does not grow with
the number of microbatches. Gradients accumulate in fp32 and are reduced over `stage` (and
`data`) once, after the loop. A `jax.custom_vjp` hands them to the caller's `jax.grad`.

`gpipe_loss` runs only the forward ops and lets autodiff produce the backward: the reference
for tests. Called without a grad, `pipelined_loss` runs the same forward ops (evaluation; at
most one chunk input waits per rank).

Rules that keep the SPMD program correct (found the hard way, see notes/pipeline.md):
- The shard_map is untyped (check_vma=False): the executor reduces by itself, once, after the
  loop, so a vjp w.r.t. a value the same on every rank (params, x, aux) must return this
  rank's part, not have autodiff psum it in every B step (what varying-axes typing does to
  an invariant value); and opaque kernels inside (Pallas attention) carry no such types.
- No collective over `stage` inside a branch taken by some stages only: it deadlocks. Branches
  that differ per stage (the head, the embedding's gradient, padded layers) hold only
  collectives over the automatic axes, whose device groups never span two stages.
- Idle slots may hold garbage; inputs of idle work are zeroed and results selected with
  jnp.where, never masked by multiplying (0 * NaN is NaN).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.layer_order import LayerOrder
from jaxtrain.pipeline_schedule import (Schedule, ScheduleError, StepTable, build_schedule,
                                        step_flags)

__all__ = ["PipelineError", "ScheduleError", "STAGE_AXIS", "DATA_AXIS", "build_schedule",
           "Schedule", "pipelined_loss", "pipelined_value_and_grad", "gpipe_loss",
           "stack_stages", "unstack_stages", "chunk_layer_counts", "manual_axes", "GradCombine",
           "SUM"]

STAGE_AXIS = "stage"
DATA_AXIS = "data"

# (one chunk's params, x[, chunk_aux of one microbatch]) -> x
ChunkFn = Callable[..., jax.Array]
HeadLossFn = Callable[[Any, jax.Array, Any], jax.Array]     # (head params, x, aux_mb) -> scalar
EmbedFn = Callable[[Any, Any], jax.Array]                   # (embed params, inputs_mb) -> x


class PipelineError(ValueError):
    """Inputs that do not fit the pipeline; the message says what to change."""


class GradCombine(NamedTuple):
    """How chunk-parameter cotangents add up: over a rank's B ops (`add(acc, d) -> acc`) and,
    once after the loop, over data replicas (`all_reduce(acc, axis_name) -> acc`)."""
    add: Callable[[Any, Any], Any]
    all_reduce: Callable[[Any, str], Any]


SUM = GradCombine(
    add=lambda acc, d: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d),
    all_reduce=lambda acc, axis: jax.tree.map(lambda a: lax.psum(a, axis), acc))


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


def manual_axes(mesh) -> tuple:
    """The mesh axes the executor makes manual: `stage`, and `data` when it has replicas (a
    size-1 `data` would only add a no-op all-reduce of every gradient)."""
    return (STAGE_AXIS,) + ((DATA_AXIS,) if mesh.shape.get(DATA_AXIS, 1) > 1 else ())


def _batch_spec(a, data: bool) -> P:
    """Inputs are [m, batch, ...]: data replicas take their rows of dim 1."""
    return P(None, DATA_AXIS) if data and a.ndim >= 2 else P()


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


def _check_fn_shapes(call_chunk, head_loss_fn, act, chunk_params, head_params, aux) -> None:
    """The chunk must keep the activation's shape and dtype; head_loss_fn must return a scalar."""
    y = jax.eval_shape(call_chunk, chunk_params, act)
    if (y.shape, y.dtype) != (act.shape, act.dtype):
        raise PipelineError(f"chunk_fn maps x {act.dtype}{list(act.shape)} to {y.dtype}"
                            f"{list(y.shape)}; a chunk must return the shape and dtype it gets "
                            "(cast inside chunk_fn, or make embed_fn return that dtype)")
    loss = jax.eval_shape(head_loss_fn, head_params, act, aux)
    if loss.shape != ():
        raise PipelineError(f"head_loss_fn returned shape {loss.shape}; it must return a scalar "
                            "(the microbatch's mean loss)")


# ----------------------------------------------------------------------------- executor
def _put(buf, slot, val):
    """buf[slot] = val when slot >= 0, else buf unchanged."""
    s = jnp.maximum(slot, 0)
    return buf.at[s].set(jnp.where(slot >= 0, val, buf[s]))


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _take(tree, k):
    return jax.tree.map(lambda a: a[k], tree)


def _execute(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, embed_fn: Optional[EmbedFn],
             chunk_params, head_params, embed_params, x, aux, chunk_aux, *,
             schedule: Schedule, mesh, backward: bool, fill: float,
             combine: Optional[GradCombine] = None):
    """Run schedule.table (backward) or schedule.forward_table in one shard_map.

    Returns (loss, grads, peak_stash[p]); grads = (d_chunk, d_head, d_in) with d_in = d_embed
    (with embed_fn) or d_x, or None without backward. peak_stash counts chunk inputs held per
    rank, measured in the loop.

    Control flow. A step's F (B) runs on all ranks when any rank has one, and each rank keeps
    its result only where its table entry says so (a step lasts as long as its busiest rank
    anyway). The head and the embedding's gradient run only on the rank that needs them
    (predicates that differ per stage), and so do the layers of padded chunks: that is what
    makes a lighter last (first) stage pay for the head (embedding). This is safe because no
    collective over `stage` is inside those branches: the collectives they hold (TP
    all-reduces, FSDP all-gathers) run over automatic axes whose groups lie within one stage,
    where every device takes the same branch. (A collective over `stage` in such a branch
    deadlocks; see the module docstring.) The embedding's forward, a gather, runs on every
    rank in every step. Inputs of idle work are zeroed, so garbage never meets a gradient.
    """
    table: StepTable = schedule.table if backward else schedule.forward_table
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
    num_v = p * v
    manual = manual_axes(mesh)
    has_data = DATA_AXIS in manual
    n_data = mesh.shape[DATA_AXIS] if has_data else 1
    n_stash, n_grad = max(max(table.stash_slots), 1), max(max(table.grad_slots), 1)
    to_right = [(i, (i + 1) % p) for i in range(p)]
    to_left = [(i, (i - 1) % p) for i in range(p)]
    cols = {k: jnp.asarray(a) for k, a in table.columns.items()}
    flags = {k: jnp.asarray(a) for k, a in step_flags(table, p, v, backward).items()}
    with_caux = chunk_aux is not None
    chunk_aux = () if chunk_aux is None else chunk_aux
    combine = combine or SUM

    def body(cp, hp, ep, x, aux, caux, cols, flags):
        r = lax.axis_index(STAGE_AXIS)
        cp = jax.tree.map(lambda a: a[0], cp)                 # this rank's chunks [v, ...]

        def call_chunk(pj, x_in, k=0):
            return chunk_fn(pj, x_in, _take(caux, k)) if with_caux else chunk_fn(pj, x_in)

        def embed(ep_, k):
            return embed_fn(ep_, _take(x, k)) if embed_fn is not None else x[k]

        act = jax.eval_shape(embed, ep, 0)                    # one microbatch's activations
        x_fill = jnp.full(act.shape, fill, act.dtype)
        # (real arrays, not `act`: eval_shape rejects avals that carry manual axes)
        _check_fn_shapes(call_chunk, head_loss_fn, x_fill, _take(cp, 0), hp, _take(aux, 0))
        buf = lambda n: jnp.full((n,) + act.shape, fill, act.dtype)
        counter = lambda: jnp.zeros((), jnp.int32)
        carry = dict(stash=buf(n_stash), recv_x=x_fill, loss=jnp.zeros((), jnp.float32))
        if backward:
            carry.update(
                gstash=buf(n_grad), recv_g=x_fill,
                d_cp=jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), cp),
                d_hp=jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), hp))
            if embed_fn is not None:
                carry["d_ep"] = jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)),
                                             ep)
            else:
                carry["dx"] = buf(m)
        carry.update(held=counter(), peak=counter())
        f32 = lambda: jnp.zeros_like(carry["loss"])

        def first_input(k):
            """Virtual stage 0's chunk input, computed on every rank in every F and B step.

            The embedding is a gather, cheap next to a chunk; under a lax.cond XLA rejects the
            branches' different output shardings (the embedding's constraint vs. zeros).
            """
            return x[k] if embed_fn is None else embed(ep, k).astype(act.dtype)

        def chunk_input(c, active, slot, x0):
            # virtual stage 0 (slot -1) reads the pipeline input instead of a stash slot
            x_in = jnp.where(slot < 0, x0, c["stash"][jnp.maximum(slot, 0)])
            return jnp.where(active, x_in, jnp.zeros_like(x_in))

        def params_of(j):
            return jax.tree.map(lambda a: a[j], cp)

        def head_loss(hp_, y, k):
            return head_loss_fn(hp_, y, _take(aux, k)).astype(jnp.float32)

        def forward_op(c, row):
            j, k, slot = row["f_chunk"], jnp.maximum(row["f_mb"], 0), row["f_slot"]
            active = j >= 0
            j = jnp.maximum(j, 0)
            x_in = chunk_input(c, active, slot, first_input(k))
            y = call_chunk(params_of(j), x_in, k)
            if backward:
                return c, y
            c = dict(c, held=c["held"] - (active & (slot >= 0)))
            is_last = active & (j * p + r == num_v - 1)
            loss = lax.cond(is_last, lambda: head_loss(hp, y, k), f32)
            c["loss"] = c["loss"] + jnp.where(is_last, loss, 0.0)
            return c, y

        def backward_op(c, row):
            j, k, slot, gslot = (row["b_chunk"], jnp.maximum(row["b_mb"], 0), row["b_slot"],
                                 row["b_gslot"])
            active = j >= 0
            j = jnp.maximum(j, 0)
            g = j * p + r
            is_last, is_first = active & (g == num_v - 1), active & (g == 0)
            x_in = chunk_input(c, active, slot, first_input(k))
            y, chunk_vjp = jax.vjp(lambda pj, x_: call_chunk(pj, x_, k), params_of(j), x_in)

            def head():
                loss, head_vjp = jax.vjp(lambda hp_, y_: head_loss(hp_, y_, k), hp, y)
                # seeded with 1, as an unpipelined microbatch is: the backward's values (and
                # an FP8 gradient's amax) do not depend on m; the mean's 1/(m*n_data) comes after
                d_hp, dy = head_vjp(jnp.ones_like(loss))
                return loss, d_hp, dy

            def no_head():
                return f32(), jax.tree.map(jnp.zeros_like, hp), jnp.zeros_like(y)

            loss, d_hp, dy_head = lax.cond(is_last, head, no_head)
            g_in = c["gstash"][jnp.maximum(gslot, 0)]
            dy = jnp.where(is_last, dy_head,
                           jnp.where(active & (gslot >= 0), g_in, jnp.zeros_like(g_in)))
            d_pj, dx = chunk_vjp(dy)
            keep = lambda mask: lambda acc, d: acc + jnp.where(mask, d, 0).astype(acc.dtype)
            c = dict(c)
            # an idle rank adds zeros (for FP8 metas: an empty observation)
            d_pj = jax.tree.map(lambda d: jnp.where(active, d, jnp.zeros_like(d)), d_pj)
            acc_j = combine.add(_take(c["d_cp"], j), d_pj)
            c["d_cp"] = jax.tree.map(lambda acc, a: acc.at[j].set(a.astype(acc.dtype)),
                                     c["d_cp"], acc_j)
            c["d_hp"] = jax.tree.map(keep(is_last), c["d_hp"], d_hp)
            c["loss"] = c["loss"] + jnp.where(is_last, loss, 0.0)
            if embed_fn is not None:
                def embed_grad():
                    _, embed_vjp = jax.vjp(lambda e: embed(e, k).astype(act.dtype), ep)
                    return embed_vjp(dx)[0]
                d_ep = lax.cond(is_first, embed_grad,
                                lambda: jax.tree.map(jnp.zeros_like, ep))
                c["d_ep"] = jax.tree.map(keep(is_first), c["d_ep"], d_ep)
            else:
                c["dx"] = c["dx"].at[k].set(jnp.where(is_first, dx, c["dx"][k]))
            c["held"] = c["held"] - (active & (slot >= 0))
            return c, dx

        def idle(c, row):
            return c, x_fill

        def step(c, t):
            row = {name: col[t, r] for name, col in cols.items()}
            row.update({name: flag[t] for name, flag in flags.items()})
            c = dict(c)
            c["stash"] = _put(c["stash"], row["recv_x"], c["recv_x"])
            c["held"] = c["held"] + (row["recv_x"] >= 0)
            c["peak"] = jnp.maximum(c["peak"], c["held"])
            c, send_x = lax.cond(row["any_f"], forward_op, idle, c, row)
            if backward:
                c["gstash"] = _put(c["gstash"], row["recv_g"], c["recv_g"])
                c, send_g = lax.cond(row["any_b"], backward_op, idle, c, row)
                c["recv_g"] = lax.ppermute(send_g, STAGE_AXIS, to_left)
            c["recv_x"] = lax.ppermute(send_x, STAGE_AXIS, to_right)
            return c, None

        c, _ = lax.scan(step, carry, jnp.arange(table.num_steps))
        loss = lax.psum(c["loss"], manual) / (m * n_data)
        if not backward:
            return loss, c["peak"][None]
        # The one data-parallel (and stage) reduction of the step.
        mean = 1.0 / (m * n_data)
        d_cp = combine.all_reduce(c["d_cp"], DATA_AXIS) if has_data else c["d_cp"]
        d_cp = jax.tree.map(lambda d, a: (d * mean).astype(a.dtype)[None], d_cp, cp)
        d_hp = jax.tree.map(lambda d, a: (lax.psum(d, manual) * mean).astype(a.dtype),
                            c["d_hp"], hp)
        if embed_fn is not None:
            d_in = jax.tree.map(lambda d, a: (lax.psum(d, manual) * mean).astype(a.dtype),
                                c["d_ep"], ep)
        else:
            # only rank 0 (virtual stage 0) filled dx; the others hold bubble fill
            d_in = lax.psum(jnp.where(r == 0, c["dx"], jnp.zeros_like(c["dx"])),
                            STAGE_AXIS) * mean
        return loss, (d_cp, d_hp, d_in), c["peak"][None]

    specs = lambda tree: jax.tree.map(lambda a: _batch_spec(a, has_data), tree)
    d_in_spec = P() if embed_fn is not None else _batch_spec(x, has_data)
    grad_specs = ((P(STAGE_AXIS), P(), d_in_spec),) if backward else ()
    out = jax.shard_map(
        body, mesh=mesh, axis_names=set(manual),
        in_specs=(P(STAGE_AXIS), P(), P(), specs(x), specs(aux), specs(chunk_aux), P(), P()),
        out_specs=(P(),) + grad_specs + (P(STAGE_AXIS),), check_vma=False,
    )(chunk_params, head_params, embed_params, x, aux, chunk_aux, cols, flags)
    if backward:
        return out
    return out[0], None, out[1]


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


# ----------------------------------------------------------------------------- public API
def pipelined_value_and_grad(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                             head_params: Any, x_MBSD: Any, aux: Any, *, schedule: Schedule,
                             mesh, embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
                             chunk_aux: Any = None, bubble_fill: float = 0.0,
                             combine: Optional[GradCombine] = None):
    """Run the schedule's forward and backward ops once.

    Returns (loss, (d_chunk_params, d_head_params, d_in), stats): loss is the mean of
    head_loss_fn over microbatches and data replicas; d_in is d_embed_params with `embed_fn`,
    else d_x; stats = {"peak_stash": int32[p]}, the chunk inputs each rank held at once,
    measured in the loop (<= schedule.stash_slots). See `pipelined_loss` for the arguments.
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux, chunk_aux, embed_fn)
    loss, grads, peak = _execute(chunk_fn, head_loss_fn, embed_fn, chunk_params, head_params,
                                 embed_params, x_MBSD, aux, chunk_aux, schedule=schedule,
                                 mesh=mesh, backward=True, fill=bubble_fill, combine=combine)
    return loss, grads, {"peak_stash": peak}


def pipelined_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                   head_params: Any, x_MBSD: Any, aux: Any, *, schedule: Schedule, mesh,
                   embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
                   chunk_aux: Any = None, bubble_fill: float = 0.0,
                   combine: Optional[GradCombine] = None) -> jax.Array:
    """Mean over microbatches k (and data replicas) of head_loss_fn(head_params, y_k, aux[k]),
    with y_k the chunks applied in order to x_k = x_MBSD[k], or to embed_fn(embed_params,
    x_MBSD[k]) when `embed_fn` is given (x_MBSD is then any pytree of raw inputs, e.g. tokens).

    chunk_fn(chunk_params[r, j], x) -> x, or chunk_fn(params, x, chunk_aux[k]) when
    `chunk_aux` (per-microbatch side inputs such as positions) is given. Leaves of x_MBSD, aux
    and chunk_aux lead with [microbatches, batch, ...]; on a mesh with a `data` axis each
    replica gets its rows of dim 1 (leaves of rank 1 are replicated), so head_loss_fn sees a
    replica's share of a microbatch.

    Differentiable w.r.t. chunk_params [p, v, ...], head_params, embed_params and a float x
    with jax.grad: the gradient comes from the schedule's manual backward (custom_vjp). aux
    and chunk_aux get zero cotangents. Called without a grad it runs the forward ops only.
    The functions must not close over values being differentiated; pass them as params.
    `bubble_fill` is what empty buffers and idle sends hold; tests set NaN to show it never
    reaches a result. `combine` says how chunk-parameter cotangents add up over microbatches
    and data replicas (default: sums; FP8 metas, whose cotangents are amax observations, need
    maxima: fp8.GRAD_COMBINE).
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux, chunk_aux, embed_fn)
    run = functools.partial(_execute, chunk_fn, head_loss_fn, embed_fn, schedule=schedule,
                            mesh=mesh, fill=bubble_fill, combine=combine)
    types = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         (x_MBSD, aux, chunk_aux))

    @jax.custom_vjp
    def loss_fn(cp, hp, ep, x, aux_, caux):
        return run(cp, hp, ep, x, aux_, caux, backward=False)[0]

    def loss_fwd(cp, hp, ep, x, aux_, caux):
        loss, grads, _ = run(cp, hp, ep, x, aux_, caux, backward=True)
        return loss, grads

    def loss_bwd(grads, g):
        scale = lambda d: (d * g).astype(d.dtype)
        d_cp, d_hp, d_in = grads
        d_x, d_aux, d_caux = jax.tree.map(_zero_cotangent, types)
        if embed_fn is None:
            d_ep, d_x = (), scale(d_in)
        else:
            d_ep = jax.tree.map(scale, d_in)
        return (jax.tree.map(scale, d_cp), jax.tree.map(scale, d_hp), d_ep, d_x, d_aux,
                d_caux)

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(chunk_params, head_params, embed_params, x_MBSD, aux, chunk_aux)


def gpipe_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any, head_params: Any,
               x_MBSD: Any, aux: Any, *, schedule: Schedule, mesh,
               embed_fn: Optional[EmbedFn] = None, embed_params: Any = (),
               chunk_aux: Any = None, bubble_fill: float = 0.0) -> jax.Array:
    """Same loss as pipelined_loss from the forward ops only; jax.grad differentiates the scan.

    The reference for the manual backward and the evaluation path. Under grad its memory is
    GPipe's: autodiff keeps every step's residuals (wrap chunk_fn in jax.checkpoint to keep
    only chunk inputs).
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux, chunk_aux, embed_fn)
    return _execute(chunk_fn, head_loss_fn, embed_fn, chunk_params, head_params, embed_params,
                    x_MBSD, aux, chunk_aux, schedule=schedule, mesh=mesh, backward=False,
                    fill=bubble_fill)[0]

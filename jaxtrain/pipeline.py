"""Pipeline-parallel executor: runs a Schedule's lock-step table in one shard_map over 'stage'.

The model is cut into p*v chunks of equal shape; rank r of the `stage` mesh axis owns virtual
stages g = j*p + r (j < v). Chunk parameters are stacked with leading dims [p, v, ...] and
sharded over `stage` on dim 0; every other mesh axis stays automatic inside the shard_map, so
tensor/fsdp/data shardings of the chunk's parameters and activations keep working unchanged.

Training (`pipelined_loss`, `pipelined_value_and_grad`) runs forward and backward ops in the
schedule's order: a B op recomputes its chunk from the stashed chunk input and applies the
chunk's `jax.vjp` to the cotangent that arrived from the next rank; the last virtual stage also
runs `head_loss_fn` and seeds the cotangent. Gradients accumulate in fp32 and are reduced over
`stage` once, after the loop. A `jax.custom_vjp` hands those gradients to the caller's
`jax.grad`, so an embedding computed before the pipeline gets its gradient through `x`.

`gpipe_loss` runs only the forward ops and lets autodiff produce the backward: the reference
for tests. Called without a grad, `pipelined_loss` runs the same forward ops (evaluation; at
most one chunk input waits per rank).

Rules that keep the SPMD program correct (found the hard way, see notes/pipeline.md):
- Values the same on every rank (head params, x, aux) are cast to stage-varying once, at the top
  of the body, so autodiff's transposed psum('stage') happens once, not inside the loop.
- No branch is taken by some stages only: the chunk and head may contain collectives over the
  automatic axes, and those deadlock when half the devices skip them. Every lax.cond predicate
  is the same on all ranks; each rank selects its own results with jnp.where.
- Idle slots may hold garbage; inputs of idle work are zeroed and results selected with
  jnp.where, never masked by multiplying (0 * NaN is NaN).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.pipeline_schedule import Schedule, ScheduleError, StepTable, build_schedule

__all__ = ["PipelineError", "ScheduleError", "STAGE_AXIS", "build_schedule", "Schedule",
           "pipelined_loss", "pipelined_value_and_grad", "gpipe_loss", "stack_stages",
           "unstack_stages"]

STAGE_AXIS = "stage"

ChunkFn = Callable[[Any, jax.Array], jax.Array]             # (one chunk's params, x) -> x
HeadLossFn = Callable[[Any, jax.Array, Any], jax.Array]     # (head params, x, aux_mb) -> scalar


class PipelineError(ValueError):
    """Inputs that do not fit the pipeline; the message says what to change."""


# ----------------------------------------------------------------------------- layout helpers
def stack_stages(layers: Any, stages: int, virtual_stages: int = 1) -> Any:
    """Leaves [L, ...] -> [p, v, L/(p*v), ...]; layers of virtual stage g = j*p + r go to [r, j]."""
    p, v = stages, virtual_stages

    def stack(a):
        if a.shape[0] % (p * v):
            raise PipelineError(f"{a.shape[0]} layers do not split into stages={p} x "
                                f"virtual_stages={v} equal chunks; pick a divisor of the layers")
        a = a.reshape((v, p, a.shape[0] // (p * v)) + a.shape[1:])
        return jnp.swapaxes(a, 0, 1)
    return jax.tree.map(stack, layers)


def unstack_stages(chunks: Any) -> Any:
    """Inverse of stack_stages: [p, v, Lc, ...] -> [L, ...]."""
    def unstack(a):
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape((-1,) + a.shape[3:])
    return jax.tree.map(unstack, chunks)


# ----------------------------------------------------------------------------- validation
def _check(schedule: Schedule, mesh, chunk_params, x, aux) -> None:
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
    if x.ndim < 1 or x.shape[0] != m:
        raise PipelineError(f"x has shape {x.shape}; its leading dim must be the schedule's "
                            f"microbatches={m}")
    for path, a in jax.tree_util.tree_leaves_with_path(aux):
        if a.ndim < 1 or a.shape[0] != m:
            raise PipelineError(f"aux leaf {jax.tree_util.keystr(path)} has shape {a.shape}; its "
                                f"leading dim must be microbatches={m}")


def _check_fn_shapes(chunk_fn, head_loss_fn, chunk_params, head_params, x, aux) -> None:
    """chunk_fn must keep x's shape and dtype; head_loss_fn must return a scalar."""
    y = jax.eval_shape(chunk_fn, chunk_params, x)
    if (y.shape, y.dtype) != (x.shape, x.dtype):
        raise PipelineError(f"chunk_fn maps x {x.dtype}{list(x.shape)} to {y.dtype}"
                            f"{list(y.shape)}; a chunk must return the shape and dtype it gets "
                            "(cast inside chunk_fn)")
    loss = jax.eval_shape(head_loss_fn, head_params, x, aux)
    if loss.shape != ():
        raise PipelineError(f"head_loss_fn returned shape {loss.shape}; it must return a scalar "
                            "(the microbatch's mean loss)")


# ----------------------------------------------------------------------------- executor
def _vary(tree):
    """Mark leaves stage-varying (identity on values); leaves already varying are kept."""
    def cast(a):
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        varying = mat.varying if mat is not None else getattr(jax.typeof(a), "vma", frozenset())
        return a if STAGE_AXIS in varying else lax.pcast(a, STAGE_AXIS, to="varying")
    return jax.tree.map(cast, tree)


def _put(buf, slot, val):
    """buf[slot] = val when slot >= 0, else buf unchanged."""
    s = jnp.maximum(slot, 0)
    return buf.at[s].set(jnp.where(slot >= 0, val, buf[s]))


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _step_flags(table: StepTable, stages: int, virtual_stages: int, backward: bool) -> dict:
    """Per-step booleans [num_steps] that are the same on every rank (cond predicates)."""
    p, num_v = stages, stages * virtual_stages
    cols = table.columns
    rank = np.arange(p)[None, :]
    f_last = (cols["f_chunk"] >= 0) & (cols["f_chunk"] * p + rank == num_v - 1)
    b_last = (cols["b_chunk"] >= 0) & (cols["b_chunk"] * p + rank == num_v - 1)
    f_work = (cols["f_chunk"] >= 0) & ~f_last if backward else cols["f_chunk"] >= 0
    return {"any_f": f_work.any(1),               # an F that computes (the last virtual
            "any_b": (cols["b_chunk"] >= 0).any(1),   # stage's F is done by its B in training)
            "any_head": (b_last if backward else f_last).any(1)}


def _execute(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params, head_params, x, aux, *,
             schedule: Schedule, mesh, backward: bool, fill: float):
    """Run schedule.table (backward) or schedule.forward_table in one shard_map.

    Returns (loss, grads, peak_stash[p]); grads = (d_chunk, d_head, d_x), or None without
    backward. peak_stash counts chunk inputs held per rank, measured in the loop.

    Control flow is the same on every rank: a step's F (B, head) runs on all ranks when any
    rank has one, and each rank keeps its result only where its table entry says so. The chunk
    and head may hold collectives over the automatic axes (TP all-reduces, FSDP all-gathers,
    resharding permutes), and a collective inside a branch that only some stages take
    deadlocks. Chunk work costs no lock-step time this way (a step lasts as long as its busiest
    rank anyway), but the head runs on every rank in each step where the last virtual stage
    has a B, which adds the head's time to those steps. Inputs of idle ranks are zeroed, so
    garbage never meets a gradient.
    """
    table: StepTable = schedule.table if backward else schedule.forward_table
    p, v, m = schedule.stages, schedule.virtual_stages, schedule.microbatches
    num_v = p * v
    n_stash, n_grad = max(max(table.stash_slots), 1), max(max(table.grad_slots), 1)
    to_right = [(i, (i + 1) % p) for i in range(p)]
    to_left = [(i, (i - 1) % p) for i in range(p)]
    cols = {k: jnp.asarray(a) for k, a in table.columns.items()}
    flags = {k: jnp.asarray(a) for k, a in _step_flags(table, p, v, backward).items()}

    def body(cp, hp, x, aux, cols, flags):
        r = lax.axis_index(STAGE_AXIS)
        cp = jax.tree.map(lambda a: a[0], cp)                 # this rank's chunks [v, ...]
        hp, x, aux = _vary(hp), _vary(x), _vary(aux)
        x_fill = jnp.full_like(x[0], fill)
        buf = lambda n: jnp.repeat(jnp.full_like(x[:1], fill), n, axis=0)
        f32 = lambda: _vary(jnp.zeros((), jnp.float32))
        i32 = lambda: _vary(jnp.zeros((), jnp.int32))
        carry = dict(stash=buf(n_stash), recv_x=x_fill, loss=f32(), held=i32(), peak=i32())
        if backward:
            carry.update(
                gstash=buf(n_grad), recv_g=x_fill, dx=buf(m),
                d_cp=jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), cp),
                d_hp=jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), hp))
        carry = _vary(carry)
        _check_fn_shapes(chunk_fn, head_loss_fn, jax.tree.map(lambda a: a[0], cp), hp, x[0],
                         jax.tree.map(lambda a: a[0], aux))

        def chunk_input(c, active, slot, k):
            # virtual stage 0 (slot -1) reads the pipeline input instead of a stash slot
            x_in = jnp.where(slot < 0, x[k], c["stash"][jnp.maximum(slot, 0)])
            return jnp.where(active, x_in, jnp.zeros_like(x_in))

        def params_of(j):
            return jax.tree.map(lambda a: a[j], cp)

        def head_loss(hp_, y, k):
            aux_k = jax.tree.map(lambda a: a[k], aux)
            return head_loss_fn(hp_, y, aux_k).astype(jnp.float32)

        def forward_op(c, row):
            j, k, slot = row["f_chunk"], jnp.maximum(row["f_mb"], 0), row["f_slot"]
            active = j >= 0
            j = jnp.maximum(j, 0)
            y = chunk_fn(params_of(j), chunk_input(c, active, slot, k))
            if backward:
                return c, y
            c = dict(c, held=c["held"] - (active & (slot >= 0)))
            is_last = active & (j * p + r == num_v - 1)
            loss = lax.cond(row["any_head"], lambda: head_loss(hp, y, k), f32)
            c["loss"] = c["loss"] + jnp.where(is_last, loss, 0.0)
            return c, y

        def backward_op(c, row):
            j, k, slot, gslot = (row["b_chunk"], jnp.maximum(row["b_mb"], 0), row["b_slot"],
                                 row["b_gslot"])
            active = j >= 0
            j = jnp.maximum(j, 0)
            g = j * p + r
            is_last = active & (g == num_v - 1)
            pj = params_of(j)
            y, chunk_vjp = jax.vjp(chunk_fn, pj, chunk_input(c, active, slot, k))

            def head():
                loss, head_vjp = jax.vjp(lambda hp_, y_: head_loss(hp_, y_, k), hp, y)
                d_hp, dy = head_vjp(jnp.full_like(loss, 1.0 / m))
                return loss, d_hp, dy

            def no_head():
                return f32(), jax.tree.map(jnp.zeros_like, hp), jnp.zeros_like(y)

            loss, d_hp, dy_head = lax.cond(row["any_head"], head, no_head)
            g_in = c["gstash"][jnp.maximum(gslot, 0)]
            dy = jnp.where(is_last, dy_head,
                           jnp.where(active & (gslot >= 0), g_in, jnp.zeros_like(g_in)))
            d_pj, dx = chunk_vjp(dy)
            keep = lambda mask: lambda acc, d: acc + jnp.where(mask, d, 0).astype(acc.dtype)
            c = dict(c)
            c["d_cp"] = jax.tree.map(lambda acc, d: acc.at[j].set(keep(active)(acc[j], d)),
                                     c["d_cp"], d_pj)
            c["d_hp"] = jax.tree.map(keep(is_last), c["d_hp"], d_hp)
            c["loss"] = c["loss"] + jnp.where(is_last, loss, 0.0)
            c["dx"] = c["dx"].at[k].set(jnp.where(active & (g == 0), dx, c["dx"][k]))
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
        loss = lax.psum(c["loss"], STAGE_AXIS) / m
        if not backward:
            return loss, c["peak"][None]
        d_cp = jax.tree.map(lambda d, a: d.astype(a.dtype)[None], c["d_cp"], cp)
        d_hp = jax.tree.map(lambda d, a: lax.psum(d, STAGE_AXIS).astype(a.dtype),
                            c["d_hp"], hp)
        # only rank 0 (virtual stage 0) filled dx; the others hold bubble fill
        dx = lax.psum(jnp.where(r == 0, c["dx"], jnp.zeros_like(c["dx"])), STAGE_AXIS)
        return loss, (d_cp, d_hp, dx), c["peak"][None]

    grad_specs = ((P(STAGE_AXIS), P(), P()),) if backward else ()
    out = jax.shard_map(
        body, mesh=mesh, axis_names={STAGE_AXIS},
        in_specs=(P(STAGE_AXIS), P(), P(), P(), P(), P()),
        out_specs=(P(),) + grad_specs + (P(STAGE_AXIS),),
    )(chunk_params, head_params, x, aux, cols, flags)
    if backward:
        return out
    return out[0], None, out[1]


# ----------------------------------------------------------------------------- public API
def pipelined_value_and_grad(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                             head_params: Any, x_MBSD: jax.Array, aux: Any, *,
                             schedule: Schedule, mesh, bubble_fill: float = 0.0):
    """Run the schedule's forward and backward ops once.

    Returns (loss, (d_chunk_params, d_head_params, d_x), stats) where loss is the mean over
    microbatches of head_loss_fn and stats = {"peak_stash": int32[p]}, the chunk inputs each
    rank held at once, measured in the loop (<= schedule.stash_slots). `bubble_fill` is what
    empty buffers and idle sends hold; tests set NaN to show it never reaches a result.
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux)
    loss, grads, peak = _execute(chunk_fn, head_loss_fn, chunk_params, head_params, x_MBSD, aux,
                                 schedule=schedule, mesh=mesh, backward=True, fill=bubble_fill)
    return loss, grads, {"peak_stash": peak}


def pipelined_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any,
                   head_params: Any, x_MBSD: jax.Array, aux: Any, *, schedule: Schedule, mesh,
                   bubble_fill: float = 0.0) -> jax.Array:
    """Mean over microbatches of head_loss_fn(head_params, chunks(x_MBSD[k]), aux[k]).

    Differentiable w.r.t. chunk_params [p, v, ...], head_params and x_MBSD with jax.grad: the
    gradient comes from the schedule's manual backward (custom_vjp). aux (labels, masks) gets
    a zero cotangent. Called without a grad it runs the forward ops only. chunk_fn and
    head_loss_fn must not close over values being differentiated; pass them as params.
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux)
    run = functools.partial(_execute, chunk_fn, head_loss_fn, schedule=schedule, mesh=mesh,
                            fill=bubble_fill)
    aux_types = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), aux)

    def aux_cotangent(a):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros(a.shape, a.dtype)
        return np.zeros(a.shape, jax.dtypes.float0)

    @jax.custom_vjp
    def loss_fn(cp, hp, x, aux_):
        return run(cp, hp, x, aux_, backward=False)[0]

    def loss_fwd(cp, hp, x, aux_):
        loss, grads, _ = run(cp, hp, x, aux_, backward=True)
        return loss, grads

    def loss_bwd(grads, g):
        scale = lambda d: (d * g).astype(d.dtype)
        d_cp, d_hp, dx = jax.tree.map(scale, grads)
        d_aux = jax.tree.map(aux_cotangent, aux_types)
        return d_cp, d_hp, dx, d_aux

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(chunk_params, head_params, x_MBSD, aux)


def gpipe_loss(chunk_fn: ChunkFn, head_loss_fn: HeadLossFn, chunk_params: Any, head_params: Any,
               x_MBSD: jax.Array, aux: Any, *, schedule: Schedule, mesh,
               bubble_fill: float = 0.0) -> jax.Array:
    """Same loss as pipelined_loss from the forward ops only; jax.grad differentiates the scan.

    The reference for the manual backward and the evaluation path. Under grad its memory is
    GPipe's: autodiff keeps every step's residuals (wrap chunk_fn in jax.checkpoint to keep
    only chunk inputs).
    """
    _check(schedule, mesh, chunk_params, x_MBSD, aux)
    return _execute(chunk_fn, head_loss_fn, chunk_params, head_params, x_MBSD, aux,
                    schedule=schedule, mesh=mesh, backward=False, fill=bubble_fill)[0]

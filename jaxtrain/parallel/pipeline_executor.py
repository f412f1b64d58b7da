"""The pipeline executor: one shard_map over `stage` (and `data`) that runs a lock-step table.

Rank r holds its chunks' parameters [v, ...] (sharded over `stage`) and its row of the edge
parameters (the embedding on rank 0, the head on rank p-1: `edge` leads with [p] too). Every
step of `schedule.table` it stores what arrived, runs its B, then its F, and sends one
activation right and one cotangent left (ppermute over `stage`):

- F (training): the chunk's forward with its residuals (pipeline_stash.ChunkProgram); what
  depends on the microbatch goes to the F's stash slot. Virtual stage 0 embeds its input
  (`fns.embed`); the others read their inbox slot.
- B: the chunk's stashed pullback, applied to the cotangent from the right; it recomputes only
  what the remat policy dropped and the parameter-only residuals. The last virtual stage's B
  runs its chunk's forward too (its F is folded in: nothing waits between them), then the
  head, whose objective it seeds with 1, and adds the head's sums; virtual stage 0's B also
  differentiates the embedding.
- forward only (`schedule.forward_table`: evaluation): F runs the chunk; the last virtual
  stage adds the head's sums.

The head returns (objective, sums): the scalar the backward differentiates and a pytree of
scalars (the model's loss as sums, jaxtrain.model.loss) the executor adds up over microbatches
and replicas without knowing what they are. A chunk may return (x, side sums) (an MoE layer's
statistics): each rank adds them up over its chunk forwards (F ops, and the last virtual
stage's B, where its F is folded in), psum'd with the head's.
Which axes are manual and how the arguments enter: pipeline_specs.py (expert parallelism
included).

A rank with nothing to do in a step skips it: F and B are `lax.switch`es on the rank's own
table entry, so no chunk runs on zeros and a device's matmuls are exactly its m·v chunk
forwards and backwards (plus the head on rank p-1). Lock-step still makes each step last as
long as the busiest rank. Branches taken by some ranks only hold no collective over `stage`
(it would deadlock): their collectives (TP, FSDP) run over automatic axes whose device groups
lie within one stage, where every device takes the same branch.

Buffers and switches. The stash, the inbox, the cotangent slots and the gradient accumulators
are updated outside the switches (the fused accumulator aside, below): a value a switch
takes is an operand of every branch, and
XLA then copies a buffer that one branch updates in place (measured on the GPU compiler: the
stash twice, the accumulators twice). So an F returns its residuals and a B its gradient
contributions, and the step writes them. A B reads its stash slot inside its switch (read
outside, the copy stayed alive beside the last stage's own residual set: one set more).

Fused gradients (`Fns.taps`, the model's layer runner tapping its weights,
parallel/grad_accumulation.py: Megatron's gradient_accumulation_fusion). The rank's
accumulator of the tapped leaves is one [v·Lc, ...] fp32 buffer per leaf; a B's chunk
program is differentiated w.r.t. it (not w.r.t. the weights), its cotangent is the
accumulator itself, and the backward's layer scan adds each layer's gradient into row j·Lc + i
in place: no chunk-sized compute-dtype gradient. This one accumulator is updated inside the B's
switch, as its own carry (measured on the GPU compiler: not copied). What made XLA copy it:
a forward whose layer loop carried it through, in the F's switch (the F's program now reads
it not: its unused inputs are dropped) and in the last virtual stage's B (which runs the
chunk program's forward and backward instead of one vjp). The untapped leaves (FP8 metas,
layer modes) come out of the switch and add up as before.

Gradients accumulate in fp32 per rank and per data replica and leave the shard_map stacked
[replicas, p, ...] (P(data, stage)): the caller reduces the replica dim once, where the
optimizer's sharding turns it into a reduce-scatter under ZeRO-1 (an all-reduce inside the
shard_map would hold an fp32 copy of every gradient). The head's sums are psum'd here.

The shard_map is untyped (check_vma=False): a vjp w.r.t. a value the same on every rank
returns this rank's part, never an autodiff psum inside a branch. Idle sends and empty
buffers hold `fill`; results are selected, never masked by multiplying (0 * NaN is NaN).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.ledger.pipeline_schedule import Schedule
from jaxtrain.parallel import grad_accumulation
from jaxtrain.parallel import pipeline_specs as specs
from jaxtrain.parallel.mesh_axes import DATA, STAGE
from jaxtrain.parallel import pipeline_taps
from jaxtrain.parallel.pipeline_stash import ChunkProgram, chunk_program
from jaxtrain.parallel.remat import opaque_zeros

STAGE_AXIS, DATA_AXIS = STAGE, DATA
# name scopes of the F and B branches: a dry run weights their matmuls by how often each runs
F_SCOPE, B_SCOPE = "pipeline_f", "pipeline_b"


class Fns(NamedTuple):
    """The model the executor runs; none closes over a value being differentiated. `taps`
    (a bool per chunk parameter leaf, or None): the leaves whose gradients the chunk's layer
    runner adds into the accumulator itself (grad_accumulation.accumulating inside `into`):
    then a B's weight gradients go into the fp32 accumulator layer by layer (module
    docstring)."""
    chunk: Callable                  # (chunk params [..], x, chunk aux of one microbatch) -> x
    head_loss: Callable              # (edge row, y, aux of one microbatch) -> (objective, sums)
    embed: Callable                  # (edge row, inputs of one microbatch) -> x
    taps: Any = None


class GradCombine(NamedTuple):
    """How chunk-parameter cotangents add up: over a rank's B ops (`add_at(acc, j, d)`: acc
    [v, ...] with chunk j's d added) and over the stacked data replicas (`reduce(tree,
    axis)`)."""
    add_at: Callable[[Any, Any, Any], Any]
    reduce: Callable[[Any, int], Any]


def add_at(acc, j, d):
    """acc[j] += d as a scatter-add, updated in place (a read-modify-write of acc[j] made XLA
    materialize the slice: one chunk's fp32 gradients more)."""
    return jax.tree.map(lambda a, x: a.at[j].add(x.astype(a.dtype)), acc, d)


SUM = GradCombine(add_at=add_at,
                  reduce=lambda tree, axis: jax.tree.map(lambda a: jnp.sum(a, axis=axis), tree))


class Carry(NamedTuple):
    """The loop state of one rank (fields a table does not use are None)."""
    inbox: jax.Array                 # [slots, *act]: activations waiting for their op
    stash: tuple                     # per saved residual [slots, *shape]
    cots: Optional[jax.Array]        # [slots, *act]: cotangents waiting for their B
    recv_x: jax.Array                # what arrived from the left at the end of the last step
    recv_g: Optional[jax.Array]      # ... and from the right
    sums: Any                        # the head's sums over this rank's microbatches
    side: Any                        # the chunks' side sums over this rank's F ops (or None)
    d_chunk: Any                     # fp32 [v, ...] gradient sums of the rank's chunks
                                     # (fused: of the untapped leaves; the tapped are None)
    d_acc: Any                       # fused: fp32 [v*Lc, ...] sums of the tapped leaves
    d_edge: Any                      # fp32 gradient sums of the rank's edge row
    held: jax.Array                  # stash slots in use, and their peak
    peak: jax.Array


class Rank(NamedTuple):
    """What a rank's ops read: its parameters and inputs (all local), and static facts."""
    r: jax.Array                     # this rank's index on `stage`
    p: int
    num_v: int                       # virtual stages, p * v
    chunks: Any                      # [v, ...]
    edge: Any                        # this rank's row of the edge parameters
    x: Any                           # pipeline inputs [m, ...] of this replica
    aux: Any
    caux: Any
    fill_x: jax.Array                # one microbatch's activations, all `fill`
    no_sums: Any                     # the head's sums, all zeros (a step without a head)
    no_side: Any                     # a chunk's side sums, all zeros (None: it has none)
    program: Optional[ChunkProgram]  # training only
    taps: Optional[tuple] = None     # fused: per chunk leaf, whether it is tapped
    lc: int = 0                      # layers per chunk (a chunk's accumulator rows)


class PipelineError(ValueError):
    """Inputs that do not fit the pipeline; the message says what to change."""


def _put(buf, slot, val):
    """buf[slot] = val when slot >= 0, else buf unchanged."""
    s = jnp.maximum(slot, 0)
    return buf.at[s].set(jnp.where(slot >= 0, val, buf[s]))


def _take(tree, k):
    return jax.tree.map(lambda a: a[k], tree)


def _add(acc, d):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d)


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _fp32_zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)),
                        tree)


def _full(shape, dtype, fill):
    return jnp.full(shape, fill if jnp.issubdtype(dtype, jnp.inexact) else 0, dtype)


def _chunk_y(fns: Fns, rk, params, x, caux):
    """The chunk's output activation (its side sums dropped)."""
    out = fns.chunk(params, x, caux)
    return out if rk.no_side is None else out[0]


# ----------------------------------------------------------------------------- one step's ops
def _first_input(fns: Fns, rk: Rank, k):
    """Virtual stage 0's chunk input: the embedded microbatch."""
    return fns.embed(rk.edge, _take(rk.x, k)).astype(rk.fill_x.dtype)


def _head(fns: Fns, rk: Rank, edge, y, k):
    """(fp32 objective, sums) of microbatch k's head."""
    objective, sums = fns.head_loss(edge, y, _take(rk.aux, k))
    return objective.astype(jnp.float32), sums


def _f_op(fns: Fns, rk: Rank, c: Carry, row, from_input: bool, backward: bool):
    """One F: (what goes right, the residuals to stash, the head's and the chunk's sums it
    adds)."""
    j, k = jnp.maximum(row["f_chunk"], 0), jnp.maximum(row["f_mb"], 0)
    x_in = _first_input(fns, rk, k) if from_input else c.inbox[jnp.maximum(row["f_in"], 0)]
    params, caux = _take(rk.chunks, j), _take(rk.caux, k)
    if backward:
        acc = {} if rk.taps is None else dict(acc=c.d_acc, row0=j * rk.lc)
        y, saved, side = rk.program.forward(params, x_in, caux, **acc)
        return y, tuple(saved), rk.no_sums, side
    out = fns.chunk(params, x_in, caux)
    y, side = (out, None) if rk.no_side is None else out
    is_last = j * rk.p + rk.r == rk.num_v - 1
    sums = lax.cond(is_last, lambda: _head(fns, rk, rk.edge, y, k)[1], lambda: rk.no_sums)
    return y, (), sums, side


class BOut(NamedTuple):
    """What a B produces: the cotangent going left and this microbatch's contributions,
    which the step adds to the accumulators after the switch (module docstring)."""
    dx: jax.Array
    d_params: Any                    # the chunk's, in the parameters' dtype (fused: untapped)
    d_edge: Any                      # the edge row's (head or embedding; zeros elsewhere)
    sums: Any                        # the head's (zeros but on the last virtual stage)
    objective: jax.Array             # the head's objective (0 elsewhere): orders the F after
    side: Any                        # the last virtual stage's chunk side sums (its F is here)
    acc: Any = None                  # fused: the accumulator with this B's weight gradients


def _b_op(fns: Fns, rk: Rank, c: Carry, row, last: bool, first: bool) -> BOut:
    """One B. A middle stage applies its stashed pullback; the last virtual stage runs its
    chunk forward and the head, whose objective it seeds with 1 (as an unpipelined microbatch
    is: the step divides by the token count after, so values in the backward, FP8 gradient
    amaxes included, do not depend on m); virtual stage 0 also differentiates the
    embedding."""
    j, k = jnp.maximum(row["b_chunk"], 0), jnp.maximum(row["b_mb"], 0)
    params = _take(rk.chunks, j)
    d_edge, sums, objective = _zeros(rk.edge), rk.no_sums, jnp.zeros((), jnp.float32)
    side, acc = rk.no_side, None
    if rk.taps is not None and last:
        x_in = _first_input(fns, rk, k) if first else c.inbox[jnp.maximum(row["b_in"], 0)]
        caux = _take(rk.caux, k)
        # the chunk program's forward and backward back to back: a forward that took the
        # accumulator (to pass it through its layer loop) made XLA copy it
        y, saved, _ = rk.program.forward(params, x_in, caux, acc=c.d_acc, row0=j * rk.lc)
        objective, head_pull, sums = jax.vjp(lambda e, y_: _head(fns, rk, e, y_, k), rk.edge,
                                             y, has_aux=True)
        d_edge, dy = head_pull(jnp.ones_like(objective))
        d_r, acc, dx = rk.program.backward(params, saved, dy, acc=c.d_acc)
        d_params = pipeline_taps.untapped(params, rk.taps, d_r)
    elif rk.taps is not None:
        slot = jnp.maximum(row["b_res"], 0)
        dy = c.cots[jnp.maximum(row["b_gslot"], 0)]
        d_r, acc, dx = rk.program.backward(params, [buf[slot] for buf in c.stash], dy,
                                           acc=c.d_acc)
        d_params = pipeline_taps.untapped(params, rk.taps, d_r)
    elif last:
        x_in = _first_input(fns, rk, k) if first else c.inbox[jnp.maximum(row["b_in"], 0)]
        caux = _take(rk.caux, k)
        chunk = lambda p_, h: fns.chunk(p_, h, caux)  # noqa: E731
        if side is None:
            y, pull = jax.vjp(chunk, params, x_in)
        else:
            y, pull, side = jax.vjp(chunk, params, x_in, has_aux=True)
        objective, head_pull, sums = jax.vjp(lambda e, y_: _head(fns, rk, e, y_, k), rk.edge,
                                             y, has_aux=True)
        d_edge, dy = head_pull(jnp.ones_like(objective))
        d_params, dx = pull(dy)
    else:
        slot = jnp.maximum(row["b_res"], 0)
        dy = c.cots[jnp.maximum(row["b_gslot"], 0)]
        d_params, dx = rk.program.backward(params, [buf[slot] for buf in c.stash], dy)
    if first:
        _, pull = jax.vjp(lambda e: fns.embed(e, _take(rk.x, k)).astype(dx.dtype), rk.edge)
        d_edge = _add(d_edge, pull(dx)[0])
    return BOut(dx, d_params, d_edge, sums, objective, side, acc)


def _b_idle(rk: Rank, c: Carry, row) -> BOut:
    chunk = _take(rk.chunks, 0)
    d_params = _zeros(chunk if rk.taps is None else pipeline_taps.untapped(chunk, rk.taps))
    return BOut(rk.fill_x, d_params, _zeros(rk.edge), rk.no_sums,
                jnp.zeros((), jnp.float32), rk.no_side, c.d_acc)


def _chunk_acc(fns: Fns, params, acc, row0, x, aux):
    """(y, acc) of a chunk whose layer runner taps its weights into `acc` (rows from
    row0): the accumulator passes through; its cotangent collects the weight gradients."""
    with grad_accumulation.into(acc, row0) as ctx:
        y = fns.chunk(params, x, aux)
    if ctx.acc is acc:
        raise PipelineError("Fns.taps is set but the chunk's layer runner did not tap: run "
                            "the layers with grad_accumulation.accumulating, or leave taps None")
    return y, ctx.acc


def _switch_f(fns: Fns, rk: Rank, c: Carry, row, backward: bool):
    """This rank's F, if it has one: from the pipeline input (virtual stage 0) or its inbox.
    Its residuals leave the switch and go into the stash after it (module docstring)."""
    j = row["f_chunk"]
    first = j * rk.p + rk.r == 0
    index = jnp.where(j >= 0, 1 + first.astype(jnp.int32), 0)

    def idle(c, row):
        return (rk.fill_x, tuple(jnp.zeros_like(buf[0]) for buf in c.stash), rk.no_sums,
                rk.no_side)
    branches = [idle] + [functools.partial(_f_op, fns, rk, from_input=f, backward=backward)
                         for f in (False, True)]
    with jax.named_scope(F_SCOPE):
        y, saved, sums, side = lax.switch(index, branches, c, row)
    stash = tuple(_put(buf, row["f_res"], s) for buf, s in zip(c.stash, saved))
    return c._replace(stash=stash, sums=_add(c.sums, sums), side=_add(c.side, side)), y


def _switch_b(fns: Fns, rk: Rank, combine: GradCombine, c: Carry, row):
    """This rank's B, if it has one (index 1 + first + 2 * last over the kinds below; kinds
    no virtual stage has are not traced), and its contributions added to the accumulators.
    An idle rank adds zeros (for FP8 metas: an empty observation)."""
    j = row["b_chunk"]
    g = j * rk.p + rk.r
    first, last = (g == 0).astype(jnp.int32), (g == rk.num_v - 1).astype(jnp.int32)
    index = jnp.where(j >= 0, 1 + first + 2 * last, 0)
    n = rk.num_v
    idle = functools.partial(_b_idle, rk)
    kinds = [(False, False, n > 2), (False, True, n > 1), (True, False, n > 1),
             (True, True, n == 1)]
    branches = [idle] + [functools.partial(_b_op, fns, rk, last=last_, first=first_)
                         if reachable else idle for last_, first_, reachable in kinds]
    with jax.named_scope(B_SCOPE):
        out = lax.switch(index, branches, c, row)
    c = c._replace(d_chunk=combine.add_at(c.d_chunk, jnp.maximum(j, 0), out.d_params),
                   d_edge=_add(c.d_edge, out.d_edge), sums=_add(c.sums, out.sums),
                   side=_add(c.side, out.side), d_acc=out.acc)
    return c, out


def _step(fns: Fns, rk: Rank, combine: GradCombine, backward: bool, cols, c: Carry, t):
    """One lock-step step: store arrivals, B, F, send right and left."""
    p = rk.p
    row = {name: col[t, rk.r] for name, col in cols.items()}
    c = c._replace(inbox=_put(c.inbox, row["recv_x"], c.recv_x))
    if backward:
        c = c._replace(cots=_put(c.cots, row["recv_g"], c.recv_g))
        c, b_out = _switch_b(fns, rk, combine, c, row)
        send_g = b_out.dx
        c = c._replace(held=c.held - (row["b_res"] >= 0))
        # The F's stash write must follow the B's read of the same buffers; nothing else
        # orders them (the F does not use the B's results), and XLA:CPU then copied every
        # stash buffer twice per step. An index offset XLA cannot prove zero orders them.
        row = dict(row, f_res=row["f_res"] + opaque_zeros(b_out.objective).astype(jnp.int32))
    c, send_x = _switch_f(fns, rk, c, row, backward)
    held = c.held + (row["f_res"] >= 0)
    c = c._replace(held=held, peak=jnp.maximum(c.peak, held), recv_x=lax.ppermute(
        send_x, STAGE_AXIS, [(i, (i + 1) % p) for i in range(p)]))
    if backward:
        c = c._replace(recv_g=lax.ppermute(send_g, STAGE_AXIS,
                                           [(i, (i - 1) % p) for i in range(p)]))
    return c, None


# ----------------------------------------------------------------------------- the loop
def _check_shapes(fns: Fns, rk: Rank) -> None:
    """The chunk must keep the activation's shape and dtype; the head's objective must be a
    scalar. With a backward the chunk program's output is read (the chunk is not traced
    again)."""
    act = rk.fill_x
    y = (rk.program.fwd.out_avals[0] if rk.program is not None else
         jax.eval_shape(functools.partial(_chunk_y, fns, rk), _take(rk.chunks, 0), act,
                        _take(rk.caux, 0)))
    if (y.shape, y.dtype) != (act.shape, act.dtype):
        raise PipelineError(f"chunk_fn maps x {act.dtype}{list(act.shape)} to {y.dtype}"
                            f"{list(y.shape)}; a chunk must return the shape and dtype it gets "
                            "(cast inside chunk_fn, or make embed_fn return that dtype)")
    objective = _head_shapes(fns, rk.edge, act, rk.aux)[0]
    if objective.shape != ():
        raise PipelineError(f"head_loss_fn returned an objective of shape {objective.shape}; "
                            "it must return a scalar (the microbatch's summed loss) and its sums")


def _head_shapes(fns: Fns, edge_row, act, aux):
    out = jax.eval_shape(fns.head_loss, edge_row, act, _take(aux, 0))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PipelineError("head_loss_fn must return (objective, sums): the scalar the "
                            "backward differentiates and a pytree of scalars to add up")
    return out


def _init(rk: Rank, table, backward: bool, fill: float) -> Carry:
    act = rk.fill_x
    slots = lambda counts: max(max(counts), 1)  # noqa: E731
    buf = lambda n: _full((n,) + act.shape, act.dtype, fill)  # noqa: E731
    zero = jnp.zeros((), jnp.int32)
    stash, cots, recv_g, d_chunk, d_edge, d_acc = (), None, None, None, None, None
    if backward:
        stash = tuple(_full((slots(table.stash_slots),) + a.shape, a.dtype, fill)
                      for a in rk.program.saved_avals)
        cots, recv_g = buf(slots(table.grad_slots)), rk.fill_x
        d_chunk, d_edge = _fp32_zeros(rk.chunks), _fp32_zeros(rk.edge)
        if rk.taps is not None:
            d_acc = _fp32_zeros(pipeline_taps.accumulator_rows(rk.chunks, rk.taps))
            d_chunk = _fp32_zeros(pipeline_taps.untapped(rk.chunks, rk.taps))
    return Carry(inbox=buf(slots(table.inbox_slots)), stash=stash, cots=cots,
                 recv_x=rk.fill_x, recv_g=recv_g, sums=rk.no_sums, side=rk.no_side,
                 d_chunk=d_chunk, d_acc=d_acc,
                 d_edge=d_edge, held=zero, peak=zero)


def _body(fns: Fns, schedule: Schedule, backward: bool, fill: float, combine: GradCombine,
          manual: tuple, chunk_params, edge, x, aux, caux, cols):
    table = schedule.table if backward else schedule.forward_table
    p, v = schedule.stages, schedule.virtual_stages
    r = lax.axis_index(STAGE_AXIS)
    chunks, edge_row = _take(chunk_params, 0), _take(edge, 0)
    act = jax.eval_shape(fns.embed, edge_row, _take(x, 0))
    fill_x = _full(act.shape, act.dtype, fill)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa
    no_sums = zeros(_head_shapes(fns, edge_row, act, aux)[1])
    chunk_out = jax.eval_shape(fns.chunk, _take(chunks, 0), fill_x, _take(caux, 0))
    no_side = zeros(chunk_out[1]) if isinstance(chunk_out, tuple) else None
    rk = Rank(r, p, p * v, chunks, edge_row, x, aux, caux, fill_x, no_sums, no_side, None)
    if backward and fns.taps is not None:
        if no_side is not None:
            raise PipelineError("Fns.taps with a chunk that returns side sums is not supported; "
                                "leave taps None")
        taps = tuple(bool(t) for t in jax.tree.leaves(fns.taps))
        rk = rk._replace(taps=taps, lc=jax.tree.leaves(chunks)[0].shape[1])
        acc = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32),
                           pipeline_taps.accumulator_rows(chunks, taps))
        rk = rk._replace(program=chunk_program(
            fns.chunk, _take(chunks, 0), fill_x, _take(caux, 0),
            chunk_acc=functools.partial(_chunk_acc, fns), taps=taps, acc=acc))
    elif backward:
        rk = rk._replace(program=chunk_program(fns.chunk, _take(chunks, 0), fill_x,
                                               _take(caux, 0), side=no_side is not None))
    _check_shapes(fns, rk)
    carry = _init(rk, table, backward, fill)
    step = functools.partial(_step, fns, rk, combine, backward, cols)
    c, _ = lax.scan(step, carry, jnp.arange(table.num_steps))
    sums = lax.psum(c.sums, manual)
    if no_side is not None:
        sums = (sums, lax.psum(c.side, manual))
    if not backward:
        return sums, c.peak[None]
    stack = lambda tree: jax.tree.map(lambda a: a[None, None], tree)  # noqa: E731
    d_chunk = (c.d_chunk if rk.taps is None else
               pipeline_taps.gradients(rk.chunks, rk.taps, c.d_acc, c.d_chunk))
    return sums, stack(d_chunk), stack(c.d_edge), c.peak[None]


def execute(fns: Fns, chunk_params, edge, x, aux, caux, *, schedule: Schedule, mesh,
            backward: bool, fill: float = 0.0, combine: Optional[GradCombine] = None,
            expert_dims: Any = None):
    """Run schedule.table (backward) or schedule.forward_table in one shard_map.

    chunk_params and edge lead with [p] (sharded over `stage`); x (the embedding's inputs),
    aux and caux with [m] (and their batch dim 1 splits over `data`). Sums, never means (the
    caller divides): forward only: (sums, peak[p]), the head's sums over microbatches and data
    replicas (a chunk with side sums: (head's, chunks'), the chunks' over every F). Training: (sums, d_chunk, d_edge, peak[p]): d_chunk [replicas, p, v, ...] and
    d_edge [replicas, p, ...] are fp32 sums over the microbatches of each data replica of the
    objectives' gradients (reduce dim 0 with `combine.reduce`); peak counts the stash slots
    each rank held at once, measured in the loop. `expert_dims`: per chunk leaf, the dim
    (counting [p, v, ...]) that holds its experts, or None.
    """
    manual = specs.manual_axes(mesh)
    table = schedule.table if backward else schedule.forward_table
    cols = {k: jnp.asarray(a) for k, a in table.columns.items()}
    inputs = lambda tree: specs.batch_specs(tree, mesh)  # noqa: E731
    in_chunks, d_chunks = specs.chunk_specs(chunk_params, expert_dims, mesh)
    out_specs = (P(), P(STAGE_AXIS))
    if backward:
        out_specs = (P(), d_chunks, specs.stacked(mesh), P(STAGE_AXIS))
    body = functools.partial(_body, fns, schedule, backward, fill, combine or SUM, manual)
    return jax.shard_map(
        body, mesh=mesh, axis_names=set(manual),
        in_specs=(in_chunks, P(STAGE_AXIS), inputs(x), inputs(aux), inputs(caux), P()),
        out_specs=out_specs, check_vma=False)(chunk_params, edge, x, aux, caux, cols)

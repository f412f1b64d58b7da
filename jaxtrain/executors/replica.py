"""The unpipelined executor (stage = 1): microbatches accumulated per data replica.

Each data-parallel replica runs the microbatch scan over its rows of the global batch [B, S]
(`per_replica`: a shard_map with `data` manual, as the pipeline's) and keeps its own fp32
gradient sums; the data-parallel reduction happens once, after the last microbatch (Megatron's
behaviour; GSPMD would otherwise all-reduce inside the loop), as a sum over the replicas'
stacked sums that XLA turns into an all-reduce (a reduce-scatter under ZeRO-1). FSDP's per-use
gather/reduce-scatter over `fsdp` stays inside the loop, as in ZeRO-3. The accumulation itself
is `microbatched`, which knows nothing about the model (levanter's grad_accum shape).

FP8: the step differentiates the loss w.r.t. params and metas; the metas' cotangents are amax
observations, combined over microbatches and replicas by the converter's rule (inside a
replica GSPMD already reduces each amax over the fsdp/tensor shards). They never reach optax.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.executors.contract import Sums, model_loss
from jaxtrain.executors.setup import Setup, split_microbatches
from jaxtrain.parallel import grad_accumulation, sharding
from jaxtrain.parallel.mesh_axes import EXPERT


def microbatched(fn: Callable, num_microbatches: int, zeros: Callable, add: Callable,
                 add_into: Callable | None = None):
    """`run(*args, batch)`: `fn(*args, mb)` over the `num_microbatches` microbatches of
    `batch` ([B, ...] leaves; split_microbatches), its outputs accumulated by one scan whose
    carry starts at `zeros(shapes of fn's output)` and takes each microbatch's output with
    `add(acc, out)`. Only `fn` knows the model; only `zeros` and `add` know how its outputs
    add up. `add_into(acc, *args, mb) -> acc`, when given, is a microbatch that adds into the
    accumulator itself (then `fn` only gives the shapes, and `add` is not used)."""
    step = add_into or (lambda acc, *args: add(acc, fn(*args)))

    def run(*args):
        *args, batch = args
        mbs = split_microbatches(batch, num_microbatches)
        shapes = jax.eval_shape(fn, *args, jax.tree.map(lambda a: a[0], mbs))
        acc, _ = jax.lax.scan(lambda acc, mb: (step(acc, *args, mb), None), zeros(shapes),
                              mbs)
        return acc
    return run


def loss_sums(setup: Setup, params, mb, fp8_meta=None):
    """(objective, LossSums) of one microbatch on one replica. Without `fp8_meta` every layer
    runs in the compute dtype (Fp8Converter.for_run)."""
    metas, use_fp8 = setup.fp8.for_run(fp8_meta, setup.meta_shapes)
    return model_loss(setup.bind(params, metas)(mb["inputs"], mb["positions"],
                                                mb["segment_ids"], use_fp8=use_fp8), mb)


def per_replica(setup: Setup, fn, grads_out: bool = False):
    """`fn(params, meta, rows) -> outputs` run once per data replica on its rows of the batch:
    a shard_map with `data` manual (every other axis stays automatic), each output stacked on
    a new leading dim over `data`. The caller reduces that dim once, after everything the
    replicas accumulate: the one data-parallel reduction of the step (GSPMD alone all-reduces
    each microbatch's gradients inside the loop). Under context parallelism `context` is
    manual too: each (data, context) replica runs the model on its part of the sequence (the
    attention moves K/V over `context` itself, sharded_kernels.ShardedAttention) and keeps its
    own partial gradient sums, reduced with the data-parallel ones (Megatron's CP ranks are
    part of the data-parallel group), not in every layer of every microbatch. Under expert
    parallelism `expert` is manual as well: its ranks are data-parallel replicas for every
    weight but the experts', which enter split over `expert` (each rank its own experts: the
    MoE dispatch's all-to-alls bring the tokens to them) and whose gradients (`grads_out`:
    fn returns Sums) are stacked over the other replica axes only, so they are reduced over
    those alone.

    Untyped (check_vma=False), as the executor reduces by itself: a gradient w.r.t. the
    replicated params is this replica's part, never psum'd by autodiff, and an opaque kernel
    (Pallas attention) needs no varying-axes types inside."""
    def body(params, meta, rows):
        return jax.tree.map(lambda a: a[None], fn(params, meta, rows))
    mesh = setup.mesh
    manual = sharding.replica_axes(mesh)
    if not manual:
        return body
    rows = sharding.replica_rows_spec(mesh)
    stacked = P(sharding.one_or_tuple(manual))
    out_specs = stacked
    if grads_out:
        out_specs = Sums(stacked, _param_specs(setup, manual, stacked=True), stacked)
    return jax.shard_map(body, mesh=mesh, axis_names=set(manual),
                         in_specs=(_param_specs(setup, manual), P(), rows),
                         out_specs=out_specs, check_vma=False)


def _param_specs(setup: Setup, manual: tuple, stacked: bool = False):
    """shard_map specs of a params-shaped tree: replicated, except the experts' dim of expert
    weights when `expert` is manual; `stacked`: after a leading dim stacked over the manual
    axes (the experts' over those but `expert`)."""
    rest = tuple(a for a in manual if a != EXPERT)

    def one(names):
        dim = sharding.expert_dim(names) if EXPERT in manual else None
        if dim is None:
            return P(sharding.one_or_tuple(manual)) if stacked else P()
        lead = (sharding.one_or_tuple(rest),) if stacked else ()
        return P(*lead, *(None,) * dim, EXPERT)
    return jax.tree.map(one, setup.logical, is_leaf=lambda x: isinstance(x, P))


def _accumulator(setup: Setup):
    """(zeros, add) of Sums over microbatches: losses and gradients sum (the gradients in
    fp32, where the compute params live), observations combine by the converter's rule (a
    zero observation has use count 0: "not seen")."""
    def constrained(tree):
        return jax.tree.map(sharding.constrain, tree, setup.compute_shardings)

    def zeros(shapes: Sums) -> Sums:
        z = lambda tree, dtype=None: jax.tree.map(  # noqa: E731
            lambda s: jnp.zeros(s.shape, dtype or s.dtype), tree)
        return Sums(z(shapes.losses), constrained(z(shapes.grads, jnp.float32)), z(shapes.fp8))

    def add(acc: Sums, out: Sums, grads=None) -> Sums:
        if grads is None:
            grads = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc.grads, out.grads)
        return Sums(jax.tree.map(jnp.add, acc.losses, out.losses), constrained(grads),
                    setup.fp8.combine(acc.fp8, out.fp8))
    return zeros, add


def _fused_microbatch(setup: Setup, add: Callable):
    """`(acc, params, meta, mb) -> acc`: one microbatch whose layer stack's weight gradients
    go straight into the fp32 accumulator (grad_accumulation: the stack is differentiated
    w.r.t. its accumulator, whose cotangent is acc + g), so no compute-dtype gradient of the
    stack is held beside it. The embedding, head and final norm are differentiated as before
    and added after the backward (a cotangent acc + g for them held an fp32 table more on
    the 8B 128K recipe's H100 program)."""
    def step(acc: Sums, params, meta, mb) -> Sums:
        def objective(acc_blocks, rest, mt):
            with grad_accumulation.into(acc_blocks) as ctx:
                obj, losses = loss_sums(setup, {**rest, "blocks": params["blocks"]}, mb, mt)
            return obj + grad_accumulation.seed(ctx.acc), losses
        rest = {k: v for k, v in params.items() if k != "blocks"}
        (_, losses), (blocks, d_rest, observations) = jax.value_and_grad(
            objective, argnums=(0, 1, 2), has_aux=True)(acc.grads["blocks"], rest, meta)
        grads = {**jax.tree.map(lambda a, x: a + x.astype(jnp.float32),
                                {k: acc.grads[k] for k in rest}, d_rest), "blocks": blocks}
        return add(acc, Sums(losses, None, observations), grads)
    return step


def grad_sums(setup: Setup, *, fuse: bool = True):
    """`fn(compute params, batch, fp8_meta) -> Sums` of the unpipelined step: each replica
    scans its microbatches, then the one data-parallel reduction of the step. A dense model's
    microbatches add their weight gradients into the accumulator as they are computed
    (_fused_microbatch) where `fuses`; elsewhere (and with `fuse=False`) each microbatch's
    gradients are added after its backward."""
    def microbatch(params, meta, mb) -> Sums:
        (_, losses), (grads, observations) = jax.value_and_grad(
            lambda p, mt: loss_sums(setup, p, mb, mt), argnums=(0, 1), has_aux=True)(params,
                                                                                    meta)
        return Sums(losses, grads, observations)
    zeros, add = _accumulator(setup)
    fused = _fused_microbatch(setup, add) if fuse and grad_accumulation.fuses(setup.cfg) else None
    run = per_replica(setup, microbatched(microbatch, setup.cfg.parallel.microbatches, zeros,
                                          add, add_into=fused), grads_out=True)

    def fn(params, batch, fp8_meta) -> Sums:
        # The one data-parallel reduction of the step.
        return setup.fp8.reduce(run(params, fp8_meta, batch), axis=0)
    return fn


def eval_sums(setup: Setup):
    """`fn(params, batch, fp8_meta=None) -> LossSums` of the unpipelined forward."""
    run = per_replica(setup, lambda p, meta, rows: loss_sums(setup, p, rows, meta)[1])

    def fn(params, batch, fp8_meta: Any = None):
        return jax.tree.map(lambda a: jnp.sum(a, axis=0), run(params, fp8_meta, batch))
    return fn

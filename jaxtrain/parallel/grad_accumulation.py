"""Weight gradients added straight into the fp32 accumulator (Megatron's
gradient_accumulation_fusion), so no compute-dtype gradient of the whole layer stack lives
beside it.

Differentiating a microbatch w.r.t. the compute-dtype params makes the layer scan's backward
write every layer's gradient into one stacked [L, ...] buffer of the compute dtype, which the
step then adds to its fp32 accumulator: 2 bytes per parameter beside the accumulator's 4. Here
the step differentiates the stack w.r.t. its accumulator instead: inside the layer scan
(`accumulating`, a wrapper of the remat runner) the stacked accumulator rides in the scan's
carry, passed through unchanged; each layer's weights pass an identity whose backward adds
that layer's gradient into row i of the carried cotangent (an in-place dynamic-update-slice of
the backward loop's carry, as Megatron's wgrad GEMM accumulates into main_grad). The carry's
cotangent starts as the accumulator itself (`seed`: its backward returns its input), so the
accumulator's cotangent is acc + Σ g. (The embedding, head and final norm are not scanned;
the executor differentiates and adds them as before.)

The accumulator reaches the runner through `into(acc_blocks)`, a trace-time context the
replica executor opens around one microbatch's forward, and the pipeline executor around a
chunk's (its accumulator holds the rank's v chunks as [v·Lc, ...] rows and `row0` = j·Lc
says where chunk j's start: a traced offset, so no chunk-sized slice of it is taken); without
one (eval, the model alone) the runner is the remat runner unchanged.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["seed", "into", "accumulating"]

_ACTIVE = threading.local()


@jax.custom_vjp
def seed(acc):
    """0.0, whose backward hands `acc` itself back as the cotangent of `acc`: added to the
    objective, it starts the layer scan's carried accumulator cotangent at the accumulator."""
    return jnp.zeros((), jnp.float32)


def _seed_fwd(acc):
    return seed(acc), acc


def _seed_bwd(acc, ct):
    del ct   # the objective's seed is 1: acc, not ct * acc (that would copy it)
    return (acc,)


seed.defvjp(_seed_fwd, _seed_bwd)


@jax.custom_vjp
def _layer_tap(w, acc, i):
    """(w, acc); backward: row i of the carried accumulator cotangent += w's gradient."""
    return w, acc


def _layer_tap_fwd(w, acc, i):
    return (w, acc), i


def _layer_tap_bwd(i, cts):
    g, ct_acc = cts

    def add_row(a, x):
        row = jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) + x.astype(a.dtype)
        return jax.lax.dynamic_update_index_in_dim(a, row, i, 0)
    return None, jax.tree.map(add_row, ct_acc, g), None


_layer_tap.defvjp(_layer_tap_fwd, _layer_tap_bwd)


class _Accumulation:
    """The accumulator of the stacked params while a microbatch's forward is traced; `acc`
    follows the layer ranges as they run (each range's carry out is the next one's in)."""

    def __init__(self, acc_blocks, row0):
        self.acc = acc_blocks
        self.row0 = row0


@contextlib.contextmanager
def into(acc_blocks, row0=0):
    """Within it, `accumulating` runners carry `acc_blocks` (the fp32 accumulator of the
    stacked params, [L, ...] leaves, a tree whose paths are the params' within the runner's
    stacked state; a leaf left None is not tapped), its rows counted from `row0` (an int or
    a traced int32); yields the context, whose `.acc` after the forward is what `seed` must
    take (or what the caller feeds its pullback as the cotangent of the accumulator)."""
    prev = getattr(_ACTIVE, "ctx", None)
    _ACTIVE.ctx = ctx = _Accumulation(acc_blocks, row0)
    try:
        yield ctx
    finally:
        _ACTIVE.ctx = prev


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", k)))


def _split(state, acc):
    """(the state's leaves that have an accumulator, in acc's leaf order; a function putting
    replacements for them back into the state)."""
    def names(path):
        out = tuple(_key(k) for k in path)
        return out[:-1] if out and out[-1] == "value" else out
    acc_paths = [names(p) for p, _ in jax.tree_util.tree_flatten_with_path(acc)[0]]
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    where = {names(path): n for n, (path, _) in enumerate(flat)}
    slots = [where[p] for p in acc_paths]

    def put_back(ws):
        leaves = [leaf for _, leaf in flat]
        for n, w in zip(slots, ws):
            leaves[n] = w
        return jax.tree_util.tree_unflatten(treedef, leaves)
    return [flat[n][1] for n in slots], put_back


def accumulating(runner: Callable, start: int = 0) -> Callable:
    """`runner` (run_layers(fn, x, stacked) -> x) that, inside `into`, carries the
    accumulator through the scan and taps each layer's weights (rows start + j of the
    accumulator: the range [start, stop) of the stack)."""
    def run(fn, x, stacked):
        ctx = getattr(_ACTIVE, "ctx", None)
        if ctx is None:
            return runner(fn, x, stacked)
        acc_tree = ctx.acc
        n = jax.tree.leaves(stacked)[0].shape[0]
        rows = ctx.row0 + jnp.arange(start, start + n, dtype=jnp.int32)

        def body(s_i, carry):
            (s, i), (x, acc) = s_i, carry
            ws, put_back = _split(s, acc_tree)
            ws, acc = _layer_tap(ws, acc, i)
            return fn(put_back(ws), x), acc
        x, ctx.acc = runner(body, (x, jax.tree.leaves(acc_tree)), (stacked, rows))
        ctx.acc = jax.tree_util.tree_unflatten(jax.tree.structure(acc_tree), ctx.acc)
        return x
    return run

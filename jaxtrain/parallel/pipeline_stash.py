"""What a pipeline F saves for its B: one chunk's VJP residuals, split by what they depend on.

`jax.vjp(chunk)` returns its pullback as a pytree (jax's VJP object) whose leaves are the
residuals the backward reads: under remat none every saved activation, under a checkpoint
policy what the policy saves (the inputs of each recomputed group under full recompute), and
values computed from the parameters alone (an FP8 weight's quantized copy, the weights a
conditional re-emits). `ChunkProgram` traces that vjp once, with the shapes of one chunk and
one microbatch, and splits its residuals with jax's partial evaluation (parameters known,
activations and side inputs unknown):

- `saved`: residuals that depend on the microbatch. An F computes them (`forward`) and the
  executor keeps them in its stash slots until the B: fixed shapes, so a slot is a buffer
  [slots, *shape] per residual.
- derived: residuals of the parameters alone. Never stashed per microbatch; the B recomputes
  them from the chunk's parameters (`backward`), so a parameter passed through unchanged costs
  nothing and an FP8 weight is quantized again (elementwise work, no matmul).

The B rebuilds the pullback from both and applies it to the cotangent: it recomputes only
what the remat policy dropped. jax's partial evaluation is reached through jaxtrain.compat.

Fused (`taps`: which parameter leaves the chunk's layer runner taps,
parallel/grad_accumulation.py): the chunk runs as `chunk_acc(params, acc, row0, x, aux) ->
(y, acc)` and is differentiated w.r.t. the untapped parameters (FP8 metas, layer modes), the
accumulator and x, never w.r.t. the tapped weights: the B feeds the rank's fp32 accumulator
as the accumulator's cotangent and the backward's layer scan adds each layer's weight
gradient into its row, in place. The forward passes the accumulator through unchanged and
saves nothing of it (the taps save their row index, from row0: stashed, a few int32).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxtrain import compat
from jaxtrain.parallel.pipeline_taps import split_taps


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkProgram:
    """One chunk's forward-with-residuals and backward, for fixed input shapes."""
    fwd: Any                 # ClosedJaxpr: (param leaves, x, aux leaves) -> (y, residual leaves)
    derived: Any             # ClosedJaxpr: param leaves -> the parameter-only residuals
    vjp_tree: Any            # PyTreeDef of the pullback (jax's VJP object)
    is_saved: tuple          # per residual leaf: True when it depends on the microbatch
    side_tree: Any = None    # PyTreeDef of the chunk's side sums (None: it returns y alone)
    taps: Any = None         # fused: per parameter leaf, whether the layer runner taps it
    acc_tree: Any = None     # fused: PyTreeDef of the accumulator (the tapped leaves)
    run: Any = None          # fused: fwd without the inputs it does not read (the
                             # accumulator: a switch operand a loop inside carries is copied)
    reads: tuple = ()        # fused: per input of fwd, whether `run` takes it

    @property
    def n_side(self) -> int:
        return 0 if self.side_tree is None else self.side_tree.num_leaves

    @property
    def saved_avals(self) -> list:
        """Shapes and dtypes of what an F stashes (one microbatch)."""
        outs = self.fwd.jaxpr.outvars[1 + self.n_side:]
        return [v.aval for v, s in zip(outs, self.is_saved) if s]

    def _params(self, params) -> list:
        """The parameter leaves as the program takes them: tapped ones first when fused."""
        if self.taps is None:
            return jax.tree.leaves(params)
        tapped, rest, _ = split_taps(params, self.taps)
        return tapped + rest

    def forward(self, params, x, aux, acc=None, row0=None) -> tuple:
        """(y, saved residuals, side sums or None) of one microbatch: the chunk's forward,
        nothing recomputed (fused: `acc`, `row0` as chunk_acc takes them; acc only passes
        through)."""
        if self.taps is None:
            y, *res = compat.jaxpr_as_fun(self.fwd)(*jax.tree.leaves(params), x,
                                                    *jax.tree.leaves(aux))
        else:
            inputs = [*self._params(params), *jax.tree.leaves(acc), row0, x,
                      *jax.tree.leaves(aux)]
            y, *res = compat.jaxpr_as_fun(self.run)(*[a for a, r in zip(inputs, self.reads)
                                                      if r])
        side, res = res[:self.n_side], res[self.n_side:]
        side = None if self.side_tree is None else jax.tree.unflatten(self.side_tree, side)
        return y, [r for r, s in zip(res, self.is_saved) if s], side

    def backward(self, params, saved, dy, acc=None) -> tuple:
        """(d_params, dx): the stashed pullback, with the parameter-only residuals recomputed.
        Fused: (d_untapped (a list, in leaf order), acc + each layer's weight gradient, dx)."""
        derived = iter(compat.jaxpr_as_fun(self.derived)(*self._params(params)))
        saved = iter(saved)
        leaves = [next(saved) if s else next(derived) for s in self.is_saved]
        pullback = jax.tree_util.tree_unflatten(self.vjp_tree, leaves)
        return pullback(dy) if self.taps is None else pullback((dy, acc))


def chunk_program(chunk: Callable, params, x, aux, side: bool = False, *,
                  chunk_acc: Callable = None, taps=None, acc=None) -> ChunkProgram:
    """Trace `chunk(params, x, aux) -> y` (`side`: -> (y, side sums), a pytree of scalars
    that is not differentiated) with these (example) values' shapes. Fused (`taps`, a bool
    per parameter leaf; `acc`, an example accumulator): `chunk_acc(params, acc, row0, x,
    aux) -> (y, acc)` is traced instead, differentiated w.r.t. the untapped leaves, acc and
    x (module docstring; no side sums)."""
    if taps is not None:
        return _fused_program(chunk_acc, params, x, aux, tuple(taps), acc)
    trees = {}

    def fwd(params_, x_, aux_):
        if side:
            y, pullback, sums = jax.vjp(lambda p, h: chunk(p, h, aux_), params_, x_,
                                        has_aux=True)
            sums, trees["side"] = jax.tree.flatten(sums)
        else:
            (y, pullback), sums = jax.vjp(lambda p, h: chunk(p, h, aux_), params_, x_), []
        leaves, trees["vjp"] = jax.tree.flatten(pullback)
        return y, *sums, leaves

    closed = jax.make_jaxpr(fwd)(params, x, aux)
    n_params = len(jax.tree.leaves(params))
    n_in = len(closed.jaxpr.invars)
    depends = compat.outputs_depending_on(closed, [i >= n_params for i in range(n_in)])
    if depends[0] is False:
        raise ValueError("the chunk's output does not depend on its input activations")
    n_side = len(closed.jaxpr.outvars) - 1 - trees["vjp"].num_leaves
    is_saved = tuple(depends[1 + n_side:])
    derived = compat.known_outputs(closed, [i >= n_params for i in range(n_in)],
                                   [False] * (1 + n_side) + [not s for s in is_saved])
    return ChunkProgram(closed, derived, trees["vjp"], is_saved, trees.get("side"))


def _fused_program(chunk_acc: Callable, params, x, aux, taps: tuple, acc) -> ChunkProgram:
    trees = {}
    w, r, merge = split_taps(params, taps)
    row0 = jax.ShapeDtypeStruct((), jax.numpy.int32)

    def fwd(w_, r_, acc_, row0_, x_, aux_):
        (y, _), pullback = jax.vjp(lambda r, a, h: chunk_acc(merge(w_, r), a, row0_, h, aux_),
                                   r_, acc_, x_)
        leaves, trees["vjp"] = jax.tree.flatten(pullback)
        return y, leaves

    closed = jax.make_jaxpr(fwd)(w, r, acc, row0, x, aux)
    n_params, n_in = len(w) + len(r), len(closed.jaxpr.invars)
    unknown = [i >= n_params for i in range(n_in)]
    depends = compat.outputs_depending_on(closed, unknown)
    if depends[0] is False:
        raise ValueError("the chunk's output does not depend on its input activations")
    is_saved = tuple(depends[1:])
    derived = compat.known_outputs(closed, unknown, [False] + [not s for s in is_saved])
    run, reads = compat.unused_inputs_removed(closed)
    return ChunkProgram(closed, derived, trees["vjp"], is_saved, None, taps,
                        jax.tree.structure(acc), run, reads)

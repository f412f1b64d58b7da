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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxtrain import compat


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkProgram:
    """One chunk's forward-with-residuals and backward, for fixed input shapes."""
    fwd: Any                 # ClosedJaxpr: (param leaves, x, aux leaves) -> (y, residual leaves)
    derived: Any             # ClosedJaxpr: param leaves -> the parameter-only residuals
    vjp_tree: Any            # PyTreeDef of the pullback (jax's VJP object)
    is_saved: tuple          # per residual leaf: True when it depends on the microbatch
    side_tree: Any = None    # PyTreeDef of the chunk's side sums (None: it returns y alone)

    @property
    def n_side(self) -> int:
        return 0 if self.side_tree is None else self.side_tree.num_leaves

    @property
    def saved_avals(self) -> list:
        """Shapes and dtypes of what an F stashes (one microbatch)."""
        outs = self.fwd.jaxpr.outvars[1 + self.n_side:]
        return [v.aval for v, s in zip(outs, self.is_saved) if s]

    def forward(self, params, x, aux) -> tuple:
        """(y, saved residuals, side sums or None) of one microbatch: the chunk's forward,
        nothing recomputed."""
        y, *res = compat.jaxpr_as_fun(self.fwd)(*jax.tree.leaves(params), x,
                                                *jax.tree.leaves(aux))
        side, res = res[:self.n_side], res[self.n_side:]
        side = None if self.side_tree is None else jax.tree.unflatten(self.side_tree, side)
        return y, [r for r, s in zip(res, self.is_saved) if s], side

    def backward(self, params, saved, dy) -> tuple:
        """(d_params, dx): the stashed pullback, with the parameter-only residuals recomputed."""
        derived = iter(compat.jaxpr_as_fun(self.derived)(*jax.tree.leaves(params)))
        saved = iter(saved)
        leaves = [next(saved) if s else next(derived) for s in self.is_saved]
        return jax.tree_util.tree_unflatten(self.vjp_tree, leaves)(dy)


def chunk_program(chunk: Callable, params, x, aux, side: bool = False) -> ChunkProgram:
    """Trace `chunk(params, x, aux) -> y` (`side`: -> (y, side sums), a pytree of scalars
    that is not differentiated) with these (example) values' shapes."""
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

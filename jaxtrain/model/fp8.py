"""FP8 as one converter: `Fp8Converter` (torchtitan's model converter, in JAX terms).

It owns everything FP8 adds to a bf16 run: which projections run in FP8 (the middle layers'
q/k/v/o and gate/up/down, `layer_spans`), their meta state (one `Fp8Meta` per projection,
stacked with the layers: the train state's `fp8_meta`), the one rule that combines amax
observations from microbatches, pipeline stages, data replicas and context ranks, and the
update that turns a step's observations into the next step's metas. The model, both executors
and the train step ask it; none of them branches on whether FP8 is on. Off, the converter has
no recipe, the meta state is an empty tree ({}) and every method is a bf16 run's identity (a
tree map over an empty tree does nothing).

Observations. fp8_matmul's custom VJP returns each matmul's amaxes as the cotangent of its
meta, per role a use count (in `scale`) and the summed amax (in `amax_history[0]`), so the sums
JAX makes when a meta is used more than once stay decodable (`_decode` divides one by the
other: exact for repeated identical uses such as remat, robust to scaling the whole gradient,
the mean for different data; TE records the max there, so the model gives every matmul its own
meta). Everything else is combined by one rule, `_max_over`: the max over the observations
that saw their op (TE's amax reduction), skipping NaN as fmaxf does, re-encoded with count 1.

Cotangent trees. The pipeline differentiates a chunk's layers and their metas together, so its
cotangents hold gradients and observations side by side: `add_at` and `reduce` sum the one and
max-combine the other (with FP8 off: plain sums).

Metas may carry leading dims (layers today; experts for a mixture-of-experts layer): every
function here maps over `Fp8Meta` leaves whatever their leading dims, and `new_meta` takes the
batch shape, so per-expert metas are combined and updated per expert.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config import Fp8Config
from jaxtrain.model.fp8_matmul import (CastKernel, Fp8Error, Fp8Meta, Recipe, TensorMeta,
                                       amax_and_scale_update, cast_kernel, fp8_dot_general,
                                       fp8_max, init_meta, is_fp8_meta, recipe_of)


class Fp8MetaState(nnx.Variable):
    """An `Fp8Meta` (scales, amax histories) in a model: train state outside `params`, never
    optimised, replaced each step by `Fp8Converter.update`."""


@dataclasses.dataclass(frozen=True)
class Fp8Converter:
    """FP8 for a model: `of(cfg.fp8)`; the default (no recipe) is FP8 off. Hashable: it lives
    in the model's ops, hence in the graph definition."""
    recipe: Optional[Recipe] = None
    bf16_first: int = 0       # layers kept in the compute dtype at the start and the end
    bf16_last: int = 0

    @classmethod
    def of(cls, cfg: Fp8Config) -> "Fp8Converter":
        """The converter of fp8.* (config_check.check_fp8_layout holds it to the model dims,
        the tensor split and the remat grouping)."""
        if not cfg.enabled:
            return cls()
        return cls(recipe_of(cfg), cfg.bf16_first_layers, cfg.bf16_last_layers)

    # --------------------------------------------------------------- which projections

    def layer_spans(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """[(start, stop, runs_fp8)]: the static layer ranges the stack runs as (one scan each,
        so every scan body is one fixed kind of layer)."""
        if self.recipe is None:
            return [(0, num_layers, False)]
        first, last = self.bf16_first, num_layers - self.bf16_last
        spans = [(0, first, False), (first, last, True), (last, num_layers, False)]
        return [s for s in spans if s[1] > s[0]]

    def refuse(self, message: str) -> None:
        """Fp8Error(message) when FP8 is on: for a part of the model with no FP8 path yet."""
        if self.recipe is not None:
            raise Fp8Error(message)

    def layer_kinds(self) -> tuple[bool, ...]:
        """The kinds of layer a model may run (`fp8` flags): compute dtype, and FP8 when on."""
        return (False,) if self.recipe is None else (False, True)

    def new_meta(self, batch_shape: tuple[int, ...] = ()) -> Optional[Fp8MetaState]:
        """The meta variable a projection owns (leading `batch_shape`, e.g. experts), or None
        when FP8 is off (the projection then has no FP8 state at all)."""
        if self.recipe is None:
            return None
        return Fp8MetaState(init_meta(self.recipe, batch_shape))

    @staticmethod
    def meta_value(variable: Optional[Fp8MetaState]) -> Optional[Fp8Meta]:
        """A projection's meta as arrays (what `project` takes), None without one."""
        return None if variable is None else variable.get_value()

    def project(self, x, w, dims, meta: Optional[Fp8Meta], *, fp8: bool,
                dot_general: Callable, name: str, gather: Optional[Callable] = None,
                cast: Optional[CastKernel] = None) -> jax.Array:
        """A projection's matmul: in FP8 when `fp8` (x the E4M3 activation, w the E4M3 kernel,
        gradients E5M2), else the model's `dot_general`. `gather(w)`: the kernel as the GEMM
        reads it (FSDP's all-gather, `Ops.gather_weight`), applied to the FP8-cast kernel;
        `cast`: the kernel already cast (`cast_kernel`), else cast here."""
        if not fp8:
            return dot_general(x, w, dims)
        if self.recipe is None or meta is None:
            raise Fp8Error(f"{name}: fp8=True but the model was built without FP8 (no FP8 "
                           "meta); set fp8.enabled=true")
        return fp8_dot_general(x, w, dims, meta=meta, cfg=self.recipe, name=name,
                               gather_rhs=gather, cast=cast)

    def cast_kernel(self, w, meta: Optional[Fp8Meta], *, fp8: bool) -> Optional[CastKernel]:
        """The kernel of an FP8 projection cast to FP8 on its shard (fp8_matmul.cast_kernel),
        None for a compute-dtype one: for a caller whose backward re-traces the projection, so
        the re-trace reads the same FP8 kernel (and the same gather) as the forward."""
        if not fp8 or self.recipe is None or meta is None:
            return None
        return cast_kernel(w, meta, self.recipe)

    # --------------------------------------------------------------- the meta state

    @staticmethod
    def split(model: nnx.Module):
        """(graphdef, params, metas) of a model as nnx.States: what optax trains and what this
        converter replaces each step (metas: an empty State with FP8 off)."""
        return nnx.split(model, nnx.Param, Fp8MetaState)

    def fresh(self, abstract_metas: Any) -> Any:
        """Fresh metas (scale 1, empty histories) in the layout of `abstract_metas` (a pure
        dict of Fp8Metas, arrays or ShapeDtypeStructs)."""
        return jax.tree.map(lambda m: init_meta(self.recipe, m.x.scale.shape), abstract_metas,
                            is_leaf=is_fp8_meta)

    def for_run(self, metas: Optional[Any], abstract_metas: Any) -> tuple[Any, bool]:
        """(metas to bind, whether FP8 layers run in FP8): the given metas, or, when None (an
        evaluation without the train state's scales), fresh ones and every layer unscaled."""
        if metas is None:
            return self.fresh(abstract_metas), False
        return metas, True

    # --------------------------------------------------------------- the one combine rule

    @staticmethod
    def combine(a: Any, b: Any) -> Any:
        """Two observation trees (e.g. of two microbatches) max-combined."""
        return combine_meta_grads(a, b)

    @staticmethod
    def add_at(acc: Any, j, d: Any) -> Any:
        """acc[j] += d for a cotangent tree (gradients add in place, observations combine at
        j): the pipeline's accumulation over a rank's B ops."""
        def one(a, x):
            if is_fp8_meta(a):
                new = combine_meta_grads(jax.tree.map(lambda t: t[j], a), x)
                return jax.tree.map(lambda t, n: t.at[j].set(n), a, new)
            return a.at[j].add(x.astype(a.dtype))
        return jax.tree.map(one, acc, d, is_leaf=is_fp8_meta)

    @staticmethod
    def reduce(tree: Any, axis: int) -> Any:
        """A cotangent tree stacked along `axis` (per data or context replica) reduced over it:
        gradients summed, observations max-combined."""
        tree = max_meta_grads(tree, axis)
        return jax.tree.map(lambda a: a if is_fp8_meta(a) else jnp.sum(a, axis=axis), tree,
                            is_leaf=is_fp8_meta)

    # --------------------------------------------------------------- after the step

    def update(self, metas: Any, observations: Any) -> Any:
        """The next step's metas from this step's combined observations (replaced, never
        optimised)."""
        return apply_meta_update(metas, observations, self.recipe)


# ----------------------------------------------------------------------------- observations

def _decode(obs: TensorMeta):
    """(amax, used) from an observation that JAX may have summed or the trainer rescaled; a
    NaN amax counts as 0 (fmaxf)."""
    count = obs.scale
    amax = obs.amax_history[..., 0] / jnp.where(count > 0, count, 1.0)
    return jnp.where(jnp.isnan(amax), 0.0, amax), count > 0


def _encode(amax, used, length) -> TensorMeta:
    used_f = used.astype(jnp.float32)
    history = jnp.zeros((*jnp.shape(amax), length), jnp.float32)
    return TensorMeta(used_f, jnp.zeros_like(used_f),
                      history.at[..., 0].set(jnp.where(used, amax, 0.0)))


def _max_over(role: TensorMeta, axis: int) -> TensorMeta:
    """The one combine rule: observations stacked along `axis` -> their max over those that saw
    their op (TE's amax reduction), one count."""
    amax, used = _decode(role)
    amax = jnp.max(jnp.where(used, amax, 0.0), axis=axis)
    return _encode(amax, jnp.any(used, axis=axis), role.amax_history.shape[-1])


def _per_role(fn, meta: Fp8Meta) -> Fp8Meta:
    return Fp8Meta(fn(meta.x), fn(meta.w), fn(meta.g))


def combine_meta_grads(a: Any, b: Any) -> Any:
    """Max-combine two trees of observations (e.g. of two microbatches)."""
    def per_meta(ma, mb):
        stacked = jax.tree.map(lambda u, v: jnp.stack([u, v]), ma, mb)
        return _per_role(lambda role: _max_over(role, 0), stacked)
    return jax.tree.map(per_meta, a, b, is_leaf=is_fp8_meta)


def max_meta_grads(meta_grad: Any, axis: int = 0) -> Any:
    """Max-reduce observations stacked along `axis` (e.g. per data replica): TE's amax
    all-reduce. Metas in `meta_grad` lose that axis; other leaves are returned unchanged."""
    return jax.tree.map(lambda m: _per_role(lambda role: _max_over(role, axis), m)
                        if is_fp8_meta(m) else m, meta_grad, is_leaf=is_fp8_meta)


def _update_role(old: TensorMeta, obs: TensorMeta, q_dtype, recipe: Recipe) -> TensorMeta:
    amax, used = _decode(obs)
    # Slot 0 is the accumulator; fmax, as TE's fmaxf, never lets a NaN in.
    history = old.amax_history.at[..., 0].set(jnp.fmax(old.amax_history[..., 0], amax))
    new_history, new_scale = amax_and_scale_update(history, old.scale, fp8_max(q_dtype),
                                                   recipe.margin, recipe.algo)
    return TensorMeta(jnp.where(used, new_scale, old.scale),
                      jnp.where(used, 1.0 / new_scale, old.scale_inv),
                      jnp.where(used[..., None], new_history, old.amax_history))


def apply_meta_update(old: Any, meta_grad: Any, cfg: Fp8Config | Recipe | None) -> Any:
    """The next step's metas from this step's observations.

    Works on a single Fp8Meta or any pytree holding them (other leaves are returned from `old`
    unchanged); layer-stacked metas are fine. A meta whose op did not run keeps its state.
    """
    def update(o, g):
        if not is_fp8_meta(o):
            return o
        recipe = recipe_of(cfg)
        return Fp8Meta(_update_role(o.x, g.x, recipe.fwd_dtype, recipe),
                       _update_role(o.w, g.w, recipe.fwd_dtype, recipe),
                       _update_role(o.g, g.g, recipe.bwd_dtype, recipe))
    return jax.tree.map(update, old, meta_grad, is_leaf=is_fp8_meta)

"""The FP8 matmul: dot_general with Transformer Engine's delayed scaling (and current scaling).

Scale convention (TE's): `fp8 = clip(x * scale, +-fp8_max)`, `x ~ fp8 * scale_inv`. Each matmul
owns an `Fp8Meta`: one `TensorMeta` (scale, scale_inv, amax_history) per tensor role, input `x`,
kernel `w` and output gradient `g`. Slot 0 of a history accumulates the current step's amax;
`amax_and_scale_update` is TE's `delayed_scaling.cu` kernel (window max ignoring NaN or the most
recent amax, keep the old scale on a zero/non-finite amax, clamp an infinite scale to FLT_MAX, then
roll: new[i] = old[i+1], new[L-1] = old[0], new[0] = 0). A step quantizes with the scale computed
at the end of the previous step (the one-step delay of delayed scaling).

An amax is TE's: max |x| reduced from 0 with fmaxf, so NaN entries are skipped (an all-NaN or
empty tensor records 0) and an inf is recorded (its window then keeps the old scale). Current
scaling is TE's too: the scale comes from the tensor's own amax, 1 when that amax is 0 or inf,
and no margin (`margin > 0` with `recipe=current` is refused).

The amaxes are observed inside the matmul, the output-gradient one only in the backward pass, so
they leave through the cotangent of `meta` (flax's "overwrite with gradient" pattern). That
cotangent is an *observation*, not a new meta, so that sums JAX makes when a meta is used more
than once stay decodable: per role `scale` holds a use count and `amax_history[0]` the summed
amax (`_observation`). Decoding them, combining them and turning them into the next step's
metas is jaxtrain.model.fp8's (the converter's).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.compat import varying_axes
from jaxtrain.config import FP8_ALIGN, ConfigError, Fp8Config, check_fp8

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FLT_MAX = float(np.finfo(np.float32).max)


class Fp8Error(ValueError):
    """An FP8 matmul that cannot run as asked (shapes, meta layout)."""


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


@flax.struct.dataclass
class TensorMeta:
    """Delayed-scaling state of one tensor role; leaves may carry leading (e.g. layer) dims."""
    scale: jax.Array         # f32[...]
    scale_inv: jax.Array     # f32[...]
    amax_history: jax.Array  # f32[..., L]


@flax.struct.dataclass
class Fp8Meta:
    """The three TensorMetas one fp8 matmul owns: input x, kernel w, output gradient g."""
    x: TensorMeta
    w: TensorMeta
    g: TensorMeta


def is_fp8_meta(node: Any) -> bool:
    return isinstance(node, Fp8Meta)


class Recipe(NamedTuple):
    """Fp8Config, validated and hashable (a static argument of the custom_vjp)."""
    current: bool
    fwd_dtype: Any
    bwd_dtype: Any
    margin: int
    algo: str
    history_len: int


def recipe_of(cfg: Fp8Config | Recipe) -> Recipe:
    """The validated, hashable form of an Fp8Config (a Recipe is returned as is)."""
    if isinstance(cfg, Recipe):
        return cfg
    check_fp8(cfg)  # the config's own rules, also for configs built without validate()
    bwd = E5M2 if cfg.format == "hybrid" else E4M3
    return Recipe(cfg.recipe == "current", E4M3, bwd, int(cfg.margin), cfg.amax_compute_algo,
                  int(cfg.amax_history_len))


def init_meta(cfg: Fp8Config | Recipe, batch_shape: tuple[int, ...] = ()) -> Fp8Meta:
    """Scale 1 and an empty history per role; `batch_shape` prepends e.g. a layer dim."""
    length = recipe_of(cfg).history_len

    def role():
        return TensorMeta(jnp.ones(batch_shape, jnp.float32), jnp.ones(batch_shape, jnp.float32),
                          jnp.zeros((*batch_shape, length), jnp.float32))
    return Fp8Meta(role(), role(), role())


# ----------------------------------------------------------------------------- scale math

def compute_scale(amax, scale, fp8_max_value: float, margin: int = 0) -> jax.Array:
    """TE: fp8_max / 2**margin / amax if amax is finite and > 0, else the old scale; no inf."""
    amax = jnp.asarray(amax, jnp.float32)
    scale = jnp.asarray(scale, jnp.float32)
    scaled_max = jnp.float32(fp8_max_value * 2.0 ** -margin)
    ok = jnp.isfinite(amax) & (amax > 0)
    new = jnp.where(ok, scaled_max / jnp.where(ok, amax, 1.0), scale)
    # A tiny amax overflows the scale; TE clamps it so scale_inv stays non-zero and no NaN appears.
    return jnp.where(jnp.isinf(new), jnp.float32(FLT_MAX), new)


def amax_and_scale_update(amax_history, scale, fp8_max_value: float, margin: int = 0,
                          algo: str = "max") -> tuple[jax.Array, jax.Array]:
    """TE's amax_and_scale_update on f32[..., L] histories whose slot 0 holds this step's amax.

    Returns (rolled history with slot 0 reset, scale for the next step).
    """
    history = jnp.asarray(amax_history, jnp.float32)
    if algo == "max":
        # The kernel reduces with fmaxf from 0, which skips NaN entries.
        amax = jnp.max(jnp.where(jnp.isnan(history), 0.0, history), axis=-1)
        amax = jnp.maximum(amax, 0.0)
    elif algo == "most_recent":
        amax = history[..., 0]
    else:
        raise ConfigError(f"fp8.amax_compute_algo={algo!r} is unknown; choose max or most_recent")
    new_scale = compute_scale(amax, scale, fp8_max_value, margin)
    new_history = jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0)
    return new_history, new_scale


def quantize(x, scale, q_dtype) -> jax.Array:
    """clip(x * scale, +-fp8_max) cast to `q_dtype`, computed in f32 as TE does."""
    limit = fp8_max(q_dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -limit, limit).astype(q_dtype)


def _amax(x) -> jax.Array:
    """max |x| as TE's cast kernels reduce it: fmaxf from 0, so NaN entries are skipped and an
    empty or all-NaN tensor gives 0 (jnp.max would make one NaN the whole tensor's amax)."""
    a = jnp.abs(x)  # abs and max are exact in any float dtype: reduce before the f32 cast
    return jnp.max(jnp.where(jnp.isnan(a), jnp.zeros((), a.dtype), a), initial=0).astype(
        jnp.float32)


# ----------------------------------------------------------------------------- the GEMMs

def _scaled_dot(a, b, dimension_numbers, scales, out_dtype):
    """scale_a * scale_b * dot(a, b) written in `out_dtype`, rounded once from an fp32 product
    as Transformer Engine's GEMM does (fp32 accumulation, an fp32 alpha, one rounding).

    On a GPU the operands are dequantized (`q * scale`) in `out_dtype`: XLA's GEMM rewriter
    takes that pattern into one `__cublas$lt$matmul$f8` with the scales as its fp32 a/b-scale
    operands, writing `out_dtype` (no fp32 result buffer, no cast kernel: 592 vs 1040 MiB of
    temporaries for a 4096x8192x28672 projection's forward and backward, compiled for an H100;
    the bf16-scaled form before held 480, XLA now quantizes the weight into both of its layouts
    in one fusion). The barrier keeps
    each scale's cast to `out_dtype` next to the rewriter's cast back to fp32, where XLA drops
    the pair (excess precision): without it the scale reached the GEMM rounded to bf16 in the
    layer loop, and the row-parallel GEMMs' scale was applied after their all-reduce. The
    GPU-compile test reads it in the H100 program. Elsewhere (XLA:CPU) the formula itself:
    the fp32 dot times the fp32 scale product, cast once."""
    def dequantized(a, b, scale_a, scale_b):
        def dq(q, scale):
            return q.astype(out_dtype) * jax.lax.optimization_barrier(scale).astype(out_dtype)
        return jax.lax.dot_general(dq(a, scale_a), dq(b, scale_b), dimension_numbers,
                                   preferred_element_type=out_dtype)

    def formula(a, b, scale_a, scale_b):
        acc = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)
        return (acc * (scale_a * scale_b)).astype(out_dtype)
    return jax.lax.platform_dependent(a, b, *scales, cuda=dequantized, default=formula)


def _free_dims(ndim, contracting, batch):
    return [i for i in range(ndim) if i not in contracting and i not in batch]


def _transpose_lhs(g, rhs, lhs_ndim, dimension_numbers, scales, out_dtype):
    """scales' product * (d lhs of dot_general(lhs, rhs) given output cotangent g), in
    `out_dtype`; `scales`: (g's, rhs's)."""
    (lc, rc), (lb, rb) = dimension_numbers
    l_free = _free_dims(lhs_ndim, lc, lb)
    r_free = _free_dims(rhs.ndim, rc, rb)
    nb, nl = len(lb), len(l_free)
    g_r = tuple(range(nb + nl, g.ndim))
    raw = _scaled_dot(g, rhs, ((g_r, tuple(r_free)), (tuple(range(nb)), tuple(rb))), scales,
                      out_dtype)
    # raw dims: batch, lhs free, then rhs contracting dims in ascending rhs order.
    src = list(lb) + l_free + [lc[k] for k in np.argsort(rc)]
    return jax.lax.transpose(raw, tuple(int(i) for i in np.argsort(src)))


def _transpose_rhs(g, lhs, rhs_ndim, dimension_numbers, scales, out_dtype):
    """scales' product * (d rhs of dot_general(lhs, rhs) given output cotangent g), in
    `out_dtype`; `scales`: (lhs's, g's)."""
    (lc, rc), (lb, rb) = dimension_numbers
    l_free = _free_dims(lhs.ndim, lc, lb)
    r_free = _free_dims(rhs_ndim, rc, rb)
    nb, nl = len(lb), len(l_free)
    g_l = tuple(range(nb, nb + nl))
    # lhs first: for a kernel laid out (contracting, free), as every Dense is, the GEMM writes
    # dw in the kernel's own layout and XLA fuses the scale (g first left a transposed output
    # and a separate multiply kernel on the GPU).
    raw = _scaled_dot(lhs, g, ((tuple(l_free), g_l), (tuple(lb), tuple(range(nb)))), scales,
                      out_dtype)
    # raw dims: batch, lhs contracting dims in ascending lhs order, then rhs free.
    src = list(rb) + [rc[k] for k in np.argsort(lc)] + r_free
    return jax.lax.transpose(raw, tuple(int(i) for i in np.argsort(src)))


# ----------------------------------------------------------------------------- the matmul

class _Static(NamedTuple):
    dimension_numbers: tuple
    recipe: Recipe
    out_dtype: Any
    lhs_dtype: Any
    rhs_dtype: Any
    lhs_varying: frozenset  # manual (shard_map) axes the operands vary over: their gradients'
    rhs_varying: frozenset
    gather_rhs: Any         # the FP8 kernel as the GEMMs read it (FSDP's gather), or None


def _step_scale(recipe: Recipe, amax, role: TensorMeta, q_dtype):
    """(scale, scale_inv) this step: the stored ones, or from the tensor itself (current: TE's
    compute_scale_from_amax, which falls back to 1, not to a stored scale, and has no margin)."""
    if recipe.current:
        scale = compute_scale(amax, jnp.ones((), jnp.float32), fp8_max(q_dtype))
        return scale, 1.0 / scale
    return role.scale, role.scale_inv


def _observation(amax, length) -> TensorMeta:
    return TensorMeta(scale=jnp.ones((), jnp.float32), scale_inv=jnp.zeros((), jnp.float32),
                      amax_history=jnp.zeros((length,), jnp.float32).at[0].set(amax))


class CastKernel(NamedTuple):
    """A kernel cast to FP8 (`cast_kernel`): E4M3 values in the kernel's own (FSDP-sharded)
    layout, the scale_inv that reads them and the kernel's amax this step."""
    q: jax.Array
    scale_inv: jax.Array
    amax: jax.Array


def cast_kernel(rhs, meta: Fp8Meta, cfg: Fp8Config | Recipe) -> CastKernel:
    """The kernel cast to FP8 where it lives: under FSDP on the rank's shard, with the delayed
    scale (known before the step, so the cast needs no gather; current scaling takes the amax
    first). The amax is the shard's max reduced over fsdp by the partitioner: exact. Constant
    to autodiff: the kernel's gradient is the FP8 matmul's (its VJP returns dW for `rhs`)."""
    r = recipe_of(cfg)
    amax = _amax(rhs)
    role = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), meta.w)
    scale, scale_inv = _step_scale(r, amax, role, r.fwd_dtype)
    return jax.lax.stop_gradient(CastKernel(quantize(rhs, scale, r.fwd_dtype), scale_inv, amax))


def _fp8_fwd(st: _Static, lhs, rhs, meta: Fp8Meta, cast: CastKernel):
    del rhs  # cast already holds it in FP8; rhs is there for its gradient
    r = st.recipe
    amax_x = _amax(lhs)
    sx, inv_x = _step_scale(r, amax_x, meta.x, r.fwd_dtype)
    qx = quantize(lhs, sx, r.fwd_dtype)
    qw, inv_w, amax_w = cast
    out = _scaled_dot(qx, _gathered(st, qw), st.dimension_numbers, (inv_x, inv_w), st.out_dtype)
    res = (qx, qw, inv_x, inv_w, meta, amax_x, amax_w)
    return out, res


def _gathered(st: _Static, qw):
    """The FP8 kernel as the GEMMs read it: `gather_rhs` (FSDP's all-gather, of FP8 bytes) of
    the cast shard. The residual is the shard; the backward gathers it with the same
    constraint, which the partitioner shares with the recompute's gather of the same value
    (one gather for the recompute and the backward under remat; without remat the gathered
    kernel is not kept from the forward to the backward, as for a bf16 weight)."""
    return qw if st.gather_rhs is None else st.gather_rhs(qw)


def _fp8_bwd(st: _Static, res, g):
    r = st.recipe
    qx, qw, inv_x, inv_w, meta, amax_x, amax_w = res
    amax_g = _amax(g)
    sg, inv_g = _step_scale(r, amax_g, meta.g, r.bwd_dtype)
    qg = quantize(g, sg, r.bwd_dtype)
    dx = _transpose_lhs(qg, _gathered(st, qw), qx.ndim, st.dimension_numbers, (inv_g, inv_w),
                        st.lhs_dtype)
    dw = _transpose_rhs(qg, qx, qw.ndim, st.dimension_numbers, (inv_x, inv_g), st.rhs_dtype)
    length = meta.g.amax_history.shape[-1]
    meta_ct = Fp8Meta(_observation(amax_x, length), _observation(amax_w, length),
                      _observation(amax_g, length))
    meta_ct = jax.tree.map(lambda ct, m: _match_manual_axes(ct, varying_axes(m), jax.lax.pmax),
                           meta_ct, meta)
    return (_match_manual_axes(dx, st.lhs_varying, jax.lax.psum),
            _match_manual_axes(dw, st.rhs_varying, jax.lax.psum), meta_ct, None)


def _match_manual_axes(ct, primal_varying: frozenset, reduce):
    """Inside shard_map a cotangent must vary over exactly the manual axes its primal varies
    over. Over axes only the cotangent varies over it is reduced: gradients are psum'd, as
    autodiff transposes the implicit broadcast of an operand that is the same on every device
    (a replicated weight); observations are pmax'd (TE's amax all-reduce; one count per
    observation, so the max keeps the encoding). Over the others it is marked varying."""
    extra = varying_axes(ct) - primal_varying
    missing = primal_varying - varying_axes(ct)
    if extra:
        ct = reduce(ct, tuple(sorted(extra)))
    return jax.lax.pcast(ct, tuple(sorted(missing)), to="varying") if missing else ct


_fp8_dot = jax.custom_vjp(
    lambda st, lhs, rhs, meta, cast: _fp8_fwd(st, lhs, rhs, meta, cast)[0], nondiff_argnums=(0,))
_fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


def _normalize_dimension_numbers(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
            (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))


def _check(lhs, rhs, dimension_numbers, meta, name):
    if not is_fp8_meta(meta):
        raise Fp8Error(f"{name}: meta must be an fp8.Fp8Meta, got {type(meta).__name__}")
    for role_name in ("x", "w", "g"):
        role = getattr(meta, role_name)
        if np.shape(role.scale) != () or np.ndim(role.amax_history) != 1:
            raise Fp8Error(
                f"{name}: meta.{role_name} has scale shape {np.shape(role.scale)} and history "
                f"shape {np.shape(role.amax_history)}; pass one matmul's meta (scalar scale, [L] "
                "history): slice a layer-stacked meta, e.g. by scanning over it")
    for arr, which in ((lhs, "lhs"), (rhs, "rhs")):
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise Fp8Error(f"{name}: {which} dtype {arr.dtype} is not floating point")
    (lc, rc), (lb, rb) = dimension_numbers
    k = math.prod(lhs.shape[i] for i in lc)
    n = math.prod(rhs.shape[i] for i in _free_dims(rhs.ndim, rc, rb))
    if k % FP8_ALIGN or n % FP8_ALIGN:
        raise Fp8Error(
            f"{name}: an fp8 matmul needs the contracting size (K={k}) and the output feature size "
            f"(N={n}) to be multiples of {FP8_ALIGN} (FP8 GEMM alignment); change the model "
            "dimension or keep this layer in bf16")


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None, *, meta: Fp8Meta, cfg: Fp8Config | Recipe,
                    name: str = "fp8_dot_general", gather_rhs=None,
                    cast: CastKernel | None = None) -> jax.Array:
    """lax.dot_general in FP8: E4M3 x E4M3 forward, E5M2 (hybrid) x E4M3 gradients.

    `lhs` is the activation (role x), `rhs` the kernel (role w). With `meta`, `cfg` and `name`
    bound (functools.partial) it is a drop-in `dot_general` for flax's Dense/DenseGeneral; not
    for jnp.einsum, which may swap the operands. `precision` is ignored (FP8 GEMMs have one);
    the output dtype is `preferred_element_type` or the inputs' result type. The cotangent for
    `meta` is this step's amax observation: the FP8 converter's (fp8.py) to combine and turn into
    the next metas, never optax's. `gather_rhs(q)`, when given, takes the kernel cast to FP8
    on its own (FSDP) shard to the layout the GEMMs read (a sharding constraint: the FSDP
    all-gather, then of FP8 bytes); it must not change values. `cast`: the kernel already
    cast (`cast_kernel(rhs, meta, cfg)`), for a caller that re-traces the matmul in its own
    backward and must read the same FP8 kernel (one gather, not a second cast and gather).
    """
    del precision
    if out_sharding is not None:
        raise Fp8Error(f"{name}: fp8_dot_general does not take out_sharding; constrain the "
                       "output's sharding after the call instead")
    recipe = recipe_of(cfg)
    dimension_numbers = _normalize_dimension_numbers(dimension_numbers)
    _check(lhs, rhs, dimension_numbers, meta, name)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    st = _Static(dimension_numbers, recipe, out_dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                 varying_axes(lhs), varying_axes(rhs), gather_rhs)
    meta = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), meta)
    cast = cast_kernel(rhs, meta, recipe) if cast is None else cast
    return _fp8_dot(st, lhs, rhs, meta, cast)

"""The experts' grouped GEMM in FP8, with per-expert delayed scaling.

`fp8_grouped_dot(x_ND, w_EKF, group_sizes_E, meta)` is `grouped_dot` (rows of x sorted by
expert, expert e's rows times w[e]) with the dense FP8 path's formulas (fp8_matmul.py) applied
per expert: `meta` is an `Fp8Meta` whose leaves carry a leading [E] (one scale and amax history
per expert for the input x, the weight w and the output gradient g), expert e's rows are
quantized with expert e's scale, and the amaxes observed are per expert, from that expert's
routed rows only (rows past the group sizes, e.g. the padding of expert parallelism's receive
buffer or dropped assignments, are never observed). The observations leave through the
cotangent of `meta` in fp8_matmul's encoding (count in `scale`, amax in `amax_history[0]`),
so fp8.py's converter combines and updates them per expert unchanged.

An expert with no routed rows observes amax 0 for x and g (an empty tensor's amax, as
fp8_matmul records it): its history rolls with the others' and its scale comes from the rest
of its window, kept when that window is all zero (TE's compute_scale keeps the old scale on a
zero amax). Its w is observed as always.

The product itself is the injected `grouped_dot` (lax.ragged_dot on CPU, the Mosaic grouped
GEMM on GPU) run on the FP8-rounded values cast to the compute dtype (exact: E4M3 and E5M2
values are bf16 values), then scaled per row by its expert's scale_inv product; the backward
is the same grouped product's VJP (dX per row group, dW per expert) on the quantized
gradient. So the rounding is FP8's and the arithmetic is the compute dtype's: no FP8 tensor
core runs (neither lax.ragged_dot nor the Mosaic kernel has an FP8 form here).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import FP8_ALIGN
from jaxtrain.model.fp8_matmul import (Fp8Error, Fp8Meta, Recipe, TensorMeta, compute_scale,
                                       fp8_max, is_fp8_meta, quantize)

F32 = jnp.float32


class _Static(NamedTuple):
    recipe: Recipe
    grouped_dot: Callable   # (lhs_ND, rhs_EKF, group_sizes_E) -> [N, F], differentiable
    out_dtype: Any
    lhs_dtype: Any
    rhs_dtype: Any


def row_groups(group_sizes_E, rows: int):
    """([N] int32 expert of each row, clipped to E-1; [N] bool whether the row is routed)."""
    ends_E = jnp.cumsum(group_sizes_E)
    group_N = jnp.searchsorted(ends_E, jnp.arange(rows, dtype=ends_E.dtype), side="right")
    return jnp.minimum(group_N, group_sizes_E.shape[0] - 1).astype(jnp.int32), \
        jnp.arange(rows) < ends_E[-1]


def _row_amax(x_ND):
    a = jnp.abs(x_ND)
    return jnp.max(jnp.where(jnp.isnan(a), jnp.zeros((), a.dtype), a), axis=-1,
                   initial=0).astype(F32)


def per_expert_amax(x_ND, group_N, routed_N, num_experts: int):
    """[E] fp32: max |x| over each expert's routed rows (fmaxf from 0: NaN skipped, empty 0)."""
    amax_N = jnp.where(routed_N, _row_amax(x_ND), 0.0)
    onehot_NE = jax.nn.one_hot(group_N, num_experts, dtype=jnp.bool_) & routed_N[:, None]
    return jnp.max(jnp.where(onehot_NE, amax_N[:, None], 0.0), axis=0, initial=0.0)


def _expert_amax(w_EKF):
    a = jnp.abs(w_EKF)
    return jnp.max(jnp.where(jnp.isnan(a), jnp.zeros((), a.dtype), a), axis=(1, 2),
                   initial=0).astype(F32)


def _step_scale(recipe: Recipe, amax_E, role: TensorMeta, q_dtype):
    if recipe.current:
        scale = compute_scale(amax_E, jnp.ones_like(amax_E), fp8_max(q_dtype))
        return scale, 1.0 / scale
    return role.scale, role.scale_inv


def _observation(amax_E, length: int) -> TensorMeta:
    return TensorMeta(jnp.ones_like(amax_E), jnp.zeros_like(amax_E),
                      jnp.zeros((*amax_E.shape, length), F32).at[..., 0].set(amax_E))


def _operand(q, dtype):
    """An FP8 operand cast to the compute dtype for the grouped GEMM. The barrier keeps the
    FP8 rounding: XLA:GPU drops a convert pair through a narrower float (excess precision),
    which without it turned quantize-then-cast into no rounding at all on the H100 program."""
    return jax.lax.optimization_barrier(q).astype(dtype)


def _fwd(st: _Static, x_ND, w_EKF, sizes_E, meta: Fp8Meta):
    r, e, cd = st.recipe, w_EKF.shape[0], st.out_dtype
    group_N, routed_N = row_groups(sizes_E, x_ND.shape[0])
    amax_x, amax_w = per_expert_amax(x_ND, group_N, routed_N, e), _expert_amax(w_EKF)
    sx, inv_x = _step_scale(r, amax_x, meta.x, r.fwd_dtype)
    sw, inv_w = _step_scale(r, amax_w, meta.w, r.fwd_dtype)
    qx = quantize(x_ND, sx[group_N][:, None], r.fwd_dtype)
    qw = quantize(w_EKF, sw[:, None, None], r.fwd_dtype)
    acc = st.grouped_dot(_operand(qx, cd), _operand(qw, cd), sizes_E)
    out = (acc.astype(F32) * (inv_x * inv_w)[group_N][:, None]).astype(cd)
    return out, (qx, qw, sizes_E, inv_x, inv_w, meta, amax_x, amax_w)


def _bwd(st: _Static, res, g_NF):
    r, cd = st.recipe, st.out_dtype
    qx, qw, sizes_E, inv_x, inv_w, meta, amax_x, amax_w = res
    e = qw.shape[0]
    group_N, routed_N = row_groups(sizes_E, qx.shape[0])
    amax_g = per_expert_amax(g_NF, group_N, routed_N, e)
    sg, inv_g = _step_scale(r, amax_g, meta.g, r.bwd_dtype)
    qg = quantize(g_NF, sg[group_N][:, None], r.bwd_dtype)
    # The grouped product is linear in each operand: its VJP is dX = g·w[e]^T per row group
    # and dW[e] = x_e^T·g_e per expert, the grouped GEMM's own backward kernels.
    _, vjp = jax.vjp(lambda a, b: st.grouped_dot(a, b, sizes_E), _operand(qx, cd),
                     _operand(qw, cd))
    dx_raw, dw_raw = vjp(_operand(qg, cd))
    dx = (dx_raw.astype(F32) * (inv_g * inv_w)[group_N][:, None]).astype(st.lhs_dtype)
    dw = (dw_raw.astype(F32) * (inv_x * inv_g)[:, None, None]).astype(st.rhs_dtype)
    length = meta.g.amax_history.shape[-1]
    meta_ct = Fp8Meta(_observation(amax_x, length), _observation(amax_w, length),
                      _observation(amax_g, length))
    sizes_ct = np.zeros(sizes_E.shape, jax.dtypes.float0)
    return dx, dw, sizes_ct, meta_ct


_grouped = jax.custom_vjp(lambda st, x, w, sizes, meta: _fwd(st, x, w, sizes, meta)[0],
                          nondiff_argnums=(0,))
_grouped.defvjp(_fwd, _bwd)


def _check(x_ND, w_EKF, sizes_E, meta, name: str) -> None:
    if not is_fp8_meta(meta):
        raise Fp8Error(f"{name}: meta must be an fp8.Fp8Meta, got {type(meta).__name__}")
    e = w_EKF.shape[0]
    for role_name in ("x", "w", "g"):
        role = getattr(meta, role_name)
        if np.shape(role.scale) != (e,) or np.ndim(role.amax_history) != 2:
            raise Fp8Error(
                f"{name}: meta.{role_name} has scale shape {np.shape(role.scale)}; a grouped "
                f"FP8 GEMM over {e} experts takes per-expert metas (scale [{e}], history "
                f"[{e}, L]): slice the layer's expert-stacked meta to this rank's experts")
    if sizes_E.shape != (e,):
        raise Fp8Error(f"{name}: group_sizes has shape {sizes_E.shape}, expected ({e},)")
    k, f = w_EKF.shape[1], w_EKF.shape[2]
    if k % FP8_ALIGN or f % FP8_ALIGN:
        raise Fp8Error(
            f"{name}: an fp8 grouped GEMM needs the contracting size (K={k}) and the output "
            f"feature size (N={f}) to be multiples of {FP8_ALIGN} (FP8 GEMM alignment); "
            "change model.hidden_size / model.moe expert mlp size or turn fp8 off")


def fp8_grouped_dot(x_ND, w_EKF, group_sizes_E, *, meta: Fp8Meta, recipe: Recipe,
                    grouped_dot: Callable, name: str = "fp8_grouped_dot") -> jax.Array:
    """The grouped product of `grouped_dot` in FP8 with per-expert delayed (or current)
    scaling: E4M3 x E4M3 forward, `recipe.bwd_dtype` gradients; output in x's dtype. The
    cotangent for `meta` is this step's per-expert amax observation (the converter's)."""
    _check(x_ND, w_EKF, group_sizes_E, meta, name)
    out_dtype = jnp.dtype(jnp.result_type(x_ND.dtype, w_EKF.dtype))
    st = _Static(recipe, grouped_dot, out_dtype, jnp.dtype(x_ND.dtype), jnp.dtype(w_EKF.dtype))
    meta = jax.tree.map(lambda a: jnp.asarray(a, F32), meta)
    return _grouped(st, x_ND, w_EKF, group_sizes_E.astype(jnp.int32), meta)

"""FP8 delayed scaling: TE's scale math, the matmul's numerics and wiring, meta bookkeeping."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax.linen import fp8_ops
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import fp8, fp8_matmul
from jaxtrain.config import ConfigError, Fp8Config

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DN_IN = (((2,), (0,)), ((), ()))         # x_BSD @ w_DHK -> BSHK (q/k/v projections)
DN_OUT = (((2, 3), (0, 1)), ((), ()))    # x_BSHK @ w_HKD -> BSD (attention out projection)


def cfg_of(**kw):
    return Fp8Config(enabled=True, **{"amax_history_len": 4, **kw})


def div32(a, b):
    """a / b rounded as f32 division rounds (the scale math runs in f32)."""
    return float(np.float32(a) / np.float32(b))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Jitted and cached per (config, dimension numbers): compiles dominate this file's run time.
def grads_fn(cfg, dn):
    """jit(grad) of <fp8_dot_general(x, w), dy> w.r.t. x, w and meta."""
    return _grads_fn(dataclasses.astuple(cfg), dn)


@functools.cache
def _grads_fn(cfg_key, dn):
    cfg = Fp8Config(*cfg_key)

    def loss(x, w, meta, dy):
        y = fp8_matmul.fp8_dot_general(x, w, dn, meta=meta, cfg=cfg, name="test")
        return jnp.sum(y.astype(jnp.float32) * dy)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def forward(x, w, dn, meta, cfg):
    return _forward(dataclasses.astuple(cfg), dn)(x, w, meta)


@functools.cache
def _forward(cfg_key, dn):
    cfg = Fp8Config(*cfg_key)
    return jax.jit(lambda x, w, meta: fp8_matmul.fp8_dot_general(x, w, dn, meta=meta, cfg=cfg))


def update(meta, meta_grad, cfg):
    return _update(dataclasses.astuple(cfg))(meta, meta_grad)


@functools.cache
def _update(cfg_key):
    cfg = Fp8Config(*cfg_key)
    return jax.jit(lambda meta, meta_grad: fp8.apply_meta_update(meta, meta_grad, cfg))


def normal(seed, shape, std=1.0, dtype=jnp.float32):
    # numpy, not jax.random: one threefry compile per shape would dominate this file's time.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * std, dtype)


# ----------------------------------------------------------------------------- scale math

@pytest.mark.parametrize("bad", [0.0, np.inf, -np.inf, np.nan])
def test_bad_amax_keeps_old_scale(bad):
    assert float(fp8_matmul.compute_scale(bad, 3.5, E4M3_MAX)) == 3.5
    hist = jnp.array([bad, 0.0, 0.0, 0.0])
    for algo in ("max", "most_recent"):
        _, scale = fp8_matmul.amax_and_scale_update(hist, 3.5, E4M3_MAX, 0, algo)
        assert float(scale) == 3.5, algo


@pytest.mark.parametrize("tiny", [1e-37, 1e-38, 1e-45])
def test_tiny_amax_gives_finite_scale_and_no_nan(tiny):
    scale = fp8_matmul.compute_scale(np.float32(tiny), 1.0, E4M3_MAX)
    assert np.isfinite(float(scale)) and float(scale) > 0
    x = jnp.full((16,), tiny, jnp.float32)
    q = fp8_matmul.quantize(x, scale, jnp.float8_e4m3fn)
    back = q.astype(jnp.float32) * (1.0 / scale)
    assert not np.isnan(np.asarray(back)).any()


def test_overflowing_scale_is_clamped_to_flt_max():
    # 448 / 1e-37 overflows f32 (1e-38 and below are denormals that XLA CPU flushes to 0).
    assert float(fp8_matmul.compute_scale(np.float32(1e-37), 1.0, E4M3_MAX)) == fp8_matmul.FLT_MAX


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_divides_by_power_of_two(margin):
    scale = fp8_matmul.compute_scale(2.0, 1.0, E4M3_MAX, margin)
    assert float(scale) == E4M3_MAX / 2.0 / 2 ** margin


def test_history_roll_and_window_follow_te_kernel():
    old = jnp.array([5.0, 1.0, 2.0, 3.0])  # slot 0: this step's amax
    new, scale = fp8_matmul.amax_and_scale_update(old, 1.0, E4M3_MAX, 0, "max")
    np.testing.assert_array_equal(new, [0.0, 2.0, 3.0, 5.0])  # new[i]=old[i+1], new[L-1]=old[0]
    assert float(scale) == div32(E4M3_MAX, 5.0)
    # The window is the last L amaxes: after L more empty steps everything has rolled out.
    hist = new
    for _ in range(3):
        hist = hist.at[0].set(0.5)
        hist, scale = fp8_matmul.amax_and_scale_update(hist, scale, E4M3_MAX)
    assert float(scale) == div32(E4M3_MAX, 5.0)  # 5.0 still in the window (slot 3 -> 2 -> 1)
    hist = hist.at[0].set(0.5)
    hist, scale = fp8_matmul.amax_and_scale_update(hist, scale, E4M3_MAX)
    assert float(scale) == E4M3_MAX / 0.5


def test_most_recent_vs_max():
    hist = jnp.array([2.0, 8.0, 4.0, 1.0])
    _, s_max = fp8_matmul.amax_and_scale_update(hist, 1.0, E4M3_MAX, 0, "max")
    _, s_recent = fp8_matmul.amax_and_scale_update(hist, 1.0, E4M3_MAX, 0, "most_recent")
    assert float(s_max) == E4M3_MAX / 8.0 and float(s_recent) == E4M3_MAX / 2.0


def test_nan_in_window_is_skipped_like_fmaxf():
    hist = jnp.array([2.0, 1.0, np.nan, 4.0])
    new, scale = fp8_matmul.amax_and_scale_update(hist, 1.0, E4M3_MAX, 0, "max")
    assert float(scale) == E4M3_MAX / 4.0
    assert np.isnan(new[1]) and np.isnan(new).sum() == 1  # the NaN stays in the history


def test_stacked_meta_update():
    cfg = cfg_of()
    meta = fp8_matmul.init_meta(cfg, (3,))
    assert meta.x.scale.shape == (3,) and meta.x.amax_history.shape == (3, 4)
    obs = jax.tree.map(jnp.zeros_like, meta)
    history = obs.x.amax_history.at[:, 0].set([2.0, 9.0, 4.0])
    obs = obs.replace(x=obs.x.replace(scale=jnp.array([1.0, 0.0, 1.0]), amax_history=history))
    new = update(meta, obs, cfg)
    np.testing.assert_allclose(new.x.scale, [E4M3_MAX / 2.0, 1.0, E4M3_MAX / 4.0])
    np.testing.assert_allclose(new.x.scale_inv, 1.0 / np.asarray(new.x.scale), rtol=1e-7)
    np.testing.assert_array_equal(new.x.amax_history[1], 0.0)  # unused layer: unchanged
    np.testing.assert_array_equal(new.x.amax_history[:, 3], [2.0, 0.0, 4.0])


# ----------------------------------------------------------------------------- the matmul

@pytest.mark.parametrize("dn,lhs_shape,rhs_shape", [
    (DN_IN, (2, 3, 5), (5, 4, 6)),
    (DN_OUT, (2, 3, 4, 6), (4, 6, 5)),
    ((((0,), (1,)), ((), ())), (5, 3), (4, 5)),
    ((((2,), (1,)), ((0,), (0,))), (2, 3, 5), (2, 5, 4)),  # a batch dim
    ((((1, 2), (2, 0)), ((), ())), (3, 4, 5), (5, 2, 4)),  # contracting dims out of order
])
def test_transposes_match_autodiff(dn, lhs_shape, rhs_shape):
    @jax.jit
    def both(lhs, rhs, g):
        _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), lhs, rhs)
        one, f32 = jnp.ones((), jnp.float32), jnp.float32
        ours = (fp8_matmul._transpose_lhs(g, rhs, lhs.ndim, dn, (one, one), f32),
                fp8_matmul._transpose_rhs(g, lhs, rhs.ndim, dn, (one, one), f32))
        return vjp(g), ours

    k1, k2, k3 = range(0, 3)
    lhs, rhs = normal(k1, lhs_shape), normal(k2, rhs_shape)
    g = normal(k3, jax.eval_shape(lambda: jax.lax.dot_general(lhs, rhs, dn)).shape)
    (want_l, want_r), (got_l, got_r) = both(lhs, rhs, g)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_r, want_r, rtol=1e-5, atol=1e-5)


def _dot_dtypes(jaxpr):
    """The operand dtypes of every dot, in the branch XLA:CPU runs where the jaxpr holds
    per-platform branches (fp8's scaled dot: a GPU one for XLA's GEMM rewriter)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for name, p in eqn.params.items():
            if name == "branches" and "branches_platforms" in eqn.params:
                p = [b for b, on in zip(p, eqn.params["branches_platforms"]) if on is None]
            for inner in p if isinstance(p, (tuple, list)) else [p]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    out += _dot_dtypes(inner)
    return out


@pytest.mark.parametrize("fmt,bwd", [("hybrid", "float8_e5m2"), ("e4m3", "float8_e4m3fn")])
def test_grad_jaxpr_has_fp8_dots(fmt, bwd):
    cfg = cfg_of(format=fmt)
    x, w = jnp.ones((2, 8, 32), jnp.bfloat16), jnp.ones((32, 2, 16), jnp.bfloat16)
    dy = jnp.ones((2, 8, 2, 16))
    def loss(x, w, meta):
        y = fp8_matmul.fp8_dot_general(x, w, DN_IN, meta=meta, cfg=cfg)
        return jnp.sum(y.astype(jnp.float32) * dy)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w, fp8_matmul.init_meta(cfg)).jaxpr
    dots = _dot_dtypes(jaxpr)
    assert ("float8_e4m3fn", "float8_e4m3fn") in dots
    # dgrad and wgrad, plus the forward when the gradient format is E4M3 too (wgrad takes
    # the activation as its first operand, so compare the operand pairs unordered).
    pairs = [tuple(sorted(d)) for d in dots]
    assert pairs.count(tuple(sorted((bwd, "float8_e4m3fn")))) == (2 if fmt == "hybrid" else 3), dots
    assert all("float8" in a and "float8" in b for a, b in dots), dots


@pytest.mark.parametrize("dn,x_shape,w_shape", [
    (DN_IN, (4, 32, 64), (64, 4, 32)),
    (DN_OUT, (4, 32, 4, 32), (4, 32, 64)),
])
def test_accuracy_after_warmup_vs_fp32(dn, x_shape, w_shape):
    cfg = cfg_of()
    keys = range(200, 203)
    x32, w32 = normal(keys[0], x_shape), normal(keys[1], w_shape, 0.05)
    x, w = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    y32, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn), x32, w32)
    dy = normal(keys[2], y32.shape, 1e-3)
    dx32, dw32 = vjp(dy)
    grads = grads_fn(cfg, dn)
    meta = fp8_matmul.init_meta(cfg)
    for _ in range(3):  # warm-up: the first step runs with scale 1
        _, _, meta_grad = grads(x, w, meta, dy)
        meta = update(meta, meta_grad, cfg)
    y = forward(x, w, dn, meta, cfg)
    dx, dw, _ = grads(x, w, meta, dy)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    errs = rel(y, y32), rel(dx, dx32), rel(dw, dw32)
    assert errs[0] < 0.05 and errs[1] < 0.08 and errs[2] < 0.08, errs
    # The scales are TE's: fp8_max / amax of the (constant) inputs.
    np.testing.assert_allclose(meta.x.scale, E4M3_MAX / float(jnp.max(jnp.abs(x))), rtol=1e-6)
    g_amax = float(jnp.max(jnp.abs(dy.astype(jnp.bfloat16))))  # g reaches the op as bf16
    np.testing.assert_allclose(meta.g.scale, E5M2_MAX / g_amax, rtol=1e-6)


def test_one_step_delay():
    cfg = cfg_of(amax_history_len=1)
    k1, k2 = range(300, 302)
    w = normal(k1, (32, 16), 0.1)
    x1 = normal(k2, (16, 32))
    x2 = 50.0 * x1  # a jump in amax: the delayed scale saturates on this step
    dn = (((1,), (0,)), ((), ()))
    grads, dy = grads_fn(cfg, dn), jnp.ones((16, 16))
    meta = fp8_matmul.init_meta(cfg)
    _, _, mg = grads(x1, w, meta, dy)
    meta = update(meta, mg, cfg)
    scale1 = E4M3_MAX / float(jnp.max(jnp.abs(x1)))
    np.testing.assert_allclose(meta.x.scale, scale1, rtol=1e-6)
    y2 = forward(x2, w, dn, meta, cfg)  # quantized with step 1's scale
    qx = fp8_matmul.quantize(x2, meta.x.scale, jnp.float8_e4m3fn).astype(jnp.float32) / meta.x.scale
    qw = fp8_matmul.quantize(w, meta.w.scale, jnp.float8_e4m3fn).astype(jnp.float32) / meta.w.scale
    np.testing.assert_allclose(y2, qx @ qw, rtol=1e-5, atol=1e-4)
    assert rel(y2, x2 @ w) > 0.5  # saturated: the scale did not see x2 yet
    _, _, mg = grads(x2, w, meta, dy)
    meta = update(meta, mg, cfg)
    np.testing.assert_allclose(meta.x.scale, scale1 / 50.0, rtol=1e-5)
    assert rel(forward(x2, w, dn, meta, cfg), x2 @ w) < 0.05


def test_current_recipe_scales_from_the_tensor_itself():
    cfg = cfg_of(recipe="current")
    keys = range(400, 403)
    # Small amplitudes underflow E4M3 at scale 1 (the delayed recipe's first step).
    x, w = normal(keys[0], (16, 64), 1e-3), normal(keys[1], (64, 32), 1e-3)
    dn = (((1,), (0,)), ((), ()))
    dy = normal(keys[2], (16, 32), 1e-6)
    meta = fp8_matmul.init_meta(cfg)
    y = forward(x, w, dn, meta, cfg)
    dx, dw, mg = grads_fn(cfg, dn)(x, w, meta, dy)
    assert rel(y, x @ w) < 0.05 and rel(dx, dy @ w.T) < 0.08 and rel(dw, x.T @ dy) < 0.08
    delayed = cfg_of()
    assert rel(forward(x, w, dn, fp8_matmul.init_meta(delayed), delayed), x @ w) > 0.5
    # The history still records the amaxes.
    new = update(meta, mg, cfg)
    assert float(new.x.amax_history[-1]) == float(jnp.max(jnp.abs(x)))


def test_margin_in_the_matmul():
    cfg = cfg_of(margin=2)
    x, w = normal(5, (16, 32)), normal(6, (32, 16))
    _, _, mg = grads_fn(cfg, (((1,), (0,)), ((), ())))(x, w, fp8_matmul.init_meta(cfg),
                                                      jnp.ones((16, 16)))
    meta = update(fp8_matmul.init_meta(cfg), mg, cfg)
    np.testing.assert_allclose(meta.x.scale, E4M3_MAX / 4 / float(jnp.max(jnp.abs(x))), rtol=1e-6)
    np.testing.assert_allclose(meta.g.scale, E5M2_MAX / 4, rtol=1e-6)


# ----------------------------------------------------------------------------- flax as an oracle

def test_matches_flax_fp8_ops_at_margin_zero():
    """flax's fp8_scaled_dot_general (scale = 1 / TE's) over steps with changing amaxes."""
    cfg = cfg_of(amax_history_len=3)
    dn = (((1,), (0,)), ((), ()))
    keys = range(700, 712)
    w = normal(keys[0], (32, 16), 0.1)

    def flax_fwd(x, w, ls, ws, gs, lh, wh, gh):
        return fp8_ops.fp8_scaled_dot_general(
            x, w, dn, preferred_element_type=jnp.float32, lhs_scale=ls, rhs_scale=ws,
            grad_scale=gs, lhs_amax_history=lh, rhs_amax_history=wh, grad_amax_history=gh)

    @jax.jit
    def flax_step(x, w, state, dy):
        y, vjp = jax.vjp(flax_fwd, x, w, *state)
        return y, vjp(dy)
    ours = grads_fn(cfg, dn)
    f_state = [jnp.ones((1,))] * 3 + [jnp.zeros((3,))] * 3
    meta = fp8_matmul.init_meta(cfg)
    for step, amp in enumerate([1.0, 3.0, 0.2, 0.5, 8.0]):
        x = normal(keys[1 + step], (16, 32), amp)
        dy = normal(keys[6 + step], (16, 16), amp * 1e-2)
        y_f, f_out = flax_step(x, w, f_state, dy)
        dx, dw, mg = ours(x, w, meta, dy)
        np.testing.assert_allclose(dx, f_out[0], rtol=1e-5, atol=1e-6 * amp)
        np.testing.assert_allclose(dw, f_out[1], rtol=1e-5, atol=1e-6 * amp)
        np.testing.assert_allclose(forward(x, w, dn, meta, cfg), y_f, rtol=1e-5, atol=1e-5)
        f_state = list(f_out[2:])
        meta = update(meta, mg, cfg)
        # flax computes the next scale lazily (from its history at the next call): compare both
        # histories, and our scale against flax's next-step scale.
        roles = ((meta.x, f_state[0], f_state[3]), (meta.w, f_state[1], f_state[4]),
                 (meta.g, f_state[2], f_state[5]))
        for role, f_scale, f_hist in roles:
            np.testing.assert_array_equal(role.amax_history[1:], jnp.roll(f_hist, -1)[1:])
            assert float(role.amax_history[0]) == 0.0
            fmax = E5M2_MAX if role is meta.g else E4M3_MAX
            next_flax = fp8_ops.compute_scale(jnp.max(f_hist), f_scale, fmax)
            np.testing.assert_allclose(role.scale, 1.0 / next_flax[0], rtol=1e-6)


# ----------------------------------------------------------------------------- double counting

def _meta_after(cfg, loss, x, w, dy):
    mg = jax.jit(jax.grad(loss, argnums=2))(x, w, fp8_matmul.init_meta(cfg), dy)
    return update(fp8_matmul.init_meta(cfg), mg, cfg)


def test_op_applied_twice_or_rematerialised_gives_same_meta_as_once():
    cfg = cfg_of()
    x, w = normal(8, (2, 16, 32)), normal(9, (32, 2, 16), 0.1)
    dy = normal(10, (2, 16, 2, 16))
    op = lambda x, w, m: fp8_matmul.fp8_dot_general(x, w, DN_IN, meta=m, cfg=cfg)
    once = lambda x, w, m, dy: jnp.sum(op(x, w, m) * dy)
    twice = lambda x, w, m, dy: jnp.sum((op(x, w, m) + op(x, w, m)) * dy)
    remat = lambda x, w, m, dy: jnp.sum(jax.checkpoint(op)(x, w, m) * dy)
    remat_twice = lambda x, w, m, dy: jnp.sum(
        (jax.checkpoint(op)(x, w, m) + jax.checkpoint(op)(x, w, m)) * dy)
    want = _meta_after(cfg, once, x, w, dy)
    assert float(want.x.scale) == div32(E4M3_MAX, jnp.max(jnp.abs(x)))
    for loss in (twice, remat, remat_twice):
        got = _meta_after(cfg, loss, x, w, dy)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    # A plain f32 cotangent sum (flax's default) would have doubled amax and scale: ours does not.
    raw = jax.jit(jax.grad(twice, argnums=2))(x, w, fp8_matmul.init_meta(cfg), dy)
    assert float(raw.x.scale) == 2.0  # the use count


def test_remat_in_a_scan_over_layers_keeps_per_layer_histories():
    cfg = cfg_of()
    x = normal(11, (2, 8, 32))
    w_LDK = normal(12, (3, 32, 32), 0.1) * jnp.array([1.0, 2.0, 4.0])[:, None, None]

    def model(x, w_LDK, meta_L, remat):
        def layer(h, wm):
            w, m = wm
            return fp8_matmul.fp8_dot_general(h, w, DN_IN[:1] + (((), ()),), meta=m, cfg=cfg), None
        layer = jax.checkpoint(layer) if remat else layer
        return jnp.sum(jax.lax.scan(layer, x, (w_LDK, meta_L))[0])

    meta_L = fp8_matmul.init_meta(cfg, (3,))
    meta_grad = jax.jit(jax.grad(model, argnums=2), static_argnums=3)
    plain = meta_grad(x, w_LDK, meta_L, False)
    rematted = meta_grad(x, w_LDK, meta_L, True)
    jax.tree.map(np.testing.assert_array_equal, rematted, plain)
    new = update(meta_L, plain, cfg)
    amax_w = np.asarray(jnp.max(jnp.abs(w_LDK), axis=(1, 2)))
    np.testing.assert_allclose(new.w.amax_history[:, -1], amax_w)


def test_microbatch_amax_is_the_max_with_combine():
    cfg = cfg_of()
    dn = (((1,), (0,)), ((), ()))
    w = normal(13, (32, 16), 0.1)
    x_MBD = normal(14, (3, 16, 32)) * jnp.array([1.0, 5.0, 2.0])[:, None, None]
    dy = jnp.ones((16, 16))
    meta = fp8_matmul.init_meta(cfg)
    per_mb = [grads_fn(cfg, dn)(x_MBD[i], w, meta, dy)[2] for i in range(3)]
    combine = jax.jit(fp8.combine_meta_grads)
    combined = combine(combine(per_mb[0], per_mb[1]), per_mb[2])
    via_combine = update(meta, combined, cfg)
    amax = float(jnp.max(jnp.abs(x_MBD)))
    assert float(via_combine.x.amax_history[-1]) == amax
    np.testing.assert_allclose(via_combine.x.scale, E4M3_MAX / amax, rtol=1e-6)
    # Averaging meta grads over microbatches (as grads are) scales count and amax alike: the
    # decoded amax is the mean, and never the sum.
    mean_grad = jax.tree.map(lambda *g: sum(g) / 3, *per_mb)
    by_mean = update(meta, mean_grad, cfg)
    mean_amax = np.mean([float(jnp.max(jnp.abs(x_MBD[i]))) for i in range(3)])
    np.testing.assert_allclose(by_mean.x.amax_history[-1], mean_amax, rtol=1e-6)


# ----------------------------------------------------------------------------- bookkeeping, errors

def test_update_a_variables_tree():
    cfg = cfg_of()
    tree = {"layer": {"kernel": jnp.ones((32, 16)), "fp8": fp8_matmul.init_meta(cfg)},
            "bias": jnp.ones(3)}
    grads = jax.tree.map(jnp.zeros_like, tree)
    grads["layer"]["fp8"] = grads["layer"]["fp8"].replace(
        w=fp8_matmul._observation(jnp.float32(2.0), 4))
    new = update(tree, grads, cfg)
    np.testing.assert_array_equal(new["layer"]["kernel"], tree["layer"]["kernel"])
    assert float(new["layer"]["fp8"].w.scale) == div32(E4M3_MAX, 2.0)
    assert float(new["layer"]["fp8"].x.scale) == 1.0  # no observation: unchanged


def test_the_converter_off_is_the_identity_of_a_bf16_run():
    """FP8 off: one layer span, no meta, an empty meta state that every method leaves empty,
    the model's own dot_general, and cotangent trees summed as gradients are."""
    off = fp8.Fp8Converter.of(Fp8Config(enabled=False))
    assert off == fp8.Fp8Converter() and off.layer_spans(4) == [(0, 4, False)]
    assert off.layer_kinds() == (False,) and off.new_meta() is None
    assert off.fresh({}) == {} and off.update({}, {}) == {} and off.combine({}, {}) == {}
    assert off.for_run(None, {}) == ({}, False)
    x, w, dims = normal(30, (4, 16)), normal(31, (16, 16)), (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(
        off.project(x, w, dims, None, fp8=False, dot_general=jax.lax.dot_general, name="t"),
        jax.lax.dot_general(x, w, dims))
    with pytest.raises(fp8_matmul.Fp8Error, match="t: fp8=True but .* set fp8.enabled=true"):
        off.project(x, w, dims, None, fp8=True, dot_general=jax.lax.dot_general, name="t")
    stacked = {"w": jnp.arange(6.0).reshape(2, 3)}
    np.testing.assert_array_equal(off.reduce(stacked, 0)["w"], [3.0, 5.0, 7.0])
    np.testing.assert_array_equal(off.add_at(stacked, 1, {"w": jnp.ones(3)})["w"][1],
                                  [4.0, 5.0, 6.0])


def _observations(amax, used, length=4):
    """Encoded observations (count, summed amax) of any batch shape."""
    used = jnp.asarray(used, jnp.float32)
    history = jnp.zeros((*used.shape, length)).at[..., 0].set(jnp.asarray(amax) * used)
    role = fp8_matmul.TensorMeta(used, jnp.zeros_like(used), history)
    return fp8_matmul.Fp8Meta(role, role, role)


def test_per_expert_metas_combine_and_update_per_expert():
    """A meta stacked [layers, experts] (what a mixture-of-experts layer will own): two
    microbatches' observations combine per expert, replicas stacked on an axis reduce per
    expert, and the update sets each expert's scale from its own max; an expert no token
    reached keeps its state."""
    conv = fp8.Fp8Converter.of(Fp8Config(enabled=True, amax_history_len=4))
    meta = conv.new_meta((2, 3)).get_value()
    assert meta.x.scale.shape == (2, 3) and meta.x.amax_history.shape == (2, 3, 4)
    used = [[1, 1, 0], [1, 0, 0]]
    a = _observations([[1.0, 8.0, 0.0], [2.0, 0.0, 0.0]], used)
    b = _observations([[4.0, 2.0, 0.0], [0.5, 0.0, 0.0]], used)
    combined = conv.combine({"moe": a}, {"moe": b})
    stacked = jax.tree.map(lambda u, v: jnp.stack([u, v]), {"moe": a}, {"moe": b})
    reduced = conv.reduce(stacked, 0)
    jax.tree.map(np.testing.assert_array_equal, reduced, combined)
    new = conv.update({"moe": meta}, combined)["moe"]
    want = np.array([[4.0, 8.0, 0.0], [2.0, 0.0, 0.0]])
    np.testing.assert_array_equal(new.x.amax_history[..., -1], want)
    np.testing.assert_allclose(new.x.scale, np.where(want > 0, E4M3_MAX / np.maximum(want, 1),
                                                     1.0), rtol=1e-6)
    np.testing.assert_allclose(new.g.scale[0, 0], E5M2_MAX / 4.0, rtol=1e-6)


def test_misaligned_dims_raise_naming_the_layer():
    cfg = cfg_of()
    meta = fp8_matmul.init_meta(cfg)
    with pytest.raises(fp8_matmul.Fp8Error, match=r"layers_0/mlp/wi.*K=24"):
        fp8_matmul.fp8_dot_general(jnp.ones((4, 24)), jnp.ones((24, 32)), (((1,), (0,)), ((), ())),
                            meta=meta, cfg=cfg, name="layers_0/mlp/wi")
    with pytest.raises(fp8_matmul.Fp8Error, match=r"attn/o.*N=40"):
        fp8_matmul.fp8_dot_general(jnp.ones((4, 32)), jnp.ones((32, 40)), (((1,), (0,)), ((), ())),
                            meta=meta, cfg=cfg, name="attn/o")


def test_stacked_meta_and_bad_config_raise():
    cfg = cfg_of()
    x, w, dn = jnp.ones((4, 32)), jnp.ones((32, 16)), (((1,), (0,)), ((), ()))
    with pytest.raises(fp8_matmul.Fp8Error, match="slice a layer-stacked meta"):
        fp8_matmul.fp8_dot_general(x, w, dn, meta=fp8_matmul.init_meta(cfg, (2,)), cfg=cfg)
    for key, value in (("format", "e5m2"), ("recipe", "mxfp8"), ("amax_compute_algo", "mean")):
        with pytest.raises(ConfigError, match=f"fp8.{key}"):
            fp8_matmul.fp8_dot_general(x, w, dn, meta=fp8_matmul.init_meta(cfg),
                                cfg=dataclasses.replace(cfg, **{key: value}))


FP8_COLLECTION = "fp8_meta"   # where a linen layer keeps its metas


class _Fp8DenseGeneral(nn.Module):
    """How a projection plugs in: it owns one meta and binds it into DenseGeneral's dot_general."""
    features: tuple
    cfg: Fp8Config

    @nn.compact
    def __call__(self, x):
        meta = self.variable(FP8_COLLECTION, "meta", fp8_matmul.init_meta, self.cfg)
        dot = functools.partial(fp8_matmul.fp8_dot_general, meta=meta.value, cfg=self.cfg,
                                name=self.name)
        return nn.DenseGeneral(self.features, use_bias=False, dot_general=dot, name="proj")(x)


def test_plugs_into_flax_dense_general():
    cfg = cfg_of()
    layer = _Fp8DenseGeneral((2, 16), cfg, name="q_proj")
    x, dy = normal(15, (2, 8, 32)), normal(16, (2, 8, 2, 16))
    variables = layer.init(jax.random.key(0), x)
    params, metas = variables["params"], variables[FP8_COLLECTION]
    assert fp8_matmul.is_fp8_meta(metas["meta"])

    @jax.jit
    def step(params, metas):
        loss = lambda p, m: jnp.sum(layer.apply({"params": p, FP8_COLLECTION: m}, x) * dy)
        g_params, g_metas = jax.grad(loss, argnums=(0, 1))(params, metas)
        return g_params, fp8.apply_meta_update(metas, g_metas, cfg)

    for _ in range(2):
        g_params, metas = step(params, metas)
    w = params["proj"]["kernel"]
    assert g_params["proj"]["kernel"].shape == w.shape == (32, 2, 16)
    assert rel(g_params["proj"]["kernel"], jnp.einsum("bsd,bshk->dhk", x, dy)) < 0.08
    w_scale = E4M3_MAX / float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(metas["meta"].w.scale, w_scale, rtol=1e-6)
    with pytest.raises(fp8_matmul.Fp8Error, match="q_proj.*N=24"):
        _Fp8DenseGeneral((24,), cfg, name="q_proj").init(jax.random.key(0), x)


# ----------------------------------------------------------------------------- edge cases vs TE

DN_2D = (((1,), (0,)), ((), ()))


def test_nan_entries_are_skipped_as_te_cast_kernels_skip_them():
    # History 4, a gradient of amax 4, then one of 8 with a NaN: TE's fmaxf reductions record
    # [0, 0, 4, 8] and scale 57344 / 8 = 7168 (a NaN amax would have kept 14336).
    cfg = cfg_of()
    x, w = normal(20, (16, 32)), normal(21, (32, 16), 0.1)
    grads = grads_fn(cfg, DN_2D)
    meta = fp8_matmul.init_meta(cfg)
    meta = update(meta, grads(x, w, meta, jnp.full((16, 16), 4.0))[2], cfg)
    dy = jnp.ones((16, 16)).at[3, 5].set(8.0).at[7, 1].set(jnp.nan)
    meta = update(meta, grads(x, w, meta, dy)[2], cfg)
    np.testing.assert_array_equal(meta.g.amax_history, [0.0, 0.0, 4.0, 8.0])
    assert float(meta.g.scale) == 7168.0
    # An activation with a NaN records the finite max; an all-NaN one records 0 (scale kept).
    mg = grads(x.at[0, 0].set(jnp.nan), w, meta, dy)[2]
    assert float(mg.x.amax_history[0]) == float(jnp.max(jnp.abs(x.at[0, 0].set(0.0))))
    mg = grads(jnp.full((16, 32), jnp.nan), w, meta, dy)[2]
    assert float(mg.x.amax_history[0]) == 0.0 and float(mg.x.scale) == 1.0
    assert float(update(meta, mg, cfg).x.scale) == float(meta.x.scale)


def test_meta_reductions_skip_a_nan_replica():
    obs = lambda *amaxes: fp8_matmul.Fp8Meta(*(fp8_matmul._observation(jnp.float32(a), 4)
                                               for a in amaxes))
    replicas = [obs(1.0, 2.0, 3.0), obs(np.nan, 5.0, np.nan), obs(4.0, np.nan, 0.5)]
    want = [4.0, 5.0, 3.0]
    check = lambda m: [float(r.amax_history[0] / r.scale) for r in (m.x, m.w, m.g)] == want
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *replicas)
    assert check(jax.jit(fp8.max_meta_grads)(stacked))
    combine = jax.jit(fp8.combine_meta_grads)
    assert check(combine(combine(replicas[0], replicas[1]), replicas[2]))
    # And the update itself: a NaN observation never enters the history.
    cfg = cfg_of()
    new = update(fp8_matmul.init_meta(cfg), replicas[1], cfg)
    np.testing.assert_array_equal(new.x.amax_history, 0.0)
    assert float(new.x.scale) == 1.0


def test_current_scaling_has_no_margin_like_te():
    # Amax 1 and a value of 3e-5: TE scales by 448 and 3e-5 * 448 rounds to 7 * 2**-9 in E4M3,
    # which is 2**-15 = 3.0518e-05 back (a margin of 2 would have given 3.4877e-05).
    cfg = cfg_of(recipe="current")
    x = jnp.zeros((16, 16)).at[0, 0].set(1.0).at[0, 1].set(3e-5)
    y = forward(x, jnp.eye(16), DN_2D, fp8_matmul.init_meta(cfg), cfg)
    np.testing.assert_allclose(y[0, :2], [1.0, 2.0 ** -15], rtol=1e-6)  # 1/448 rounds in f32
    with pytest.raises(ConfigError, match="fp8.margin=2 with fp8.recipe=current"):
        fp8_matmul.recipe_of(cfg_of(recipe="current", margin=2))
    from jaxtrain.config import Config
    full = Config()
    full.fp8 = cfg_of(recipe="current", margin=2)
    with pytest.raises(ConfigError, match="current scaling has no margin"):
        full.validate()


def test_current_scaling_with_an_inf_amax_uses_scale_one_like_te():
    # The stored scale (1e-3) would flush 0.5 to zero in E4M3; TE's fallback scale 1 keeps it.
    cfg = cfg_of(recipe="current")
    meta = fp8_matmul.init_meta(cfg)
    meta = meta.replace(x=meta.x.replace(scale=jnp.float32(1e-3), scale_inv=jnp.float32(1e3)))
    x = jnp.full((16, 16), 0.5).at[0, 0].set(jnp.inf)
    y = forward(x, jnp.eye(16), DN_2D, meta, cfg)
    np.testing.assert_array_equal(y[1:], 0.5)
    np.testing.assert_allclose(y[0, 0], E4M3_MAX, rtol=1e-6)  # inf saturates at scale 1


def test_shared_meta_records_the_mean():
    # One meta for two matmuls whose inputs have amax 1 and 4: JAX sums the two observations,
    # which decode to the mean (2.5, docs/design.md section 8); TE records the max (4), which
    # the model gets by giving each matmul its own meta (per layer, per projection).
    cfg = cfg_of()
    w = normal(22, (32, 16), 0.1)
    x1 = jnp.zeros((16, 32)).at[0, 0].set(1.0)
    x2 = jnp.zeros((16, 32)).at[0, 0].set(4.0)
    op = lambda x, m: jnp.sum(fp8_matmul.fp8_dot_general(x, w, DN_2D, meta=m, cfg=cfg))
    shared = lambda m: op(x1, m) + op(x2, m)
    meta = fp8_matmul.init_meta(cfg)
    new = update(meta, jax.jit(jax.grad(shared))(meta), cfg)
    assert float(new.x.amax_history[-1]) == 2.5
    assert float(new.x.scale) == div32(E4M3_MAX, 2.5)


def _sharded_grads(x_spec, w_spec, x, w, dy, meta, cfg):
    mesh = jax.make_mesh((8,), ("d",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

    def loss(x, w, meta, dy):
        def local(x, w, meta, dy):
            y = fp8_matmul.fp8_dot_general(x, w, DN_2D, meta=meta, cfg=cfg)
            return jax.lax.psum(jnp.sum(y * dy), "d")
        y_spec = P(x_spec[0], w_spec[1])
        return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec, P(), y_spec),
                             out_specs=P())(x, w, meta, dy)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        put(x, x_spec), put(w, w_spec), meta, put(dy, P(x_spec[0], w_spec[1])))


@pytest.mark.parametrize("x_spec, w_spec", [
    (P("d", None), P(None, None)),  # a weight that is the same on every device: dw is psum'd
    (P(None, None), P(None, "d")),  # an activation that is: dx is psum'd
])
def test_replicated_operand_under_shard_map_gets_autodiffs_gradient(x_spec, w_spec):
    cfg = cfg_of()
    x, w = normal(23, (64, 32)), normal(24, (32, 128), 0.1)
    dy = normal(25, (64, 128), 1e-2)
    fresh = fp8_matmul.init_meta(cfg)
    meta = update(fresh, grads_fn(cfg, DN_2D)(x, w, fresh, dy)[2], cfg)
    dx, dw, mg = _sharded_grads(x_spec, w_spec, x, w, dy, meta, cfg)
    want_dx, want_dw, want_mg = grads_fn(cfg, DN_2D)(x, w, meta, dy)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-7)
    # Observations are pmax'd over the shards: the amaxes of the whole tensors, one use each.
    jax.tree.map(np.testing.assert_array_equal, mg, want_mg)


def test_empty_batch_runs_and_records_amax_zero():
    cfg = cfg_of()
    x, w = jnp.zeros((0, 32)), normal(26, (32, 16), 0.1)
    meta = fp8_matmul.init_meta(cfg)
    dx, dw, mg = grads_fn(cfg, DN_2D)(x, w, meta, jnp.zeros((0, 16)))
    assert dx.shape == (0, 32) and forward(x, w, DN_2D, meta, cfg).shape == (0, 16)
    np.testing.assert_array_equal(dw, 0.0)
    assert float(mg.x.amax_history[0]) == 0.0 and float(mg.g.amax_history[0]) == 0.0
    new = update(meta, mg, cfg)
    assert float(new.x.scale) == 1.0  # amax 0 keeps the old scale (TE)
    assert float(new.w.scale) == div32(E4M3_MAX, jnp.max(jnp.abs(w)))


def test_every_gemm_rounds_once_from_an_fp32_alpha_as_transformer_engine():
    """TE's FP8 GEMM writes D = bf16(alpha * sum(a * b)): fp32 accumulation, an fp32 alpha =
    scale_inv_a * scale_inv_b, one rounding. Small integers are exact in E4M3 and E5M2 and
    their dots exact in fp32, so with scale_invs that bf16 cannot hold the alpha product and
    the one rounding are all the arithmetic left: forward, dgrad and wgrad equal the formula
    bit for bit. (With the scale cast to bf16 and applied to a bf16 result, most differed.)"""
    cfg = cfg_of()
    rng = np.random.default_rng(0)
    x, w, g = (jnp.asarray(rng.integers(-8, 9, shape), jnp.bfloat16)
               for shape in ((16, 32), (32, 48), (16, 48)))
    inv = {"x": 1.2345679, "w": 0.7777777, "g": 3.1415927}  # no bf16 holds these
    meta = fp8.init_meta(cfg)
    meta = fp8.Fp8Meta(*(dataclasses.replace(getattr(meta, r), scale_inv=jnp.float32(inv[r]))
                         for r in ("x", "w", "g")))   # scale 1: integers quantize exactly
    dims = (((1,), (0,)), ((), ()))
    y, vjp = jax.vjp(lambda x, w: fp8.fp8_dot_general(x, w, dims, meta=meta, cfg=cfg), x, w)
    dx, dw = vjp(g)

    def te(a, b, inv_a, inv_b):
        alpha = np.float32(inv_a) * np.float32(inv_b)
        acc = np.asarray(a, np.float32) @ np.asarray(b, np.float32)  # exact integers
        return (acc * alpha).astype(jnp.bfloat16)
    for got, want in ((y, te(x, w, inv["x"], inv["w"])), (dx, te(g, w.T, inv["g"], inv["w"])),
                      (dw, te(x.T, g, inv["x"], inv["g"]))):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), want)

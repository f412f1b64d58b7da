"""The Hopper grouped matmul's Mosaic GPU kernels, run in Mosaic GPU interpret mode on CPU,
against lax.ragged_dot: forward, both backward products, empty groups, groups that end
inside a tile, rows in no group, bf16 and fp16, and inside the MoE layer. (Interpret mode
checks logic, not speed; the H100 compile is tests/test_gpu_compile.py's.)"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ModelConfig, MoeConfig
from jaxtrain.model import llama as model_lib
from jaxtrain.model import moe
from jaxtrain.model.kernels import grouped_matmul as gm

F32 = jnp.float32
KERNEL = functools.partial(gm.grouped_matmul, config=gm.INTERPRET)


def _operands(dtype, m, k, n, g, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (m, k), F32).astype(dtype),
            jax.random.normal(keys[1], (g, k, n), F32).astype(dtype),
            jax.random.normal(keys[2], (m, n), F32).astype(dtype))


def _assert_rounding_close(ours, ref):
    """Equal up to rounding an fp32 result to the dtype twice (bf16: 2^-8 relative each)."""
    eps = float(jnp.finfo(ours.dtype).eps)
    ours, ref = np.asarray(ours.astype(F32)), np.asarray(ref.astype(F32))
    np.testing.assert_allclose(ours, ref, rtol=2 * eps, atol=2 * eps * np.abs(ref).max())


@pytest.mark.parametrize("dtype,sizes,m", [
    # an empty group, groups ending inside a 64-row tile, 8 rows in no group, M padded to 192
    (jnp.bfloat16, (50, 0, 77, 45), 180),
    # an empty first group, one group over three tiles, one inside a tile, 12 rows in no group
    (jnp.float16, (0, 130, 10, 40), 192),
], ids=["bf16", "fp16"])
def test_forward_and_both_gradients_equal_ragged_dot(dtype, sizes, m):
    sizes = jnp.asarray(sizes, jnp.int32)
    x, w, ct = _operands(dtype, m, 128, 128, 4)

    def pulled(f):
        y, pull = jax.vjp(lambda a, b: f(a, b, sizes), x, w)
        return (y, *pull(ct))

    def reference(a, b, s):   # fp32 products, rounded once to the dtype like the kernels
        return jax.lax.ragged_dot(a.astype(F32), b.astype(F32), s).astype(dtype)

    ours = jax.jit(lambda: pulled(KERNEL))()
    ref = jax.jit(lambda: pulled(reference))()
    total = int(sizes.sum())
    for a, b in zip(ours, ref):
        assert a.dtype == jnp.dtype(dtype)
        _assert_rounding_close(a, b)
    y, dx, dw = ours
    assert float(jnp.abs(y[total:].astype(F32)).max(initial=0.0)) == 0.0   # rows in no group
    assert float(jnp.abs(dx[total:].astype(F32)).max(initial=0.0)) == 0.0
    empty = int(np.flatnonzero(np.asarray(sizes) == 0)[0])
    assert float(jnp.abs(dw[empty].astype(F32)).max()) == 0.0             # an empty group
    assert float(jnp.abs(dw.astype(F32)).max()) > 1.0                    # not all zero


def test_bad_operands_are_named():
    x, w, _ = _operands(jnp.bfloat16, 64, 128, 128, 2)
    sizes = jnp.asarray([32, 32], jnp.int32)
    with pytest.raises(gm.GroupedMatmulError, match="bfloat16 or float16"):
        gm.grouped_matmul(x.astype(F32), w.astype(F32), sizes, gm.INTERPRET)
    with pytest.raises(gm.GroupedMatmulError, match="multiples of 64"):
        gm.grouped_matmul(x[:, :96], w[:, :96], sizes, gm.INTERPRET)
    with pytest.raises(gm.GroupedMatmulError, match="K=128 but rhs has K=64"):
        gm.grouped_matmul(x, w[:, :64], sizes, gm.INTERPRET)
    with pytest.raises(gm.GroupedMatmulError, match="group_sizes"):
        gm.grouped_matmul(x, w, sizes[:1], gm.INTERPRET)
    with pytest.raises(gm.GroupedMatmulError, match="at least 64"):
        gm.grouped_matmul(x, w, sizes, dataclasses.replace(gm.INTERPRET, block_k=32))


def test_moe_layer_with_the_kernel_matches_ragged_dot():
    """The layer's dropless path with Ops.grouped_dot = the kernels (bf16): its output and
    gradients are ragged_dot's up to bf16 rounding."""
    cfg = ModelConfig(hidden_size=64, compute_dtype="bfloat16", num_layers=1,
                      moe=MoeConfig(num_experts=4, top_k=2, mlp_size=64, aux_loss_coeff=0.01))
    x = jax.random.normal(jax.random.key(1), (2, 16, 64), F32)

    def run(grouped_dot):
        graphdef, state = nnx.split(moe.MoeLayer(cfg, model_lib.Ops(grouped_dot=grouped_dot),
                                                 nnx.Rngs(0)))
        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(F32) ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)

    (loss, grads), (ref_loss, ref_grads) = run(KERNEL), run(moe.ragged_dot)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * np.abs(b).max())

"""Pallas flash attention vs the einsum reference, in interpret mode on CPU.

Every distinct configuration costs an XLA compile of the interpreted kernels (seconds on CPU), so
the cases are few, each one checks forward and all three gradients at once, and test jits compile
at XLA backend optimization level 0 (half the compile time; the interpreted loops run in ms).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxtrain.pallas_kernels import FlashAttentionError, flash_attention, reference_attention


def _inputs(seed, B, S, H, K, D, dtype=jnp.float32):
  """q, k, v in `dtype` and an fp32 output cotangent (numpy RNG: no per-op XLA compiles)."""
  rng = np.random.default_rng(seed)
  q, k, v, do = (rng.standard_normal(shape, np.float32)
                 for shape in ((B, S, H, D), (B, S, K, D), (B, S, K, D), (B, S, H, D)))
  return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(do)


def _packed_segments(B, S, seed=0):
  """Random document boundaries, different per batch row."""
  rng = np.random.default_rng(seed)
  starts = np.zeros((B, S), np.int32)
  for b in range(B):
    starts[b, rng.choice(np.arange(1, S), size=3, replace=False)] = 1
  return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, static_argnums=0, compiler_options=_FAST_COMPILE)
def _value_and_grads(attn, q, k, v, do):
  out, vjp = jax.vjp(attn, q, k, v)
  return (out, *vjp(do.astype(out.dtype)))


def _max_errors(attn, ref, q, k, v, do):
  """Max |flash - reference| for (out, dq, dk, dv); the reference runs in fp32."""
  got = [np.asarray(x, np.float32) for x in _value_and_grads(attn, q, k, v, do)]
  f32 = lambda x: x.astype(jnp.float32)
  want = [np.asarray(x) for x in _value_and_grads(ref, f32(q), f32(k), f32(v), do)]
  for g in got:
    assert np.all(np.isfinite(g))
  return [float(np.max(np.abs(a - b))) for a, b in zip(got, want)]


# GQA groups 1, 2, 4 and 8 (MQA: one kv head) cross causal x segment ids and head dims.
@pytest.mark.parametrize(
    "kv_heads, causal, use_segments, head_dim, blocks",
    [
        (8, True, False, 64, {}),  # default (clamped) blocks
        (4, True, True, 32, dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)),
        # S=40 is not a multiple of the blocks and D=24 not a power of two: both get zero-padded,
        # and non-causal attention must still ignore the padded keys.
        (2, False, True, 24, dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)),
        (1, False, False, 128, {}),
    ],
)
def test_fp32_matches_reference(kv_heads, causal, use_segments, head_dim, blocks):
  B, H = 2, 8
  S = 40 if head_dim == 24 else 64
  q, k, v, do = _inputs(kv_heads, B, S, H, kv_heads, head_dim)
  seg = _packed_segments(B, S) if use_segments else None
  attn = lambda q, k, v: flash_attention(q, k, v, seg, causal=causal, **blocks)
  ref = lambda q, k, v: reference_attention(q, k, v, seg, causal=causal)
  errors = _max_errors(attn, ref, q, k, v, do)
  assert _value_and_grads(attn, q, k, v, do)[0].shape == q.shape
  print(f"fp32 G={H // kv_heads} causal={causal} seg={use_segments} D={head_dim}: "
        f"out/dq/dk/dv max err {errors}")
  assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_fp32_reference(dtype):
  B, S, H, K, D = 1, 64, 4, 2, 64
  q, k, v, do = _inputs(1, B, S, H, K, D, dtype)
  seg = _packed_segments(B, S, seed=1)
  attn = lambda q, k, v: flash_attention(q, k, v, seg, causal=True)
  ref = lambda q, k, v: reference_attention(q, k, v, seg, causal=True)
  assert all(x.dtype == dtype for x in _value_and_grads(attn, q, k, v, do))
  errors = _max_errors(attn, ref, q, k, v, do)
  print(f"{jnp.dtype(dtype).name} out/dq/dk/dv max err {errors}")
  assert errors[0] < 2e-2, errors
  assert max(errors[1:]) < 5e-2, errors


def test_fully_masked_rows_are_zero_and_finite():
  # Separate q/kv segment ids: queries of document 9 and the very first query (document 1 while
  # key 0 is document 0) see no key at all under causal masking.
  B, S, H, K, D = 1, 32, 2, 1, 16
  q, k, v, do = _inputs(3, B, S, H, K, D)
  kv_seg = jnp.asarray([[0] * 1 + [1] * 15 + [2] * 16], jnp.int32)
  q_seg = jnp.asarray([[1] * 1 + [1] * 15 + [9] * 8 + [2] * 8], jnp.int32)
  segs = (q_seg, kv_seg)
  blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
  attn = lambda q, k, v: flash_attention(q, k, v, segs, causal=True, **blocks)
  ref = lambda q, k, v: reference_attention(q, k, v, segs, causal=True)
  out, dq, _, _ = (np.asarray(x) for x in _value_and_grads(attn, q, k, v, do))
  empty_rows = np.r_[0, 16:24]
  np.testing.assert_array_equal(out[0, empty_rows], 0.0)
  np.testing.assert_array_equal(dq[0, empty_rows], 0.0)
  errors = _max_errors(attn, ref, q, k, v, do)
  assert max(errors) < 1e-5, errors


def test_causal_kernel_skips_masked_blocks():
  # Poison what causal loop bounds must never read; with 4 blocks of 16 tokens:
  #  * NaN in the last KV block may reach only the last q block's output and dQ (forward and dQ
  #    kernel skip it for earlier q blocks);
  #  * NaN in the first q block may reach only the first KV block's dK/dV (the dK/dV kernel skips
  #    q blocks that precede its keys).
  B, S, H, K, D = 1, 64, 2, 1, 16
  q, k, v, do = _inputs(4, B, S, H, K, D)
  blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
  attn = lambda q, k, v: flash_attention(q, k, v, causal=True, **blocks)
  finite = lambda x: bool(np.all(np.isfinite(x)))
  run = lambda *a: [np.asarray(x) for x in _value_and_grads(attn, *a, do)]

  out, dq, _, dv = run(q, k, v.at[:, 48:].set(jnp.nan))
  assert finite(out[:, :48]) and finite(dq[:, :48]) and finite(dv[:, :48])
  assert not finite(out[:, 48:])  # the poison is live where it should be

  out, _, dk, dv = run(q.at[:, :16].set(jnp.nan), k, v)
  assert finite(dk[:, 16:]) and finite(dv[:, 16:])
  assert not finite(dk[:, :16]) and not finite(out[:, :16])


def test_check_grads_tiny():
  B, S, H, K, D = 1, 32, 2, 1, 16
  q, k, v, _ = _inputs(5, B, S, H, K, D)
  seg = jnp.asarray([[0] * 12 + [1] * 20], jnp.int32)
  attn = lambda q, k, v: flash_attention(q, k, v, seg, causal=True, block_q=16, block_k=16,
                                         block_q_bwd=16, block_k_bwd=16)
  check_grads(attn, (q, k, v), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


def test_reference_agrees_with_jax_nn_xla():
  B, S, H, K, D = 2, 32, 4, 2, 16
  q, k, v, _ = _inputs(6, B, S, H, K, D)
  want = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                   implementation="xla"))(q, k, v)
  got = jax.jit(functools.partial(reference_attention, causal=True))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize(
    "dtype, causal, use_segments, S, K, D",
    [(jnp.bfloat16, True, True, 256, 2, 128), (jnp.float32, False, False, 200, 8, 80)],
)
def test_lowers_to_triton_for_gpu(dtype, causal, use_segments, S, K, D):
  # Cross-lowering for CUDA on a CPU host runs the Pallas->Triton lowering rules on the kernels
  # (forward, dK/dV, dQ), catching ops the Triton backend lacks. PTX codegen still needs a GPU.
  from jax import export

  B, H = 1, 8
  q = jax.ShapeDtypeStruct((B, S, H, D), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, D), dtype)
  seg = jax.ShapeDtypeStruct((B, S), jnp.int32)

  def step(q, k, v, seg):
    attn = lambda q, k, v: flash_attention(q, k, v, seg if use_segments else None,
                                           causal=causal, interpret=False)
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(out)

  exported = export.export(
      jax.jit(step), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(q, kv, kv, seg)
  module = exported.mlir_module()
  for name in ("jaxtrain_flash_fwd", "jaxtrain_flash_bwd_dkv", "jaxtrain_flash_bwd_dq"):
    assert name in module


def _arr(*shape, dtype=np.float32):
  return np.zeros(shape, dtype)  # numpy: validation needs shapes only, and numpy never compiles


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((_arr(1, 32, 6, 16), _arr(1, 32, 4, 16), _arr(1, 32, 4, 16)), {},
         "num_heads=6 must be a multiple of num_kv_heads=4"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 1, 16)), {},
         "k and v must have the same shape"),
        ((_arr(1, 32, 4, 16), _arr(1, 16, 2, 16), _arr(1, 16, 2, 16)), {}, "sequence mismatch"),
        ((_arr(2, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)), {}, "batch mismatch"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 32), _arr(1, 32, 2, 32)), {}, "head_dim mismatch"),
        ((_arr(1, 32, 4, 512), _arr(1, 32, 2, 512), _arr(1, 32, 2, 512)), {},
         "head_dim=512 is unsupported"),
        ((_arr(32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)), {}, "q must be 4-D"),
        ((_arr(1, 32, 4, 16, dtype=jnp.int32),) * 3, {}, "dtype int32 is unsupported"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16, dtype=jnp.bfloat16),
          _arr(1, 32, 2, 16, dtype=jnp.bfloat16)), {}, "must share one dtype"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16), _arr(1, 16, dtype=jnp.int32)),
         {}, r"segment_ids must have shape \[batch, seq\] = \(1, 32\)"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16), _arr(1, 32)), {},
         "must be an integer array"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)), {"block_q": 24},
         "block_q=24 must be a power of two >= 16"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)), {"block_k_bwd": 8},
         "block_k_bwd=8 must be a power of two >= 16"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, kwargs, message):
  with pytest.raises(FlashAttentionError, match=message):
    flash_attention(*args, **kwargs)
  assert issubclass(FlashAttentionError, ValueError)

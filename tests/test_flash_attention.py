"""Pallas flash attention vs the einsum reference, in interpret mode on CPU.

Every distinct configuration costs an XLA compile of the interpreted kernels (seconds on CPU), so
the cases are few, each one checks forward and all three gradients at once, and test jits compile
at XLA backend optimization level 0 (tests/conftest.py: half the compile time; the interpreted
loops run in ms).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxtrain.data.context import context_order
from jaxtrain.model.kernels import (FlashAttentionError, block_counts, flash_attention,
                                     flash_attention_backward, reference_attention)
from jaxtrain.model.kernels.flash_attention import _kernel_block_counts


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


@functools.partial(jax.jit, static_argnums=0)
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
    "dtype, causal, use_segments, S, K, D, shard",
    [(jnp.bfloat16, True, True, 256, 2, 128, False), (jnp.float32, False, False, 200, 8, 80, False),
     (jnp.bfloat16, True, True, 256, 2, 128, True)],  # a context shard: positions, Sq != Sk
)
def test_lowers_to_triton_for_gpu(dtype, causal, use_segments, S, K, D, shard):
  # Cross-lowering for CUDA on a CPU host runs the Pallas->Triton lowering rules on the kernels
  # (forward, dK/dV, dQ), catching ops the Triton backend lacks. PTX codegen still needs a GPU.
  from jax import export

  B, H = 1, 8
  Sq = S // 2 if shard else S
  q = jax.ShapeDtypeStruct((B, Sq, H, D), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, D), dtype)
  seg = jax.ShapeDtypeStruct((B, S), jnp.int32)

  def step(q, k, v, seg):
    ids = seg if use_segments else None
    extra = {}
    if shard:
      ids = (seg[:, :Sq], seg)
      extra = dict(positions=(jnp.arange(Sq, 2 * Sq, dtype=jnp.int32),
                              jnp.arange(S, dtype=jnp.int32)))
    attn = lambda q, k, v: flash_attention(q, k, v, ids, causal=causal, interpret=False,
                                           **extra)
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
         "k and v must have the same batch, length and heads"),
        # q and kv lengths may differ (a context shard against gathered keys), but one
        # segment-id array cannot describe both.
        ((_arr(1, 32, 4, 16), _arr(1, 16, 2, 16), _arr(1, 16, 2, 16),
          _arr(1, 32, dtype=np.int32)), {}, "sequence mismatch.*pass \\(q_segment_ids"),
        ((_arr(1, 32, 4, 16), _arr(1, 16, 2, 16), _arr(1, 16, 2, 16)),
         {"positions": (_arr(32, dtype=np.int32), _arr(32, dtype=np.int32))},
         r"kv_positions must be an integer array of shape \[seq\] = \(16,\)"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)),
         {"positions": (_arr(32, dtype=np.int32),)}, "positions must be a pair"),
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
        # Half-given pairs: (None, kv) used to run unmasked, (q, None) to raise AttributeError.
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16),
          (None, _arr(1, 32, dtype=np.int32))), {}, "got None for q_segment_ids; pass both"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16),
          (_arr(1, 32, dtype=np.int32), None)), {}, "got None for kv_segment_ids; pass both"),
        # int64 ids 0 and 2**32 would become one document once jax truncates them to int32.
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16),
          np.array([[0] * 16 + [2 ** 32] * 16], np.int64)), {}, "outside int32"),
        ((_arr(1, 32, 4, 16), _arr(1, 32, 2, 16), _arr(1, 32, 2, 16)), {"precision": "int8"},
         "precision='int8' is not a jax.lax.Precision"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, kwargs, message):
  with pytest.raises(FlashAttentionError, match=message):
    flash_attention(*args, **kwargs)
  assert issubclass(FlashAttentionError, ValueError)



# ----------------------------------------------------------------------------- edge cases


def test_empty_batch_or_sequence_returns_empty_arrays():
  for B, S in ((0, 32), (2, 0)):
    q, k, v, do = _inputs(7, B, S, 4, 2, 16)
    seg = np.zeros((B, S), np.int32)
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, seg), q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert [g.shape for g in vjp(do)] == [q.shape, k.shape, v.shape]


def test_second_derivatives_and_jvp_raise_clear_errors():
  q, k, v, _ = _inputs(8, 1, 32, 2, 1, 16)
  attn = lambda q: jnp.sum(flash_attention(q, k, v, block_q=16, block_k=16) ** 2)
  with pytest.raises(FlashAttentionError, match="no second derivative"):
    jax.grad(lambda q: jnp.sum(jax.grad(attn)(q)))(q)
  with pytest.raises(FlashAttentionError, match="no second derivative"):
    jax.jvp(jax.grad(attn), (q,), (q,))  # a Hessian-vector product
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(attn, (q,), (q,))


def _kernel_dot_precisions(jaxpr, found=None):
  """{pallas kernel name: [precision of each dot_general in it]} anywhere in `jaxpr`."""
  found = {} if found is None else found

  def dots(inner):
    out = []
    for eqn in inner.eqns:
      if eqn.primitive.name == "dot_general":
        out.append(eqn.params["precision"])
      for param in eqn.params.values():
        sub = getattr(param, "jaxpr", param)
        out += dots(sub) if hasattr(sub, "eqns") else []
    return out

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found[str(eqn.params["name"])] = dots(getattr(eqn.params["jaxpr"], "jaxpr",
                                                    eqn.params["jaxpr"]))
      continue
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if hasattr(sub, "eqns"):
        _kernel_dot_precisions(sub, found)
  return found


@pytest.mark.parametrize("precision, want", [
    (None, lax.Precision.DEFAULT),  # jax's default: TF32 for fp32 dots in Triton on GPU
    (lax.Precision.HIGHEST, lax.Precision.HIGHEST),  # IEEE fp32
])
def test_kernel_dots_carry_the_requested_precision(precision, want):
  q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 32, 1, 16), jnp.float32)
  loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, precision=precision, block_q=16,
                                                 block_k=16, block_q_bwd=16, block_k_bwd=16))
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv).jaxpr
  found = _kernel_dot_precisions(jaxpr)
  assert sorted(found) == ["jaxtrain_flash_bwd_dkv", "jaxtrain_flash_bwd_dq",
                           "jaxtrain_flash_fwd"] and all(found.values()), found
  assert all(p == (want, want) for dots in found.values() for p in dots), found


def test_int64_ids_are_compared_in_their_own_dtype_with_x64():
  B, S, H, K, D = 1, 32, 2, 1, 16
  q, k, v, _ = _inputs(9, B, S, H, K, D)
  with jax.enable_x64(True):
    seg = jnp.asarray([[0] * 16 + [2 ** 32] * 16], jnp.int64)
    got = flash_attention(q, k, v, seg, block_q=16, block_k=16)
    want = reference_attention(q, k, v, seg)
  unsegmented = reference_attention(q, k, v)
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert float(jnp.max(jnp.abs(want - unsegmented))) > 0.1  # two documents, not one


# ----------------------------------------------------------------------------- block skipping


def _documents(B, S, lengths, pad=0, shuffle=False, seed=0):
  """[B, S] int64 ids (numpy, as np.cumsum gives them) of documents of random lengths in
  `lengths`, then `pad` tokens of id 0 (data.py's padding); `shuffle` permutes the ids."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(B):
    ids, doc = [], 1
    while len(ids) < S - pad:
      ids += [doc] * int(rng.choice(lengths))
      doc += 1
    row = np.array(ids[:S - pad] + [0] * pad, np.int64)
    if shuffle:
      row = rng.permutation(doc)[row]
    rows.append(row)
  return np.stack(rows)


_BLOCKS = dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)


@pytest.mark.parametrize("causal, S, kv_heads, separate", [
    (True, 72, 2, False),  # GQA 4, a ragged length (padded to 96), data.py-style 0 padding
    (False, 64, 1, True),  # MQA, non-causal, separate q/kv ids in shuffled order
])
def test_block_skipping_equals_the_unskipped_kernel(causal, S, kv_heads, separate):
  B, H, D = 2, 8, 16
  q, k, v, do = _inputs(10, B, S, H, kv_heads, D)
  q_seg = _documents(B, S, (5, 9, 20, 33), pad=7, shuffle=separate)
  seg = (q_seg, _documents(B, S, (5, 9, 20, 33), pad=7, shuffle=True, seed=1)) if separate \
      else q_seg
  run = lambda skip: [np.asarray(x) for x in _value_and_grads(
      lambda q, k, v: flash_attention(q, k, v, seg, causal=causal, skip_empty_blocks=skip,
                                      **_BLOCKS), q, k, v, do)]
  skipped, dense = run(True), run(False)
  for a, b in zip(skipped, dense):
    np.testing.assert_array_equal(a, b)  # skipped tiles add exact zeros in the dense kernel
  ref = lambda q, k, v: reference_attention(q, k, v, seg, causal=causal)
  errors = _max_errors(lambda q, k, v: flash_attention(q, k, v, seg, causal=causal, **_BLOCKS),
                       ref, q, k, v, do)
  assert max(errors) < 1e-5, errors
  # The kernels' own counters agree with the host block map, and skipping computed fewer tiles.
  blocks = tuple(_BLOCKS[n] for n in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"))
  counted = _kernel_block_counts(q, k, v, seg, causal=causal, blocks=blocks)
  assert counted == block_counts(q.shape, seg, causal=causal, **_BLOCKS)
  dense_count = block_counts(q.shape, seg, causal=causal, skip_empty_blocks=False,
                             **_BLOCKS)
  assert dense_count == _kernel_block_counts(q, k, v, seg, causal=causal, blocks=blocks,
                                             skip_empty_blocks=False)
  assert all(a < b for a, b in zip(counted, dense_count)), (counted, dense_count)


def test_block_counts_fall_as_documents_get_shorter():
  B, S, H = 2, 1024, 8
  blocks = dict(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64)
  counts = [block_counts((B, S, H, 64), np.repeat(np.arange(S // n), n)[None].repeat(B, 0),
                         **blocks) for n in (1024, 512, 256, 128, 64)]
  for longer, shorter in zip(counts, counts[1:]):
    assert all(s < l for s, l in zip(shorter, longer)), counts
  # Block-aligned documents of n tokens: (S / n) causal triangles of n / 64 blocks each.
  for n, c in zip((1024, 512, 256, 128, 64), counts):
    m = n // 64
    assert c.fwd == c.dq == c.dkv == B * H * (S // n) * m * (m + 1) // 2
  assert counts[0] == block_counts((B, S, H, 64), None, **blocks)  # one document: causal only


def test_packed_documents_never_read_other_documents_blocks():
  # Poison what skipping must never read, as the causal test does: with two documents of 32
  # tokens and blocks of 16, document 1's q blocks skip document 0's kv blocks (forward, dQ)
  # and document 0's kv blocks skip document 1's q blocks (dK/dV, which causal alone visits).
  B, S, H, K, D = 1, 64, 2, 1, 16
  q, k, v, do = _inputs(11, B, S, H, K, D)
  seg = jnp.asarray([[0] * 32 + [1] * 32], jnp.int32)
  finite = lambda x: bool(np.all(np.isfinite(x)))

  def run(skip, *qkv):
    attn = lambda q, k, v: flash_attention(q, k, v, seg, causal=True, skip_empty_blocks=skip,
                                           block_q=16, block_k=16, block_q_bwd=16,
                                           block_k_bwd=16)
    return [np.asarray(x) for x in _value_and_grads(attn, *qkv, do)]

  out, dq, _, _ = run(True, q, k, v.at[:, :32].set(jnp.nan))
  assert finite(out[:, 32:]) and finite(dq[:, 32:]) and not finite(out[:, :32])
  _, _, dk, dv = run(True, q.at[:, 32:].set(jnp.nan), k, v)
  assert finite(dk[:, :32]) and finite(dv[:, :32]) and not finite(dk[:, 32:])
  # Without skipping the masked tiles are computed, and 0 * NaN reaches the outputs.
  out, _, _, _ = run(False, q, k, v.at[:, :32].set(jnp.nan))
  assert not finite(out[:, 32:])


# ----------------------------------------------------------------------------- context shards


def test_a_context_shard_against_gathered_keys_matches_the_reference():
  """Queries of one load-balanced shard (rank 1 of 2: chunks 1 and 2 of 4) against every key in
  the shards' order, with packed documents: causal masking by global position, Sq != Sk, the
  LSE and its gradient, and tiles skipped by position ranges (the kernels' own counters: fewer
  than without skipping, and the same results)."""
  B, S, H, K, D = 2, 64, 4, 2, 16
  order = context_order(S, 2)   # load-balanced: rank r holds chunks r and 2c-1-r
  q, _, _, do = _inputs(12, B, S // 2, H, K, D)
  _, k, v, _ = _inputs(13, B, S, H, K, D)
  docs = np.asarray(_packed_segments(B, S, seed=3))
  segs = (jnp.asarray(docs[:, order[S // 2:]]), jnp.asarray(docs[:, order]))
  pos = (jnp.asarray(order[S // 2:], jnp.int32), jnp.asarray(order, jnp.int32))
  blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
  dlse = jnp.asarray(np.random.default_rng(4).standard_normal((B, H, S // 2)), jnp.float32)

  def run(attn):
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return [np.asarray(x) for x in (out, lse, *vjp((do, dlse)))]

  flash = lambda skip: run(lambda q, k, v: flash_attention(
      q, k, v, segs, positions=pos, return_lse=True, skip_empty_blocks=skip, **blocks))
  got, dense = flash(True), flash(False)
  want = run(lambda q, k, v: reference_attention(q, k, v, segs, positions=pos, return_lse=True))
  for a, b, c in zip(got, dense, want):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, atol=2e-5, rtol=1e-5)
  skipped = _kernel_block_counts(q, k, v, segs, blocks=(16,) * 4, positions=pos)
  unskipped = _kernel_block_counts(q, k, v, segs, blocks=(16,) * 4, positions=pos,
                                   skip_empty_blocks=False)
  assert all(a < b for a, b in zip(skipped, unskipped)), (skipped, unskipped)
  # flash_attention_backward: the gradients of a block from the whole attention's out and LSE.
  out, lse = flash_attention(q, k, v, segs, positions=pos, return_lse=True, **blocks)
  _, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, segs, positions=pos, **blocks),
                   q, k, v)
  for a, b in zip(flash_attention_backward(q, k, v, segs, pos, out, lse, do, **blocks), vjp(do)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_ring_step_that_sees_no_key_is_finite():
  """A ring step's kv block entirely after the queries: every row masked, output 0, LSE -inf,
  gradients 0 and finite (the merge and the backward rely on it)."""
  B, S, H, K, D = 1, 32, 2, 1, 16
  q, k, v, do = _inputs(14, B, S, H, K, D)
  pos = (jnp.arange(S, dtype=jnp.int32), jnp.arange(S, 2 * S, dtype=jnp.int32))
  attn = lambda q, k, v: flash_attention(q, k, v, positions=pos, return_lse=True, block_q=16,
                                         block_k=16, block_q_bwd=16, block_k_bwd=16)
  (out, lse), vjp = jax.vjp(attn, q, k, v)
  grads = vjp((do, jnp.ones_like(lse)))
  np.testing.assert_array_equal(out, 0.0)
  assert np.all(np.asarray(lse) == -np.inf)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)

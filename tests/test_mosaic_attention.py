"""The Mosaic GPU flash attention (flash_attention(backend="mosaic")) in jax's GPU interpreter
against the fp32 reference: forward and the three gradients for every feature the Triton
kernel has, plus a value head size that differs from the query/key one.

The interpreter simulates shared memory, TMA and barriers and compiles each warpgroup's program
anew at every grid point, so every run costs seconds: the cases are few and each combines
features (causal x GQA x packed documents x ragged lengths x unequal head sizes; a context
shard: positions, Sq != Sk, the LSE and its cotangent; non-causal with padded keys), shapes are
one or two programs per head, and identical programs load from a persistent compile cache.
What runs here are the checked products (mosaic_tiles.Mma); the fast ones do not interpret at
this jax version and are compiled for H100 in test_gpu_compile.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import compat
from jaxtrain.data.context import context_order
from jaxtrain.model.kernels import (FlashAttentionError, flash_attention,
                                     flash_attention_backward, reference_attention)


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  with compat.persistent_compile_cache(tmp_path_factory.mktemp("mosaic-cache")):
    yield


def _inputs(seed, B, Sq, Sk, H, K, D, Dv, dtype):
  rng = np.random.default_rng(seed)
  shapes = ((B, Sq, H, D), (B, Sk, K, D), (B, Sk, K, Dv), (B, Sq, H, Dv))
  q, k, v, do = (rng.standard_normal(s, np.float32) for s in shapes)
  return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(do))


def _documents(B, S, lengths, seed=0):
  """Row b packs documents of the given lengths, rotated by b (so rows differ)."""
  rows = []
  for b in range(B):
    ls = list(lengths[b % len(lengths):]) + list(lengths[:b % len(lengths)])
    ids = np.repeat(np.arange(len(ls)), ls)[:S]
    rows.append(np.pad(ids, (0, S - len(ids)), mode="edge"))
  return jnp.asarray(np.stack(rows), jnp.int32)


def _vjp_all(attn, q, k, v, cotangent):
  out, vjp = jax.vjp(attn, q, k, v)
  return [out, *vjp(cotangent)]


def _errors(got, want):
  return [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]


def _f32(*xs):
  return [x.astype(jnp.float32) for x in xs]


def test_packed_gqa_causal_ragged_unequal_heads_bf16():
  """Causal, GQA 2, three packed documents per row, S = 100 (padded to 128 inside), q/k head
  dim 64 and v head dim 32 (zero-padded to 64), an explicit softmax scale."""
  B, S, H, K, D, Dv = 1, 100, 4, 2, 64, 32
  q, k, v, do = _inputs(0, B, S, S, H, K, D, Dv, jnp.bfloat16)
  seg = _documents(B, S, (37, 41, 22))
  attn = lambda q, k, v: flash_attention(q, k, v, seg, sm_scale=0.2, backend="mosaic")
  ref = lambda q, k, v: reference_attention(q, k, v, seg, sm_scale=0.2)
  got = jax.jit(lambda *a: _vjp_all(attn, *a, do.astype(jnp.bfloat16)))(q, k, v)
  assert got[0].shape == (B, S, H, Dv) and all(x.dtype == jnp.bfloat16 for x in got)
  errors = _errors(got, _vjp_all(ref, *_f32(q, k, v), do))
  print("bf16 out/dq/dk/dv max err", errors)
  assert errors[0] < 2e-2 and max(errors[1:]) < 5e-2, errors


def test_a_context_shard_with_positions_and_the_lse_fp16():
  """A load-balanced shard's 64 queries (rank 1 of 2: chunks 1 and 2 of 4) against all 128
  keys in the shards' order, separate q/kv segment ids, MQA; the LSE and its cotangent; and
  flash_attention_backward (a ring step's gradients from the whole attention's out and LSE)
  equal to the VJP."""
  B, S, H, K, D = 1, 128, 2, 1, 64
  order = context_order(S, 2)
  q, _, _, do = _inputs(1, B, S // 2, S, H, K, D, D, jnp.float16)
  _, k, v, _ = _inputs(2, B, S // 2, S, H, K, D, D, jnp.float16)
  docs = np.asarray(_documents(B, S, (50, 78)))
  segs = (jnp.asarray(docs[:, order[S // 2:]]), jnp.asarray(docs[:, order]))
  pos = (jnp.asarray(order[S // 2:], jnp.int32), jnp.asarray(order, jnp.int32))
  dlse = jnp.asarray(np.random.default_rng(3).standard_normal((B, H, S // 2)), jnp.float32)
  attn = lambda q, k, v: flash_attention(q, k, v, segs, positions=pos, return_lse=True,
                                         backend="mosaic")
  ref = lambda q, k, v: reference_attention(q, k, v, segs, positions=pos, return_lse=True)
  got = jax.jit(lambda *a: _vjp_all(attn, *a, (do.astype(jnp.float16), dlse)))(q, k, v)
  errors = _errors(got, _vjp_all(ref, *_f32(q, k, v), (do, dlse)))
  print("fp16 out/lse/dq/dk/dv max err", errors)
  assert max(errors[:2]) < 1e-2 and max(errors[2:]) < 3e-2, errors
  out, lse = got[0]
  grads = jax.jit(lambda *a: flash_attention_backward(
      *a, segs, pos, out, lse, do.astype(jnp.float16), backend="mosaic",
      grad_dtype=jnp.float32))(q, k, v)
  _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segs, positions=pos),
                   *_f32(q, k, v))
  errors = _errors(grads, vjp(do))
  assert all(g.dtype == jnp.float32 for g in grads) and max(errors) < 3e-2, errors


def test_non_causal_padded_keys_head_dim_128():
  """Non-causal MHA at head dim 128 with 72 keys (padded to 128: a length mask hides them)
  and no segment ids: the kernels' loops without a block map."""
  B, Sq, Sk, H, K, D = 1, 128, 72, 2, 2, 128
  q, k, v, do = _inputs(4, B, Sq, Sk, H, K, D, D, jnp.bfloat16)
  attn = lambda q, k, v: flash_attention(q, k, v, causal=False, backend="mosaic")
  ref = lambda q, k, v: reference_attention(q, k, v, causal=False)
  got = jax.jit(lambda *a: _vjp_all(attn, *a, do.astype(jnp.bfloat16)))(q, k, v)
  errors = _errors(got, _vjp_all(ref, *_f32(q, k, v), do))
  assert errors[0] < 2e-2 and max(errors[1:]) < 5e-2, errors


def test_packed_documents_never_read_other_documents_blocks():
  """Skipping by the block map is real (non-causal: nothing else skips). With two 128-token
  documents, NaN in document 0's values reaches neither document 1's output nor its dQ
  (forward and dQ skip document 0's kv blocks), and NaN in document 1's queries none of
  document 0's dK/dV (dK/dV skips document 1's q blocks)."""
  B, S, H, K, D = 1, 256, 1, 1, 64
  q, k, v, do = _inputs(5, B, S, S, H, K, D, D, jnp.bfloat16)
  seg = jnp.asarray([[0] * 128 + [1] * 128], jnp.int32)
  attn = lambda q, k, v: flash_attention(q, k, v, seg, causal=False, backend="mosaic")
  run = jax.jit(lambda *a: _vjp_all(attn, *a, do.astype(jnp.bfloat16)))
  finite = lambda x: bool(np.all(np.isfinite(np.asarray(x, np.float32))))
  out, dq, _, _ = run(q, k, v.at[:, :128].set(jnp.nan))
  assert finite(out[:, 128:]) and finite(dq[:, 128:])
  assert not finite(out[:, :128])  # the poison is live where it should be
  _, _, dk, dv = run(q.at[:, 128:].set(jnp.nan), k, v)
  assert finite(dk[:, :128]) and finite(dv[:, :128]) and not finite(dk[:, 128:])


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype=jnp.float32), "backend='mosaic' takes bfloat16 or float16"),
    (dict(D=256), "head dims up to 192"),
    (dict(block_q=96), "block_q=96: backend='mosaic' blocks are 64 or 128"),
    (dict(num_stages=1), "num_stages=1: backend='mosaic' pipelines at least 2"),
    (dict(fast_mma=True, interpret=True), "fast_mma=True uses what jax's GPU interpreter"),
    (dict(backend="cuda"), "backend='cuda'; choose one of"),
    (dict(segments=(True, False)), "got None for kv_segment_ids; pass both"),
])
def test_bad_inputs_raise_one_line_errors_before_tracing(kwargs, message):
  kwargs = dict(kwargs)
  dtype, D = kwargs.pop("dtype", jnp.bfloat16), kwargs.pop("D", 64)
  q, k, v, _ = _inputs(6, 1, 64, 64, 2, 1, D, D, dtype)
  seg = jnp.zeros((1, 64), jnp.int32)
  segments = kwargs.pop("segments", None)
  if segments is not None:
    seg = tuple(seg if given else None for given in segments)
  options = {"backend": "mosaic", **kwargs}
  with pytest.raises(FlashAttentionError, match=message) as err:
    jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, seg, **options), q, k, v)
  assert "\n" not in str(err.value)


def test_ring_steps_merged_by_their_lse_equal_the_gathered_attention():
  """A context rank's ring, hop by hop, with the Mosaic kernel (load-balanced order, packed
  documents): its two partial attentions (its own kv chunk, then the other rank's), merged by
  their LSE as ring_attention merges them, equal the rank's queries against all keys in one
  kernel (out and LSE). On one device: interpreted Mosaic kernels in a multi-device program
  deadlock XLA:CPU (attention.check_interpretable), so the hops are called in sequence here."""
  from jaxtrain.parallel import context_attention as ca
  B, S, H, K, D, c = 1, 256, 1, 1, 64, 2
  q, k, v, _ = _inputs(7, B, S, S, H, K, D, D, jnp.bfloat16)
  order = context_order(S, c)
  docs = _documents(B, S, (90, 166))
  pos = jnp.asarray(order, jnp.int32)
  q, k, v, seg = (x[:, order] for x in (q, k, v, docs))
  ops = ca.kernel_blocks(interpret=True, backend="mosaic")
  mine, other = slice(S // 2, S), slice(0, S // 2)   # rank 1's tokens, then rank 0's
  rank = lambda x, part: x[:, part]  # noqa: E731

  def hops(q, k, v, seg, pos):
    partial = [ops.forward(rank(q, mine), rank(k, part), rank(v, part), rank(seg, mine),
                           rank(seg, part), pos[mine], pos[part]) for part in (mine, other)]
    out, lse = partial[0]
    out, lse = ca.merge(out.astype(jnp.float32), lse, partial[1][0].astype(jnp.float32),
                        partial[1][1])
    gathered = ops.forward(rank(q, mine), k, v, rank(seg, mine), seg, pos[mine], pos)
    return out, lse, *gathered

  ring_out, ring_lse, out, lse = jax.jit(hops)(q, k, v, seg, pos)
  np.testing.assert_allclose(np.asarray(ring_lse), np.asarray(lse), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ring_out), np.asarray(out, np.float32), atol=1e-2)
  want = reference_attention(*_f32(rank(q, mine), k, v), (rank(seg, mine), seg),
                             positions=(pos[mine], pos))
  assert _errors(out, want)[0] < 2e-2

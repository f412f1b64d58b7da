"""Flash attention (forward + backward) in Pallas, Triton backend, with GQA and packed documents.

Layout is [batch, seq, heads, head_dim]: q_BSHD, k_BSKD, v_BSKD with H % K == 0; query head h reads
kv head h // (H // K). The algorithm is FlashAttention-2: the forward walks KV blocks with an online
softmax and saves only the output and the log-sum-exp (fp32, base 2); the backward recomputes the
probabilities block by block in two kernels, one for dK/dV and one for dQ. Causal masking skips
the tiles above the diagonal; with segment ids every kernel also skips the tiles whose q and kv
blocks share no document (block_map.py), so packed short documents cost what they compute.
For context parallelism the kernels also take the global positions of a shard's queries and
keys (causal masking by position, tiles skipped by position ranges), queries and keys of
different lengths, and return the log-sum-exp; `flash_attention_backward` gives one block's
share of the gradients from the whole attention's output and LSE (a ring step's backward).

On CPU the same kernels run in Pallas interpret mode, which is how the tests check them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.compat import triton_compiler_params
from jaxtrain.model.kernels import block_map

__all__ = [
    "FlashAttentionError",
    "block_counts",
    "flash_attention",
    "flash_attention_backward",
    "reference_attention",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256
# Triton's tl.dot needs every tile dimension to be a power of two and at least 16.
_MIN_TILE = 16
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Finite stand-in for -inf on masked logits: exp2(_MASKED - m) underflows to 0 without ever
# forming inf - inf, and it stays representable in fp32.
_MASKED = -1e30

SegmentIds = Union[jax.Array, Tuple[jax.Array, jax.Array], None]


class FlashAttentionError(ValueError):
  """Bad shapes, dtypes or block sizes passed to flash_attention."""


# ----------------------------------------------------------------------------------------------
# Reference (XLA) implementation: the test oracle and the fallback for backends without Triton.


def _split_segments(segment_ids: SegmentIds):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise FlashAttentionError(
          "segment_ids must be one [batch, seq] array or a pair (q_segment_ids, kv_segment_ids); "
          f"got a sequence of length {len(segment_ids)}.")
    q_seg, kv_seg = segment_ids
    if (q_seg is None) != (kv_seg is None):
      missing = "q_segment_ids" if q_seg is None else "kv_segment_ids"
      raise FlashAttentionError(
          f"segment_ids=(q_segment_ids, kv_segment_ids) got None for {missing}; pass both "
          "arrays, one [batch, seq] array for both, or segment_ids=None (no document masking).")
    return q_seg, kv_seg
  return segment_ids, segment_ids


def _check_groups(H: int, K: int) -> None:
  if K == 0 or H % K:
    raise FlashAttentionError(
        f"num_heads={H} must be a multiple of num_kv_heads={K} (GQA groups query heads evenly "
        "over kv heads); pick num_kv_heads among the divisors of num_heads.")


def reference_attention(q, k, v, segment_ids: SegmentIds = None, causal: bool = True,
                        sm_scale: Optional[float] = None, *, positions=None,
                        return_lse: bool = False):
  """Plain attention with repeated KV heads and an fp32 softmax; same contract as flash_attention.

  Rows with no visible key (possible with separate q/kv segment ids) produce zeros.
  """
  B, S, H, D = q.shape
  K = k.shape[2]
  _check_groups(H, K)
  group = H // K
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(D)
  k_BSHD = jnp.repeat(k, group, axis=2)
  v_BSHD = jnp.repeat(v, group, axis=2)
  s_BHST = jnp.einsum("bshd,bthd->bhst", q, k_BSHD,
                      preferred_element_type=jnp.float32) * sm_scale
  T = k.shape[1]
  mask_BST = jnp.ones((B, S, T), dtype=bool)
  if causal and positions is not None:
    q_pos, kv_pos = positions
    mask_BST &= (kv_pos[None, :] <= q_pos[:, None])[None]
  elif causal:
    mask_BST &= jnp.tril(jnp.ones((S, T), dtype=bool))[None]
  q_seg, kv_seg = _split_segments(segment_ids)
  if q_seg is not None:
    mask_BST &= q_seg[:, :, None] == kv_seg[:, None, :]
  s_BHST = jnp.where(mask_BST[:, None], s_BHST, _MASKED)
  p_BHST = jax.nn.softmax(s_BHST, axis=-1)
  out_BSHD = jnp.einsum("bhst,bthd->bshd", p_BHST.astype(v.dtype), v_BSHD,
                        preferred_element_type=jnp.float32)
  # A fully masked row softmaxes to uniform weights over masked keys; zero its output instead.
  # (Zeroing p before the einsum instead is equivalent but slow to compile on XLA CPU.)
  visible_BS11 = jnp.any(mask_BST, axis=-1)[:, :, None, None]
  out_BSHD = jnp.where(visible_BS11, out_BSHD, 0.0).astype(q.dtype)
  if not return_lse:
    return out_BSHD
  lse_BHS = jax.nn.logsumexp(jnp.where(mask_BST[:, None], s_BHST, -jnp.inf), axis=-1)
  return out_BSHD, lse_BHS


# ----------------------------------------------------------------------------------------------
# Static configuration.


@dataclasses.dataclass(frozen=True)
class _Config:
  causal: bool
  sm_scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  kv_len: Optional[int]  # mask keys at or past this (padding that nothing else hides), else None
  has_segments: bool
  has_positions: bool  # causal masking by given [Sq] / [Sk] positions, not 0, 1, ...
  skip_blocks: bool  # loop over block_map schedules (needs segment ids or positions)
  count_blocks: bool  # debug: each program also writes how many tiles it computed
  precision: lax.Precision  # of every in-kernel dot: DEFAULT is TF32 for fp32 on GPU
  num_warps: Optional[int]
  num_warps_bwd: Optional[int]
  num_stages: Optional[int]
  num_stages_bwd: Optional[int]
  interpret: bool


def _default_blocks(head_dim: int) -> Tuple[int, int, int, int]:
  """(block_q, block_k, block_q_bwd, block_k_bwd), chosen for Hopper register/SMEM budgets.

  Compiled for sm_90a (tests/test_gpu_compile.py reads ptxas' report), with segment ids: at
  head dim 64 a 128x128 forward tile spilled 76-264 bytes at 255 registers (64x128: 220, no
  spill). Not yet timed on hardware: bench/attention.py --block-* flags sweep them.
  """
  if head_dim <= 64:
    return 64, 128, 64, 64
  if head_dim <= 128:
    return 128, 64, 64, 64
  return 64, 32, 32, 32


def _compiler_params(num_warps, num_stages):
  return triton_compiler_params(num_warps, num_stages)


# ----------------------------------------------------------------------------------------------
# Kernel helpers (only the Triton-lowerable subset of jax.numpy is used inside kernels).


def _dot_nt(a, b, precision):
  """a @ b.T with fp32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _dot(a, b, precision):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _mask(q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: Optional[int]):
  """Visibility mask, or None when every entry of the tile is visible.

  q_pos/k_pos/q_seg/k_seg are broadcastable to the tile. kv_len masks padded keys where
  causality does not already hide them from real queries (_Config.kv_len).
  """
  mask = None

  def _and(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if causal:
    mask = _and(mask, q_pos >= k_pos)
  if kv_len is not None:
    mask = _and(mask, k_pos < kv_len)
  if q_seg is not None:
    mask = _and(mask, q_seg == k_seg)
  return mask


def _split_refs(refs, cfg: _Config):
  """(q segment ref, kv segment ref, (q position ref, kv position ref), schedule refs, output
  refs, count ref) from the refs after the fixed inputs: segment ids, positions and the block
  schedule come first, the count output last."""
  refs = list(refs)
  q_seg, kv_seg = (refs.pop(0), refs.pop(0)) if cfg.has_segments else (None, None)
  pos = (refs.pop(0), refs.pop(0)) if cfg.has_positions else (None, None)
  schedule = tuple(refs.pop(0) for _ in range(3)) if cfg.skip_blocks else None
  count = refs.pop() if cfg.count_blocks else None
  return q_seg, kv_seg, pos, schedule, refs, count


def _row_loops(cfg: _Config, schedule, q_start, block_q: int, block_k: int, num_k_blocks: int):
  """([(lo, hi, causal_mask)], kv block of iteration t) of a q-block program (forward, dQ)."""
  if schedule is not None:  # the block map's list: (0, split) below the diagonal, then on it
    blocks_ref, split_ref, total_ref = schedule
    split, total = split_ref[...], total_ref[...]
    loops = [(0, split, False), (split, total, True)] if cfg.causal else [(0, total, False)]
    return loops, lambda t: blocks_ref[t]
  if cfg.causal and cfg.has_positions:  # no schedule (skip_empty_blocks=False): mask them all
    return [(0, num_k_blocks, True)], lambda t: t
  if cfg.causal:
    # Blocks strictly below the diagonal need no causal mask; blocks past it are skipped.
    num_full = _div(q_start, block_k)
    num_live = jnp.minimum(_cdiv(q_start + block_q, block_k), num_k_blocks)
    return [(0, num_full, False), (num_full, num_live, True)], lambda t: t
  return [(0, num_k_blocks, False)], lambda t: t


def _col_loops(cfg: _Config, schedule, k_start, block_q: int, block_k: int, num_q_blocks: int):
  """([(lo, hi, causal_mask)], q block of iteration t) of a kv-block program (dK/dV)."""
  if schedule is not None:  # the block map's list: (0, split) on the diagonal, then below it
    blocks_ref, split_ref, total_ref = schedule
    split, total = split_ref[...], total_ref[...]
    loops = [(0, split, True), (split, total, False)] if cfg.causal else [(0, total, False)]
    return loops, lambda t: blocks_ref[t]
  if cfg.causal and cfg.has_positions:
    return [(0, num_q_blocks, True)], lambda t: t
  if cfg.causal:
    # q blocks before first_live see none of these keys; from first_full on, all of them.
    first_live = _div(k_start, block_q)
    first_full = jnp.minimum(_cdiv(k_start + block_k - 1, block_q), num_q_blocks)
    return [(first_live, first_full, True), (first_full, num_q_blocks, False)], lambda t: t
  return [(0, num_q_blocks, False)], lambda t: t


def _run_loops(loops, block_of, body, carry, count):
  """Run body(block, carry, causal_mask=...) over each loop's iterations, in order, counting
  the iterations into `count` when it is not None (the debug block counter)."""
  for lo, hi, causal_mask in loops:
    step = lambda t, c, cm=causal_mask: body(block_of(t), c, causal_mask=cm)
    if count is None:
      carry = lax.fori_loop(lo, hi, step, carry)
    else:
      carry, count = lax.fori_loop(lo, hi, lambda t, c, s=step: (s(t, c[0]), c[1] + 1),
                                   (carry, count))
  return carry, count


def _div(a, b: int):
  # An int32 divisor: a Python int would be int64 under jax_enable_x64, which lax.div refuses.
  return lax.div(a, np.int32(b))


def _cdiv(a, b: int):
  return _div(a + (b - 1), b)


# ----------------------------------------------------------------------------------------------
# Forward kernel: one program per (q block, batch, head); loops over KV blocks.


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Config, num_q_blocks: int):
  q_seg_ref, kv_seg_ref, (q_pos_ref, kv_pos_ref), schedule, (o_ref, lse_ref), count_ref = \
      _split_refs(refs, cfg)
  block_q, head_dim = q_ref.shape
  block_k = cfg.block_k
  num_k_blocks = k_ref.shape[0] // block_k
  q_blk = _q_block_index(pl.program_id(0), num_q_blocks, cfg.causal)
  q_start = q_blk * block_q
  scale2 = cfg.sm_scale * _LOG2E  # work in base 2 so the softmax uses exp2

  q = q_ref[...]
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]
  q_pos = (q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
           if q_pos_ref is None else q_pos_ref[...][:, None])
  kv_len = cfg.kv_len

  def body(j, carry, *, causal_mask):
    acc, m, l = carry
    k_start = pl.multiple_of(j * block_k, block_k)
    kv_slice = pl.ds(k_start, block_k)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    s = _dot_nt(q, k, cfg.precision) * scale2
    k_pos = (k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
             if kv_pos_ref is None else kv_pos_ref[kv_slice][None, :])
    k_seg = None if kv_seg_ref is None else kv_seg_ref[kv_slice][None, :]
    mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=causal_mask, kv_len=kv_len)
    if mask is not None:
      s = jnp.where(mask, s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if mask is not None:
      # A row with no visible key yet has m_new == _MASKED, where exp2(0) = 1 would count
      # masked keys; zeroing keeps fully masked rows at l == 0.
      p = jnp.where(mask, p, 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, cfg.precision)
    return acc, m_new, l

  carry = (jnp.zeros((block_q, head_dim), jnp.float32),
           jnp.full((block_q,), _MASKED, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  count = jnp.int32(0) if cfg.count_blocks else None
  loops, block_of = _row_loops(cfg, schedule, q_start, block_q, block_k, num_k_blocks)
  (acc, m, l), count = _run_loops(loops, block_of, body, carry, count)
  if count_ref is not None:
    count_ref[...] = count

  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # +inf for rows that see no key, so exp2(s - lse) is 0 in the backward.
  lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe))


def _schedule_specs(schedule: block_map.Schedule, program_block):
  """BlockSpecs giving each program its own row of a block_map.Schedule; `program_block` maps
  grid indices to (batch, program's block)."""
  width = schedule.blocks.shape[-1]
  return [pl.BlockSpec((None, None, width), lambda *g: (*program_block(*g), 0)),
          pl.BlockSpec((None, None), program_block), pl.BlockSpec((None, None), program_block)]


def _q_block_index(pid, num_q_blocks: int, causal: bool):
  # Causal work grows with the q block index; launching the longest blocks first shortens the tail.
  return num_q_blocks - 1 - pid if causal else pid


def _schedules(cfg: _Config, q_seg, kv_seg, q_pos, kv_pos, block_q: int, block_k: int, B: int,
               Sq: int, Sk: int):
  return block_map.schedules(jnp, q_seg, kv_seg, block_q, block_k, cfg.causal, batch=B,
                             q_pos_S=None if q_pos is None else q_pos[0],
                             kv_pos_S=None if kv_pos is None else kv_pos[0], seq=(Sq, Sk))


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  B, Sq, H, D = q.shape
  Sk, K = k.shape[1], k.shape[2]
  group = H // K
  block_q = cfg.block_q
  num_q_blocks = Sq // block_q

  def q_map(i, b, h):
    return (b, _q_block_index(i, num_q_blocks, cfg.causal), h, 0)

  def kv_map(i, b, h):
    return (b, 0, _div(h, group), 0)

  in_specs = [
      pl.BlockSpec((None, block_q, None, D), q_map),
      pl.BlockSpec((None, Sk, None, D), kv_map),
      pl.BlockSpec((None, Sk, None, D), kv_map),
  ]
  args = [q, k, v]
  q_row = lambda i, b, h: (b, _q_block_index(i, num_q_blocks, cfg.causal))
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, block_q), q_row),
                 pl.BlockSpec((None, Sk), lambda i, b, h: (b, 0))]
    args += [q_seg, kv_seg]
  if cfg.has_positions:  # [1, S]: one row of positions for the whole batch
    in_specs += [pl.BlockSpec((None, block_q), lambda i, b, h: (0, q_row(i, b, h)[1])),
                 pl.BlockSpec((None, Sk), lambda i, b, h: (0, 0))]
    args += [q_pos, kv_pos]
  if cfg.skip_blocks:
    rows, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, block_q, cfg.block_k, B, Sq, Sk)
    in_specs += _schedule_specs(rows, q_row)
    args += list(rows)
  out_specs = [
      pl.BlockSpec((None, block_q, None, D), q_map),
      pl.BlockSpec((None, None, block_q),
                   lambda i, b, h: (b, h, _q_block_index(i, num_q_blocks, cfg.causal))),
  ]
  out_shape = [
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((B, H, Sq), jnp.float32),
  ]
  if cfg.count_blocks:
    out_specs.append(pl.BlockSpec((None, None, None), lambda i, b, h: (b, h, q_row(i, b, h)[1])))
    out_shape.append(jax.ShapeDtypeStruct((B, H, num_q_blocks), jnp.int32))
  out, lse_BHS, *count = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, num_q_blocks=num_q_blocks),
      grid=(num_q_blocks, B, H),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(cfg.num_warps, cfg.num_stages),
      interpret=cfg.interpret,
      name="jaxtrain_flash_fwd",
  )(*args)
  return out, lse_BHS, (count[0] if count else None)


# ----------------------------------------------------------------------------------------------
# Backward. delta = rowsum(dO * O) is a cheap elementwise reduction left to XLA. Then:
#  * dK/dV: one program per (kv block, batch, kv head). It loops over the G query heads that share
#    this kv head and over their q blocks, accumulating dK/dV for the whole group in fp32
#    registers. Looping inside the kernel (rather than emitting per-q-head dK/dV and summing in
#    XLA) avoids a G-times-larger fp32 intermediate and its extra HBM traffic; the grid still has
#    B * K * S / block_k_bwd programs, enough to fill an H100 at training sizes.
#  * dQ: one program per (q block, batch, q head), looping over KV blocks.
# Both recompute P = exp2(S * scale * log2 e - lse) from the saved base-2 log-sum-exp.


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config, group: int):
  q_seg_ref, kv_seg_ref, (q_pos_ref, kv_pos_ref), schedule, (dk_ref, dv_ref), count_ref = \
      _split_refs(refs, cfg)
  block_k, head_dim = k_ref.shape
  block_q = cfg.block_q_bwd
  num_q_blocks = q_ref.shape[0] // block_q
  k_start = pl.program_id(0) * block_k
  scale2 = cfg.sm_scale * _LOG2E
  kv_len = cfg.kv_len

  k = k_ref[...]
  v = v_ref[...]
  # Work on transposed tiles [block_k, block_q] so no operand needs an in-kernel transpose.
  k_pos = (k_start + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 0)
           if kv_pos_ref is None else kv_pos_ref[...][:, None])
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...][:, None]

  def q_body(i, carry, *, g, causal_mask):
    dk, dv = carry
    q_start = pl.multiple_of(i * block_q, block_q)
    q_slice = pl.ds(q_start, block_q)
    q = q_ref[q_slice, g, :]
    do = do_ref[q_slice, g, :]
    lse = lse_ref[g, q_slice]
    delta = delta_ref[g, q_slice]
    s_t = _dot_nt(k, q, cfg.precision) * scale2
    p_t = jnp.exp2(s_t - lse[None, :])
    q_pos = (q_start + lax.broadcasted_iota(jnp.int32, (block_k, block_q), 1)
             if q_pos_ref is None else q_pos_ref[q_slice][None, :])
    q_seg = None if q_seg_ref is None else q_seg_ref[q_slice][None, :]
    mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=causal_mask, kv_len=kv_len)
    if mask is not None:
      p_t = jnp.where(mask, p_t, 0.0)
    dv = dv + _dot(p_t.astype(do.dtype), do, cfg.precision)
    dp_t = _dot_nt(v, do, cfg.precision)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + _dot(ds_t.astype(q.dtype), q, cfg.precision)
    return dk, dv

  loops, block_of = _col_loops(cfg, schedule, k_start, block_q, block_k, num_q_blocks)

  def group_body(g, state):
    return _run_loops(loops, block_of, functools.partial(q_body, g=g), *state)

  zeros = jnp.zeros((block_k, head_dim), jnp.float32)
  count = jnp.int32(0) if cfg.count_blocks else None
  (dk, dv), count = lax.fori_loop(0, group, group_body, ((zeros, zeros), count))
  if count_ref is not None:
    count_ref[...] = count
  dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg: _Config,
               num_q_blocks: int):
  q_seg_ref, kv_seg_ref, (q_pos_ref, kv_pos_ref), schedule, (dq_ref,), count_ref = \
      _split_refs(refs, cfg)
  block_q, head_dim = q_ref.shape
  block_k = cfg.block_k_bwd
  num_k_blocks = k_ref.shape[0] // block_k
  q_start = _q_block_index(pl.program_id(0), num_q_blocks, cfg.causal) * block_q
  scale2 = cfg.sm_scale * _LOG2E
  kv_len = cfg.kv_len

  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  q_pos = (q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
           if q_pos_ref is None else q_pos_ref[...][:, None])
  q_seg = None if q_seg_ref is None else q_seg_ref[...][:, None]

  def body(j, dq, *, causal_mask):
    k_start = pl.multiple_of(j * block_k, block_k)
    kv_slice = pl.ds(k_start, block_k)
    k = k_ref[kv_slice, :]
    v = v_ref[kv_slice, :]
    p = jnp.exp2(_dot_nt(q, k, cfg.precision) * scale2 - lse)
    k_pos = (k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
             if kv_pos_ref is None else kv_pos_ref[kv_slice][None, :])
    k_seg = None if kv_seg_ref is None else kv_seg_ref[kv_slice][None, :]
    mask = _mask(q_pos, k_pos, q_seg, k_seg, causal=causal_mask, kv_len=kv_len)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (_dot_nt(do, v, cfg.precision) - delta)
    return dq + _dot(ds.astype(k.dtype), k, cfg.precision)

  dq = jnp.zeros((block_q, head_dim), jnp.float32)
  count = jnp.int32(0) if cfg.count_blocks else None
  loops, block_of = _row_loops(cfg, schedule, q_start, block_q, block_k, num_k_blocks)
  dq, count = _run_loops(loops, block_of, body, dq, count)
  dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)
  if count_ref is not None:
    count_ref[...] = count


def _backward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do,
              dlse_BHS=None, grad_dtype=None):
  """dq, dk, dv (and the debug counts), in the inputs' dtypes or `grad_dtype`. `lse_BHS` is
  the kernels' base-2 log-sum-exp (+inf for rows that see no key); `dlse_BHS`, a cotangent of
  the natural-log LSE, enters as delta - dlse (d lse / d s = p)."""
  B, Sq, H, D = q.shape
  Sk, K = k.shape[1], k.shape[2]
  group = H // K
  delta_BHS = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
  if dlse_BHS is not None:
    delta_BHS = delta_BHS - dlse_BHS
  params = _compiler_params(cfg.num_warps_bwd, cfg.num_stages_bwd)
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd

  # dK/dV over grid (kv block, batch, kv head); the group's q heads are a contiguous slab.
  group_q_spec = pl.BlockSpec((None, Sq, group, D), lambda j, b, kh: (b, 0, kh, 0))
  kv_block_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, kh: (b, j, kh, 0))
  group_row_spec = pl.BlockSpec((None, group, Sq), lambda j, b, kh: (b, kh, 0))
  in_specs = [group_q_spec, kv_block_spec, kv_block_spec, group_q_spec, group_row_spec,
              group_row_spec]
  args = [q, k, v, do, lse_BHS, delta_BHS]
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, Sq), lambda j, b, kh: (b, 0)),
                 pl.BlockSpec((None, bk), lambda j, b, kh: (b, j))]
    args += [q_seg, kv_seg]
  if cfg.has_positions:
    in_specs += [pl.BlockSpec((None, Sq), lambda j, b, kh: (0, 0)),
                 pl.BlockSpec((None, bk), lambda j, b, kh: (0, j))]
    args += [q_pos, kv_pos]
  if cfg.skip_blocks:
    rows, cols = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, bq, bk, B, Sq, Sk)
    in_specs += _schedule_specs(cols, lambda j, b, kh: (b, j))
    args += list(cols)
  out_specs = [kv_block_spec, kv_block_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, grad_dtype or k.dtype),
               jax.ShapeDtypeStruct(v.shape, grad_dtype or v.dtype)]
  if cfg.count_blocks:
    out_specs.append(pl.BlockSpec((None, None, None), lambda j, b, kh: (b, kh, j)))
    out_shape.append(jax.ShapeDtypeStruct((B, K, Sk // bk), jnp.int32))
  dk, dv, *count_dkv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, group=group),
      grid=(Sk // bk, B, K),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=params,
      interpret=cfg.interpret,
      name="jaxtrain_flash_bwd_dkv",
  )(*args)

  # dQ over grid (q block, batch, q head).
  num_q_blocks = Sq // bq

  def q_map(i, b, h):
    return (b, _q_block_index(i, num_q_blocks, cfg.causal), h, 0)

  def row_map(i, b, h):
    return (b, h, _q_block_index(i, num_q_blocks, cfg.causal))

  def kv_map(i, b, h):
    return (b, 0, _div(h, group), 0)

  q_spec = pl.BlockSpec((None, bq, None, D), q_map)
  kv_full_spec = pl.BlockSpec((None, Sk, None, D), kv_map)
  row_spec = pl.BlockSpec((None, None, bq), row_map)
  in_specs = [q_spec, kv_full_spec, kv_full_spec, q_spec, row_spec, row_spec]
  args = [q, k, v, do, lse_BHS, delta_BHS]
  q_row = lambda i, b, h: (b, _q_block_index(i, num_q_blocks, cfg.causal))
  if cfg.has_segments:
    in_specs += [pl.BlockSpec((None, bq), q_row),
                 pl.BlockSpec((None, Sk), lambda i, b, h: (b, 0))]
    args += [q_seg, kv_seg]
  if cfg.has_positions:
    in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (0, q_row(i, b, h)[1])),
                 pl.BlockSpec((None, Sk), lambda i, b, h: (0, 0))]
    args += [q_pos, kv_pos]
  if cfg.skip_blocks:
    in_specs += _schedule_specs(rows, q_row)
    args += list(rows)
  out_specs = [q_spec]
  out_shape = [jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype)]
  if cfg.count_blocks:
    out_specs.append(pl.BlockSpec((None, None, None), row_map))
    out_shape.append(jax.ShapeDtypeStruct((B, H, num_q_blocks), jnp.int32))
  dq, *count_dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, num_q_blocks=num_q_blocks),
      grid=(num_q_blocks, B, H),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=params,
      interpret=cfg.interpret,
      name="jaxtrain_flash_bwd_dq",
  )(*args)
  counts = (count_dkv[0], count_dq[0]) if cfg.count_blocks else None
  return dq, dk, dv, counts


# ----------------------------------------------------------------------------------------------
# custom_vjp plumbing: residuals are the inputs, the output and the fp32 log-sum-exp.


def _natural_lse(lse2_BHS):
  """The kernels' base-2 LSE (+inf: no visible key) as a natural-log one (-inf: no key)."""
  return jnp.where(jnp.isinf(lse2_BHS), -jnp.inf, lse2_BHS * _LN2)


def _kernel_lse(lse_BHS):
  return jnp.where(lse_BHS == -jnp.inf, jnp.inf, lse_BHS * _LOG2E)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_core(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse2 = _forward_kernel(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return out, _natural_lse(lse2)


# Neither the forward kernel (whose residuals a second derivative differentiates) nor the
# backward kernels have a derivative of their own: differentiating them (grad of grad,
# forward-over-reverse) would reach the pallas_call JVP rule, which fails deep inside Pallas.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _forward_kernel(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  return _forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[:2]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 12))
def _backward_kernels(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do, dlse_BHS,
                      grad_dtype=None):
  return _backward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do, dlse_BHS,
                   grad_dtype)[:3]


def _no_second_derivative(cfg, *args):
  raise FlashAttentionError(
      "flash_attention has no second derivative (grad of grad, jvp of grad, Hessian-vector "
      "products): its backward pass is a kernel without a derivative. Differentiate "
      "reference_attention (same contract) where second-order terms are needed.")


_forward_kernel.defjvp(_no_second_derivative)
_backward_kernels.defjvp(_no_second_derivative)


def _flash_core_fwd(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  out, lse2 = _forward_kernel(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
  return (out, _natural_lse(lse2)), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse2)


def _flash_core_bwd(cfg, residuals, cotangents):
  do, dlse = cotangents
  dq, dk, dv = _backward_kernels(cfg, *residuals, do, dlse)
  return dq, dk, dv, None, None, None, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)

_NEVER = np.iinfo(np.int32).max  # the position of a padded key: after every query


def _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_head_dim):
  Sq, Sk, D = q.shape[1], k.shape[1], q.shape[3]
  pad_d = padded_head_dim - D
  # Zero head-dim padding leaves q.k and the real output columns unchanged.
  if padded_sq != Sq or pad_d:
    q = jnp.pad(q, ((0, 0), (0, padded_sq - Sq), (0, 0), (0, pad_d)))
  if padded_sk != Sk or pad_d:
    k, v = (jnp.pad(x, ((0, 0), (0, padded_sk - Sk), (0, 0), (0, pad_d))) for x in (k, v))
  if q_seg is not None:
    q_seg = block_map.pad_segments(jnp, q_seg, padded_sq)
    kv_seg = block_map.pad_segments(jnp, kv_seg, padded_sk)
  if q_pos is not None:
    # Padded queries repeat the last position (their block's range stays), padded keys come
    # after every query: causality hides them.
    q_pos = block_map.pad_segments(jnp, q_pos, padded_sq)
    kv_pos = jnp.pad(kv_pos, ((0, 0), (0, padded_sk - Sk)), constant_values=_NEVER)
  return q, k, v, q_seg, kv_seg, q_pos, kv_pos


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_head_dim"))
def _flash_padded(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, cfg, padded_sq, padded_sk,
                  padded_head_dim):
  Sq, D = q.shape[1], q.shape[3]
  out, lse = _flash_core(cfg, *_pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq,
                                    padded_sk, padded_head_dim))
  return out[:, :Sq, :, :D], lse[:, :, :Sq]


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_head_dim",
                                             "grad_dtype"))
def _backward_padded(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do, *, cfg, padded_sq,
                     padded_sk, padded_head_dim, grad_dtype=None):
  Sq, Sk, D = q.shape[1], k.shape[1], q.shape[3]
  padded = _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_head_dim)
  rows = ((0, 0), (0, padded_sq - Sq), (0, 0), (0, padded_head_dim - D))
  out, do = jnp.pad(out, rows), jnp.pad(do, rows)
  # padded rows see no key (+inf), so they add nothing to dK/dV
  lse2 = jnp.pad(_kernel_lse(lse.astype(jnp.float32)), ((0, 0), (0, 0), (0, padded_sq - Sq)),
                 constant_values=jnp.inf)
  dq, dk, dv = _backward_kernels(cfg, *padded, out, lse2, do, None, grad_dtype)
  return dq[:, :Sq, :, :D], dk[:, :Sk, :, :D], dv[:, :Sk, :, :D]


# ----------------------------------------------------------------------------------------------
# Public entry point.


def _check_block(name: str, value: int) -> int:
  if not isinstance(value, int) or value < _MIN_TILE or value & (value - 1):
    raise FlashAttentionError(
        f"{name}={value!r} must be a power of two >= {_MIN_TILE} (Triton tile constraint).")
  return value


def _fit_block(block: int, seq_len: int) -> int:
  # A block longer than the (power-of-two rounded) sequence only adds padding.
  return max(_MIN_TILE, min(block, pl.next_power_of_2(seq_len)))


def _exact_segment_ids(seg, name: str):
  """Segment ids in a dtype the kernels compare exactly: int32, or the ids' own 64-bit dtype
  when jax has x64 on. Without x64 a 64-bit array can only be a host array, and jax would
  truncate it: it passes only if its values fit int32."""
  if seg is None or jnp.dtype(seg.dtype).itemsize <= 4:
    # <= 32-bit ints cast to int32 injectively (uint32 wraps): equality, all a mask needs, holds.
    return None if seg is None else jnp.asarray(seg).astype(jnp.int32)
  if jax.config.jax_enable_x64:
    return jnp.asarray(seg)
  values = np.asarray(seg)
  info = np.iinfo(np.int32)
  if values.size and (values.min() < info.min or values.max() > info.max):
    raise FlashAttentionError(
        f"{name} ({values.dtype}) hold values in [{values.min()}, {values.max()}], outside "
        "int32, which jax (x64 off) would truncate, merging documents; relabel them per row "
        "(e.g. np.unique(ids, return_inverse=True)[1]) or enable jax_enable_x64.")
  return jnp.asarray(values.astype(np.int32))


def _split_positions(positions):
  if positions is None:
    return None, None
  if not isinstance(positions, (tuple, list)) or len(positions) != 2 or any(
      x is None for x in positions):
    raise FlashAttentionError(
        "positions must be a pair (q_positions [Sq], kv_positions [Sk]) of integer arrays, or "
        "None (0, 1, ... for both)")
  return tuple(positions)


def _validate(q, k, v, q_seg, kv_seg, q_pos, kv_pos, one_segment_array: bool):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise FlashAttentionError(
          f"{name} must be 4-D [batch, seq, heads, head_dim]; got shape {getattr(x, 'shape', x)}.")
  B, S, H, D = q.shape
  if k.shape != v.shape:
    raise FlashAttentionError(f"k and v must have the same shape; got k {k.shape}, v {v.shape}.")
  Bk, Sk, K, Dk = k.shape
  if Bk != B:
    raise FlashAttentionError(f"batch mismatch: q has {B}, k/v have {Bk}.")
  if Dk != D:
    raise FlashAttentionError(f"head_dim mismatch: q has {D}, k/v have {Dk}.")
  _check_groups(H, K)
  if not 1 <= D <= MAX_HEAD_DIM:
    raise FlashAttentionError(
        f"head_dim={D} is unsupported: must be in [1, {MAX_HEAD_DIM}] (non-powers of two and "
        "dims below 16 are zero-padded).")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if len(dtypes) != 1:
    raise FlashAttentionError(
        f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}.")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise FlashAttentionError(
        f"dtype {q.dtype} is unsupported; use one of float32, bfloat16, float16.")
  if one_segment_array and Sk != S:
    raise FlashAttentionError(
        f"sequence mismatch: q has {S} tokens, k/v have {Sk}, and one segment_ids array can "
        "only serve both when they match; pass (q_segment_ids, kv_segment_ids).")
  for name, seg, n in (("q segment_ids", q_seg, S), ("kv segment_ids", kv_seg, Sk)):
    if seg is None:
      continue
    if tuple(seg.shape) != (B, n):
      raise FlashAttentionError(f"{name} must have shape [batch, seq] = {(B, n)}; "
                                f"got {tuple(seg.shape)}.")
    if not jnp.issubdtype(seg.dtype, jnp.integer):
      raise FlashAttentionError(f"{name} must be an integer array; got {seg.dtype}.")
  for name, pos, n in (("q_positions", q_pos, S), ("kv_positions", kv_pos, Sk)):
    if pos is None:
      continue
    if tuple(pos.shape) != (n,) or not jnp.issubdtype(pos.dtype, jnp.integer):
      raise FlashAttentionError(f"{name} must be an integer array of shape [seq] = ({n},); "
                                f"got {pos.dtype}{list(pos.shape)}.")


def _precision(precision) -> lax.Precision:
  """The in-kernel dots' precision: the argument, else jax's default_matmul_precision."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  if precision is None:
    return lax.Precision.DEFAULT
  try:
    return lax.Precision(precision)
  except (ValueError, TypeError):
    raise FlashAttentionError(
        f"precision={precision!r} is not a jax.lax.Precision (DEFAULT or HIGH: TF32 for fp32 "
        "inputs on GPU; HIGHEST: full fp32)") from None


def _resolve(B, Sq, Sk, H, D, has_segments, has_positions=False, *, causal, sm_scale, blocks,
             num_warps, num_warps_bwd, num_stages, num_stages_bwd, interpret, precision,
             skip_empty_blocks, count_blocks=False):
  """(_Config, padded q length, padded kv length, padded head_dim) for a call: what
  flash_attention runs and what block_counts counts."""
  padded_d = max(_MIN_TILE, pl.next_power_of_2(D))
  chosen = []
  for name, value, default, n in zip(("block_q", "block_k", "block_q_bwd", "block_k_bwd"),
                                     blocks, _default_blocks(padded_d), (Sq, Sk, Sq, Sk)):
    chosen.append(_check_block(name, value) if value is not None else _fit_block(default, n))
  multiple = max(chosen)
  padded_sq, padded_sk = (-(-n // multiple) * multiple for n in (Sq, Sk))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  # Padded keys sit after every real query (positions Sk, ... or _NEVER) unless attention is
  # not causal or more queries than keys count from 0: only then a length mask hides them.
  hide_padding = padded_sk != Sk and (not causal or (not has_positions and Sq > Sk))
  cfg = _Config(
      causal=bool(causal), sm_scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
      block_q=chosen[0], block_k=chosen[1], block_q_bwd=chosen[2], block_k_bwd=chosen[3],
      kv_len=Sk if hide_padding else None, has_segments=has_segments,
      has_positions=bool(has_positions and causal),
      skip_blocks=(has_segments or bool(has_positions and causal)) and bool(skip_empty_blocks),
      count_blocks=count_blocks, precision=_precision(precision),
      num_warps=(4 if padded_d <= 64 else 8) if num_warps is None else num_warps,
      num_warps_bwd=(4 if padded_d <= 64 else 8) if num_warps_bwd is None else num_warps_bwd,
      num_stages=3 if num_stages is None else num_stages,
      num_stages_bwd=2 if num_stages_bwd is None else num_stages_bwd,
      interpret=bool(interpret))
  return cfg, padded_sq, padded_sk, padded_d


def _prepare(q, k, v, segment_ids, positions, *, causal, sm_scale, blocks, num_warps,
             num_warps_bwd, num_stages, num_stages_bwd, interpret, precision,
             skip_empty_blocks):
  """Validated int32 ids and positions, and the (_Config, padded sizes) of a call."""
  q_seg, kv_seg = _split_segments(segment_ids)
  q_pos, kv_pos = _split_positions(positions)
  _validate(q, k, v, q_seg, kv_seg, q_pos, kv_pos,
            one_segment_array=segment_ids is not None and not isinstance(segment_ids,
                                                                         (tuple, list)))
  q_seg = _exact_segment_ids(q_seg, "q segment_ids")
  kv_seg = _exact_segment_ids(kv_seg, "kv segment_ids")
  if q_pos is not None and causal:  # [1, S]: the layout the kernels read them in
    q_pos, kv_pos = (jnp.asarray(x).astype(jnp.int32)[None] for x in (q_pos, kv_pos))
  else:
    q_pos = kv_pos = None  # without causal masking positions change nothing
  B, Sq, H, D = q.shape
  if B == 0 or Sq == 0 or k.shape[1] == 0:
    return (q_seg, kv_seg, q_pos, kv_pos), None
  cfg, padded_sq, padded_sk, padded_d = _resolve(
      B, Sq, k.shape[1], H, D, q_seg is not None, q_pos is not None, causal=causal,
      sm_scale=sm_scale, blocks=blocks, num_warps=num_warps, num_warps_bwd=num_warps_bwd,
      num_stages=num_stages, num_stages_bwd=num_stages_bwd, interpret=interpret,
      precision=precision, skip_empty_blocks=skip_empty_blocks)
  sizes = dict(cfg=cfg, padded_sq=padded_sq, padded_sk=padded_sk, padded_head_dim=padded_d)
  return (q_seg, kv_seg, q_pos, kv_pos), sizes


def flash_attention(
    q_BSHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segment_ids_BS: SegmentIds = None,
    *,
    positions=None,
    return_lse: bool = False,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    block_q_bwd: Optional[int] = None,
    block_k_bwd: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_warps_bwd: Optional[int] = None,
    num_stages: Optional[int] = None,
    num_stages_bwd: Optional[int] = None,
    interpret: Optional[bool] = None,
    precision: Optional[lax.Precision] = None,
    skip_empty_blocks: bool = True,
):
  """Memory-efficient attention softmax(q k^T * sm_scale + mask) v, differentiable once.

  Args:
    q_BSHD: queries [B, Sq, H, D]; float32, bfloat16 or float16.
    k_BSKD, v_BSKD: keys/values [B, Sk, K, D] with H % K == 0 (K == 1 is MQA); same dtype as
      q. Sk may differ from Sq (a context-parallel shard's queries against gathered keys).
    segment_ids_BS: None, an int [B, S] array (packed documents: i attends to j only when their
      ids match; Sq == Sk), or a pair (q_segment_ids [B, Sq], kv_segment_ids [B, Sk]), both
      given. Rows with no visible key return 0. Ids are compared exactly in any integer dtype
      (64-bit host ids must fit int32 unless jax_enable_x64 is on).
    positions: None (queries and keys at 0, 1, ...), or a pair (q_positions [Sq],
      kv_positions [Sk]) of int32 positions in the whole sequence, shared by the batch rows:
      causal masking then keeps key j for query i when kv_positions[j] <= q_positions[i]. A
      context-parallel shard passes its tokens' global positions (any order: tiles are
      skipped from each block's range of positions, block_map.py). Ignored without causal.
    return_lse: also return the fp32 natural-log log-sum-exp [B, H, Sq] of each query's
      scaled scores (-inf for a row with no visible key), differentiable too: what a ring
      step needs to merge partial results.
    causal: also require j <= i (by position).
    sm_scale: logit scale, default 1/sqrt(D).
    block_q, block_k: forward tile sizes; block_q_bwd, block_k_bwd: backward tile sizes
      (dK/dV kernel keeps a block_k_bwd KV tile and loops over block_q_bwd q tiles; dQ the
      reverse). Powers of two >= 16; None picks Hopper defaults by head_dim.
    num_warps*, num_stages*: Triton launch parameters (GPU only).
    interpret: run the Pallas interpreter; None means True unless the default backend is GPU.
    precision: of the in-kernel dots. None follows jax's default_matmul_precision, whose
      default, like DEFAULT and HIGH, computes fp32 inputs in TF32 on GPU (as XLA's fp32 dots
      do there; ~1e-3 relative, not the ~1e-6 the CPU tests see); HIGHEST computes full fp32
      (several times slower). No effect on bf16/fp16 inputs or in interpret mode.
    skip_empty_blocks: with segment ids or positions, skip the (q block, kv block) tiles no
      query of which sees a key of (block_map.py; exact). False only to measure what
      skipping saves.

  Returns:
    [B, Sq, H, D] in q's dtype (and the LSE with return_lse). Softmax statistics and all
    accumulations are fp32. An empty batch or sequence returns empty arrays without running a
    kernel.

  A sequence length that is not a multiple of the block sizes is zero-padded up to one (padded
  keys are masked) and the result sliced back; head dims that are not a power of two >= 16 are
  zero-padded likewise. Both cost a copy of q/k/v; prefer aligned shapes. Raises
  FlashAttentionError (a ValueError) on inconsistent shapes, dtypes, head_dim > 256, bad blocks
  or half-given segment ids, and when differentiated twice; jvp (forward mode) is not
  supported either (jax raises a TypeError for the custom VJP).
  """
  ids, sizes = _prepare(
      q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, positions, causal=causal, sm_scale=sm_scale,
      blocks=(block_q, block_k, block_q_bwd, block_k_bwd), num_warps=num_warps,
      num_warps_bwd=num_warps_bwd, num_stages=num_stages, num_stages_bwd=num_stages_bwd,
      interpret=interpret, precision=precision, skip_empty_blocks=skip_empty_blocks)
  B, Sq, H, _ = q_BSHD.shape
  if sizes is None:  # an empty batch or sequence
    out = jnp.zeros(q_BSHD.shape, q_BSHD.dtype)
    return (out, jnp.full((B, H, Sq), -jnp.inf, jnp.float32)) if return_lse else out
  out, lse = _flash_padded(q_BSHD, k_BSKD, v_BSKD, *ids, **sizes)
  return (out, lse) if return_lse else out


def flash_attention_backward(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, positions, out_BSHD,
                             lse_BHS, do_BSHD, *, causal: bool = True, grad_dtype=None,
                             **options):
  """(dq, dk, dv) of one block of a larger attention, from the whole attention's output and
  LSE (natural log, -inf for no visible key) and the output cotangent: p = exp(s - lse) and
  ds = p (dp - rowsum(do * out)) are then this block's share of the exact gradients, as a
  ring step's backward needs (context_attention.py). In the inputs' dtypes, or `grad_dtype`
  (float32: partial gradients that sum without rounding). Same arguments and options as
  flash_attention; not differentiable."""
  ids, sizes = _prepare(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, positions, causal=causal,
                        **_options(options))
  dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
  if sizes is None:
    return tuple(jnp.zeros(x.shape, dtype or x.dtype) for x in (q_BSHD, k_BSKD, v_BSKD))
  return _backward_padded(q_BSHD, k_BSKD, v_BSKD, *ids, out_BSHD, lse_BHS, do_BSHD,
                          grad_dtype=dtype, **sizes)


def _options(options: dict) -> dict:
  known = ("sm_scale", "block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps",
           "num_warps_bwd", "num_stages", "num_stages_bwd", "interpret", "precision",
           "skip_empty_blocks")
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise FlashAttentionError(f"unknown options {unknown}; known: {', '.join(known)}")
  o = {k: options.get(k) for k in known}
  return dict(sm_scale=o["sm_scale"], blocks=(o["block_q"], o["block_k"], o["block_q_bwd"],
                                              o["block_k_bwd"]),
              num_warps=o["num_warps"], num_warps_bwd=o["num_warps_bwd"],
              num_stages=o["num_stages"], num_stages_bwd=o["num_stages_bwd"],
              interpret=o["interpret"], precision=o["precision"],
              skip_empty_blocks=True if o["skip_empty_blocks"] is None
              else o["skip_empty_blocks"])


def block_counts(q_shape, segment_ids_BS=None, *, causal: bool = True,
                 block_q=None, block_k=None, block_q_bwd=None, block_k_bwd=None,
                 skip_empty_blocks: bool = True) -> block_map.BlockCounts:
  """The (q block, kv block, query head) tiles flash_attention's forward, dK/dV and dQ kernels
  compute for queries of shape `q_shape` and these (numpy or concrete) segment ids: the same
  blocks, padding and block map the kernels use, counted on the host without running them."""
  B, S, H, D = q_shape
  cfg, padded_s, _, _ = _resolve(
      B, S, S, H, D, segment_ids_BS is not None, causal=causal, sm_scale=None,
      blocks=(block_q, block_k, block_q_bwd, block_k_bwd), num_warps=None, num_warps_bwd=None,
      num_stages=None, num_stages_bwd=None, interpret=True, precision=None,
      skip_empty_blocks=skip_empty_blocks)
  q_seg, kv_seg = _split_segments(segment_ids_BS)
  if q_seg is not None:
    q_seg, kv_seg = (block_map.pad_segments(np, np.asarray(s), padded_s) for s in (q_seg, kv_seg))
  return block_map.block_counts(
      q_seg, kv_seg, batch=B, seq=padded_s, num_heads=H, causal=cfg.causal, block_q=cfg.block_q,
      block_k=cfg.block_k, block_q_bwd=cfg.block_q_bwd, block_k_bwd=cfg.block_k_bwd,
      skip=cfg.skip_blocks)


def _kernel_block_counts(q, k, v, segment_ids_BS=None, *, causal=True, blocks=(None,) * 4,
                         skip_empty_blocks=True, positions=None) -> block_map.BlockCounts:
  """block_counts as the kernels themselves count them (debug outputs; interpret mode on CPU):
  the test that the host block map is the one the kernels run."""
  q_seg, kv_seg = _split_segments(segment_ids_BS)
  q_seg = _exact_segment_ids(q_seg, "q segment_ids")
  kv_seg = _exact_segment_ids(kv_seg, "kv segment_ids")
  q_pos, kv_pos = _split_positions(positions)
  if q_pos is not None:
    q_pos, kv_pos = (jnp.asarray(x, jnp.int32)[None] for x in (q_pos, kv_pos))
  B, Sq, H, D = q.shape
  cfg, padded_sq, padded_sk, padded_d = _resolve(
      B, Sq, k.shape[1], H, D, q_seg is not None, q_pos is not None, causal=causal,
      sm_scale=None, blocks=blocks, num_warps=None, num_warps_bwd=None, num_stages=None,
      num_stages_bwd=None, interpret=None, precision=None,
      skip_empty_blocks=skip_empty_blocks, count_blocks=True)
  return block_map.BlockCounts(*(int(n) for n in _counted_run(
      q, k, v, q_seg, kv_seg, q_pos, kv_pos, cfg=cfg, padded_sq=padded_sq, padded_sk=padded_sk,
      padded_head_dim=padded_d)))


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_head_dim"))
def _counted_run(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, cfg, padded_sq, padded_sk,
                 padded_head_dim):
  padded = _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_head_dim)
  out, lse_BHS, n_fwd = _forward(cfg, *padded)
  _, _, _, (n_dkv, n_dq) = _backward(cfg, *padded, out, lse_BHS, jnp.ones_like(out))
  return jnp.sum(n_fwd), jnp.sum(n_dkv), jnp.sum(n_dq)

"""Flash attention's forward kernel and its pallas_call: one program per (q block, batch, head),
looping over KV blocks with an online softmax; it writes the output and the base-2
log-sum-exp (fp32) the backward recomputes the probabilities from.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.model.kernels.flash_config import _Config
from jaxtrain.model.kernels.flash_tiles import (_LOG2E, _MASKED, _dot, _dot_nt, _mask,
                                                _pallas_call, _q_block_index, _q_maps,
                                                _q_program_inputs, _row_loops, _run_loops,
                                                _schedules, _split_refs)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Config, num_q_blocks: int):
  q_seg_ref, kv_seg_ref, (q_pos_ref, kv_pos_ref), schedule, (o_ref, lse_ref), count_ref = \
      _split_refs(refs, cfg)
  block_q = q_ref.shape[0]
  v_head_dim = v_ref.shape[1]
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

  carry = (jnp.zeros((block_q, v_head_dim), jnp.float32),
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


def _forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  B, Sq, H, D = q.shape
  Sk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  group = H // K
  block_q = cfg.block_q
  num_q_blocks = Sq // block_q
  maps = _q_maps(cfg, num_q_blocks, group)
  in_specs = [
      pl.BlockSpec((None, block_q, None, D), maps.q),
      pl.BlockSpec((None, Sk, None, D), maps.kv),
      pl.BlockSpec((None, Sk, None, Dv), maps.kv),
  ]
  rows = None
  if cfg.skip_blocks:
    rows, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, block_q, cfg.block_k, B, Sq, Sk)
  extra_specs, extra_args = _q_program_inputs(cfg, maps.q_row, block_q, Sk, q_seg, kv_seg,
                                              q_pos, kv_pos, rows)
  in_specs += extra_specs
  args = [q, k, v, *extra_args]
  (out, lse_BHS), count = _pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, num_q_blocks=num_q_blocks), cfg, args,
      name="jaxtrain_flash_fwd", grid=(num_q_blocks, B, H), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, block_q, None, Dv), maps.q),
                 pl.BlockSpec((None, None, block_q), maps.row)],
      out_shape=[jax.ShapeDtypeStruct((B, Sq, H, Dv), q.dtype),
                 jax.ShapeDtypeStruct((B, H, Sq), jnp.float32)],
      count_map=maps.row, count_shape=(B, H, num_q_blocks),
      warps_stages=(cfg.num_warps, cfg.num_stages))
  return out, lse_BHS, count

"""Flash attention's backward kernels and their pallas_calls.

delta = rowsum(dO * O) is a cheap elementwise reduction left to XLA. Then:
 * dK/dV: one program per (kv block, batch, kv head). It loops over the G query heads that share
   this kv head and over their q blocks, accumulating dK/dV for the whole group in fp32
   registers. Looping inside the kernel (rather than emitting per-q-head dK/dV and summing in
   XLA) avoids a G-times-larger fp32 intermediate and its extra HBM traffic; the grid still has
   B * K * S / block_k_bwd programs, enough to fill an H100 at training sizes.
 * dQ: one program per (q block, batch, q head), looping over KV blocks.
Both recompute P = exp2(S * scale * log2 e - lse) from the saved base-2 log-sum-exp.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.model.kernels.flash_config import _Config
from jaxtrain.model.kernels.flash_tiles import (_LOG2E, _col_loops, _dot, _dot_nt, _mask,
                                                _pallas_call, _q_block_index, _q_maps,
                                                _q_program_inputs, _row_loops, _run_loops,
                                                _schedule_specs, _schedules, _split_refs)


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

  zeros = (jnp.zeros((block_k, head_dim), jnp.float32),
           jnp.zeros((block_k, v_ref.shape[1]), jnp.float32))
  count = jnp.int32(0) if cfg.count_blocks else None
  (dk, dv), count = lax.fori_loop(0, group, group_body, (zeros, count))
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


def _dkv_call(cfg: _Config, q, k, v, do, lse_BHS, delta_BHS, q_seg, kv_seg, q_pos, kv_pos, cols,
              grad_dtype):
  """(dk, dv, debug count or None) over grid (kv block, batch, kv head); the group's q heads
  are a contiguous slab. `cols`: the block map's q blocks of each kv block (cfg.skip_blocks)."""
  B, Sq, H, D = q.shape
  Sk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  group = H // K
  bk = cfg.block_k_bwd
  group_spec = lambda d: pl.BlockSpec((None, Sq, group, d), lambda j, b, kh: (b, 0, kh, 0))  # noqa: E731
  kv_spec = lambda d: pl.BlockSpec((None, bk, None, d), lambda j, b, kh: (b, j, kh, 0))  # noqa: E731
  group_row_spec = pl.BlockSpec((None, group, Sq), lambda j, b, kh: (b, kh, 0))
  in_specs = [group_spec(D), kv_spec(D), kv_spec(Dv), group_spec(Dv), group_row_spec,
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
    in_specs += _schedule_specs(cols, lambda j, b, kh: (b, j))
    args += list(cols)
  (dk, dv), count = _pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, group=group), cfg, args,
      name="jaxtrain_flash_bwd_dkv", grid=(Sk // bk, B, K), in_specs=in_specs,
      out_specs=[kv_spec(D), kv_spec(Dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, grad_dtype or k.dtype),
                 jax.ShapeDtypeStruct(v.shape, grad_dtype or v.dtype)],
      count_map=lambda j, b, kh: (b, kh, j), count_shape=(B, K, Sk // bk),
      warps_stages=(cfg.num_warps_bwd, cfg.num_stages_bwd))
  return dk, dv, count


def _dq_call(cfg: _Config, q, k, v, do, lse_BHS, delta_BHS, q_seg, kv_seg, q_pos, kv_pos, rows,
             grad_dtype):
  """(dq, debug count or None) over grid (q block, batch, q head). `rows`: the block map's kv
  blocks of each q block (cfg.skip_blocks)."""
  B, Sq, H, D = q.shape
  Sk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  group = H // K
  bq = cfg.block_q_bwd
  num_q_blocks = Sq // bq
  maps = _q_maps(cfg, num_q_blocks, group)
  q_spec = lambda d: pl.BlockSpec((None, bq, None, d), maps.q)  # noqa: E731
  kv_full_spec = lambda d: pl.BlockSpec((None, Sk, None, d), maps.kv)  # noqa: E731
  row_spec = pl.BlockSpec((None, None, bq), maps.row)
  in_specs = [q_spec(D), kv_full_spec(D), kv_full_spec(Dv), q_spec(Dv), row_spec, row_spec]
  extra_specs, extra_args = _q_program_inputs(cfg, maps.q_row, bq, Sk, q_seg, kv_seg, q_pos, kv_pos,
                                              rows)
  in_specs += extra_specs
  args = [q, k, v, do, lse_BHS, delta_BHS, *extra_args]
  (dq,), count = _pallas_call(
      functools.partial(_dq_kernel, cfg=cfg, num_q_blocks=num_q_blocks), cfg, args,
      name="jaxtrain_flash_bwd_dq", grid=(num_q_blocks, B, H), in_specs=in_specs,
      out_specs=[q_spec(D)], out_shape=[jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype)],
      count_map=maps.row, count_shape=(B, H, num_q_blocks),
      warps_stages=(cfg.num_warps_bwd, cfg.num_stages_bwd))
  return dq, count


def _backward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do,
              dlse_BHS=None, grad_dtype=None):
  """dq, dk, dv (and the debug counts), in the inputs' dtypes or `grad_dtype`. `lse_BHS` is
  the kernels' base-2 log-sum-exp (+inf for rows that see no key); `dlse_BHS`, a cotangent of
  the natural-log LSE, enters as delta - dlse (d lse / d s = p)."""
  delta_BHS = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
  if dlse_BHS is not None:
    delta_BHS = delta_BHS - dlse_BHS
  rows = cols = None
  if cfg.skip_blocks:  # the block map: kv blocks of each q block (dQ), q blocks of each kv block
    rows, cols = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, cfg.block_q_bwd, cfg.block_k_bwd,
                            q.shape[0], q.shape[1], k.shape[1])
  ids = (q_seg, kv_seg, q_pos, kv_pos)
  dk, dv, count_dkv = _dkv_call(cfg, q, k, v, do, lse_BHS, delta_BHS, *ids, cols, grad_dtype)
  dq, count_dq = _dq_call(cfg, q, k, v, do, lse_BHS, delta_BHS, *ids, rows, grad_dtype)
  counts = (count_dkv, count_dq) if cfg.count_blocks else None
  return dq, dk, dv, counts


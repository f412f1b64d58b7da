"""Flash attention's forward kernel on Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

One program per (2 q blocks, batch, head): each compute warpgroup owns one block of queries
and walks the program's KV blocks with an online softmax, while the memory warpgroup streams
K (and the keys' segment ids and positions) and V through shared memory. It writes the output
and the base-2 log-sum-exp (fp32) that the backward recomputes the probabilities from, as
the Triton kernel does (flash_forward.py); the block map (block_map.py) is the same, at the
granularity of a program's two blocks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain.model.kernels.flash_config import _Config
from jaxtrain.model.kernels.flash_tiles import _LOG2E, _MASKED, _schedules
from jaxtrain.model.kernels import mosaic_tiles as mt
from jaxtrain.model.kernels.mosaic_tiles import plgpu


def _forward_body(refs, cfg: _Config, dims):
  B, Sq, Sk, H, K, D, Dv = dims
  bq, bk = cfg.block_q, cfg.block_k
  dtype = refs["q"].dtype
  mma = mt.Mma(cfg.fast_mma)
  wgs = cfg.compute_wgs
  pr = mt.program(refs, cfg, axis="q", programs=Sq // (wgs * bq), span=wgs * bq,
                  other_block=bk, num_other=Sk // bk, group=H // K, rows=True)
  b, h, kh = pr.b, pr.h, pr.kh
  scale2 = cfg.sm_scale * _LOG2E  # base 2: the softmax uses exp2

  def kv_window(j):
    return pl.ds(j * bk, bk)
  # K^T for q @ K^T: the fast kernel views K's tile transposed, the checked one streams K^T
  k_streams = [mma.transposed_stream(refs["k"], lambda j: (b, kv_window(j), kh), (bk, D), dtype)]
  k_streams += mt.row_streams(refs, cfg, "kv_seg", "kv_pos", kv_window, b, bk)
  v_streams = [mt.Stream(lambda j: refs["v"].at[b, kv_window(j), kh], mt.tile_smem((bk, Dv), dtype))]
  pipeline = mt.Pipeline([k_streams, v_streams], cfg.num_stages, wgs)

  private = [mt.tile_smem((wgs, bq, D), dtype),      # the q block
             plgpu.Barrier(num_arrivals=1 + cfg.has_segments + cfg.has_positions,
                           num_barriers=wgs)]
  private.append(mt.tile_smem((wgs, bq, bk), dtype) if not cfg.fast_mma else None)
  private.append(mt.row_smem((wgs, bq), jnp.int32) if cfg.has_segments else None)
  private.append(mt.row_smem((wgs, bq), jnp.int32) if cfg.has_positions else None)

  def program(stream_refs, private_refs):
    pipe = pipeline.bind(stream_refs)
    q_smem, q_bar, p_smem, qseg_smem, qpos_smem = private_refs

    def compute(w):
      row0 = pr.start + w * bq
      rows = pl.ds(row0, bq)
      copies = [(refs["q"].at[b, rows, h], q_smem.at[w])]
      if cfg.has_segments:
        copies.append((refs["q_seg"].at[b, rows], qseg_smem.at[w]))
      if cfg.has_positions:
        copies.append((refs["q_pos"].at[rows], qpos_smem.at[w]))
      mt.load_own(copies, q_bar.at[w])
      q_seg = qseg_smem.at[w][...] if cfg.has_segments else None
      q_pos = qpos_smem.at[w][...] if cfg.has_positions else None

      def body(t, u, carry, *, causal_mask):
        acc, m, l = carry
        j = pr.block_of(t)
        slot = pipe.slot(u)
        k_tiles = pipe.wait(0, slot)
        s = mma.product(q_smem.at[w], mma.transposed(k_tiles[0]), (bq, bk)) * scale2
        rest = iter(k_tiles[1:])
        k_seg = next(rest)[...] if cfg.has_segments else None
        k_pos = next(rest)[...] if cfg.has_positions else None
        pipe.release(0, slot)
        mask = mt.tile_mask(cfg, (bq, bk), row_pos=q_pos, col_pos=k_pos, row_seg=q_seg,
                            col_seg=k_seg, causal=causal_mask, row0=row0, col0=j * bk)
        if mask is not None:
          s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - mt.broadcast_rows(m_new, s.shape))
        if mask is not None:
          # a row with no visible key yet has m_new == _MASKED, where exp2(0) = 1 would count
          # masked keys; zeroing keeps fully masked rows at l == 0
          p = jnp.where(mask, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        acc = acc * mt.broadcast_rows(alpha, acc.shape)
        p_op = mma.staged(p.astype(dtype), None if cfg.fast_mma else p_smem.at[w])
        (v_tile,) = pipe.wait(1, slot)
        acc = mma.accumulate(acc, p_op, v_tile)
        pipe.release(1, slot)
        return acc, m_new, l

      carry = (jnp.zeros((bq, Dv), jnp.float32), jnp.full((bq,), _MASKED, jnp.float32),
               jnp.zeros((bq,), jnp.float32))
      (acc, m, l), _ = mt.run_loops(pr.loops, body, carry)
      empty = l == 0.0
      l_safe = jnp.where(empty, 1.0, l)
      mt.store(refs["out"].at[b, rows, h], acc / mt.broadcast_rows(l_safe, acc.shape))
      # +inf for rows that see no key, so exp2(s - lse) is 0 in the backward
      refs["lse"].at[b, h, rows][...] = jnp.where(empty, jnp.inf, m + jnp.log2(l_safe))

    def memory():
      pipe.produce(mt.loop_steps(pr.loops), lambda u: pr.block_of(pr.first + u))

    mt.split_roles(compute, memory, wgs)

  mt.scoped(program, pipeline.allocations(), tuple(private))


def mosaic_forward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
  """(out, base-2 LSE [B, H, Sq], None): the Triton forward's contract (flash_forward.py)."""
  B, Sq, H, D = q.shape
  Sk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  inputs = {"q": q, "k": mt.Mma(cfg.fast_mma).transposed_input(k), "v": v}
  if cfg.has_segments:
    inputs.update(q_seg=q_seg, kv_seg=kv_seg)
  if cfg.has_positions:
    inputs.update(q_pos=q_pos[0], kv_pos=kv_pos[0])
  if cfg.skip_blocks:
    rows, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, cfg.compute_wgs * cfg.block_q,
                         cfg.block_k, B, Sq, Sk)
    inputs["schedule"] = mt.packed_schedule(rows)
  outputs = {"out": jax.ShapeDtypeStruct((B, Sq, H, Dv), q.dtype),
             "lse": jax.ShapeDtypeStruct((B, H, Sq), jnp.float32)}
  dims = (B, Sq, Sk, H, K, D, Dv)
  res = mt.launch(lambda refs: _forward_body(refs, cfg, dims), inputs, outputs,
                  # Mosaic launches the last grid axis fastest: a head's q programs run side by
                  # side and share its K/V in L2
                  grid=(B, H, Sq // (cfg.compute_wgs * cfg.block_q)), grid_names=("b", "h", "q"),
                  wgs=cfg.compute_wgs, interpret=cfg.interpret, name="jaxtrain_mosaic_flash_fwd")
  return res["out"], res["lse"], None

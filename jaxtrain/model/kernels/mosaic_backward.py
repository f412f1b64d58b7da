"""Flash attention's backward kernels on Mosaic GPU, the Triton backward's contract
(flash_backward.py): P = exp2(S * scale * log2 e - lse) recomputed from the base-2 LSE,
delta = rowsum(dO * O) - dlse from XLA, and two kernels:

 * dK/dV: one program per (2 kv blocks, batch, kv head); each compute warpgroup keeps its kv
   block's dK and dV in fp32 registers and walks the G query heads of its group and their q
   blocks (the block map's list), on transposed tiles [kv, q] so that every product's left
   operand is a kv-side tile or a register tile.
 * dQ: one program per (2 q blocks, batch, q head), walking the kv blocks.

The memory warpgroup streams each step's q-side (dK/dV) or kv-side (dQ) tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.model.kernels.flash_config import _Config
from jaxtrain.model.kernels.flash_tiles import _LOG2E
from jaxtrain.model.kernels import mosaic_tiles as mt
from jaxtrain.model.kernels.mosaic_tiles import plgpu


def _dkv_body(refs, cfg: _Config, dims, grad_dtype):
  B, Sq, Sk, H, K, D, Dv = dims
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  dtype = refs["k"].dtype
  mma = mt.Mma(cfg.fast_mma)
  wgs = cfg.compute_wgs_bwd
  pr = mt.program(refs, cfg, axis="kv", programs=Sk // (wgs * bk), span=wgs * bk,
                  other_block=bq, num_other=Sq // bq, group=H // K, rows=False)
  b, h, kh = pr.b, pr.h, pr.kh
  scale2 = cfg.sm_scale * _LOG2E
  # The fast kernel accumulates dK and dV in one pass over the q blocks. Without in-place
  # accumulation the fp32 accumulators and a fresh product of each do not fit in 255
  # registers (ptxas spilled 500+ bytes at D = 128), so the checked kernel takes two passes,
  # dV then dK, each recomputing P (one extra product per step).
  passes = [("dk", "dv")] if cfg.fast_mma else [("dv",), ("dk",)]

  window = lambda i: pl.ds(i * bq, bq)  # noqa: E731
  s_streams = [mma.transposed_stream(refs["q"], lambda s: (b, window(s), h), (bq, D), dtype),
               mt.Stream(lambda s: refs["lse"].at[b, h, window(s)],
                         mt.row_smem((bq,), jnp.float32))]
  s_streams += mt.row_streams(refs, cfg, "q_seg", "q_pos", window, b, bq)
  d_streams = [mt.Stream(lambda s: refs["do"].at[b, window(s), h], mt.tile_smem((bq, Dv), dtype)),
               mt.Stream(lambda s: refs["delta"].at[b, h, window(s)],
                         mt.row_smem((bq,), jnp.float32))]
  if not cfg.fast_mma:  # the checked kernel's transposed copy of dO and plain copy of Q
    d_streams += [mma.transposed_stream(refs["doT"], lambda s: (b, window(s), h),
                                        (bq, Dv), dtype),
                  mt.Stream(lambda s: refs["q_plain"].at[b, window(s), h],
                            mt.tile_smem((bq, D), dtype))]
  pipeline = mt.Pipeline([s_streams, d_streams], cfg.num_stages_bwd, wgs)

  private = [mt.tile_smem((wgs, bk, D), dtype), mt.tile_smem((wgs, bk, Dv), dtype),
             plgpu.Barrier(num_arrivals=2 + cfg.has_segments + cfg.has_positions,
                           num_barriers=wgs),
             # where the checked kernel stages P^T, then dS^T (the products' left operands)
             mt.tile_smem((wgs, bk, bq), dtype) if not cfg.fast_mma else None,
             mt.row_smem((wgs, bk), jnp.int32) if cfg.has_segments else None,
             mt.row_smem((wgs, bk), jnp.int32) if cfg.has_positions else None]

  def program(stream_refs, private_refs):
    pipe = pipeline.bind(stream_refs)
    k_smem, v_smem, bar, stage_smem, seg_smem, pos_smem = private_refs

    def compute(w):
      col0 = pr.start + w * bk
      cols = pl.ds(col0, bk)
      copies = [(refs["k"].at[b, cols, kh], k_smem.at[w]), (refs["v"].at[b, cols, kh], v_smem.at[w])]
      if cfg.has_segments:
        copies.append((refs["kv_seg"].at[b, cols], seg_smem.at[w]))
      if cfg.has_positions:
        copies.append((refs["kv_pos"].at[cols], pos_smem.at[w]))
      mt.load_own(copies, bar.at[w])
      k_seg = seg_smem.at[w][...] if cfg.has_segments else None
      k_pos = pos_smem.at[w][...] if cfg.has_positions else None
      shape = (bk, bq)

      def body(t, u, carry, *, causal_mask, wants):
        i = pr.block_of(t)
        slot = pipe.slot(u)
        q_tile, lse_tile, *rest = pipe.wait(0, slot)
        s_t = mma.product(k_smem.at[w], mma.transposed(q_tile), shape) * scale2
        p_t = jnp.exp2(s_t - mt.broadcast_cols(lse_tile[...], shape))
        rest = iter(rest)
        q_seg = next(rest)[...] if cfg.has_segments else None
        q_pos = next(rest)[...] if cfg.has_positions else None
        mask = mt.tile_mask(cfg, shape, row_pos=k_pos, col_pos=q_pos, row_seg=k_seg,
                            col_seg=q_seg, causal=causal_mask, row0=col0, col0=i * bq,
                            transposed=True)
        if mask is not None:
          p_t = jnp.where(mask, p_t, 0.0)
        stage = None if cfg.fast_mma else stage_smem.at[w]
        do_tile, delta_tile, *checked = pipe.wait(1, slot)
        carry = dict(carry)
        if "dv" in wants:
          carry["dv"] = mma.accumulate(carry["dv"], mma.staged(p_t.astype(dtype), stage),
                                       do_tile)
        if "dk" in wants:
          do_t = do_tile if cfg.fast_mma else checked[0]
          dp_t = mma.product(v_smem.at[w], mma.transposed(do_t), shape)
          ds_t = p_t * (dp_t - mt.broadcast_cols(delta_tile[...], shape))
          carry["dk"] = mma.accumulate(carry["dk"], mma.staged(ds_t.astype(dtype), stage),
                                       q_tile if cfg.fast_mma else checked[1])
        pipe.release(0, slot)
        pipe.release(1, slot)
        return carry

      step = 0
      for wants in passes:
        body_of = functools.partial(body, wants=wants)
        carry = {"dk": jnp.zeros((bk, D), jnp.float32)} if "dk" in wants else {}
        if "dv" in wants:
          carry["dv"] = jnp.zeros((bk, Dv), jnp.float32)
        carry, step = mt.run_loops(pr.loops, body_of, carry, step0=step)
        if "dk" in carry:
          mt.store(refs["dk"].at[b, cols, h], carry["dk"] * cfg.sm_scale)
        if "dv" in carry:
          mt.store(refs["dv"].at[b, cols, h], carry["dv"])

    def memory():
      steps = mt.loop_steps(pr.loops)
      pipe.produce(len(passes) * steps, lambda u: pr.block_of(pr.first + lax.rem(u, steps)))

    mt.split_roles(compute, memory, wgs)

  mt.scoped(program, pipeline.allocations(), tuple(private))


def _dq_body(refs, cfg: _Config, dims, grad_dtype):
  B, Sq, Sk, H, K, D, Dv = dims
  bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
  dtype = refs["q"].dtype
  mma = mt.Mma(cfg.fast_mma)
  wgs = cfg.compute_wgs_bwd
  pr = mt.program(refs, cfg, axis="q", programs=Sq // (wgs * bq), span=wgs * bq,
                  other_block=bk, num_other=Sk // bk, group=H // K, rows=True)
  b, h, kh = pr.b, pr.h, pr.kh
  scale2 = cfg.sm_scale * _LOG2E

  window = lambda j: pl.ds(j * bk, bk)  # noqa: E731
  s_streams = [mma.transposed_stream(refs["k"], lambda j: (b, window(j), kh), (bk, D), dtype)]
  s_streams += mt.row_streams(refs, cfg, "kv_seg", "kv_pos", window, b, bk)
  d_streams = [mma.transposed_stream(refs["v"], lambda j: (b, window(j), kh), (bk, Dv), dtype)]
  if not cfg.fast_mma:  # the checked kernel's plain copy of K (dQ += dS K)
    d_streams.append(mt.Stream(lambda j: refs["k_plain"].at[b, window(j), kh],
                               mt.tile_smem((bk, D), dtype)))
  pipeline = mt.Pipeline([s_streams, d_streams], cfg.num_stages_bwd, wgs)

  private = [mt.tile_smem((wgs, bq, D), dtype), mt.tile_smem((wgs, bq, Dv), dtype),
             mt.row_smem((wgs, bq), jnp.float32), mt.row_smem((wgs, bq), jnp.float32),
             plgpu.Barrier(num_arrivals=4 + cfg.has_segments + cfg.has_positions,
                           num_barriers=wgs),
             mt.tile_smem((wgs, bq, bk), dtype) if not cfg.fast_mma else None,
             mt.row_smem((wgs, bq), jnp.int32) if cfg.has_segments else None,
             mt.row_smem((wgs, bq), jnp.int32) if cfg.has_positions else None]

  def program(stream_refs, private_refs):
    pipe = pipeline.bind(stream_refs)
    q_smem, do_smem, lse_smem, delta_smem, bar, ds_smem, seg_smem, pos_smem = private_refs

    def compute(w):
      row0 = pr.start + w * bq
      rows = pl.ds(row0, bq)
      copies = [(refs["q"].at[b, rows, h], q_smem.at[w]), (refs["do"].at[b, rows, h], do_smem.at[w]),
                (refs["lse"].at[b, h, rows], lse_smem.at[w]),
                (refs["delta"].at[b, h, rows], delta_smem.at[w])]
      if cfg.has_segments:
        copies.append((refs["q_seg"].at[b, rows], seg_smem.at[w]))
      if cfg.has_positions:
        copies.append((refs["q_pos"].at[rows], pos_smem.at[w]))
      mt.load_own(copies, bar.at[w])
      shape = (bq, bk)
      lse = mt.broadcast_rows(lse_smem.at[w][...], shape)
      delta = mt.broadcast_rows(delta_smem.at[w][...], shape)
      q_seg = seg_smem.at[w][...] if cfg.has_segments else None
      q_pos = pos_smem.at[w][...] if cfg.has_positions else None

      def body(t, u, dq, *, causal_mask):
        j = pr.block_of(t)
        slot = pipe.slot(u)
        k_tile, *rest = pipe.wait(0, slot)
        p = jnp.exp2(mma.product(q_smem.at[w], mma.transposed(k_tile), shape) * scale2 - lse)
        rest = iter(rest)
        k_seg = next(rest)[...] if cfg.has_segments else None
        k_pos = next(rest)[...] if cfg.has_positions else None
        mask = mt.tile_mask(cfg, shape, row_pos=q_pos, col_pos=k_pos, row_seg=q_seg,
                            col_seg=k_seg, causal=causal_mask, row0=row0, col0=j * bk)
        if mask is not None:
          p = jnp.where(mask, p, 0.0)
        v_tile, *checked = pipe.wait(1, slot)
        ds = p * (mma.product(do_smem.at[w], mma.transposed(v_tile), shape) - delta)
        k_plain = k_tile if cfg.fast_mma else checked[0]
        dq = mma.accumulate(dq, mma.staged(ds.astype(dtype),
                                           None if cfg.fast_mma else ds_smem.at[w]), k_plain)
        pipe.release(0, slot)
        pipe.release(1, slot)
        return dq

      dq, _ = mt.run_loops(pr.loops, body, jnp.zeros((bq, D), jnp.float32))
      mt.store(refs["dq"].at[b, rows, h], dq * cfg.sm_scale)

    def memory():
      pipe.produce(mt.loop_steps(pr.loops), lambda u: pr.block_of(pr.first + u))

    mt.split_roles(compute, memory, wgs)

  mt.scoped(program, pipeline.allocations(), tuple(private))


def mosaic_backward(cfg: _Config, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do,
                    dlse_BHS=None, grad_dtype=None):
  """(dq, dk, dv, None): the Triton backward's contract (flash_backward._backward)."""
  from jaxtrain.model.kernels.flash_tiles import _schedules
  B, Sq, H, D = q.shape
  Sk, K, Dv = k.shape[1], k.shape[2], v.shape[3]
  mma = mt.Mma(cfg.fast_mma)
  delta_BHS = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
  if dlse_BHS is not None:
    delta_BHS = delta_BHS - dlse_BHS
  ids = {}
  if cfg.has_segments:
    ids.update(q_seg=q_seg, kv_seg=kv_seg)
  if cfg.has_positions:
    ids.update(q_pos=q_pos[0], kv_pos=kv_pos[0])
  rows = cols = None
  if cfg.skip_blocks:  # dQ: kv blocks of each 2-block q program; dK/dV: q blocks of each kv one
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    wgs = cfg.compute_wgs_bwd
    rows, _ = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, wgs * bq, bk, B, Sq, Sk)
    _, cols = _schedules(cfg, q_seg, kv_seg, q_pos, kv_pos, bq, wgs * bk, B, Sq, Sk)
  dims = (B, Sq, Sk, H, K, D, Dv)
  gd = jnp.dtype(grad_dtype or q.dtype)
  common = dict(lse=lse_BHS, delta=delta_BHS, **ids)

  dkv_in = dict(q=mma.transposed_input(q), k=k, v=v, do=do, **common)
  if not cfg.fast_mma:
    dkv_in.update(doT=mma.transposed_input(do), q_plain=q)
  if cols is not None:
    dkv_in["schedule"] = mt.packed_schedule(cols)
  # one program per q head: its share of its kv head's dK/dV (fp32 when the group's shares
  # are summed after; a loop over the group inside the program spilled its accumulators)
  part = jnp.float32 if H > K else gd
  dkv = mt.launch(lambda refs: _dkv_body(refs, cfg, dims, gd), dkv_in,
                  {"dk": jax.ShapeDtypeStruct((B, Sk, H, D), part),
                   "dv": jax.ShapeDtypeStruct((B, Sk, H, Dv), part)},
                  grid=(B, H, Sk // (cfg.compute_wgs_bwd * cfg.block_k_bwd)),  # last: fastest
                  grid_names=("b", "h", "kv"), wgs=cfg.compute_wgs_bwd, interpret=cfg.interpret,
                  name="jaxtrain_mosaic_flash_bwd_dkv")

  dq_in = dict(q=q, k=mma.transposed_input(k), v=mma.transposed_input(v), do=do, **common)
  if not cfg.fast_mma:
    dq_in["k_plain"] = k
  if rows is not None:
    dq_in["schedule"] = mt.packed_schedule(rows)
  dq = mt.launch(lambda refs: _dq_body(refs, cfg, dims, gd), dq_in,
                 {"dq": jax.ShapeDtypeStruct(q.shape, gd)},
                 grid=(B, H, Sq // (cfg.compute_wgs_bwd * cfg.block_q_bwd)),
                 grid_names=("b", "h", "q"), wgs=cfg.compute_wgs_bwd, interpret=cfg.interpret,
                 name="jaxtrain_mosaic_flash_bwd_dq")
  dk, dv = (x.reshape(B, Sk, K, H // K, x.shape[-1]).sum(axis=3).astype(gd)
            for x in (dkv["dk"], dkv["dv"]))
  return dq["dq"], dk, dv, None

"""What the flash attention kernels share: the dots, a tile's visibility mask, the refs after
the fixed inputs, and the loops over a program's blocks (a block_map schedule or the causal
diagonal), with the BlockSpecs that hand each program its schedule row.

Only the Triton-lowerable subset of jax.numpy is used inside kernels.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain.compat import triton_compiler_params
from jaxtrain.model.kernels import block_map
from jaxtrain.model.kernels.flash_config import _Config

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Finite stand-in for -inf on masked logits: exp2(_MASKED - m) underflows to 0 without ever
# forming inf - inf, and it stays representable in fp32.
_MASKED = -1e30


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


def _schedule_specs(schedule: block_map.Schedule, program_block):
  """BlockSpecs giving each program its own row of a block_map.Schedule; `program_block` maps
  grid indices to (batch, program's block)."""
  width = schedule.blocks.shape[-1]
  return [pl.BlockSpec((None, None, width), lambda *g: (*program_block(*g), 0)),
          pl.BlockSpec((None, None), program_block), pl.BlockSpec((None, None), program_block)]


class _QMaps(NamedTuple):
  """Index maps of a q-block program's grid (q block, batch, q head): forward and dQ."""
  q: Callable       # its q rows of its head, in [B, S, H, D]
  kv: Callable      # the whole K/V of its head's kv head, in [B, S, K, D]
  row: Callable     # (batch, head, q block) of a per-row output [B, H, S] (LSE, counts)
  q_row: Callable   # (batch, q block) of a per-token input [B, S] (segment ids)


def _q_maps(cfg: _Config, num_q_blocks: int, group: int) -> _QMaps:
  qb = lambda i: _q_block_index(i, num_q_blocks, cfg.causal)  # noqa: E731
  return _QMaps(q=lambda i, b, h: (b, qb(i), h, 0), kv=lambda i, b, h: (b, 0, _div(h, group), 0),
                row=lambda i, b, h: (b, h, qb(i)), q_row=lambda i, b, h: (b, qb(i)))


def _q_program_inputs(cfg: _Config, q_row, block_q: int, Sk: int, q_seg, kv_seg, q_pos, kv_pos,
                      rows):
  """(BlockSpecs, arrays) of a q-block program's optional inputs (forward, dQ), in the order
  _split_refs reads them: this block's query segment ids and every key's, the positions (one
  [1, S] row for the whole batch), the block map's rows. `q_row(i, b, h)` -> (batch, q block)."""
  specs, args = [], []
  if cfg.has_segments:
    specs += [pl.BlockSpec((None, block_q), q_row),
              pl.BlockSpec((None, Sk), lambda i, b, h: (b, 0))]
    args += [q_seg, kv_seg]
  if cfg.has_positions:
    specs += [pl.BlockSpec((None, block_q), lambda i, b, h: (0, q_row(i, b, h)[1])),
              pl.BlockSpec((None, Sk), lambda i, b, h: (0, 0))]
    args += [q_pos, kv_pos]
  if cfg.skip_blocks:
    specs += _schedule_specs(rows, q_row)
    args += list(rows)
  return specs, args


def _q_block_index(pid, num_q_blocks: int, causal: bool):
  # Causal work grows with the q block index; launching the longest blocks first shortens the tail.
  return num_q_blocks - 1 - pid if causal else pid


def _schedules(cfg: _Config, q_seg, kv_seg, q_pos, kv_pos, block_q: int, block_k: int, B: int,
               Sq: int, Sk: int):
  return block_map.schedules(jnp, q_seg, kv_seg, block_q, block_k, cfg.causal, batch=B,
                             q_pos_S=None if q_pos is None else q_pos[0],
                             kv_pos_S=None if kv_pos is None else kv_pos[0], seq=(Sq, Sk))



def _pallas_call(kernel, cfg: _Config, args, *, name: str, grid, in_specs, out_specs, out_shape,
                 count_map, count_shape, warps_stages):
  """One flash kernel's pallas_call: (its outputs, its debug tile counts or None). With
  cfg.count_blocks the kernel also writes, through `count_map`, an int32 `count_shape`
  array of the tiles each program computed."""
  if cfg.count_blocks:
    out_specs = [*out_specs, pl.BlockSpec((None, None, None), count_map)]
    out_shape = [*out_shape, jax.ShapeDtypeStruct(count_shape, jnp.int32)]
  outs = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(*warps_stages), interpret=cfg.interpret,
      name=name)(*args)
  return (outs[:-1], outs[-1]) if cfg.count_blocks else (outs, None)

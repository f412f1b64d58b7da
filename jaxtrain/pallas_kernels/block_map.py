"""Which (q block, kv block) tiles of flash attention the kernels compute for packed documents.

A tile whose q block and kv block have disjoint segment-id ranges ([min, max] per block) holds
no pair of equal ids, so every entry of it is masked: skipping it is exact whatever the ids
(any total order of them works, even after a wrapping cast), a conservative skip where a
block's range spans ids it does not hold. Each program of a kernel gets a schedule: the
ascending list of the blocks it visits (those whose ranges overlap its own and that causality
does not hide) and where that list crosses the diagonal, so it splits into the tiles that need
the causal mask and those that do not, as the kernels' causal loops do.

Every function takes the array module `xp` (numpy or jax.numpy): the kernels' wrapper builds
the schedules with jax.numpy, `block_counts` with numpy, from the same code.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class BlockCounts(NamedTuple):
  """Tiles (q block x kv block x query head) each kernel computes, summed over the batch."""
  fwd: int
  dkv: int
  dq: int


class Schedule(NamedTuple):
  """Per program (a q block for the forward and dQ kernels, a kv block for dK/dV), [B, n, ...]:
  `blocks` lists the visited blocks in ascending order (padded to a power of two with unread
  entries), the first `split` of them are on one side of the diagonal (forward/dQ: below it,
  no causal mask; dK/dV: on it, masked), `total` are visited in all."""
  blocks: object
  split: object
  total: object


def pad_segments(xp, seg_BS, padded_seq: int):
  """Pad ids by repeating each row's last id: padded keys are masked anyway (causal or kv_len),
  and the last block's id range does not widen, so no extra tile overlaps it."""
  pad = padded_seq - seg_BS.shape[1]
  return xp.pad(seg_BS, ((0, 0), (0, pad)), mode="edge") if pad else seg_BS


def _ranges(seg_BS, block: int):
  s = seg_BS.reshape(seg_BS.shape[0], -1, block)
  return s.min(axis=-1), s.max(axis=-1)


def _cdiv(a, b: int):
  return -(-a // b)


def _schedule(xp, visit_BNM, split_BNM) -> Schedule:
  """The Schedule of programs n that visit blocks m where visit_BNM (split: the visited blocks
  counted in the first part)."""
  m = visit_BNM.shape[-1]
  index = np.arange(m, dtype=np.int32)
  # Visited indices sort first, in ascending order; the rest (offset by m) are never read.
  blocks = xp.sort(xp.where(visit_BNM, index, index + m), axis=-1).astype(np.int32)
  width = 1 << (m - 1).bit_length()  # Triton loads power-of-two blocks
  if width != m:
    blocks = xp.pad(blocks, ((0, 0), (0, 0), (0, width - m)))
  total = visit_BNM.sum(axis=-1).astype(np.int32)
  split = (visit_BNM & split_BNM).sum(axis=-1).astype(np.int32)
  return Schedule(blocks, split, total)


def schedules(xp, q_seg_BS, kv_seg_BS, block_q: int, block_k: int,
              causal: bool) -> tuple[Schedule, Schedule]:
  """(rows, cols): the schedule of each q block over kv blocks (forward, dQ) and of each kv
  block over q blocks (dK/dV), for [B, S] ids (S a multiple of both blocks)."""
  q_min, q_max = _ranges(q_seg_BS, block_q)
  k_min, k_max = _ranges(kv_seg_BS, block_k)
  overlap_BQK = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
  nq, nk = overlap_BQK.shape[1:]
  i = np.arange(nq)[:, None]
  j = np.arange(nk)[None, :]
  if causal:
    # Row programs: kv blocks from num_live on are above the diagonal, below num_full unmasked.
    q_start = i * block_q
    rows_visible = j < np.minimum(_cdiv(q_start + block_q, block_k), nk)
    rows_split = j < q_start // block_k
    # Column programs: q blocks before first_live see none of the keys; masked up to first_full.
    k_start = j * block_k
    cols_visible = i >= k_start // block_q
    cols_split = i < np.minimum(_cdiv(k_start + block_k - 1, block_q), nq)
  else:
    rows_visible = cols_visible = np.ones((nq, nk), bool)
    rows_split = cols_split = np.zeros((nq, nk), bool)
  rows = _schedule(xp, overlap_BQK & rows_visible, np.broadcast_to(rows_split, (1, nq, nk)))
  cols_BKQ = xp.swapaxes(overlap_BQK & cols_visible, 1, 2)
  cols = _schedule(xp, cols_BKQ, np.broadcast_to(cols_split.T, (1, nk, nq)))
  return rows, cols


def block_counts(q_seg_BS, kv_seg_BS, *, batch: int, seq: int, num_heads: int, causal: bool,
                 block_q: int, block_k: int, block_q_bwd: int, block_k_bwd: int,
                 skip: bool = True) -> BlockCounts:
  """The tiles the kernels compute for these (padded, [batch, seq] numpy) segment ids; ids None
  means one document per row. `skip=False`: the kernels without block skipping."""
  if q_seg_BS is None or not skip:
    q_seg_BS = kv_seg_BS = np.zeros((batch, seq), np.int32)
  rows, _ = schedules(np, q_seg_BS, kv_seg_BS, block_q, block_k, causal)
  rows_bwd, cols_bwd = schedules(np, q_seg_BS, kv_seg_BS, block_q_bwd, block_k_bwd, causal)
  # Every query head runs each row program; each kv head's dK/dV program loops over its group.
  return BlockCounts(*(int(s.total.sum()) * num_heads for s in (rows, cols_bwd, rows_bwd)))

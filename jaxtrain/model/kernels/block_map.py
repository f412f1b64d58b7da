"""Which (q block, kv block) tiles of flash attention the kernels compute for packed documents.

A tile whose q block and kv block have disjoint segment-id ranges ([min, max] per block) holds
no pair of equal ids, so every entry of it is masked: skipping it is exact whatever the ids
(any total order of them works, even after a wrapping cast), a conservative skip where a
block's range spans ids it does not hold. Each program of a kernel gets a schedule: the list
of the blocks it visits (those whose ranges overlap its own and that causality does not hide),
split into the tiles that need the causal mask and those that do not, as the kernels' causal
loops run them. Causality is judged the same way, from each block's range of positions (0, 1,
... by default; under context parallelism the tokens' global positions, in whatever order a
shard holds them), so skipping stays exact for any order.

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


def _schedule(xp, visit_BNM, first_BNM) -> Schedule:
  """The Schedule of programs n that visit blocks m where visit_BNM, those where first_BNM
  listed first (each part in ascending order): `split` of them."""
  m = visit_BNM.shape[-1]
  index = np.arange(m, dtype=np.int32)
  # Visited first-part indices sort first, then the other visited ones (offset by m), then
  # the rest (offset by 2m), which are never read.
  key = xp.where(visit_BNM, xp.where(first_BNM, index, index + m), index + 2 * m)
  blocks = (xp.sort(key, axis=-1) % m).astype(np.int32)
  width = 1 << (m - 1).bit_length()  # Triton loads power-of-two blocks
  if width != m:
    blocks = xp.pad(blocks, ((0, 0), (0, 0), (0, width - m)))
  total = visit_BNM.sum(axis=-1).astype(np.int32)
  split = (visit_BNM & first_BNM).sum(axis=-1).astype(np.int32)
  return Schedule(blocks, split, total)


def causal_blocks(q_pos_S, kv_pos_S, block_q: int, block_k: int):
  """(visible, unmasked) [nq, nk]: which (q block, kv block) tiles hold a key some query of
  the block sees under causal masking (key position <= query position), and which need no
  mask at all, from each block's range of positions. Positions None: 0, 1, ... (the
  kernels' default); given (context parallelism's global positions of a shard's tokens, in
  any order), a tile is skipped only when no pair in it is visible, so it stays exact."""
  q_lo, q_hi = _ranges(q_pos_S[None], block_q)
  k_lo, k_hi = _ranges(kv_pos_S[None], block_k)
  visible = k_lo[0][None, :] <= q_hi[0][:, None]
  unmasked = k_hi[0][None, :] <= q_lo[0][:, None]
  return visible, unmasked


def schedules(xp, q_seg_BS, kv_seg_BS, block_q: int, block_k: int, causal: bool, *,
              batch: int | None = None, q_pos_S=None, kv_pos_S=None,
              seq: tuple[int, int] | None = None) -> tuple[Schedule, Schedule]:
  """(rows, cols): the schedule of each q block over kv blocks (forward, dQ) and of each kv
  block over q blocks (dK/dV), for [B, Sq] / [B, Sk] ids (each a multiple of its block; None:
  one document per row, then `batch` and `seq` = (Sq, Sk) give the shape) and, for causal
  masking, the [Sq] / [Sk] positions (None: 0, 1, ...)."""
  if q_seg_BS is not None:
    q_min, q_max = _ranges(q_seg_BS, block_q)
    k_min, k_max = _ranges(kv_seg_BS, block_k)
    overlap_BQK = ((q_min[:, :, None] <= k_max[:, None, :])
                   & (k_min[:, None, :] <= q_max[:, :, None]))
    sq, sk = q_seg_BS.shape[1], kv_seg_BS.shape[1]
  else:
    sq, sk = seq
    overlap_BQK = np.ones((batch, sq // block_q, sk // block_k), bool)
  nq, nk = overlap_BQK.shape[1:]
  if causal:
    q_pos = np.arange(sq, dtype=np.int32) if q_pos_S is None else q_pos_S
    kv_pos = np.arange(sk, dtype=np.int32) if kv_pos_S is None else kv_pos_S
    visible, unmasked = causal_blocks(q_pos, kv_pos, block_q, block_k)
    masked = visible & ~unmasked
  else:  # every tile visible, none masked (the kernels' non-causal loops ignore `split`)
    visible = np.ones((nq, nk), bool)
    unmasked = masked = np.zeros((nq, nk), bool)
  # Row programs visit the unmasked tiles first, column programs (dK/dV) the masked ones, as
  # the kernels' causal loops do.
  rows = _schedule(xp, overlap_BQK & visible[None], xp.broadcast_to(unmasked[None],
                                                                   overlap_BQK.shape))
  cols_BKQ = xp.swapaxes(overlap_BQK & visible[None], 1, 2)
  cols = _schedule(xp, cols_BKQ, xp.broadcast_to(masked.T[None], cols_BKQ.shape))
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

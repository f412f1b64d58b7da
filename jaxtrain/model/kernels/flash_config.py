"""From a flash_attention call's arguments to the kernels' static configuration.

Validation (shapes, dtypes, segment ids, positions), the block sizes (Hopper defaults by head
dim, or the caller's, checked), Triton launch parameters or the Mosaic GPU kernels' warpgroups
and pipeline depth, the dots' precision, and the padded sizes they imply: `_prepare` for a
call, `_resolve` for what block_counts counts too.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256
# Triton's tl.dot needs every tile dimension to be a power of two and at least 16.
_MIN_TILE = 16
BACKENDS = ("triton", "mosaic")
# Mosaic GPU (mosaic_*.py): wgmma on 16-bit tiles whose minor dimension fills 128-byte
# swizzled rows (64 elements; head dims are zero-padded to that), one warpgroup's 64 rows per
# block. Its backward's shared memory holds head dims up to 192 (DeepSeek's 192/128).
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MOSAIC_TILE = 64
MOSAIC_MAX_HEAD_DIM = 192

SegmentIds = Union[jax.Array, Tuple[jax.Array, jax.Array], None]


class FlashAttentionError(ValueError):
  """Bad shapes, dtypes or block sizes passed to flash_attention."""


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
  backend: str = "triton"  # or "mosaic": the Mosaic GPU kernels (mosaic_forward/backward.py)
  fast_mma: bool = False   # mosaic: FlashAttention-3's products, not interpretable (mosaic_tiles)
  compute_wgs: int = 2     # mosaic: compute warpgroups per forward program (blocks of rows)
  compute_wgs_bwd: int = 2  # mosaic: per backward program


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


# ----------------------------------------------------------------------------------------------
# Arguments: segment ids, positions, shapes, dtypes, blocks, precision.


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


def check_groups(H: int, K: int) -> None:
  """GQA's one rule: query heads group evenly over kv heads."""
  if K == 0 or H % K:
    raise FlashAttentionError(
        f"num_heads={H} must be a multiple of num_kv_heads={K} (GQA groups query heads evenly "
        "over kv heads); pick num_kv_heads among the divisors of num_heads.")


def _validate(q, k, v, q_seg, kv_seg, q_pos, kv_pos, one_segment_array: bool):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise FlashAttentionError(
          f"{name} must be 4-D [batch, seq, heads, head_dim]; got shape {getattr(x, 'shape', x)}.")
  B, S, H, D = q.shape
  if k.shape[:3] != v.shape[:3]:
    raise FlashAttentionError(f"k and v must have the same batch, length and heads; got k "
                              f"{k.shape}, v {v.shape} (only v's head dim may differ).")
  Bk, Sk, K, Dk = k.shape
  if Bk != B:
    raise FlashAttentionError(f"batch mismatch: q has {B}, k/v have {Bk}.")
  if Dk != D:
    raise FlashAttentionError(f"head_dim mismatch: q has {D}, k/v have {Dk}.")
  check_groups(H, K)
  for name, d in (("head_dim", D), ("v head_dim", v.shape[3])):
    if not 1 <= d <= MAX_HEAD_DIM:
      raise FlashAttentionError(
          f"{name}={d} is unsupported: must be in [1, {MAX_HEAD_DIM}] (non-powers of two and "
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


def _check_mosaic(dtype, D, Dv, blocks, num_stages, num_stages_bwd):
  """The Mosaic GPU kernels' limits, before anything is traced (one line each)."""
  if jnp.dtype(dtype) not in MOSAIC_DTYPES:
    raise FlashAttentionError(
        f"backend='mosaic' takes bfloat16 or float16 (wgmma on 16-bit tiles), got {dtype}; "
        "cast q/k/v, or use backend='triton'.")
  if max(D, Dv) > MOSAIC_MAX_HEAD_DIM:
    raise FlashAttentionError(
        f"backend='mosaic' takes head dims up to {MOSAIC_MAX_HEAD_DIM} (its backward's shared "
        f"memory), got q/k {D}, v {Dv}; use backend='triton'.")
  for name, value in zip(("block_q", "block_k", "block_q_bwd", "block_k_bwd"), blocks):
    if value is not None and (not isinstance(value, int) or value not in (64, 128)):
      raise FlashAttentionError(
          f"{name}={value!r}: backend='mosaic' blocks are 64 or 128 rows (a warpgroup's wgmma "
          "tile); pass 64 or 128, or None for the defaults.")
  for name, value in (("num_stages", num_stages), ("num_stages_bwd", num_stages_bwd)):
    if value is not None and (not isinstance(value, int) or value < 2):
      raise FlashAttentionError(
          f"{name}={value!r}: backend='mosaic' pipelines at least 2 shared-memory stages.")


def _mosaic_blocks(blocks, fast: bool):
  """(block_q, block_k, block_q_bwd, block_k_bwd) and compute warpgroups (forward, backward).

  Compiled for sm_90a (tests/test_gpu_compile.py reads ptxas' report): with the checked
  products a 128-key forward block needs 234 KB of shared memory at head dim 128 (the H100
  gives a block 227 KB), and the backward fits 255 registers only with one compute
  warpgroup per program; the fast products fit 128 keys and two. Not yet timed on hardware.
  """
  defaults = (64, 128 if fast else 64, 64, 64)
  chosen = tuple(d if b is None else b for b, d in zip(blocks, defaults))
  return chosen, (2, 2 if fast else 1)


def _resolve(B, Sq, Sk, H, D, has_segments, has_positions=False, *, causal, sm_scale, blocks,
             num_warps, num_warps_bwd, num_stages, num_stages_bwd, interpret, precision,
             skip_empty_blocks, count_blocks=False, backend="triton", fast_mma=False, Dv=None,
             dtype=None):
  """(_Config, padded q length, padded kv length, padded head_dim, padded v head_dim) for a
  call: what flash_attention runs and what block_counts counts."""
  Dv = D if Dv is None else Dv
  if backend not in BACKENDS:
    raise FlashAttentionError(f"backend={backend!r}; choose one of {BACKENDS}")
  wgs = (1, 1)
  if backend == "mosaic":
    _check_mosaic(dtype, D, Dv, blocks, num_stages, num_stages_bwd)
    padded_d, padded_dv = (-(-d // MOSAIC_TILE) * MOSAIC_TILE for d in (D, Dv))
    chosen, wgs = _mosaic_blocks(blocks, fast_mma)
    # a program's rows: wgs blocks; both lengths cover every kernel's blocks and programs
    q_multiple = max(wgs[0] * chosen[0], wgs[1] * chosen[2])
    k_multiple = max(chosen[1], chosen[3] * wgs[1])
  else:
    padded_d, padded_dv = (max(_MIN_TILE, pl.next_power_of_2(d)) for d in (D, Dv))
    chosen = []
    for name, value, default, n in zip(("block_q", "block_k", "block_q_bwd", "block_k_bwd"),
                                       blocks, _default_blocks(max(padded_d, padded_dv)),
                                       (Sq, Sk, Sq, Sk)):
      chosen.append(_check_block(name, value) if value is not None else _fit_block(default, n))
    q_multiple = k_multiple = max(chosen)
  padded_sq, padded_sk = -(-Sq // q_multiple) * q_multiple, -(-Sk // k_multiple) * k_multiple
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if backend == "mosaic" and fast_mma and interpret:
    raise FlashAttentionError(
        "fast_mma=True uses what jax's GPU interpreter does not run (transposed and register "
        "wgmma operands, pl.run_state accumulators); interpret with fast_mma=False, or "
        "compile for a GPU (interpret=False).")
  # Padded keys sit after every real query (positions Sk, ... or flash_attention._NEVER) unless
  # attention is not causal or more queries than keys count from 0: only then a length mask
  # hides them.
  hide_padding = padded_sk != Sk and (not causal or (not has_positions and Sq > Sk))
  big = max(padded_d, padded_dv) > 64
  cfg = _Config(
      causal=bool(causal), sm_scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
      block_q=chosen[0], block_k=chosen[1], block_q_bwd=chosen[2], block_k_bwd=chosen[3],
      kv_len=Sk if hide_padding else None, has_segments=has_segments,
      has_positions=bool(has_positions and causal),
      skip_blocks=(has_segments or bool(has_positions and causal)) and bool(skip_empty_blocks),
      count_blocks=count_blocks, precision=_precision(precision),
      num_warps=(8 if big else 4) if num_warps is None else num_warps,
      num_warps_bwd=(8 if big else 4) if num_warps_bwd is None else num_warps_bwd,
      num_stages=(2 if backend == "mosaic" else 3) if num_stages is None else num_stages,
      num_stages_bwd=2 if num_stages_bwd is None else num_stages_bwd,
      interpret=bool(interpret), backend=backend, fast_mma=bool(fast_mma),
      compute_wgs=wgs[0], compute_wgs_bwd=wgs[1])
  return cfg, padded_sq, padded_sk, padded_d, padded_dv


def _prepare(q, k, v, segment_ids, positions, *, causal, sm_scale, blocks, num_warps,
             num_warps_bwd, num_stages, num_stages_bwd, interpret, precision,
             skip_empty_blocks, backend="triton", fast_mma=False):
  """Validated int32 ids and positions, and the (_Config, padded sizes) of a call."""
  q_seg, kv_seg = _split_segments(segment_ids)
  q_pos, kv_pos = _split_positions(positions)
  _validate(q, k, v, q_seg, kv_seg, q_pos, kv_pos,
            one_segment_array=segment_ids is not None and not isinstance(segment_ids,
                                                                         (tuple, list)))
  q_seg = _exact_segment_ids(q_seg, "q segment_ids")
  kv_seg = _exact_segment_ids(kv_seg, "kv segment_ids")
  if backend == "mosaic" and q_seg is not None and q_seg.dtype != jnp.int32:
    raise FlashAttentionError(
        f"backend='mosaic' compares int32 segment ids, got {q_seg.dtype} (64-bit ids under "
        "jax_enable_x64); relabel them per row to int32, or use backend='triton'.")
  if q_pos is not None and causal:  # [1, S]: the layout the kernels read them in
    q_pos, kv_pos = (jnp.asarray(x).astype(jnp.int32)[None] for x in (q_pos, kv_pos))
  else:
    q_pos = kv_pos = None  # without causal masking positions change nothing
  B, Sq, H, D = q.shape
  if B == 0 or Sq == 0 or k.shape[1] == 0:
    return (q_seg, kv_seg, q_pos, kv_pos), None
  cfg, padded_sq, padded_sk, padded_d, padded_dv = _resolve(
      B, Sq, k.shape[1], H, D, q_seg is not None, q_pos is not None, causal=causal,
      sm_scale=sm_scale, blocks=blocks, num_warps=num_warps, num_warps_bwd=num_warps_bwd,
      num_stages=num_stages, num_stages_bwd=num_stages_bwd, interpret=interpret,
      precision=precision, skip_empty_blocks=skip_empty_blocks, backend=backend,
      fast_mma=fast_mma, Dv=v.shape[3], dtype=q.dtype)
  sizes = dict(cfg=cfg, padded_sq=padded_sq, padded_sk=padded_sk,
               padded_dims=(padded_d, padded_dv))
  return (q_seg, kv_seg, q_pos, kv_pos), sizes


def _options(options: dict) -> dict:
  """flash_attention_backward's **options as _prepare's keywords; unknown ones raise."""
  known = ("sm_scale", "block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps",
           "num_warps_bwd", "num_stages", "num_stages_bwd", "interpret", "precision",
           "skip_empty_blocks", "backend", "fast_mma")
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
              else o["skip_empty_blocks"], backend=o["backend"] or "triton",
              fast_mma=bool(o["fast_mma"]))

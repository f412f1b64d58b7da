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

The pieces: flash_config.py turns a call's arguments into the kernels' static configuration
(validation, block sizes, launch parameters); flash_tiles.py holds what the kernels share;
flash_forward.py and flash_backward.py the kernels and their pallas_calls. This module is the
public API, the XLA reference, and the custom VJP with the padding around the kernels.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxtrain.model.kernels import block_map
from jaxtrain.model.kernels.flash_backward import _backward
from jaxtrain.model.kernels.flash_config import (MAX_HEAD_DIM, SUPPORTED_DTYPES,
                                                 FlashAttentionError, SegmentIds, check_groups,
                                                 _exact_segment_ids, _options, _prepare, _resolve,
                                                 _split_positions, _split_segments)
from jaxtrain.model.kernels.flash_forward import _forward
from jaxtrain.model.kernels.flash_tiles import _LN2, _LOG2E, _MASKED

__all__ = [
    "FlashAttentionError",
    "block_counts",
    "flash_attention",
    "flash_attention_backward",
    "reference_attention",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
]


# ----------------------------------------------------------------------------------------------
# Reference (XLA) implementation: the test oracle and the fallback for backends without Triton.


def reference_attention(q, k, v, segment_ids: SegmentIds = None, causal: bool = True,
                        sm_scale: Optional[float] = None, *, positions=None,
                        return_lse: bool = False):
  """Plain attention with repeated KV heads and an fp32 softmax; same contract as flash_attention.

  Rows with no visible key (possible with separate q/kv segment ids) produce zeros.
  """
  B, S, H, D = q.shape
  K = k.shape[2]
  check_groups(H, K)
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
# Public entry points.


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

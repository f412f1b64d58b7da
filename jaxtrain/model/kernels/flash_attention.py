"""Flash attention (forward + backward) in Pallas, on the Triton or the Mosaic GPU backend, with
GQA, packed documents and a value head size that may differ from the query/key one.

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

`backend="triton"` (the default) is the FlashAttention-2-style kernel above; `backend="mosaic"`
runs the same algorithm and contract as Hopper kernels on Mosaic GPU (FlashAttention-3's
warp-specialised producer/consumer programs with TMA and wgmma: mosaic_forward.py,
mosaic_backward.py, mosaic_tiles.py), bf16/fp16 only.

On CPU the same kernels run in Pallas interpret mode (Mosaic GPU's: jax's GPU interpreter),
which is how the tests check them.

The pieces: flash_config.py turns a call's arguments into the kernels' static configuration
(validation, block sizes, launch parameters); flash_tiles.py holds what the Triton kernels
share; flash_forward.py and flash_backward.py the kernels and their pallas_calls. This module
is the public API, the XLA reference, and the custom VJP with the padding around the kernels.
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
from jaxtrain.model.kernels.mosaic_backward import mosaic_backward
from jaxtrain.model.kernels.mosaic_forward import mosaic_forward

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
  check_groups(H, K)  # v's head dim may differ from q/k's (the output takes v's)
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
  forward = mosaic_forward if cfg.backend == "mosaic" else _forward
  return forward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[:2]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 12))
def _backward_kernels(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do, dlse_BHS,
                      grad_dtype=None):
  backward = mosaic_backward if cfg.backend == "mosaic" else _backward
  return backward(cfg, q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse_BHS, do, dlse_BHS,
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


def _pad_to(x, length: int, dim: int):
  """x [B, S, heads, d] zero-padded to [B, length, heads, dim]."""
  if x.shape[1] == length and x.shape[3] == dim:
    return x
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dim - x.shape[3])))


def _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_dims):
  Sk = k.shape[1]
  # Zero head-dim padding leaves q.k and the real output columns unchanged.
  (d, dv) = padded_dims
  q, k, v = _pad_to(q, padded_sq, d), _pad_to(k, padded_sk, d), _pad_to(v, padded_sk, dv)
  if q_seg is not None:
    q_seg = block_map.pad_segments(jnp, q_seg, padded_sq)
    kv_seg = block_map.pad_segments(jnp, kv_seg, padded_sk)
  if q_pos is not None:
    # Padded queries repeat the last position (their block's range stays), padded keys come
    # after every query: causality hides them.
    q_pos = block_map.pad_segments(jnp, q_pos, padded_sq)
    kv_pos = jnp.pad(kv_pos, ((0, 0), (0, padded_sk - Sk)), constant_values=_NEVER)
  return q, k, v, q_seg, kv_seg, q_pos, kv_pos


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_dims"))
def _flash_padded(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, cfg, padded_sq, padded_sk,
                  padded_dims):
  Sq, Dv = q.shape[1], v.shape[3]
  out, lse = _flash_core(cfg, *_pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq,
                                    padded_sk, padded_dims))
  return out[:, :Sq, :, :Dv], lse[:, :, :Sq]


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_dims",
                                             "grad_dtype"))
def _backward_padded(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do, *, cfg, padded_sq,
                     padded_sk, padded_dims, grad_dtype=None):
  Sq, Sk, D, Dv = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
  padded = _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_dims)
  out, do = _pad_to(out, padded_sq, padded_dims[1]), _pad_to(do, padded_sq, padded_dims[1])
  # padded rows see no key (+inf), so they add nothing to dK/dV
  lse2 = jnp.pad(_kernel_lse(lse.astype(jnp.float32)), ((0, 0), (0, 0), (0, padded_sq - Sq)),
                 constant_values=jnp.inf)
  dq, dk, dv = _backward_kernels(cfg, *padded, out, lse2, do, None, grad_dtype)
  return dq[:, :Sq, :, :D], dk[:, :Sk, :, :D], dv[:, :Sk, :, :Dv]


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
    backend: str = "triton",
    fast_mma: bool = False,
):
  """Memory-efficient attention softmax(q k^T * sm_scale + mask) v, differentiable once.

  Args:
    q_BSHD: queries [B, Sq, H, D]; float32, bfloat16 or float16.
    k_BSKD, v_BSKD: keys [B, Sk, K, D] and values [B, Sk, K, Dv] with H % K == 0 (K == 1 is
      MQA); same dtype as q; Dv may differ from D (DeepSeek's latent attention: 192 / 128).
      Sk may differ from Sq (a context-parallel shard's queries against gathered keys).
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
      reverse). Triton: powers of two >= 16; Mosaic: 64 or 128 (rows per warpgroup). None
      picks Hopper defaults by head_dim.
    num_warps*, num_stages*: Triton launch parameters (GPU only); Mosaic takes num_stages*
      as its TMA pipeline depth (>= 2).
    interpret: run the Pallas interpreter; None means True unless the default backend is GPU.
    precision: of the in-kernel dots. None follows jax's default_matmul_precision, whose
      default, like DEFAULT and HIGH, computes fp32 inputs in TF32 on GPU (as XLA's fp32 dots
      do there; ~1e-3 relative, not the ~1e-6 the CPU tests see); HIGHEST computes full fp32
      (several times slower). No effect on bf16/fp16 inputs or in interpret mode.
    skip_empty_blocks: with segment ids or positions, skip the (q block, kv block) tiles no
      query of which sees a key of (block_map.py; exact). False only to measure what
      skipping saves.
    backend: "triton" (any GPU Pallas supports; fp32 too) or "mosaic" (Hopper: H100/H200;
      bfloat16/float16, head dims up to 192).
    fast_mma: with backend="mosaic", FlashAttention-3's product forms (transposed and
      register operands, in-place accumulation: mosaic_tiles.Mma), which jax's GPU
      interpreter does not run; False (the checked forms) until a GPU has confirmed them.

  Returns:
    [B, Sq, H, Dv] in q's dtype (and the LSE with return_lse). Softmax statistics and all
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
      interpret=interpret, precision=precision, skip_empty_blocks=skip_empty_blocks,
      backend=backend, fast_mma=fast_mma)
  B, Sq, H, _ = q_BSHD.shape
  if sizes is None:  # an empty batch or sequence
    out = jnp.zeros((B, Sq, H, v_BSKD.shape[3]), q_BSHD.dtype)
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
  cfg, padded_s, *_ = _resolve(
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
  cfg, padded_sq, padded_sk, *dims = _resolve(
      B, Sq, k.shape[1], H, D, q_seg is not None, q_pos is not None, causal=causal,
      sm_scale=None, blocks=blocks, num_warps=None, num_warps_bwd=None, num_stages=None,
      num_stages_bwd=None, interpret=None, precision=None,
      skip_empty_blocks=skip_empty_blocks, count_blocks=True, Dv=v.shape[3])
  return block_map.BlockCounts(*(int(n) for n in _counted_run(
      q, k, v, q_seg, kv_seg, q_pos, kv_pos, cfg=cfg, padded_sq=padded_sq, padded_sk=padded_sk,
      padded_dims=tuple(dims))))


@functools.partial(jax.jit, static_argnames=("cfg", "padded_sq", "padded_sk", "padded_dims"))
def _counted_run(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, cfg, padded_sq, padded_sk,
                 padded_dims):
  padded = _pad(q, k, v, q_seg, kv_seg, q_pos, kv_pos, padded_sq, padded_sk, padded_dims)
  out, lse_BHS, n_fwd = _forward(cfg, *padded)
  _, _, _, (n_dkv, n_dq) = _backward(cfg, *padded, out, lse_BHS, jnp.ones_like(out))
  return jnp.sum(n_fwd), jnp.sum(n_dkv), jnp.sum(n_dq)

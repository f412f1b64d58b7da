"""Grouped matmul (the MoE expert GEMM) for Hopper: `lax.ragged_dot`'s contract, differentiable.

    grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G) -> out_MN,  out[r] = lhs[r] @ rhs[g(r)]

where rows [sum(sizes[:g]), sum(sizes[:g+1])) belong to group g (rows past the last group are
zero, as in ragged_dot). Forward and both backward products run as Mosaic GPU kernels
(grouped_matmul_kernels.py): the forward and dX = dY @ W[g]^T as `rows_times_group`, dW[g] =
X[g]^T @ dY[g] as `per_group_products`. On CPU the same kernels run in Mosaic GPU interpret
mode (`config=INTERPRET`), which is how the tests check them against `lax.ragged_dot`.

Why not `lax.ragged_dot` on GPU: XLA:GPU at jax 0.10 expands it into one dense GEMM of
E times the work (../shared/notes/moe-and-mosaic-gpu-without-gpu.md). Why not jax's
ragged_dot_mgpu / transposed_ragged_dot_mgpu as they ship: they take no interpret parameter,
fix the SM count, read `jax.devices()` (no deviceless compile for the transposed one), and
their transposed operands do not run in the interpreter; tokamax refuses JAX_PLATFORMS=cpu.
docs/design.md §8 has the decision.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxtrain.model.kernels import grouped_matmul_kernels as kernels

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class GroupedMatmulError(ValueError):
  """Shapes, dtypes or tiles the grouped matmul kernels cannot take."""


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
  """Tiles and launch of the kernels (defaults: an H100/H200, 132 SMs; compiled for sm_90a
  without spills at Mixtral's shapes, tests/test_gpu_compile.py)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  group_rows: int = 8
  num_sms: int = 132
  interpret: bool = False

  def tiles(self) -> kernels.Tiles:
    return kernels.Tiles(self.block_m, self.block_n, self.block_k, self.stages,
                         self.group_rows, self.num_sms, self.interpret)


# CPU checks: the smallest wgmma tiles and two simulated SMs (interpret mode runs every
# simulated thread in Python; it checks the kernels' logic, never their speed).
INTERPRET = GroupedMatmulConfig(block_m=64, block_n=64, block_k=64, stages=2, group_rows=2,
                                num_sms=2, interpret=True)


def _check(lhs_MK, rhs_GKN, group_sizes_G, cfg: GroupedMatmulConfig) -> None:
  if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or group_sizes_G.shape != rhs_GKN.shape[:1]:
    raise GroupedMatmulError(
        f"grouped_matmul takes lhs [M, K], rhs [G, K, N] and group_sizes [G]; got "
        f"{lhs_MK.shape}, {rhs_GKN.shape} and {group_sizes_G.shape}")
  if lhs_MK.shape[1] != rhs_GKN.shape[1]:
    raise GroupedMatmulError(f"grouped_matmul: lhs has K={lhs_MK.shape[1]} but rhs has "
                             f"K={rhs_GKN.shape[1]}")
  if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise GroupedMatmulError(f"grouped_matmul: group_sizes must be integers, got "
                             f"{group_sizes_G.dtype}")
  dtypes = {jnp.dtype(lhs_MK.dtype), jnp.dtype(rhs_GKN.dtype)}
  if len(dtypes) != 1 or not dtypes <= set(SUPPORTED_DTYPES):
    raise GroupedMatmulError(
        f"grouped_matmul runs wgmma on bfloat16 or float16 operands of one dtype, got "
        f"{lhs_MK.dtype} and {rhs_GKN.dtype}; cast both to the compute dtype (fp32 has "
        "lax.ragged_dot)")
  if min(cfg.block_m, cfg.block_n, cfg.block_k) < 64 or cfg.stages < 2:
    raise GroupedMatmulError(f"grouped_matmul: tiles {cfg.block_m}x{cfg.block_n}x"
                             f"{cfg.block_k} with {cfg.stages} stages; wgmma needs tiles of "
                             "at least 64 and the pipeline at least 2 stages")
  # K and N are each a contraction, an output column and a weight-gradient row dim in one
  # of the three products, so each must hold whole tiles of every kind.
  unit = math.lcm(cfg.block_m, cfg.block_n, cfg.block_k)
  k, n = rhs_GKN.shape[1:]
  if k % unit or n % unit:
    raise GroupedMatmulError(f"grouped_matmul: K={k} and N={n} must be multiples of {unit} "
                             f"(the tiles {cfg.block_m}x{cfg.block_n}x{cfg.block_k}); pad the "
                             "hidden or expert size, or pick smaller tiles")


def _bounds(group_sizes_G, m: int):
  """(starts, ends) [G] int32 of each group's rows, clipped to the M rows."""
  ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  return starts, ends


def _pad_rows(x, rows: int):
  return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _forward(lhs_MK, rhs_GKN, group_sizes_G, cfg):
  m = lhs_MK.shape[0]
  padded = -(-m // math.lcm(cfg.block_m, cfg.block_k)) * math.lcm(cfg.block_m, cfg.block_k)
  starts, ends = _bounds(group_sizes_G, m)
  out = kernels.rows_times_group(_pad_rows(lhs_MK, padded), rhs_GKN, starts, ends,
                                 cfg.tiles(), "kn")
  return out[:m]


def _backward(lhs_MK, rhs_GKN, group_sizes_G, ct_MN, cfg):
  m = lhs_MK.shape[0]
  padded = -(-m // math.lcm(cfg.block_m, cfg.block_k)) * math.lcm(cfg.block_m, cfg.block_k)
  starts, ends = _bounds(group_sizes_G, m)
  ct = _pad_rows(ct_MN.astype(lhs_MK.dtype), padded)
  lhs = _pad_rows(lhs_MK, padded)
  tiles = cfg.tiles()
  if cfg.interpret:  # the interpreter takes no transposed wgmma operand: materialize it
    d_lhs = kernels.rows_times_group(ct, jnp.swapaxes(rhs_GKN, 1, 2), starts, ends, tiles, "kn")
    d_rhs = kernels.per_group_products(lhs.T, ct, starts, ends, tiles, "km")
  else:
    d_lhs = kernels.rows_times_group(ct, rhs_GKN, starts, ends, tiles, "nk")
    d_rhs = kernels.per_group_products(lhs, ct, starts, ends, tiles, "mk")
  return d_lhs[:m], d_rhs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, cfg):
  return _forward(lhs_MK, rhs_GKN, group_sizes_G, cfg)


def _fwd(lhs_MK, rhs_GKN, group_sizes_G, cfg):
  return _forward(lhs_MK, rhs_GKN, group_sizes_G, cfg), (lhs_MK, rhs_GKN, group_sizes_G)


def _bwd(cfg, saved, ct_MN):
  lhs_MK, rhs_GKN, group_sizes_G = saved
  d_lhs, d_rhs = _backward(lhs_MK, rhs_GKN, group_sizes_G, ct_MN, cfg)
  return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_fwd, _bwd)


def grouped_matmul(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array,
                   config: GroupedMatmulConfig = GroupedMatmulConfig()) -> jax.Array:
  """out[M, N] (lhs's dtype, fp32 accumulation): each row times its group's [K, N] matrix.

  Args:
    lhs_MK: rows sorted by group; bfloat16 or float16.
    rhs_GKN: one [K, N] matrix per group, lhs's dtype; K and N multiples of the tiles'
      least common multiple (128 by default).
    group_sizes_G: int rows per group, in row order; rows past their sum are zero (and get a
      zero gradient). Every row, grouped or not, must be finite: a boundary tile multiplies
      the other groups' rows by zero.
    config: tiles and launch; INTERPRET runs the kernels on CPU.

  Differentiable in lhs and rhs (group_sizes gets no gradient), once.
  """
  _check(lhs_MK, rhs_GKN, group_sizes_G, config)
  return _grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, config)


def reference(lhs_MK, rhs_GKN, group_sizes_G, config=None):
  """`lax.ragged_dot` with the same contract (what the kernels are checked against)."""
  del config
  return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G)

"""The grouped matmul's Mosaic GPU kernels (Hopper: TMA loads, wgmma, a persistent grid).

Rows of `lhs` are sorted by group: group g owns rows [starts[g], ends[g]) (contiguous and in
order; rows past the last group belong to none).

`rows_times_group`: out[M, N], row r = lhs[r] @ rhs[g(r)] (zero for a row in no group). One
  program per output tile (row block, column block), persistent over the SMs. The tile loops
  over the groups its rows meet (one, except at a group boundary), accumulating each group's
  product into the same wgmma accumulator, and stores the whole tile once. A group that covers
  part of the block multiplies with the block's other rows zeroed in shared memory first, so
  each row gets exactly its own group's product and the store needs no row mask (jax's
  ragged_dot_mgpu instead writes a boundary block once per group, only that group's rows,
  through a ladder of power-of-two TMA stores; here a row in no group is zero, as in
  lax.ragged_dot). `rhs_layout` "kn": rhs[g] is [K, N] (the forward); "nk": rhs[g] is [N, K]
  and is read transposed (the lhs gradient dY @ W[g]^T: a transposed shared-memory view for
  wgmma, no copy).

`per_group_products`: out[G, K, N], out[g] = lhs[rows of g]^T @ rhs[rows of g] (the weight
  gradient). One program per (group, K tile, N tile) loops over its group's row blocks; the
  rows of other groups in its first and last block are zeroed in the rhs tile. An empty group
  gives zeros. `lhs_layout` "mk": lhs is [M, K], read transposed; "km": lhs is [K, M].

Interpret mode (CPU) simulates shared memory, barriers and TMA but, at jax 0.10, not a
transposed wgmma operand: there the caller materializes the transposed operand ("kn", "km")
and the kernels read it as is. The masked operand, the tiles and the schedule are those the
compiled kernels run.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtrain import compat


ROWS_KERNEL = "jaxtrain_grouped_rows"          # forward and dX
PER_GROUP_KERNEL = "jaxtrain_grouped_per_group"  # dW


@dataclasses.dataclass(frozen=True)
class Tiles:
  block_m: int       # output rows per tile (rows_times_group); K rows per tile (per_group)
  block_n: int       # output columns per tile
  block_k: int       # contraction step: 64 bf16 values are one 128-byte swizzle row
  stages: int        # TMA loads in flight (shared memory: stages x both operand tiles)
  group_rows: int    # tile order: this many row tiles walked together (rhs reuse in L2)
  num_sms: int       # the persistent grid (132 on an H100 or H200)
  interpret: bool


def _tile(t, rows: int, cols: int, group_rows: int):
  """(row, col) of the t-th tile of a rows x cols grid, `group_rows` rows at a time, column by
  column within a group: the tiles in flight on the SMs then share few rhs column tiles and
  few lhs row tiles (Triton's grouped order). plgpu.planar_snake takes a remainder by zero
  when the grid divides its tile width (interpret mode died of SIGFPE on a one-tile grid)."""
  per_group = group_rows * cols
  first_row = (t // per_group) * group_rows
  height = jnp.minimum(rows - first_row, group_rows)
  within = t % per_group
  return first_row + within % height, within // height


def _spec(block_shape, index_map, dtype):
  """A pipelined operand tile, swizzled for wgmma along its minor dim."""
  swizzle = plgpu.find_swizzle(block_shape[-1] * jnp.dtype(dtype).itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))
  # delay_release=1: a slot is refilled one step after its wgmma was issued (wgmma is async)
  return plgpu.BlockSpec(block_shape, index_map, delay_release=1, transforms=transforms)


def _zero_rows_outside(ref, row0, start, end, axis: int):
  """Zero the tile's rows (along `axis`, global index row0 + i) outside [start, end)."""
  rows = jax.lax.broadcasted_iota(jnp.int32, ref.shape, axis) + row0
  ref[...] = ref[...] * ((rows >= start) & (rows < end)).astype(ref.dtype)
  plgpu.commit_smem()  # the generic-proxy writes, visible to wgmma's async proxy


def _store_tile(acc, out_ref):
  """The fp32 accumulator, cast to the output dtype, into `out_ref` (a gmem tile) by TMA."""
  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(acc.shape, dtype=out_ref.dtype))
  def _(o_smem):
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(body, name: str, out_shape, dtype, tiles: Tiles, *operands):
  body.__name__ = name  # the kernel's name in the compiled program and Mosaic's dumps
  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(out_shape, dtype), grid=(tiles.num_sms,),
      grid_names=("sm",), compiler_params=compat.mosaic_compiler_params(plgpu),
      interpret=compat.mosaic_interpret_params() if tiles.interpret else None)
  return kernel(*operands)


def row_block_groups(starts_G, ends_G, m: int, block_m: int):
  """(first, last) group each row block meets, [M / block_m] each (first > last: none).
  Empty groups inside the range are skipped by the kernel."""
  row0 = jnp.arange(m // block_m, dtype=jnp.int32) * block_m
  total = ends_G[-1]
  first = jnp.searchsorted(ends_G, row0, side="right")
  last_row = jnp.minimum(row0 + block_m, total) - 1
  last = jnp.where(row0 < total, jnp.searchsorted(ends_G, last_row, side="right"), -1)
  return first.astype(jnp.int32), last.astype(jnp.int32)


def rows_times_group(lhs_MK, rhs, starts_G, ends_G, tiles: Tiles, rhs_layout: str):
  m, k = lhs_MK.shape
  n = rhs.shape[2] if rhs_layout == "kn" else rhs.shape[1]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  row_blocks, col_blocks = m // bm, n // bn
  first_R, last_R = row_block_groups(starts_G, ends_G, m, bm)

  def body(starts_ref, ends_ref, first_ref, last_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((row_blocks * col_blocks,), collective_axes="sm")
    def _(info):
      mi, ni = _tile(info.index[0], row_blocks, col_blocks, tiles.group_rows)
      row0 = mi * bm

      def accumulate(acc_ref):
        def one_group(g, carry):
          start, end = starts_ref[g], ends_ref[g]
          partial = (start > row0) | (end < row0 + bm)

          def step(_, lhs_smem, rhs_smem):
            @pl.when(partial)
            def _():
              _zero_rows_outside(lhs_smem, row0, start, end, axis=0)
            w = rhs_smem if rhs_layout == "kn" else plgpu.transpose_ref(rhs_smem, (1, 0))
            plgpu.wgmma(acc_ref, lhs_smem, w)

          rhs_spec = (_spec((bk, bn), lambda kk: (kk, ni), rhs.dtype) if rhs_layout == "kn"
                      else _spec((bn, bk), lambda kk: (ni, kk), rhs.dtype))

          @pl.when(end > start)
          def _():
            plgpu.emit_pipeline(
                step, grid=(k // bk,),
                in_specs=[_spec((bm, bk), lambda kk: (mi, kk), lhs_MK.dtype), rhs_spec],
                max_concurrent_steps=tiles.stages)(lhs_ref, rhs_ref.at[g])
            # The pipeline returns with its last wgmma in flight, reading a shared-memory
            # slot the next group's pipeline would refill (the interpreter runs wgmma
            # synchronously and cannot see this race).
            plgpu.wgmma_wait(0)
          return carry

        jax.lax.fori_loop(first_ref[mi], last_ref[mi] + 1, one_group, 0)
        return acc_ref[...]

      acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))
      _store_tile(acc, out_ref.at[pl.ds(row0, bm), pl.ds(ni * bn, bn)])

  return _launch(body, ROWS_KERNEL, (m, n), lhs_MK.dtype, tiles, starts_G, ends_G, first_R,
                 last_R, lhs_MK, rhs)


def per_group_products(lhs, rhs_MN, starts_G, ends_G, tiles: Tiles, lhs_layout: str):
  m, n = rhs_MN.shape
  k = lhs.shape[1] if lhs_layout == "mk" else lhs.shape[0]
  g_count = starts_G.shape[0]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  k_blocks, n_blocks = k // bm, n // bn

  def body(starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((g_count, k_blocks * n_blocks), collective_axes="sm")
    def _(info):
      g = info.index[0]
      ki, ni = _tile(info.index[1], k_blocks, n_blocks, tiles.group_rows)
      start, end = starts_ref[g], ends_ref[g]
      first = start // bk

      def accumulate(acc_ref):
        def step(idx, lhs_smem, rhs_smem):
          row0 = (first + idx[0]) * bk

          @pl.when((row0 < start) | (row0 + bk > end))
          def _():
            _zero_rows_outside(rhs_smem, row0, start, end, axis=0)
          x = lhs_smem if lhs_layout == "km" else plgpu.transpose_ref(lhs_smem, (1, 0))
          plgpu.wgmma(acc_ref, x, rhs_smem)

        lhs_spec = (_spec((bm, bk), lambda r: (ki, first + r), lhs.dtype) if lhs_layout == "km"
                    else _spec((bk, bm), lambda r: (first + r, ki), lhs.dtype))

        @pl.when(end > start)
        def _():
          plgpu.emit_pipeline(
              step, grid=(pl.cdiv(end, bk) - first,),
              in_specs=[lhs_spec, _spec((bk, bn), lambda r: (first + r, ni), rhs_MN.dtype)],
              max_concurrent_steps=tiles.stages)(lhs_ref, rhs_ref)
        return acc_ref[...]

      acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))
      _store_tile(acc, out_ref.at[g, pl.ds(ki * bm, bm), pl.ds(ni * bn, bn)])

  return _launch(body, PER_GROUP_KERNEL, (g_count, k, n), rhs_MN.dtype, tiles, starts_G,
                 ends_G, lhs, rhs_MN)

"""What the Mosaic GPU flash kernels share: the launch (warp-specialised programs), the TMA
producer that streams a program's tiles through shared memory, the matrix products in their
checked and fast forms, a tile's visibility mask, and the program's list of blocks.

Each program runs `wgs` (1 or 2) compute warpgroups (one block of rows each) and one memory
warpgroup that copies every step's tiles into a ring of `num_stages` shared-memory slots with
TMA (FlashAttention-3's producer/consumer split). A step's tiles come in groups, each with
its own `loaded` barrier (one arrival per copy) and `consumed` barrier (one arrival per
compute warpgroup), so a compute warpgroup starts its first product while the second group
is still in flight.

The checked and fast kernels differ only in three constructs that jax's GPU interpreter does
not run at jax 0.10.2 / 0.11.1 (`Mma` below): a transposed shared-memory operand
(TransposeTransform), a register operand (wgmma reads it from registers), and a product
accumulated into live registers (`pl.run_state` on an accumulator). The checked kernel reads
transposed copies that XLA wrote to HBM, stages register operands through shared memory and
adds a fresh accumulator; it is what the CPU tests interpret and what runs by default.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain import compat
from jaxtrain.model.kernels.flash_tiles import _cdiv, _div

plgpu = compat.mosaic_gpu()

WG = "wg"  # the thread axis: compute warpgroups 0 .. wgs - 1, then the memory warpgroup
# Register budgets (setmaxnreg) with two compute warpgroups: 2 x 128 x 240 + 128 x 24 <= the
# SM's 64 Ki registers (FlashAttention-3's split). With one, both get 255 at launch.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 240, 24


def tile_smem(shape, dtype):
  """Shared memory for a matrix tile as wgmma and TMA read it: swizzled 8-row tiles of the
  widest swizzle (128, 64 or 32 bytes) that the minor dimension fills."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(128, shape[-1] * itemsize)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))


def row_smem(shape, dtype):
  """Shared memory for per-row vectors (segment ids, positions, LSE): no transforms."""
  return plgpu.SMEM(shape, dtype)


# ----------------------------------------------------------------------------- launching


def launch(body, inputs: dict, outputs: dict, grid, grid_names, *, wgs: int, interpret: bool,
           name: str):
  """Run `body(refs)` (refs: the inputs' and outputs' GMEM refs by name) on `grid` programs of
  wgs + 1 warpgroups; returns the outputs by name."""
  in_names, out_names = list(inputs), list(outputs)

  def entry(*refs):
    body(dict(zip(in_names + out_names, refs)))

  run = plgpu.kernel(
      entry, out_type=[outputs[n] for n in out_names], grid=grid, grid_names=grid_names,
      num_threads=wgs + 1, thread_name=WG,
      compiler_params=compat.mosaic_compiler_params(plgpu),
      interpret=compat.mosaic_interpret_params() if interpret else False, kernel_name=name)
  return dict(zip(out_names, run(*[inputs[n] for n in in_names])))


def scoped(fn, *allocations):
  """fn(*allocations as refs), all of them shared by the program's warpgroups."""
  return pl.run_scoped(fn, *allocations, collective_axes=WG)


def split_roles(compute: Callable[[Any], None], memory: Callable[[], None], wgs: int):
  """compute(w) on compute warpgroup w, memory() on the last one, with their register budgets."""
  wg = lax.axis_index(WG)

  @pl.when(wg < wgs)
  def _():
    if wgs > 1:
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    compute(wg)

  @pl.when(wg == wgs)
  def _():
    if wgs > 1:
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
    memory()


# ----------------------------------------------------------------------------- streaming


@dataclasses.dataclass(frozen=True)
class Stream:
  """One tile a step copies: `view(step)` is its GMEM window, `smem` its slot's type."""
  view: Callable[[Any], Any]
  smem: Any


class Pipeline:
  """The ring of `slots` shared-memory slots that the memory warpgroup fills, step by step,
  with groups of streams, and the compute warpgroups read and release."""

  def __init__(self, groups: Sequence[Sequence[Stream]], slots: int, wgs: int):
    self.groups = [list(g) for g in groups]
    self.slots, self.wgs = slots, wgs

  def allocations(self):
    buffers = tuple(tuple(plgpu.SMEM((self.slots, *s.smem.shape), s.smem.dtype,
                                     transforms=s.smem.transforms) for s in g)
                    for g in self.groups)
    loaded = tuple(plgpu.Barrier(num_arrivals=len(g), num_barriers=self.slots)
                   for g in self.groups)
    consumed = tuple(plgpu.Barrier(num_arrivals=self.wgs, num_barriers=self.slots)
                     for _ in self.groups)
    return buffers, loaded, consumed

  def bind(self, refs) -> "BoundPipeline":
    return BoundPipeline(self, *refs)


@dataclasses.dataclass
class BoundPipeline:
  spec: Pipeline
  buffers: Any
  loaded: Any
  consumed: Any

  def slot(self, u):
    return lax.rem(u, jnp.int32(self.spec.slots))

  def produce(self, num_steps, step_of: Callable[[Any], Any]):
    """The memory warpgroup: every step u in [0, num_steps), step_of(u) its indices."""
    slots = self.spec.slots

    def body(u, carry):
      slot, step = self.slot(u), step_of(u)
      for g, streams in enumerate(self.spec.groups):
        @pl.when(u >= slots)
        def _():  # the slot's previous tiles have been read by every compute warpgroup
          plgpu.barrier_wait(self.consumed[g].at[slot])
        for s, stream in enumerate(streams):
          plgpu.copy_gmem_to_smem(stream.view(step), self.buffers[g][s].at[slot],
                                  self.loaded[g].at[slot])
      return carry
    lax.fori_loop(0, num_steps, body, None)

    def drain(u, carry):  # observe the last steps' releases too (the interpreter checks that
      for g in range(len(self.spec.groups)):  # every thread saw each phase it waited on)
        plgpu.barrier_wait(self.consumed[g].at[self.slot(u)])
      return carry
    lax.fori_loop(jnp.maximum(num_steps - slots, 0), num_steps, drain, None)

  def wait(self, g: int, slot):
    """Group g's tiles of `slot`, once they have landed."""
    plgpu.barrier_wait(self.loaded[g].at[slot])
    return [b.at[slot] for b in self.buffers[g]]

  def release(self, g: int, slot):
    plgpu.barrier_arrive(self.consumed[g].at[slot])


def row_streams(refs, cfg, seg_name: str, pos_name: str, window, batch, n: int) -> list[Stream]:
  """The streams of a block's segment ids and positions (those the config has), `window(step)`
  its rows, `batch` the program's batch row."""
  out = []
  if cfg.has_segments:
    out.append(Stream(lambda s: refs[seg_name].at[batch, window(s)], row_smem((n,), jnp.int32)))
  if cfg.has_positions:
    out.append(Stream(lambda s: refs[pos_name].at[window(s)], row_smem((n,), jnp.int32)))
  return out


def load_own(copies, barrier):
  """Copy a warpgroup's own tiles ((GMEM window, SMEM tile) pairs; one barrier, one arrival
  per copy) and wait for them."""
  for src, dst in copies:
    plgpu.copy_gmem_to_smem(src, dst, barrier)
  plgpu.barrier_wait(barrier)


class Program(NamedTuple):
  """Where a program is: its batch row, head, kv head, first row, and its loops over the
  other side's blocks (block_loops) with the first block index they start from."""
  b: Any
  h: Any
  kh: Any
  start: Any
  loops: list
  block_of: Callable
  first: Any


def program(refs, cfg, *, axis: str, programs: int, span: int, other_block: int, num_other: int,
            group: int, rows: bool) -> Program:
  """The program at grid axis `axis` (`programs` of `span` rows; q-block programs of a causal
  kernel run the longest first) and its loops, from the block map when the config skips."""
  b, h = lax.axis_index("b"), lax.axis_index("h")
  prog = lax.axis_index(axis)
  if rows and cfg.causal:  # causal work grows with the q block: launch the longest first
    prog = programs - 1 - prog
  schedule = (lambda i: refs["schedule"][b, prog, i]) if cfg.skip_blocks else None
  start = prog * span
  loops, block_of = block_loops(cfg, schedule, start, span, other_block, num_other, rows=rows)
  return Program(b, h, lax.div(h, jnp.int32(group)), start, loops, block_of, loops[0][0])


# ----------------------------------------------------------------------------- products


@dataclasses.dataclass(frozen=True)
class Mma:
  """The kernels' matrix products on tensor cores (wgmma), fp32 accumulation.

  `fast` picks FlashAttention-3's forms: operands transposed in shared memory, register
  operands, accumulation into live registers. The checked forms (fast=False) are what jax's
  GPU interpreter runs (module docstring); they cost a transposed HBM copy per transposed
  operand, a shared-memory round trip per register operand and an add per accumulation.
  """
  fast: bool

  def product(self, a, b, shape):
    """a @ b into a fresh [M, N] fp32 accumulator (a, b: shared-memory tiles)."""
    def scope(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      return acc_ref[...]
    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

  def accumulate(self, acc, a, b):
    """acc + a @ b."""
    if self.fast:
      return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))
    return acc + self.product(a, b, acc.shape)

  def transposed_stream(self, src, window, shape, dtype) -> Stream:
    """The stream of a tile whose transpose a product reads: `window(step)` indexes the
    [*, S, heads, d] array `src` (an [n, d] tile of `shape`). The fast form streams that tile;
    the checked one the [d, n] tile of its transposed copy [*, heads, d, S] (transposed_input)."""
    if self.fast:
      return Stream(lambda step: src.at[window(step)], tile_smem(shape, dtype))

    def view(step):
      lead, rows, head = window(step)
      return src.at[lead, head, :, rows]
    return Stream(view, tile_smem(shape[::-1], dtype))

  def transposed_input(self, x_BSHD):
    """What a kernel takes for an operand it reads transposed: the array itself (fast), or
    its [B, H, D, S] copy, written once by XLA (checked)."""
    return x_BSHD if self.fast else jnp.transpose(x_BSHD, (0, 2, 3, 1))

  def transposed(self, tile):
    """A streamed tile's transpose as a product operand (see transposed_stream)."""
    return plgpu.transpose_ref(tile, (1, 0)) if self.fast else tile

  def staged(self, x, smem):
    """A register tile as a product's left operand: the fast form passes the registers; the
    checked one stores them in `smem` (fenced for the tensor cores) and passes that."""
    if self.fast:
      return x
    smem[...] = x
    plgpu.commit_smem()
    return smem


def store(dst, acc):
  """An fp32 tile to its GMEM window in the window's dtype, from registers (the epilogue:
  once per program, no shared-memory staging to budget for)."""
  dst[...] = acc.astype(dst.dtype)


# ----------------------------------------------------------------------------- masks, blocks


def broadcast_rows(x, shape):
  """A per-row vector [M] over an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, (0,))


def broadcast_cols(x, shape):
  """A per-column vector [N] over an [M, N] tile."""
  return lax.broadcast_in_dim(x, shape, (1,))


def tile_mask(cfg, shape, *, row_pos, col_pos, row_seg, col_seg, causal, row0, col0,
              transposed=False):
  """The visibility mask of an [M, N] tile (None: all visible) from per-row and per-column
  positions / segment ids ([M] and [N] vectors, or None: positions then count from row0 /
  col0). `causal`: a Python bool, or a traced one (whether this step's tile needs the causal
  mask). `transposed`: rows are keys (dK/dV's tiles), columns queries."""
  def full(x, cols):
    return None if x is None else (broadcast_cols if cols else broadcast_rows)(x, shape)

  def positions(given, start, cols):
    if given is None:  # a vector, broadcast like given ones (a tile of iotas spilled)
      given = start + lax.broadcasted_iota(jnp.int32, (shape[1 if cols else 0],), 0)
    return full(given, cols)

  mask = None
  if causal is not False or cfg.kv_len is not None:
    rp, cp = positions(row_pos, row0, False), positions(col_pos, col0, True)
    q_pos, k_pos = (cp, rp) if transposed else (rp, cp)
    if causal is not False:
      mask = q_pos >= k_pos
      if causal is not True:  # a traced flag: off-diagonal steps see every pair
        mask = mask | jnp.logical_not(causal)
    if cfg.kv_len is not None:
      mask = _and(mask, k_pos < cfg.kv_len)
  if row_seg is not None:
    mask = _and(mask, full(row_seg, False) == full(col_seg, True))
  return mask


def _and(a, b):
  return b if a is None else a & b


def block_loops(cfg, schedule, prog_start, span: int, other_block: int, num_other: int, *,
                rows: bool):
  """([(lo, hi, causal_mask)], block of iteration t) of a program whose `span` rows start at
  prog_start: its list from the block map (`schedule(t)`; entry 0 is `split`, entry 1
  `total`), or the causal diagonal. `rows`: a q-block program (forward, dQ; unmasked blocks
  first); else a kv-block program (dK/dV; masked blocks first)."""
  if schedule is not None:
    split, total = schedule(0), schedule(1)
    if not cfg.causal:
      return [(0, total, False)], lambda t: schedule(2 + t)
    first = [(0, split, not rows), (split, total, rows)]
    return first, lambda t: schedule(2 + t)
  if cfg.causal and cfg.has_positions:
    return [(0, num_other, True)], lambda t: t
  if cfg.causal and rows:
    full = _div(prog_start, other_block)
    live = jnp.minimum(_cdiv(prog_start + span, other_block), num_other)
    return [(0, full, False), (full, live, True)], lambda t: t
  if cfg.causal:
    first_live = _div(prog_start, other_block)
    first_full = jnp.minimum(_cdiv(prog_start + span - 1, other_block), num_other)
    return [(first_live, first_full, True), (first_full, num_other, False)], lambda t: t
  return [(0, num_other, False)], lambda t: t


def loop_steps(loops) -> Any:
  """How many steps the loops run in all (what the memory warpgroup streams)."""
  return functools.reduce(lambda a, b: a + b, [jnp.maximum(hi - lo, 0) for lo, hi, _ in loops])


def run_loops(loops, body, carry, step0=0):
  """body(t, u, carry, causal_mask=...) over each loop's iterations t, u counting steps from
  step0 across loops (the pipeline's slot sequence); returns (carry, steps run)."""
  u = jnp.int32(step0)
  for lo, hi, causal_mask in loops:
    def step(t, c, cm=causal_mask, lo=lo, u0=u):
      return body(t, u0 + (t - lo), c, causal_mask=cm)
    carry = lax.fori_loop(lo, hi, step, carry)
    u = u + jnp.maximum(hi - lo, 0)
  return carry, u


def packed_schedule(schedule):
  """A block_map.Schedule as one int32 array [B, programs, 2 + width]: split, total, blocks
  (what a program reads with scalar loads)."""
  split, total = schedule.split[..., None], schedule.total[..., None]
  return jnp.concatenate([split, total, schedule.blocks], axis=-1).astype(jnp.int32)

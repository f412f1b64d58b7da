"""Expert parallelism's token dispatch: the MoE layer's `Ops.dispatch` when `expert` > 1.

Runs inside the executors' shard_map, where `expert` is manual: each expert rank holds its
own rows of the batch and E/ep of the experts (their weights enter the shard_map split over
`expert`). Under MoE parallel folding (parallel.expert_tensor=1) the expert ranks span
(expert, tensor): `FoldedDispatch` makes the executors' automatic `tensor` manual with a
nested shard_map, each tensor rank dispatching its 1/t of the layer's rows (the router ran on
all of them) with its whole experts, the results gathered back over `tensor` by the out
specs. Megatron's alltoall dispatcher, per MoE layer:

    permute (rows sorted by expert; the rows for rank j are one contiguous block)
    -> all-to-all of the counts (which of my rows each rank's experts get)
    -> transport: block j to rank j; rank i's rows land in block i of a [ep, N, D] buffer
    -> sort the received rows by local expert -> grouped GEMM (the layer's experts_fn)
    -> unsort -> transport back (block i to rank i, landing in block j)
    -> each sorted row read back from its block -> unpermute, weighted by the router

Two transports with one semantics (they deliver the same buffer, zeros past each block's
rows): `ragged` (`lax.ragged_all_to_all`, an async start/done pair on XLA:GPU; XLA:CPU has no
kernel for it) and `fixed` (each block padded to N rows and one `all_to_all`: CPU, and a
fallback). N = T·k (every assignment of this rank may go to one expert rank): the buffers are
dropless' worst case, ep·N rows, whichever transport moves them; `ragged` moves only the rows.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxtrain.model import moe
from jaxtrain.parallel.mesh_axes import EXPERT, TENSOR
from jaxtrain.parallel.sharding import context_mesh


class Plan(NamedTuple):
    """One direction of a transfer, from this rank (lax.ragged_all_to_all's arguments): the
    rows of my operand for rank j start at input_offsets[j] (send_sizes[j] of them) and land
    at output_offsets[j] of rank j's buffer; recv_sizes[i]: the rows rank i sends me."""
    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


def plan(send_sizes_P, recv_sizes_P, block: int, input_offsets_P=None,
         axes: tuple = (EXPERT,)) -> Plan:
    """The plan of a transfer into [ep, block] buffers over mesh `axes` (their ranks in
    row-major order): my rows land in block `my rank` of every receiver's buffer; without
    `input_offsets_P` my blocks are contiguous in order."""
    if input_offsets_P is None:
        input_offsets_P = jnp.cumsum(send_sizes_P) - send_sizes_P
    me = jax.lax.axis_index(axes)
    return Plan(input_offsets_P.astype(jnp.int32), send_sizes_P.astype(jnp.int32),
                jnp.full_like(send_sizes_P, me * block, dtype=jnp.int32),
                recv_sizes_P.astype(jnp.int32))


def ragged(x_MD, p: Plan, block: int, axes: tuple = (EXPERT,)):
    """[ep, block, D]: the plan's rows by `lax.ragged_all_to_all` over `axes` (GPUs)."""
    ep = p.send_sizes.shape[0]
    out = jnp.zeros((ep * block, x_MD.shape[1]), x_MD.dtype)
    y = jax.lax.ragged_all_to_all(x_MD, out, p.input_offsets, p.send_sizes, p.output_offsets,
                                  p.recv_sizes, axis_name=axes)
    return y.reshape(ep, block, x_MD.shape[1])


def fixed(x_MD, p: Plan, block: int, axes: tuple = (EXPERT,)):
    """[ep, block, D]: the plan's rows, each block padded to `block` rows with zeros, by one
    `all_to_all` over `axes` (CPU, and a fallback). Lands where `ragged` puts them (block i
    from rank i)."""
    rows_B = jnp.arange(block, dtype=jnp.int32)
    index_PB = jnp.minimum(p.input_offsets[:, None] + rows_B, x_MD.shape[0] - 1)
    valid_PB = rows_B < p.send_sizes[:, None]
    send_PBD = jnp.where(valid_PB[..., None], x_MD[index_PB], 0).astype(x_MD.dtype)
    return jax.lax.all_to_all(send_PBD, axes, 0, 0, tiled=True)


TRANSPORTS: dict[str, Callable] = {"ragged": ragged, "fixed": fixed}


def dispatch_for(mesh, platform: str, folded: bool = False):
    """The MoE layer's Ops.dispatch on `mesh`: the local one without expert parallelism; else
    over `expert` (and `tensor` when `folded`), by ragged_all_to_all on GPUs (XLA:CPU cannot
    run it), fixed elsewhere."""
    transport = "ragged" if platform == "gpu" else "fixed"
    if mesh is not None and folded:
        axes = tuple(a for a in (EXPERT, TENSOR) if mesh.shape[a] > 1)
        ep = mesh.shape[EXPERT] * mesh.shape[TENSOR]
        return FoldedDispatch(mesh, ExpertParallelDispatch(ep, transport, axes))
    if mesh is None or mesh.shape[EXPERT] == 1:
        return moe.local_dispatch
    return ExpertParallelDispatch(mesh.shape[EXPERT], transport)


def _group_of_rows(counts_PL, block: int):
    """[ep·block] int32: the local expert of each row of a received [ep, block] buffer (each
    block holds its sender's rows sorted by my experts); rows past a block's count get L,
    which sorts after every expert."""
    ends_PL = jnp.cumsum(counts_PL, axis=1)
    rows_B = jnp.arange(block, dtype=counts_PL.dtype)
    group_PB = jnp.sum(rows_B[None, :, None] >= ends_PL[:, None, :], axis=-1)
    return group_PB.reshape(-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ExpertParallelDispatch:
    """`Ops.dispatch` over the manual `axes` (moe.local_dispatch's contract):
    (x_TD, experts_TK, weights_TK, keep_TK, num_experts, experts_fn, params) -> y_TD fp32,
    where `experts_fn(params, x_RD, group_sizes_L)` runs this rank's L = num_experts/ep
    experts (`params`: their weights) on rows sorted by them."""
    expert: int             # the expert degree (ep): the product of the axes' sizes
    transport: str = "fixed"
    axes: tuple = (EXPERT,)

    def local_experts(self, tree, num_experts: int):
        """A tree of [num_experts, ...] leaves (the layer's per-expert FP8 metas, replicated)
        sliced to this rank's experts; autodiff scatters the slice's cotangents back, zero
        (an unused observation) at the other ranks' experts."""
        local = num_experts // self.expert
        first = jax.lax.axis_index(self.axes) * local
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, local, 0), tree)

    def __call__(self, x_TD, experts_TK, weights_TK, keep_TK, num_experts: int,
                 experts_fn: Callable, params):
        ep, axes = self.expert, self.axes
        move = functools.partial(TRANSPORTS[self.transport], axes=axes)
        local = num_experts // ep
        x_ND, perm = moe.permute(x_TD, experts_TK, num_experts, keep_TK)
        block = x_ND.shape[0]
        counts_PL = perm.group_sizes_E.reshape(ep, local)   # row j: my rows for rank j
        recv_counts_PL = jax.lax.all_to_all(counts_PL, axes, 0, 0, tiled=True)
        send_P, recv_P = jnp.sum(counts_PL, axis=1), jnp.sum(recv_counts_PL, axis=1)
        out = plan(send_P, recv_P, block, axes=axes)
        recv_RD = move(x_ND, out, block).reshape(ep * block, -1)

        group_R = _group_of_rows(recv_counts_PL, block)
        order_R = jnp.argsort(group_R, stable=True)
        y_sorted_RD = experts_fn(params, recv_RD[order_R], jnp.sum(recv_counts_PL, axis=0))
        y_RD = jnp.zeros_like(y_sorted_RD).at[order_R].set(y_sorted_RD)

        offsets_P = jnp.arange(ep, dtype=jnp.int32) * block
        back_PBD = move(y_RD, plan(recv_P, send_P, block, offsets_P, axes), block)
        # sorted row n went to rank dest_N, as row n - offset of its block there
        rows_N = jnp.arange(block, dtype=jnp.int32)
        dest_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(send_P), rows_N, side="right"),
                             ep - 1)
        y_ND = back_PBD[dest_N, jnp.clip(rows_N - out.input_offsets[dest_N], 0, block - 1)]
        y_ND = jnp.where((rows_N < jnp.sum(send_P))[:, None], y_ND, 0)
        return moe.unpermute(y_ND, perm.order_N, weights_TK)


@dataclasses.dataclass(frozen=True)
class FoldedDispatch:
    """`Ops.dispatch` under MoE parallel folding: a nested shard_map makes `tensor` manual
    (the executors leave it automatic), each tensor rank takes its 1/t of the rows and of the
    experts (the weights' experts dim is split over expert x tensor, their mlp dim whole) and
    `inner` exchanges the rows over (expert, tensor); the outputs leave split over `tensor` on
    their rows, where GSPMD gathers or re-splits them as the layer's output constraint asks."""
    mesh: object                      # the executors' mesh (its context mesh inside them)
    inner: ExpertParallelDispatch     # over (expert, tensor), ep = expert x tensor

    @property
    def expert(self) -> int:
        return self.inner.expert

    def local_experts(self, tree, num_experts: int):
        raise NotImplementedError("FP8 experts under parallel.expert_tensor=1 (config_check "
                                  "refuses the combination)")

    def __call__(self, x_TD, experts_TK, weights_TK, keep_TK, num_experts: int,
                 experts_fn: Callable, params):
        def body(x_TD, experts_TK, weights_TK, keep_TK, params):
            return self.inner(x_TD, experts_TK, weights_TK, keep_TK, num_experts, experts_fn,
                              params)
        split = P(TENSOR)     # rows of the tokens; experts of the weights (their dim 0)
        mesh = context_mesh(self.mesh)
        return jax.shard_map(body, mesh=mesh, in_specs=(split,) * 5, out_specs=split,
                             axis_names={TENSOR}, check_vma=False)(
            x_TD, experts_TK, weights_TK, keep_TK, params)

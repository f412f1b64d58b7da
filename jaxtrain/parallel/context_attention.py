"""Context parallelism's attention: a rank's queries against every key of the sequence.

Under `parallel.context = c` the sequence of every activation is split over the `context` mesh
axis (the rules table); attention is the one op that mixes positions. It runs per shard
(sharded_kernels.ShardedAttention: a shard_map with `context` manual) on a rank's queries,
keys and values, with each token's segment id and global position (`data/context.py`: under
causal load balancing rank r holds chunks r and 2c-1-r), in one of two ways:

- `all_gather`: K, V (and their segment ids and positions) are all-gathered over `context`,
  the core attends the local queries to all of them, and the backward reduce-scatters dK, dV.
  Only the local K and V are kept for the backward, which gathers them again (Megatron's and
  TE's all-gather CP), so no layer holds the whole sequence's K/V between passes.
- `ring`: K/V blocks (stacked: one transfer a hop, as TE; a pair under MLA, whose V head
  size differs) travel c-1 hops around the ring
  (ppermute); each hop's send is issued before the current block's attention, and the two
  meet at an optimization barrier, so the scheduler hides the transfer behind that block
  (XLA:GPU's scheduler otherwise ran the hops back to back: it sees no cost in a Pallas
  call). Partial outputs merge by their log-sum-exp in fp32. The backward passes K/V around
  again, with the fp32 dK/dV accumulators travelling with their block (c sends; the last
  brings the finished dK/dV home in the compute dtype). The loop is unrolled in Python (TE
  notes that a scan costs an extra KV permute).

Both are exact for any mask: the causal mask is by global position, documents by segment id,
and only KV heads move (GQA; K/V are never repeated before communicating). A row that sees no
key of a block has LSE -inf and output 0; the merge keeps such rows finite.

The cores give a block's forward (out, LSE) and backward (dq, dk, dv from the whole
attention's out and LSE): `xla` in jnp, `pallas` and `mosaic` the flash kernel on its Triton or
Mosaic GPU backend (positions, Sq != Sk, LSE; interpret mode on CPU). `cudnn` runs all_gather only, through jax's differentiable cuDNN call
with an explicit [B, 1, Sq, S] mask (its backward keeps the gathered K/V).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import ConfigError, check_context_core
from jaxtrain.data.context import context_order
from jaxtrain.parallel.mesh_axes import CONTEXT

AXIS = CONTEXT


class ContextAttentionError(ConfigError):
    """A context-parallel attention this core or layout cannot run; names what can."""


@dataclasses.dataclass(frozen=True)
class ContextPlan:
    """How attention runs over `context` (hashable: it lives in the model's graph definition)."""
    strategy: str = "all_gather"
    load_balanced: bool = True

    def positions(self, seq_len: int, context: int) -> np.ndarray:
        """[S] global position of each slot of the (possibly reordered) sequence."""
        return context_order(seq_len, context if self.load_balanced else 1)


def plan_of(parallel_cfg) -> ContextPlan:
    return ContextPlan(parallel_cfg.context_strategy, parallel_cfg.context_load_balance)


class BlockOps(NamedTuple):
    """A core's attention of queries to one block of keys, and its backward."""
    # (q, k, v, q_seg, kv_seg, q_pos, kv_pos) -> (out [B,Sq,H,E], lse [B,H,Sq] fp32)
    forward: Callable
    # (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do) -> fp32 (dq, dk, dv), so that the
    # blocks' shares sum without rounding
    backward: Callable


# ----------------------------------------------------------------------------- xla blocks

def _scores(q_BSHE, k_BTKE, q_seg_BS, kv_seg_BT, q_pos_S, kv_pos_T):
    """fp32 scaled scores [B, K, G, S, T] and the visibility mask [B, 1, 1, S, T]."""
    b, s, h, e = q_BSHE.shape
    k_heads = k_BTKE.shape[2]
    q_BSKGE = q_BSHE.reshape(b, s, k_heads, h // k_heads, e)
    scores = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE,
                        preferred_element_type=jnp.float32) * e ** -0.5
    mask_BST = ((q_seg_BS[:, :, None] == kv_seg_BT[:, None, :])
                & (kv_pos_T[None, None, :] <= q_pos_S[None, :, None]))
    return scores, mask_BST[:, None, None]


def xla_block_forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """Causal, segment-masked attention of q to one block of keys: (out, natural LSE)."""
    b, s, h, e = q.shape
    scores, mask = _scores(q, k, q_seg, kv_seg, q_pos, kv_pos)
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m_safe[..., None])           # masked entries are exactly 0
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("bkgst,btke->bskge", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    total_safe = jnp.where(total == 0.0, 1.0, total)
    out = out / jnp.moveaxis(total_safe, 3, 1)[..., None]
    lse = jnp.where(total == 0.0, -jnp.inf, m_safe + jnp.log(total_safe))   # [B, K, G, S]
    return out.reshape(b, s, h, v.shape[-1]).astype(q.dtype), lse.reshape(b, h, s)


def xla_block_backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do):
    """This block's share of dq, dk, dv (fp32) given the whole attention's out and LSE."""
    b, s, h, e = q.shape
    k_heads = k.shape[2]
    g = h // k_heads
    scores, mask = _scores(q, k, q_seg, kv_seg, q_pos, kv_pos)
    lse_BKGS = lse.reshape(b, k_heads, g, s)
    p = jnp.where(mask, jnp.exp(scores - lse_BKGS[..., None]), 0.0)
    ev = v.shape[-1]   # v's head size (may differ from q/k's)
    do_BSKGE = do.reshape(b, s, k_heads, g, ev).astype(jnp.float32)
    delta_BKGS = jnp.einsum("bskge,bskge->bkgs", do_BSKGE,
                            out.reshape(b, s, k_heads, g, ev).astype(jnp.float32))
    dv = jnp.einsum("bkgst,bskge->btke", p, do_BSKGE)
    dp = jnp.einsum("bskge,btke->bkgst", do_BSKGE, v.astype(jnp.float32))
    ds = p * (dp - delta_BKGS[..., None]) * e ** -0.5
    dq = jnp.einsum("bkgst,btke->bskge", ds, k.astype(jnp.float32)).reshape(b, s, h, e)
    dk = jnp.einsum("bkgst,bskge->btke", ds, q.reshape(b, s, k_heads, g, e).astype(jnp.float32))
    return dq, dk, dv


XLA_BLOCKS = BlockOps(xla_block_forward, xla_block_backward)


def kernel_blocks(interpret: bool, backend: str = "triton") -> BlockOps:
    """The flash kernel's blocks on its Pallas `backend` (triton: pallas, mosaic: mosaic)."""
    from jaxtrain.model.kernels import flash_attention, flash_attention_backward
    options = dict(causal=True, interpret=interpret, backend=backend)

    def forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return flash_attention(q, k, v, (q_seg, kv_seg), positions=(q_pos, kv_pos),
                               return_lse=True, **options)

    def backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, do):
        return flash_attention_backward(q, k, v, (q_seg, kv_seg), (q_pos, kv_pos), out, lse,
                                        do, grad_dtype=jnp.float32, **options)
    return BlockOps(forward, backward)


def cudnn_gathered(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """cuDNN attention of the local queries to the gathered keys, masked explicitly."""
    mask = ((q_seg[:, :, None] == kv_seg[:, None, :])
            & (kv_pos[None, None, :] <= q_pos[None, :, None]))[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


# ----------------------------------------------------------------------------- merging

def merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, combined by their LSE
    (fp32): weights exp(lse_x - lse), where rows with no key on either side (-inf) stay 0."""
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(lse_a - m_safe), jnp.exp(lse_b - m_safe)
    total = w_a + w_b
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m_safe + jnp.log(total_safe), -jnp.inf)

    def share(w_BHS):  # [B, H, S] -> [B, S, H, 1], the output's layout
        return jnp.moveaxis(jnp.where(seen, w_BHS / total_safe, 0.0), 1, 2)[..., None]
    return out_a * share(w_a) + out_b * share(w_b), lse


# ----------------------------------------------------------------------------- strategies

def _ring(c: int):
    return [(i, (i + 1) % c) for i in range(c)]


def _send(x, c):
    return jax.lax.ppermute(x, AXIS, _ring(c))


def _gather(x, axis):
    return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)


def _gather_kv(k, v, kv_seg, kv_pos):
    """Every rank's K, V, key segment ids and key positions, in sequence order."""
    return _gather(k, 1), _gather(v, 1), _gather(kv_seg, 1), _gather(kv_pos, 0)


def _gathered(ops: BlockOps, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    k, v, kv_seg, kv_pos = _gather_kv(k, v, kv_seg, kv_pos)
    return ops.forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos)


def gathered_attention(ops: BlockOps, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """all_gather: the local queries against every rank's K/V (gathered again backward)."""
    @jax.custom_vjp
    def attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return _gathered(ops, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]

    def fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        out, lse = _gathered(ops, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
        return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)

    def bwd(res, do):
        q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = res
        k_all, v_all, kv_seg_all, kv_pos_all = _gather_kv(k, v, kv_seg, kv_pos)
        dq, dk, dv = ops.backward(q, k_all, v_all, q_seg, kv_seg_all, q_pos, kv_pos_all, out, lse,
                                  do)
        # reduce-scattered in the compute dtype (Megatron's), the ring's accumulators in fp32
        scatter = lambda x, like: jax.lax.psum_scatter(  # noqa: E731
            x.astype(like.dtype), AXIS, scatter_dimension=1, tiled=True)
        return dq.astype(q.dtype), scatter(dk, k), scatter(dv, v), None, None, None, None

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos)


def _pack(k, v):
    """K and V stacked (one transfer a hop), or a pair where their head sizes differ (MLA's
    value head size: two transfers, no padding on the wire); [0] and [1] read either."""
    return jnp.stack([k, v]) if k.shape == v.shape else (k, v)


def _ring_forward(ops: BlockOps, c: int, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    block = (_pack(k, v), kv_seg, kv_pos)   # K and V stacked: one transfer a hop
    out = lse = None
    for hop in range(c):
        nxt = _send(block, c) if hop < c - 1 else None   # issued before this block's work
        kv, seg, pos = block
        o, o_lse = ops.forward(q, kv[0], kv[1], q_seg, seg, q_pos, pos)
        if nxt is not None:
            # The next block's transfer and this block's attention meet here, so the
            # scheduler has nothing else to put between the send's start and its done.
            nxt, o, o_lse = jax.lax.optimization_barrier((nxt, o, o_lse))
        o = o.astype(jnp.float32)
        out, lse = (o, o_lse) if out is None else merge(out, lse, o, o_lse)
        block = nxt
    return out.astype(q.dtype), lse


def _ring_backward(ops: BlockOps, c: int, res, do):
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = res
    block = (_pack(k, v), kv_seg, kv_pos)
    dq = jnp.zeros(q.shape, jnp.float32)
    arrived = None   # the (stacked) dK/dV accumulators of the block this rank holds now
    for hop in range(c):
        nxt = _send(block, c) if hop < c - 1 else None
        kv, seg, pos = block
        grads = ops.backward(q, kv[0], kv[1], q_seg, seg, q_pos, pos, out, lse, do)
        # This block's work hides the next block's K/V and the last block's dK/dV.
        nxt, grads, arrived = jax.lax.optimization_barrier((nxt, grads, arrived))
        dq_b, dk_b, dv_b = grads
        dq = dq + dq_b
        acc = _pack(dk_b, dv_b)
        if arrived is not None:
            acc = jax.tree.map(jnp.add, arrived, acc)
        if hop == c - 1:  # complete: home in the compute dtype (rounded once, as anywhere)
            acc = jax.tree.map(lambda a: a.astype(k.dtype), acc)
        arrived = _send(acc, c)   # to the rank that holds this block next (the last: home)
        block = nxt
    return dq.astype(q.dtype), arrived[0], arrived[1]


def ring_attention(ops: BlockOps, c: int, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """ring: c-1 K/V hops, each send before the block it overlaps; merged by LSE."""
    @jax.custom_vjp
    def attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return _ring_forward(ops, c, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]

    def fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        out, lse = _ring_forward(ops, c, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
        return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)

    def bwd(res, do):
        return (*_ring_backward(ops, c, res, do), None, None, None, None)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos)


# ----------------------------------------------------------------------------- entry

def core_name(core) -> str:
    """'xla', 'pallas', 'mosaic' or 'cudnn' for an attention core of attention.select."""
    from jaxtrain.model import attention as attention_lib
    if core is attention_lib.xla_attention:
        return "xla"
    if isinstance(core, attention_lib.PallasAttention):
        return core.name
    if core is attention_lib.cudnn_attention:
        return "cudnn"
    raise ContextAttentionError(f"attention core {core!r} has no context-parallel form; "
                                "use model.attention=xla, pallas, mosaic or cudnn")


def check_supported(core, strategy: str) -> None:
    check_context_core(strategy, core_name(core), ContextAttentionError)


def check_backend(strategy: str, stages: int, platform: str) -> None:
    """XLA:CPU crashes (segfault at run time) executing a collective-permute that only some
    devices reach: under pipeline stages each stage rank runs its own branch of the executor's
    F/B switches, so the ring's hops are such permutes. The GPU compiler's program is fine
    (tests/test_gpu_compile.py compiles it); all_gather runs everywhere."""
    if strategy == "ring" and stages > 1 and platform == "cpu":
        raise ContextAttentionError(
            "parallel.context_strategy=ring with parallel.stage > 1 crashes XLA:CPU (its "
            "collective-permutes sit in per-stage branches); on CPU use "
            "parallel.context_strategy=all_gather, or run on GPUs")


def attend(core, plan: ContextPlan, c: int, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """One rank's attention under context parallelism (inside a shard_map with `context`
    manual): q [B, S/c, H, E], k/v [B, S/c, K, E], segment ids [B, S/c], positions [S/c]."""
    name = core_name(core)   # the strategy was checked against it when the ops were built
    if name == "cudnn":
        k, v, kv_seg, kv_pos = _gather_kv(k, v, kv_seg, kv_pos)
        return cudnn_gathered(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    ops = XLA_BLOCKS if name == "xla" else kernel_blocks(core.interpret, core.backend)
    if plan.strategy == "ring":
        return ring_attention(ops, c, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    return gathered_attention(ops, q, k, v, q_seg, kv_seg, q_pos, kv_pos)

"""Kernels opaque to GSPMD run per shard with jax.shard_map: attention (`ShardedAttention`,
context parallelism included) and the vocab-parallel embedding lookup (`ShardedLookup`). The
shard specs come from the rules table (sharding.mesh_axes_for), over the context mesh's
automatic axes, so the same wrapper runs in the train step, inside the pipeline's shard_map
and on compile-only devices."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.model.attention import check_interpretable, is_kernel, local_kv_heads
from jaxtrain.parallel import context_attention
from jaxtrain.parallel.mesh_axes import CONTEXT, TENSOR
from jaxtrain.parallel.sharding import context_mesh, flat_axes, mesh_axes_for


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An attention kernel (opaque to GSPMD) run per shard with jax.shard_map: batch and heads
    split where the rules table puts them (`batch`, `heads`, `kv_heads` activations) over the
    context mesh's automatic axes — so it runs the same in the train step, inside the
    pipeline's shard_map and on compile-only devices. When KV heads are fewer than the head
    shards, K/V stay whole and each shard slices the KV heads its query heads read (before
    anything moves over `context`). With `context` > 1 the sequence is split too and each
    shard runs `context` plan's strategy (context_attention.py) on the core, with its
    tokens' global positions. Hashable by value (nnx keeps it in the graph definition
    through `Ops`)."""
    kernel: Callable
    mesh: Mesh
    context: Optional[context_attention.ContextPlan] = None

    def __call__(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
        mesh = context_mesh(self.mesh)
        b, s, n_heads, _ = q_BSHE.shape
        batch = mesh_axes_for("batch", 1, mesh, b)
        heads = mesh_axes_for("heads", 1, mesh, n_heads)
        kv_heads = mesh_axes_for("kv_heads", 1, mesh, k_BSKE.shape[2]) if heads else None
        kv_heads = kv_heads if kv_heads == heads else None
        head_shards = math.prod(mesh.shape[a] for a in flat_axes(heads))
        # The sequence is split over `context` here (seq), or the caller's shard_map holds
        # `context` manual and q.. are already its rank's part (the train step's per_replica).
        seq = mesh_axes_for("sequence", 1, mesh, s) if self.context else None
        outer = bool(self.context) and CONTEXT in mesh.manual_axes
        c = mesh.shape[CONTEXT] if seq or outer else 1
        if self.context and mesh.shape[CONTEXT] > 1 and c == 1:
            raise context_attention.ContextAttentionError(
                f"a sequence of {s} tokens does not split over context={mesh.shape['context']}"
                "; use a length divisible by it (2x it under causal load balancing)")
        q_spec, kv_spec = P(batch, seq, heads, None), P(batch, seq, kv_heads, None)
        args = [q_BSHE, k_BSKE, v_BSKE, segment_ids_BS]
        if c > 1:  # each token's global position, split like the sequence
            order_CS = self.context.positions(s * (c if outer else 1), c).reshape(c, -1)
            args.append(jnp.asarray(order_CS if outer else order_CS.reshape(-1)))

        def per_shard(q, k, v, seg, *pos):
            if heads and not kv_heads:
                k, v = local_kv_heads(k, v, n_heads, head_shards, jax.lax.axis_index(heads))
            if c == 1:
                return self.kernel(q, k, v, seg)
            pos_S = pos[0][jax.lax.axis_index(CONTEXT)] if outer else pos[0]
            return context_attention.attend(self.kernel, self.context, c, q, k, v, seg, seg,
                                            pos_S, pos_S)

        # check_vma=False: a pallas_call carries no varying-axes types for the checker (and
        # jax 0.10's Pallas interpreter cannot type its loops). The specs are exact, and
        # autodiff still sums replicated K/V's cotangents over `tensor`.
        inner = {a for a in mesh.axis_names if a not in set(mesh.manual_axes)}
        in_specs = (q_spec, kv_spec, kv_spec, P(batch, seq)) + ((P(seq),) if c > 1 else ())
        return jax.shard_map(per_shard, mesh=mesh, axis_names=inner, in_specs=in_specs,
                             out_specs=q_spec, check_vma=False)(*args)


def shard_attention(core: Callable, mesh: Mesh | None,
                    context: Optional[context_attention.ContextPlan] = None) -> Callable:
    """`ops.attention` on `mesh`: an opaque kernel per shard (ShardedAttention); the xla core
    as it is (GSPMD partitions it like the rest of the model). With `context` > 1 every core
    runs per shard with `context`'s strategy (default: all_gather, load-balanced); a core
    that lacks the strategy fails here, before anything compiles."""
    check_interpretable(core, 1 if mesh is None else mesh.size)
    if mesh is not None and mesh.shape.get(CONTEXT, 1) > 1:
        context = context or context_attention.ContextPlan()
        context_attention.check_supported(core, context.strategy)
        return ShardedAttention(core, mesh, context)
    if mesh is None or mesh.size == 1 or not is_kernel(core):
        return core
    return ShardedAttention(core, mesh)


@dataclasses.dataclass(frozen=True)
class ShardedLookup:
    """The embedding lookup that never gathers the table (Megatron's vocab-parallel embedding,
    MaxText's): each device looks up, in its own [V/t, D/f] block of the table (vocab over
    `tensor`, embed over `fsdp`, as the parameter is stored), the tokens of every row its fsdp
    group holds — gathering only their ids — sums the vocab shards' parts over `tensor`
    (reduce-scattered over the sequence under SP), and trades its D-slice of all rows for all
    of D of its own rows (one all-to-all). The backward runs the transposes: an all-to-all of
    the cotangent and a local scatter-add, so the table's gradient needs no reduction over
    fsdp. Per microbatch: token ids and two activation-sized all-to-alls, where gathering the
    table moves V·D (128256 x 4096 bf16: 1 GB) each way."""
    mesh: Mesh
    sequence_parallel: bool = False

    def __call__(self, table_VD, tokens_BS):
        mesh = context_mesh(self.mesh)
        (V, D), (B, S) = table_VD.shape, tokens_BS.shape
        vocab = flat_axes(mesh_axes_for("vocab", 0, mesh, V))
        embed = flat_axes(mesh_axes_for("embed", 0, mesh, D))
        batch = flat_axes(mesh_axes_for("batch", 1, mesh, B))
        context = flat_axes(mesh_axes_for("length", 1, mesh, S))   # context parallelism
        c = math.prod(mesh.shape[a] for a in context)
        seq = (TENSOR,) if (self.sequence_parallel and vocab == (TENSOR,)
                            and (S // c) % mesh.shape[TENSOR] == 0) else ()
        if not vocab and not embed and not context:
            return jnp.take(table_VD, tokens_BS, axis=0)
        trade = bool(embed) and embed == batch      # all-to-all rows for D, else gather D
        v_shard = V // math.prod(mesh.shape[a] for a in vocab)

        def per_shard(table, ids):
            if embed and batch:
                ids = jax.lax.all_gather(ids, batch, axis=0, tiled=True)
            if vocab:
                local = ids - jax.lax.axis_index(vocab) * v_shard
                inside = (local >= 0) & (local < v_shard)
                x = jnp.where(inside[..., None],
                              jnp.take(table, jnp.clip(local, 0, v_shard - 1), axis=0), 0)
                x = (jax.lax.psum_scatter(x, vocab, scatter_dimension=1, tiled=True) if seq
                     else jax.lax.psum(x, vocab))
            else:
                x = jnp.take(table, ids, axis=0)
            if trade:
                return jax.lax.all_to_all(x, embed, 0, 2, tiled=True)
            if embed:
                x = jax.lax.all_gather(x, embed, axis=2, tiled=True)
            if batch:  # back to this device's rows
                n = math.prod(mesh.shape[a] for a in batch)
                x = x.reshape(n, -1, *x.shape[1:])[jax.lax.axis_index(batch)]
            return x

        inner = {a for a in mesh.axis_names if a not in set(mesh.manual_axes)}
        spec = lambda axes: axes[0] if len(axes) == 1 else (axes or None)  # noqa: E731
        # Each context rank looks up its own part of the sequence (split further over tensor
        # under SP: tensor is minor to context).
        return jax.shard_map(
            per_shard, mesh=mesh, axis_names=inner,
            in_specs=(P(spec(vocab), spec(embed)), P(spec(batch), spec(context))),
            out_specs=P(spec(batch), spec(context + seq), None))(table_VD, tokens_BS)

"""The Llama model on the pipeline executor: the train step's loss and grads when stage > 1.

`grad_sums(setup)` has the contract of `step.grad_sums(setup)`: a function `(compute params,
batch, fp8_meta=None) -> (summed token loss, token count, fp32 gradients of that sum, amax
observations)` over the usual pure-dict params (blocks stacked [L, ...]) and a global batch
[B, S]; step.loss_and_grads casts the params, runs it and divides by the token count once,
for both executors, so the pipelined step equals the unpipelined one up to float rounding.
The model is step's: the Setup's graphdef (built once, with the ops that leave weights to
GSPMD when stage > 1), bound by `Setup.bind`. How the model maps onto the executor:

- edge rows (`split_params`): one vocab table and one final norm per stage rank, sharded over
  `stage`: rank 0's row is the embedding, rank p-1's the head (the lm_head transposed, or the
  embedding again when tied) and the final norm, the ranks between hold zeros. So the
  embedding runs (and is differentiated) on rank 0 only, inside the first virtual stage (no
  activation-sized [m, B, S, D] input buffer: 1F1B's memory does not grow with m), and the
  head and loss on rank p-1; each device holds one table's compute copy and gradient
  accumulator instead of two. The masters and Adam moments stay where the train state keeps
  them (replicated over stage), so the tables' gradients reach every stage rank in one
  all-reduce after the loop (with tied embeddings both copies' gradients sum in it);
- chunks: the blocks split into p*v chunks (pipeline.stack_stages), each run by the model's
  layer runner, so remat policies apply per layer inside a chunk (block:N counts the chunk's
  layers), and an F stashes what the policy saves. With parallel.first/last_stage_layers
  (Megatron's decoder-first/last-pipeline-num-layers) the stages hold different numbers of
  layers, each split evenly over its v chunks; chunks are padded to the largest and a padding
  layer is skipped (a lax.switch per layer on its stacked mode), so the lighter first/last
  stage has time for the embedding's gradient/the head. Without full recompute the switch
  makes a B copy its chunk's weights (jax's partial evaluation of a conditional re-emits its
  operands; ledger.memory prices it), and an FP8 chunk mixing bf16 layers stashes what the
  switch's branches save together (on the tiny CPU model 6% more than an all-bf16 chunk);
- RoPE tables: recomputed per chunk from the microbatch's positions (chunk_aux), with its
  segment ids; what the backward needs of them is stashed with the chunk's residuals;
- head: final norm + lm_head + summed cross entropy on (targets, loss_mask) as aux.

The gradients come from pipeline.pipelined_value_and_grad with reduction="sum" (fp32, reduced
over data once, after the loop: a reduce-scatter where ZeRO-1 shards them), mapped back to the
params through split_params' transpose. Microbatches: step.split_microbatches of the global
batch on the mesh, [B, S] (sharded over data x fsdp) -> [m, B/m, S] with the rows of each
device staying on it. The schedule comes from cfg.parallel (schedule, stage, virtual_stages,
microbatches). `eval_sums(setup)` is the forward-only variant, step.eval_sums' peer.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import step
from jaxtrain.model import fp8 as fp8_lib
from jaxtrain.model import llama as model_lib
from jaxtrain.parallel import pipeline as pl
from jaxtrain.ledger.layout import stage_layer_counts

__all__ = ["PipelineModel", "build", "grad_sums", "eval_sums"]

CHUNK_AUX_KEYS = ("positions", "segment_ids")
HEAD_AUX_KEYS = ("targets", "loss_mask")


# What a layer of a chunk does, stacked with the layers as a float (the remat runners
# differentiate every scanned leaf, so no integers): padding rows are zero.
SKIP, PLAIN, FP8 = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """The pieces the executor runs, built once per setup (all static)."""
    setup: step.Setup          # its model: graphdef, abstract state, ops, bind
    block_apply: Any           # (layer_state, x, cos, sin, segment_ids, fp8) -> x
    schedule: pl.Schedule
    stage_layers: tuple        # layers per physical stage

    @property
    def mesh(self):
        return self.setup.mesh

    def layer_modes(self, use_fp8: bool) -> np.ndarray:
        """[L] what each layer runs as: FP8 in its FP8 spans when use_fp8, else PLAIN."""
        modes = np.full(self.setup.cfg.model.num_layers, PLAIN, np.float32)
        if use_fp8:
            for start, stop, fp8 in model_lib.layer_spans(len(modes), self.setup.ops.fp8):
                modes[start:stop] = FP8 if fp8 else PLAIN
        return modes

    def uniform_mode(self, use_fp8: bool):
        """The one mode of every chunk row when there is no padding and no mixed span, else
        None (then each layer branches on its stacked mode)."""
        modes = set(self.layer_modes(use_fp8).tolist())
        even = len(set(self.stage_layers)) == 1
        return int(modes.pop()) if even and len(modes) == 1 else None

    # The executor's three functions; none closes over a differentiated value.
    def chunk_fn(self, chunk, x_BSD, chunk_aux, *, mode=None):
        """chunk = (layer states [Lc, ...], modes [Lc]); `mode` (static) when all are equal."""
        cos, sin = model_lib.rope_tables(self.setup.model_cfg, chunk_aux["positions"])
        segment_ids_BS = chunk_aux["segment_ids"]

        def block(s, x, fp8):
            return self.block_apply(s, x, cos, sin, segment_ids_BS, fp8)
        if mode is not None:
            return self.setup.ops.run_layers(lambda sm, x: block(sm[0], x, mode == FP8), x_BSD,
                                             chunk)

        def any_mode(sm, x):
            # a per-rank branch: padding (uneven stages) is skipped, bf16 spans run unscaled
            s, m = sm
            branches = [lambda: x, lambda: block(s, x, False)]
            if self.setup.ops.fp8 is not None:
                branches.append(lambda: block(s, x, True))
            return jax.lax.switch(m.astype(jnp.int32), branches)
        return self.setup.ops.run_layers(any_mode, x_BSD, chunk)

    def head_params_of(self, edge_row):
        """The final norm and the head of rank p-1's edge row (its table is the lm_head's
        transpose, or the embedding itself when tied)."""
        head = {"final_norm": edge_row["norm"]}
        if self.setup.cfg.model.tie_embeddings:
            head["embed"] = edge_row["table"]
        else:
            head["lm_head"] = edge_row["table"].T
        return head

    def embed_fn(self, edge_row, inputs):
        return self.setup.bind({"embed": edge_row["table"]}).embed_tokens(inputs["inputs"])

    def head_loss_fn(self, edge_row, x_BSD, aux):
        logits_BSV = self.setup.bind(self.head_params_of(edge_row)).logits(x_BSD)
        return model_lib.cross_entropy_sum(logits_BSV, aux["targets"], aux["loss_mask"])[0]

    def modes(self, use_fp8: bool):
        """[p, v, Lc] what each chunk row runs as (a constant, in the stored chunk order)."""
        p, v = self.schedule.stages, self.schedule.virtual_stages
        modes = self.setup.layer_order.from_natural(self.layer_modes(use_fp8))
        return jnp.asarray(modes).reshape(p, v, -1)

    def split_params(self, params, fp8_meta=None):
        """(chunk layer states [p, v, Lc, ...], edge rows) of the train state's pure-dict params
        (and FP8 metas, which go with their layers). Edge rows: one vocab table and one norm per
        stage rank, sharded over `stage`: rank 0 holds the embedding, rank p-1 the head (the
        lm_head transposed to [V, D], or the embedding again when tied) and the final norm,
        the ranks between zeros. Linear in its inputs (its transpose maps the executor's
        gradients back)."""
        cfg, p = self.setup.cfg, self.schedule.stages
        metas = None if fp8_meta is None else {"blocks": fp8_meta["blocks"]}
        blocks = self.setup.bind({"blocks": params["blocks"]}, metas).block_fn()[1]
        # stored in chunk order (layer_order): a local reshape to [p, v, Lc, ...]
        v = self.schedule.virtual_stages
        chunks = jax.tree.map(lambda a: a.reshape((p, v, -1) + a.shape[1:]), blocks)
        embed = params["embed"]
        head = embed if cfg.model.tie_embeddings else params["lm_head"].T
        # selects, not a stack: each rank picks its row locally (XLA moved a stack's rows
        # between stages with all-to-alls)
        rank = lambda a: jnp.arange(p).reshape((p,) + (1,) * a.ndim)  # noqa: E731
        table = jnp.where(rank(embed) == 0, embed[None],
                          jnp.where(rank(embed) == p - 1, head[None], 0).astype(embed.dtype))
        norm = jax.tree.map(lambda a: jnp.where(rank(a) == p - 1, a[None], 0).astype(a.dtype),
                            params["final_norm"])
        spec = self.setup.compute_shardings["embed"].spec
        table = jax.lax.with_sharding_constraint(
            table, NamedSharding(self.mesh, P(pl.STAGE_AXIS, *spec)))
        return chunks, {"table": table, "norm": norm}

    def _executor_args(self, params, batch, fp8_meta):
        """The executor's positional arguments and keywords for these params and batch."""
        mbs = step.split_microbatches(batch, self.schedule.microbatches, self.mesh)
        chunks, edge = self.split_params(params, fp8_meta)
        chunk_fn = functools.partial(self.chunk_fn, mode=self.uniform_mode(fp8_meta is not None))
        args = (chunk_fn, self.head_loss_fn, (chunks, self.modes(fp8_meta is not None)), None,
                {"inputs": mbs["inputs"]}, {k: mbs[k] for k in HEAD_AUX_KEYS})
        kw = dict(schedule=self.schedule, mesh=self.mesh, embed_fn=self.embed_fn,
                  chunk_aux={k: mbs[k] for k in CHUNK_AUX_KEYS}, edge_params=edge,
                  reduction="sum")
        return args, kw

    def grad_sums(self, params, batch, fp8_meta=None):
        """(summed token loss over microbatches and replicas, tokens, fp32 gradients of that
        sum w.r.t. params, the metas' observations or None): step.grad_sums' contract, by the
        executor's manual backward mapped back through split_params' transpose."""
        args, kw = self._executor_args(params, batch, fp8_meta)
        loss, (d_chunks, d_edge, _), _ = pl.pipelined_value_and_grad(
            *args, **kw, combine=None if fp8_meta is None else FP8_COMBINE)
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731
        # the glue is linear: its transpose at any point (XLA drops the unused forward)
        _, transpose = jax.vjp(self.split_params, f32(params), f32(fp8_meta))
        d_params, d_meta = transpose((d_chunks[0], d_edge))
        return loss, token_count(batch), d_params, d_meta

    def loss_sums(self, params, batch, fp8_meta=None, *, bubble_fill: float = 0.0):
        """(summed token loss over microbatches and replicas, tokens), from the forward ops
        only."""
        args, kw = self._executor_args(params, batch, fp8_meta)
        loss = pl.pipelined_loss(*args, **kw, bubble_fill=bubble_fill)
        return loss, token_count(batch)


def token_count(batch):
    return jnp.sum(batch["loss_mask"].astype(jnp.float32))


def _add_at_fp8(acc, j, d):
    """acc[j] += d for gradients (in place); FP8 meta observations max-combine at j."""
    def one(a, x):
        if fp8_lib.is_fp8_meta(a):
            new = fp8_lib.combine_meta_grads(jax.tree.map(lambda t: t[j], a), x)
            return jax.tree.map(lambda t, n: t.at[j].set(n), a, new)
        return a.at[j].add(x.astype(a.dtype))
    return jax.tree.map(one, acc, d, is_leaf=fp8_lib.is_fp8_meta)


def _reduce_fp8(tree, axis):
    """Stacked gradients summed over `axis`, FP8 meta observations max-combined over it."""
    tree = fp8_lib.max_meta_grads(tree, axis)
    return jax.tree.map(lambda a: a if fp8_lib.is_fp8_meta(a) else jnp.sum(a, axis=axis), tree,
                        is_leaf=fp8_lib.is_fp8_meta)


# FP8 metas' cotangents are amax observations: max over microbatches and replicas
FP8_COMBINE = pl.GradCombine(_add_at_fp8, _reduce_fp8)


def build(setup: step.Setup) -> PipelineModel:
    """The PipelineModel of `setup` (whose config step.build has checked), on setup's model."""
    cfg, mesh = setup.cfg, setup.mesh
    par = cfg.parallel
    p, v, m = mesh.shape.get(pl.STAGE_AXIS, 1), par.virtual_stages, par.microbatches
    stage_layers = stage_layer_counts(cfg, p, v)
    schedule = pl.build_schedule(par.schedule, p, m, v)
    states = [x for x in (setup.abstract_state, setup.abstract_meta) if x is not None]
    block_apply = nnx.merge(setup.graphdef, *states).block_fn()[0]
    return PipelineModel(setup, block_apply, schedule, stage_layers)


def grad_sums(setup: step.Setup):
    """`fn(compute params, batch, fp8_meta=None) -> (loss sum, tokens, grads of the sum,
    meta observations)`: step.grad_sums on the pipeline (the observations: the FP8 metas'
    amaxes, max over microbatches and data replicas; None without fp8_meta)."""
    return build(setup).grad_sums


def eval_sums(setup: step.Setup):
    """`fn(params, batch, fp8_meta=None) -> (summed token loss, tokens)`: forward ops only, as
    step.eval_sums (unjitted); in FP8 when given the metas."""
    return build(setup).loss_sums

"""The pipelined executor (stage > 1): the Llama on parallel/pipeline.py's lock-step schedule.

`grad_sums(setup)` has the replica executor's contract: a function `(compute params, batch,
fp8_meta) -> contract.Sums` over the usual pure-dict params (blocks stacked [L, ...]) and a
global batch [B, S]; the train step casts the params, runs it and divides by the token count
once, for both executors, so the pipelined step equals the unpipelined one up to float
rounding. The model is the Setup's (built once, with the ops that leave weights to GSPMD when
stage > 1), bound by `Setup.bind`. How the model maps onto the executor:

- edge rows (`split_params`): one vocab table and one final norm per stage rank, sharded over
  `stage`: rank 0's row is the embedding, rank p-1's the head (the lm_head transposed, or the
  embedding again when tied) and the final norm, the ranks between hold zeros. So the
  embedding runs (and is differentiated) on rank 0 only, inside the first virtual stage (no
  activation-sized [m, B, S, D] input buffer: 1F1B's memory does not grow with m), and the
  head and loss on rank p-1; each device holds one table's compute copy and gradient
  accumulator instead of two. The rows are built from the compute copy, which the step
  gathers over stage once (the masters and Adam moments of the tables and the norm are split
  over stage: parallel/sharding.stage_state_axis), and the transpose of the selects sends the
  rows' gradients to the masters' stage shards in one reduce-scatter after the loop (with tied
  embeddings both copies' gradients sum in it);
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
- head: final norm + lm_head + model/loss.py's token loss on (targets, loss_mask): the
  objective the schedule differentiates and the LossSums it adds up.

A B adds each layer's weight gradient into the rank's fp32 accumulator as its backward
makes it (`taps`: the layer runner's grad_accumulation taps, where `fuses`: dense stacks
without context, tensor or fsdp sharding), so no chunk-sized bf16 gradient is held. The gradients come from pipeline.pipelined_value_and_grad (fp32, reduced over data once, after
the loop: a reduce-scatter where ZeRO-1 shards them; the FP8 converter's rule for the metas'
observations), mapped back to the params through split_params' transpose. Microbatches:
setup.split_microbatches of the global batch on the mesh, [B, S] (sharded over data x fsdp)
-> [m, B/m, S] with the rows of each device staying on it. The schedule comes from
cfg.parallel (schedule, stage, virtual_stages, microbatches). `eval_sums(setup)` is the
forward-only variant.
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

from jaxtrain.executors import replica
from jaxtrain.executors.contract import Sums
from jaxtrain.executors.setup import Setup, split_microbatches
from jaxtrain.ledger.layout import stage_layer_counts
from jaxtrain.model import llama as model_lib
from jaxtrain.model import loss as loss_lib
from jaxtrain.model import moe as moe_lib
from jaxtrain.parallel import pipeline as pl
from jaxtrain.parallel import sharding

__all__ = ["PipelineModel", "build", "grad_sums", "eval_sums"]

CHUNK_AUX_KEYS = ("positions", "segment_ids")
HEAD_AUX_KEYS = ("targets", "loss_mask")


# What a layer of a chunk does, stacked with the layers as a float (the remat runners
# differentiate every scanned leaf, so no integers): padding rows are zero.
SKIP, PLAIN, FP8 = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PipelineModel:
    """The pieces the executor runs, built once per setup (all static)."""
    setup: Setup               # its model: graphdef, abstract state, ops, bind
    block_apply: Any           # (layer_state, x, cos, sin, segment_ids, fp8) -> x
    schedule: pl.Schedule
    stage_layers: tuple        # layers per physical stage

    @property
    def mesh(self):
        return self.setup.mesh

    @property
    def moe(self) -> bool:
        """Every layer an MoE layer (config_check refuses mixed stacks under stages)."""
        return self.setup.model_cfg.moe is not None

    def expert_dims(self, chunks):
        """Per leaf of (chunks, modes): its experts' dim in the chunk layout [p, v, Lc, ...]
        (the layer-stacked dim 0 becomes three), or None. Matched by path: the chunks carry
        the FP8 metas beside the params, and those (the experts' per-expert ones included) are
        replicated like every FP8 meta, so their dim is None."""
        logical = {tuple(k.key for k in path): spec for path, spec in
                   jax.tree_util.tree_flatten_with_path(
                       self.setup.logical["blocks"] if self.moe else {},
                       is_leaf=lambda x: isinstance(x, P))[0]}

        def dim(path):
            spec = logical.get(tuple(k.key for k in path
                                     if isinstance(k, jax.tree_util.DictKey)))
            d = None if spec is None else sharding.expert_dim(spec)
            return None if d is None else d + 2
        paths, structure = jax.tree_util.tree_flatten_with_path(chunks)
        return jax.tree.unflatten(structure, [dim(path) for path, _ in paths]), None

    def taps(self, chunks):
        """The executor's Fns.taps for (chunks, modes), given the chunks' layer states: per
        leaf, whether the B adds its gradient into the fp32 accumulator layer by layer (the
        layers' parameters; not their FP8 metas, not the modes) where `fuses`; else None
        (each B's chunk gradient is added after it)."""
        if not fuses(self.setup.cfg):
            return None
        params = {tuple(k.key for k in path) for path, _ in
                  jax.tree_util.tree_flatten_with_path(self.setup.logical["blocks"],
                                                       is_leaf=lambda x: isinstance(x, P))[0]}

        def tapped(path):
            return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)) in params
        paths, structure = jax.tree_util.tree_flatten_with_path(chunks)
        return jax.tree.unflatten(structure, [tapped(path) for path, _ in paths]), False

    def _with_stats(self, sums):
        """The head's LossSums, with the chunks' MoeStats (summed over every F) as its aux."""
        if not self.moe:
            return sums
        losses, stats = sums
        return losses.replace(aux=moe_lib.means(stats, losses.tokens))

    def layer_modes(self, use_fp8: bool) -> np.ndarray:
        """[L] what each layer runs as: FP8 in the converter's FP8 spans when use_fp8, else
        PLAIN."""
        modes = np.full(self.setup.cfg.model.num_layers, PLAIN, np.float32)
        for start, stop, fp8 in self.setup.fp8.layer_spans(len(modes)):
            modes[start:stop] = FP8 if fp8 and use_fp8 else PLAIN
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
            if not self.moe:
                return self.block_apply(s, x, cos, sin, segment_ids_BS, fp8)
            # MoE layers carry (x, MoeStats): the chunk returns both, the executor sums
            # the stats over each rank's F ops (side sums)
            y, stats = self.block_apply(s, x[0], cos, sin, segment_ids_BS, fp8)
            return y, x[1] + stats
        carry = (x_BSD, moe_lib.MoeStats.zeros()) if self.moe else x_BSD
        if mode is not None:
            return self.setup.ops.run_layers(lambda sm, x: block(sm[0], x, mode == FP8), carry,
                                             chunk)

        def any_mode(sm, x):
            # a per-rank branch: padding (uneven stages) is skipped (SKIP), then one branch
            # per kind of layer the converter runs (PLAIN, and FP8 when on)
            s, m = sm
            branches = [lambda: x] + [lambda f=f: block(s, x, f)
                                      for f in self.setup.fp8.layer_kinds()]
            return jax.lax.switch(m.astype(jnp.int32), branches)
        return self.setup.ops.run_layers(any_mode, carry, chunk)

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
        """(objective, LossSums) of a microbatch's head on rank p-1."""
        logits_BSV = self.setup.bind(self.head_params_of(edge_row)).logits(x_BSD)
        return loss_lib.token_loss(logits_BSV, aux["targets"], aux["loss_mask"])

    def modes(self, use_fp8: bool):
        """[p, v, Lc] what each chunk row runs as (a constant, in the stored chunk order)."""
        p, v = self.schedule.stages, self.schedule.virtual_stages
        modes = self.setup.layer_order.from_natural(self.layer_modes(use_fp8))
        return jnp.asarray(modes).reshape(p, v, -1)

    def split_params(self, params, fp8_meta):
        """(chunk layer states [p, v, Lc, ...], edge rows) of the train state's pure-dict params
        and FP8 metas (which are the blocks' and go with their layers). Edge rows: one vocab
        table and one norm per stage rank, sharded over `stage`: rank 0 holds the embedding,
        rank p-1 the head (the lm_head transposed to [V, D], or the embedding again when tied)
        and the final norm, the ranks between zeros. Linear in its inputs (its transpose maps
        the executor's gradients back: summed over stage into the masters' stage shards)."""
        cfg, p = self.setup.cfg, self.schedule.stages
        blocks = self.setup.bind({"blocks": params["blocks"]}, fp8_meta).block_fn()[1]
        # stored in chunk order (layer_order): a local reshape to [p, v, Lc, ...]
        v = self.schedule.virtual_stages
        chunks = jax.tree.map(lambda a: a.reshape((p, v, -1) + a.shape[1:]), blocks)
        embed = params["embed"]
        # selects, not a stack: each rank picks its row locally (XLA moved a stack's rows
        # between stages with all-to-alls)
        rank = lambda a: jnp.arange(p).reshape((p,) + (1,) * a.ndim)  # noqa: E731
        last = lambda a: jnp.where(rank(a) == p - 1, a[None], 0).astype(a.dtype)  # noqa: E731
        # the lm_head's row transposed after the select, per rank: its transpose's gradient
        # then sums over stage in the master's [D, V] layout (split over stage on V: a
        # reduce-scatter; transposed before the select, XLA all-reduced the whole table)
        head = last(embed) if cfg.model.tie_embeddings else last(params["lm_head"]).swapaxes(1, 2)
        table = jnp.where(rank(embed) == 0, embed[None], head)
        norm = jax.tree.map(lambda a: jnp.where(rank(a) == p - 1, a[None], 0).astype(a.dtype),
                            params["final_norm"])
        spec = self.setup.compute_shardings["embed"].spec
        table = jax.lax.with_sharding_constraint(
            table, NamedSharding(self.mesh, P(pl.STAGE_AXIS, *spec)))
        return chunks, {"table": table, "norm": norm}

    def _executor_args(self, params, batch, fp8_meta):
        """The executor's arguments for these params and batch, and whether FP8 runs."""
        metas, use_fp8 = self.setup.fp8.for_run(fp8_meta, self.setup.meta_shapes)
        mbs = split_microbatches(batch, self.schedule.microbatches, self.mesh)
        chunks, edge = self.split_params(params, metas)
        fns = pl.Fns(functools.partial(self.chunk_fn, mode=self.uniform_mode(use_fp8)),
                     self.head_loss_fn, self.embed_fn, self.taps(chunks))
        args = (fns, (chunks, self.modes(use_fp8)), edge, {"inputs": mbs["inputs"]},
                {k: mbs[k] for k in HEAD_AUX_KEYS}, {k: mbs[k] for k in CHUNK_AUX_KEYS})
        return args, metas

    def grad_sums(self, params, batch, fp8_meta) -> Sums:
        """The contract's Sums by the executor's manual backward, mapped back through
        split_params' transpose; FP8 observations combine by the converter's rule (max over
        microbatches and data replicas)."""
        args, metas = self._executor_args(params, batch, fp8_meta)
        fp8 = self.setup.fp8
        losses, (d_chunks, d_edge), _ = pl.pipelined_value_and_grad(
            *args, schedule=self.schedule, mesh=self.mesh,
            combine=pl.GradCombine(fp8.add_at, fp8.reduce),
            expert_dims=self.expert_dims(args[1][0]))
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731
        # the glue is linear: its transpose at any point (XLA drops the unused forward)
        _, transpose = jax.vjp(self.split_params, f32(params), f32(metas))
        d_params, observations = transpose((d_chunks[0], d_edge))
        return Sums(self._with_stats(losses), d_params, observations)

    def loss_sums(self, params, batch, fp8_meta=None, *, bubble_fill: float = 0.0):
        """LossSums over microbatches and replicas, from the forward ops only."""
        args, _ = self._executor_args(params, batch, fp8_meta)
        return self._with_stats(pl.pipelined_forward(
            *args, schedule=self.schedule, mesh=self.mesh, bubble_fill=bubble_fill,
            expert_dims=self.expert_dims(args[1][0])))


def fuses(cfg) -> bool:
    """Whether a B adds each layer's weight gradient into the accumulator as its backward
    makes it: where replica.fuses, and without tensor or fsdp sharding. With either (axes
    left automatic inside the executor's switches) the GPU compiler copies the fused
    accumulator in the B switch's pass-through branches, a whole fp32 accumulator more than
    it saves (tiny bf16 step, 8 layers, stage 2 x tensor 2, v 2: 847.4 MiB fused, 730.8
    unfused; the 70B recipe at 16 layers, TP8: 16.4 vs 13.1 GiB); cause not found yet.
    ledger.memory prices the same choice."""
    par = cfg.parallel
    return replica.fuses(cfg) and par.tensor == 1 and par.fsdp == 1


def build(setup: Setup) -> PipelineModel:
    """The PipelineModel of `setup` (whose config setup.build has checked), on its model."""
    cfg, mesh = setup.cfg, setup.mesh
    par = cfg.parallel
    p, v, m = mesh.shape.get(pl.STAGE_AXIS, 1), par.virtual_stages, par.microbatches
    stage_layers = stage_layer_counts(cfg, p, v)
    schedule = pl.build_schedule(par.schedule, p, m, v)
    block_apply = nnx.merge(setup.graphdef, setup.abstract_state,
                            setup.abstract_meta).block_fn()[0]
    return PipelineModel(setup, block_apply, schedule, stage_layers)


def grad_sums(setup: Setup):
    """`fn(compute params, batch, fp8_meta) -> Sums`: replica.grad_sums' contract on the
    pipeline."""
    return build(setup).grad_sums


def eval_sums(setup: Setup):
    """`fn(params, batch, fp8_meta=None) -> LossSums`: forward ops only, as replica.eval_sums
    (unjitted); in FP8 when given the metas."""
    return build(setup).loss_sums

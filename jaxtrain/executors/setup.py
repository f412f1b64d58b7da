"""The model on a mesh: abstract init -> shardings -> sharded init, computed once per run.

`build(cfg, mesh)` checks the config, builds the model once (abstract) with its injected ops
and returns a `Setup`: the graph definition, where the state lives (master and compute params,
the optimizer state, the FP8 metas), the batch's shardings and the layer order. Both executors
and the train step take one; neither executor builds anything of its own. The train state is
`jaxtrain.train_state.TrainState`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import config_check, optim, weights
from jaxtrain.checkpoint import CheckpointMismatchError, check_shapes
from jaxtrain.config import Config, ConfigError, folds, padded_vocab
from jaxtrain.ledger.layout import stage_layer_counts
from jaxtrain.model import attention as attention_lib
from jaxtrain.model import llama as model_lib
from jaxtrain.model import moe_balance
from jaxtrain.model.fp8 import Fp8Converter
from jaxtrain.parallel import (collective_matmul, context_attention, expert_dispatch,
                               grad_accumulation, layer_order, remat, sharded_kernels, sharding)
from jaxtrain.parallel.layer_order import LayerOrder
from jaxtrain.parallel.mesh_axes import TENSOR
from jaxtrain.parallel.pipeline import chunk_layer_counts
from jaxtrain.train_state import TrainState

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass
class Setup:
    """Everything static about a run on a mesh, computed once (`build`) and shared by both
    executors: the model (built once, abstract), its ops, where the state lives."""
    cfg: Config
    mesh: Mesh
    graphdef: Any
    abstract_state: Any       # nnx.State of ShapeDtypeStruct (carries logical names)
    logical: Any              # pure dict of P(logical names)
    param_shardings: Any      # where the fp32 master params live
    compute_shardings: Any    # where the params a step computes with live (differs under ZeRO-1)
    optimizer: optax.GradientTransformation
    model_cfg: Any
    ops: model_lib.Ops        # the model's injected ops (make_ops), in graphdef
    abstract_meta: Any        # nnx.State of the FP8 metas (ShapeDtypeStruct; empty: no FP8)
    layer_order: LayerOrder   # rows of the layer-stacked state (layer_order.py)

    @property
    def fp8(self) -> Fp8Converter:
        """The FP8 converter the model was built with (FP8 off: one without a recipe)."""
        return self.ops.fp8

    @functools.cached_property
    def meta_shapes(self) -> Any:
        """The FP8 metas' shapes as a pure dict ({} without FP8): the train state's layout."""
        return nnx.to_pure_dict(self.abstract_meta)

    @functools.cached_property
    def abstract_train_state(self) -> TrainState:
        """The train state's shapes and shardings (ShapeDtypeStructs), allocating nothing:
        what init, restore, import, the jitted steps and AOT compiles all place it by."""
        shapes = jax.eval_shape(lambda: fresh_state(self, nnx.to_pure_dict(self.abstract_state),
                                                    self.fp8.fresh(self.meta_shapes)))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, _state_shardings(self, shapes))

    @functools.cached_property
    def state_shardings(self) -> TrainState:
        """The train state's shardings (of `abstract_train_state`)."""
        return jax.tree.map(lambda s: s.sharding, self.abstract_train_state)

    @functools.cached_property
    def batch_shardings(self) -> dict:
        """The global batch's shardings, per key of BATCH_KEYS."""
        return {k: sharding.batch_sharding(self.mesh) for k in BATCH_KEYS}

    def bind(self, params, fp8_meta=None):
        """A Llama module over the pure-dict `params` (works on tracers inside jit) and FP8
        metas (`fp8_meta`, from Fp8Converter.for_run when the model runs its layers). A subset
        binds too (the pipeline's embedding, head, blocks); the rest stays abstract. Both
        executors bind through this."""
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        metas = jax.tree.map(lambda x: x, self.abstract_meta)
        nnx.replace_by_pure_dict(metas, fp8_meta or {})
        return nnx.merge(self.graphdef, state, metas)


def folded(cfg: Config, mesh: Mesh | None) -> bool:
    """Whether `cfg` folds the experts over the tensor ranks of `mesh` (MoE parallel folding:
    the dispatch, the experts' specs and the grouped GEMM follow)."""
    return (mesh is not None and cfg.parallel.expert > 1
            and folds(mesh.shape[TENSOR], cfg.parallel.expert_tensor))


def grouped_dot_for(model_cfg, mesh, fold: bool = False) -> tuple[Any, str]:
    """(the MoE experts' Ops.grouped_dot, why) on `mesh`: the Mosaic GPU kernels
    (kernels/grouped_matmul) on sm_90 GPUs when the experts' shapes and dtype fit them and no
    automatic axis splits the expert GEMM (the kernel is opaque to GSPMD; inside the
    executors' shard_maps data, expert and context are manual, and under folding, `fold`,
    the dispatch's own makes tensor manual); else lax.ragged_dot, which XLA:GPU at jax 0.10
    runs as an E-fold dense GEMM (docs/design.md §8)."""
    from jaxtrain.model import moe as moe_lib
    from jaxtrain.model.kernels import grouped_matmul as gm
    if model_cfg.moe is None or sharding.platform(mesh) != "gpu":
        return moe_lib.ragged_dot, "not a GPU program"
    cc = sharding.compute_capability(mesh) or ""
    if not cc.startswith("9."):
        return moe_lib.ragged_dot, f"compute capability {cc or 'unknown'}, the kernels are sm_90a"
    split = [a for a in ("fsdp",) + (() if fold else ("tensor",)) if mesh.shape[a] > 1]
    if split:
        return moe_lib.ragged_dot, f"{'/'.join(split)} > 1 would split the opaque kernel"
    unit = math.lcm(gm.GroupedMatmulConfig.block_m, gm.GroupedMatmulConfig.block_n,
                    gm.GroupedMatmulConfig.block_k)
    dims = (model_cfg.hidden_size, model_cfg.expert_mlp_size)
    if jnp.dtype(model_cfg.compute_dtype) not in gm.SUPPORTED_DTYPES or any(d % unit for d in dims):
        return moe_lib.ragged_dot, (f"compute dtype {model_cfg.compute_dtype} or hidden/expert "
                                    f"sizes {dims} not multiples of {unit}")
    return gm.grouped_matmul, "Mosaic GPU grouped GEMM (sm_90a)"


def make_ops(cfg: Config, mesh: Mesh | None, *, constrain_weights: bool = True) -> model_lib.Ops:
    """The model's injected ops for `cfg` on `mesh` (None: one device, no constraints).
    `constrain_weights=False` leaves weights to GSPMD (the pipeline executor's per-rank
    conditionals)."""
    constrain = gather_weight = model_lib.identity_constrain
    if mesh is not None:
        constrain = sharding.ActivationSharding(mesh, cfg.parallel.sequence_parallel,
                                                constrain_weights=constrain_weights)
        if constrain_weights:
            gather_weight = sharding.WeightGather(mesh)
    attention = sharded_kernels.shard_attention(
        attention_lib.select(cfg.model, sharding.platform(mesh),
                             sharding.compute_capability(mesh)), mesh,
        context_attention.plan_of(cfg.parallel))
    lookup = (sharded_kernels.ShardedLookup(mesh, cfg.parallel.sequence_parallel)
              if mesh is not None and mesh.size > 1 else None)
    # the runners carry the replica executor's gradient accumulator when it opens one
    spans = remat.span_runner(cfg.remat)
    return model_lib.Ops(constrain=constrain, gather_weight=gather_weight,
                         attention=attention, embed_lookup=lookup,
                         run_layers=grad_accumulation.accumulating(remat.layer_runner(cfg.remat)),
                         fp8=Fp8Converter.of(cfg.fp8),
                         span_runner=lambda start, stop: grad_accumulation.accumulating(
                             spans(start, stop), start),
                         dispatch=expert_dispatch.dispatch_for(mesh, sharding.platform(mesh),
                                                               folded(cfg, mesh)),
                         grouped_dot=grouped_dot_for(cfg.model, mesh, folded(cfg, mesh))[0],
                         run_layer=remat.single_layer_runner(cfg.remat),
                         collective_matmul=collective_matmul.collective_matmul_for(
                             cfg.parallel, mesh, cfg.remat.granularity == "full"))


def build(cfg: Config, mesh: Mesh) -> Setup:
    layout = config_check.check(cfg, mesh.size)  # every config rule, before anything compiles
    p = layout.stage
    v = cfg.parallel.virtual_stages if p > 1 else 1
    stage_layers = stage_layer_counts(cfg, p, v)
    if layout.context > 1:
        context_attention.check_backend(cfg.parallel.context_strategy, p,
                                        mesh.devices.flat[0].platform)
    order = LayerOrder.natural(cfg.model.num_layers)
    if p > 1:   # chunk order: each stage's layers in its own rows
        order = LayerOrder.chunks(chunk_layer_counts(cfg.model.num_layers, p, v, stage_layers))
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=padded_vocab(cfg.model.vocab_size, layout.tensor),
        num_layers=len(order.rows))
    # Weights are left to GSPMD inside the pipeline executor's per-rank conditionals; the
    # model is built once, for whichever executor runs it (the step dispatches on p)
    ops = make_ops(cfg, mesh, constrain_weights=p == 1)
    graphdef, abstract_state, abstract_meta = ops.fp8.split(nnx.eval_shape(
        lambda: model_lib.Llama(model_cfg, rngs=nnx.Rngs(0), ops=ops,
                                real_vocab=cfg.model.vocab_size)))
    logical = sharding.logical_axes(abstract_state)
    shapes = nnx.to_pure_dict(abstract_state)
    fold = folded(cfg, mesh)
    master = sharding.param_specs(logical, shapes, mesh, zero1=cfg.parallel.zero1, folded=fold,
                                  state=True)
    compute = sharding.param_specs(logical, shapes, mesh, folded=fold)
    return Setup(cfg, mesh, graphdef, abstract_state, logical, sharding.named(mesh, master),
                 sharding.named(mesh, compute), optim.make_optimizer(cfg.train), model_cfg,
                 ops, abstract_meta, order)


def fresh_state(setup: Setup, params, fp8_meta) -> TrainState:
    """The train state at step 0 around `params` and `fp8_meta`: a new optimizer state."""
    return TrainState(params=params, opt_state=setup.optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), fp8_meta=fp8_meta)


def _state_shardings(setup: Setup, shapes: TrainState) -> TrainState:
    replicated = NamedSharding(setup.mesh, P())
    params_sh = setup.param_shardings
    param_struct = jax.tree.structure(shapes.params)

    def opt_shardings(node):
        # optax states hold parameter-shaped trees (mu, nu) next to scalars (count).
        if jax.tree.structure(node) == param_struct:
            return params_sh
        if isinstance(node, (tuple, list)) and not hasattr(node, "shape"):
            out = [opt_shardings(c) for c in node]
            return type(node)(*out) if hasattr(node, "_fields") else type(node)(out)
        if isinstance(node, dict):
            return {k: opt_shardings(v) for k, v in node.items()}
        return jax.tree.map(lambda _: replicated, node)
    # the FP8 metas are tiny and read by every device: replicated
    return TrainState(params=params_sh, opt_state=opt_shardings(shapes.opt_state),
                      step=replicated,
                      fp8_meta=jax.tree.map(lambda _: replicated, shapes.fp8_meta))


def init_train_state(setup: Setup, seed: int) -> TrainState:
    """Sharded init: each device materialises only its own shards."""
    ops = make_ops(setup.cfg, None)

    order = setup.layer_order
    natural = LayerOrder.natural(order.num_layers)

    def init():
        # the model's layers in model order, so every layout starts from the same weights
        model_cfg = dataclasses.replace(setup.model_cfg, num_layers=order.num_layers)
        model = model_lib.Llama(model_cfg, rngs=nnx.Rngs(seed), ops=ops,
                                real_vocab=setup.cfg.model.vocab_size)
        _, params, metas = ops.fp8.split(model)
        to_order = lambda s: layer_order.convert(nnx.to_pure_dict(s), natural, order)  # noqa
        return fresh_state(setup, to_order(params), to_order(metas))
    return jax.jit(init, out_shardings=setup.state_shardings)()


def train_state_from_params(setup: Setup, params: dict) -> TrainState:
    """A fresh train state (step 0, new optimizer state, fresh FP8 metas) around `params`
    (layers in model order), on `setup`'s shardings: how a run starts from imported weights.
    Pads the vocab to the setup's."""
    params = weights.pad_vocab(params, setup.model_cfg.vocab_size)
    order = setup.layer_order
    have_layers = layer_order.stored_rows(params)
    kinds = setup.model_cfg.moe_layers
    stacked = sum(kinds) or order.num_layers   # `blocks`: the MoE layers when there are any
    if have_layers is not None and have_layers != stacked:
        of = f" ({stacked} of them MoE)" if any(kinds) and not all(kinds) else ""
        raise CheckpointMismatchError(f"params have {have_layers} {'MoE ' if of else ''}layers "
                                      f"but the configured model has model.num_layers="
                                      f"{order.num_layers}{of}")
    params = layer_order.convert(params, LayerOrder.natural(order.num_layers), order)
    abstract = setup.abstract_train_state
    check_shapes(params, abstract.params, "params", missing="they were made for another model",
                 different="they were made for another model config")

    def place(spec, x):
        x = np.asarray(x).astype(spec.dtype)
        return jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx: x[idx])
    placed = jax.tree.map(place, abstract.params, params)
    # donated: the placed params become the state's, not a second copy
    return jax.jit(lambda p: fresh_state(setup, p, setup.fp8.fresh(setup.meta_shapes)),
                   out_shardings=setup.state_shardings, donate_argnums=0)(placed)


def compute_params(setup: Setup, params):
    """The params a step computes with: the fp32 masters cast to the compute dtype once per
    step and placed where `compute_shardings` puts them (under ZeRO-1 that gathers them over
    data: the distributed optimizer's copy). Gradients are taken w.r.t. this copy, so one
    microbatch's gradient is compute-dtype sized before it joins the fp32 accumulator
    (Megatron's bf16 wgrad added into main_grad), and no layer casts its weights again per
    microbatch."""
    dtype = jnp.dtype(setup.cfg.model.compute_dtype)

    def one(path, p, sh):   # the MoE balancing bias stays fp32 (its cotangent carries loads)
        return jax.lax.with_sharding_constraint(
            p if moe_balance.is_bias(path) else p.astype(dtype), sh)
    return jax.tree_util.tree_map_with_path(one, params, setup.compute_shardings)


def split_microbatches(batch, m: int, mesh: Mesh | None = None):
    """[B, ...] -> [m, B/m, ...]. Row r of a device's rows goes to microbatch r % m, so the
    sharding of dim 0 carries over to dim 1 without moving data: over fsdp inside the
    replica executor's shard_map, over data x fsdp for the whole batch on `mesh` (the
    pipeline's microbatches: then constrained so, and each device's rows must split into m)."""
    n = 1 if mesh is None else sharding.batch_row_shards(mesh)

    def one(x):
        if x.shape[0] % (n * m):
            raise ConfigError(f"a batch of {x.shape[0]} rows does not split into data*fsdp={n} "
                              f"x parallel.microbatches={m}; change train.global_batch")
        x = jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0)
        if mesh is None:
            return x
        spec = P(None, *sharding.batch_spec(mesh))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return {k: one(v) for k, v in batch.items()}

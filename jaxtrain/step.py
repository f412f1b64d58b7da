"""The model on a mesh: abstract init -> shardings -> sharded init, and the jitted train/eval steps.

Gradient accumulation: each data-parallel replica runs the microbatch scan over its rows of the
global batch [B, S] (`per_replica`: a shard_map with `data` manual, as the pipeline's) and
keeps its own fp32 gradient sums; the data-parallel reduction happens once, after the last
microbatch (Megatron's behaviour; GSPMD would otherwise all-reduce inside the loop), as a
sum over the replicas' stacked sums that XLA turns into an all-reduce (a reduce-scatter
under ZeRO-1). FSDP's per-use gather/reduce-scatter over `fsdp` stays inside the loop, as in
ZeRO-3. Loss and gradients are sums over tokens until that reduction divides once.

FP8 (fp8.enabled): the train state gains "fp8_meta", a pure dict of layer-stacked
`fp8.Fp8Meta`s mirroring the projections' paths, replicated. The step differentiates the loss
w.r.t. params and metas; the metas' cotangents are amax observations, max-combined over
microbatches and data replicas (TE's amax reduction; inside a replica GSPMD already reduces
each amax over the fsdp/tensor shards) and turned into the next metas by
`fp8.apply_meta_update`. They never reach optax, grad clipping or grad_norm.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.model import attention as attention_lib
from jaxtrain.parallel import context_attention
from jaxtrain.model import fp8 as fp8_lib
from jaxtrain.parallel import layer_order
from jaxtrain.model import llama as model_lib
from jaxtrain import config_check, optim, weights, xla_flags
from jaxtrain.parallel import remat, sharding
from jaxtrain.parallel.mesh_axes import STAGE
from jaxtrain.checkpoint import CheckpointMismatchError, check_shapes
from jaxtrain.config import Config, ConfigError
from jaxtrain.ledger.layout import stage_layer_counts
from jaxtrain.ledger.memory import padded_vocab
from jaxtrain.parallel.layer_order import LayerOrder
from jaxtrain.parallel.pipeline import chunk_layer_counts

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
    abstract_meta: Any = None  # nnx.State of the FP8 metas (ShapeDtypeStruct); None: no FP8
    fp8: Optional[fp8_lib.Recipe] = None
    layer_order: Optional[LayerOrder] = None  # rows of the layer-stacked state (layer_order.py)

    @functools.cached_property
    def abstract_train_state(self):
        """The train state's shapes and shardings (ShapeDtypeStructs), allocating nothing:
        what init, restore, import, the jitted steps and AOT compiles all place it by."""
        shapes = jax.eval_shape(lambda: fresh_state(self, nnx.to_pure_dict(self.abstract_state)))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, _state_shardings(self, shapes))

    @functools.cached_property
    def state_shardings(self):
        """The train state's shardings (of `abstract_train_state`)."""
        return jax.tree.map(lambda s: s.sharding, self.abstract_train_state)

    @functools.cached_property
    def batch_shardings(self) -> dict:
        """The global batch's shardings, per key of BATCH_KEYS."""
        return {k: sharding.batch_sharding(self.mesh) for k in BATCH_KEYS}

    def bind(self, params, fp8_meta=None):
        """A Llama module over the pure-dict `params` (works on tracers inside jit), with the
        pure-dict `fp8_meta` when FP8 is on (fresh metas when None: only for bf16 runs). A
        subset of the params binds too (the pipeline's embedding, head, blocks); the rest,
        and the metas of parts not bound, stay abstract. Both executors bind through this."""
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        if self.abstract_meta is None:
            return nnx.merge(self.graphdef, state)
        meta_state = jax.tree.map(lambda x: x, self.abstract_meta)
        if fp8_meta is None:  # the metas mirror their projections' paths
            fp8_meta = init_fp8_meta(self, parts=params.keys())
        nnx.replace_by_pure_dict(meta_state, fp8_meta)
        return nnx.merge(self.graphdef, state, meta_state)


def fp8_layers(cfg: Config) -> model_lib.Fp8Layers | None:
    """The model's FP8 plan from fp8.*; None when FP8 is off (config_check.check_fp8_layout
    holds it to the model dims, the tensor split and the remat grouping)."""
    f = cfg.fp8
    if not f.enabled:
        return None
    return model_lib.Fp8Layers(fp8_lib.recipe_of(f), f.bf16_first_layers, f.bf16_last_layers)


def make_ops(cfg: Config, mesh: Mesh | None, *, constrain_weights: bool = True) -> model_lib.Ops:
    """The model's injected ops for `cfg` on `mesh` (None: one device, no constraints).
    `constrain_weights=False` leaves weights to GSPMD (the pipeline executor's per-rank
    conditionals)."""
    constrain = model_lib.identity_constrain
    if mesh is not None:
        constrain = sharding.ActivationSharding(mesh, cfg.parallel.sequence_parallel,
                                                constrain_weights=constrain_weights)
    attention = sharding.shard_attention(
        attention_lib.select(cfg.model, sharding.platform(mesh),
                             sharding.compute_capability(mesh)), mesh,
        context_attention.plan_of(cfg.parallel))
    fp8 = fp8_layers(cfg)
    lookup = (sharding.ShardedLookup(mesh, cfg.parallel.sequence_parallel)
              if mesh is not None and mesh.size > 1 else None)
    return model_lib.Ops(constrain=constrain, attention=attention, embed_lookup=lookup,
                         run_layers=remat.layer_runner(cfg.remat), fp8=fp8,
                         span_runner=remat.span_runner(cfg.remat) if fp8 is not None else None)


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
    # model is built once, for whichever executor runs it (loss_and_grads dispatches on p)
    ops = make_ops(cfg, mesh, constrain_weights=p == 1)
    graphdef, abstract_state, abstract_meta = split_model(nnx.eval_shape(
        lambda: model_lib.Llama(model_cfg, rngs=nnx.Rngs(0), ops=ops,
                                real_vocab=cfg.model.vocab_size)))
    logical = sharding.logical_axes(abstract_state)
    shapes = nnx.to_pure_dict(abstract_state)
    master = sharding.param_specs(logical, shapes, mesh, zero1=cfg.parallel.zero1)
    compute = sharding.param_specs(logical, shapes, mesh)
    return Setup(cfg, mesh, graphdef, abstract_state, logical, sharding.named(mesh, master),
                 sharding.named(mesh, compute), optim.make_optimizer(cfg.train), model_cfg,
                 ops, abstract_meta, ops.fp8.recipe if ops.fp8 is not None else None, order)


def split_model(model):
    """(graphdef, params, FP8 metas or None) of a Llama, as nnx.States: what optax trains
    and what FP8 replaces each step, split in this one place."""
    if model.ops.fp8 is None:
        graphdef, params = nnx.split(model)
        return graphdef, params, None
    return nnx.split(model, nnx.Param, model_lib.Fp8MetaState)


def init_fp8_meta(setup: Setup, parts=None):
    """Fresh metas (scale 1, empty histories) in the pure-dict layout of the train state (of
    the top-level `parts` only, when given)."""
    metas = nnx.to_pure_dict(setup.abstract_meta)
    if parts is not None:
        metas = {k: v for k, v in metas.items() if k in parts}
    return jax.tree.map(lambda m: fp8_lib.init_meta(setup.fp8, m.x.scale.shape), metas,
                        is_leaf=fp8_lib.is_fp8_meta)


def fresh_state(setup: Setup, params, fp8_meta=None) -> dict:
    """The train state at step 0 around `params`: a new optimizer state, and the FP8 metas
    (fresh ones when FP8 is on and none are given)."""
    state = {"params": params, "opt_state": setup.optimizer.init(params),
             "step": jnp.zeros((), jnp.int32)}
    if setup.fp8 is not None:
        state["fp8_meta"] = fp8_meta if fp8_meta is not None else init_fp8_meta(setup)
    return state


def _state_shardings(setup: Setup, shapes):
    replicated = NamedSharding(setup.mesh, P())
    params_sh = setup.param_shardings
    param_struct = jax.tree.structure(shapes["params"])

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
    out = {"params": params_sh, "opt_state": opt_shardings(shapes["opt_state"]),
           "step": replicated}
    if "fp8_meta" in shapes:  # tiny, read by every device: replicated
        out["fp8_meta"] = jax.tree.map(lambda _: replicated, shapes["fp8_meta"])
    return out


def init_train_state(setup: Setup, seed: int):
    """Sharded init: each device materialises only its own shards."""
    ops = make_ops(setup.cfg, None)

    order = setup.layer_order
    natural = LayerOrder.natural(order.num_layers)

    def init():
        # the model's layers in model order, so every layout starts from the same weights
        model_cfg = dataclasses.replace(setup.model_cfg, num_layers=order.num_layers)
        model = model_lib.Llama(model_cfg, rngs=nnx.Rngs(seed), ops=ops,
                                real_vocab=setup.cfg.model.vocab_size)
        _, params, metas = split_model(model)
        params = layer_order.convert(nnx.to_pure_dict(params), natural, order)
        metas = None if metas is None else layer_order.convert(nnx.to_pure_dict(metas),
                                                               natural, order)
        return fresh_state(setup, params, metas)
    return jax.jit(init, out_shardings=setup.state_shardings)()


def train_state_from_params(setup, params: dict):
    """A fresh train state (step 0, new optimizer state) around `params` (layers in model
    order), on `setup`'s shardings: how a run starts from imported weights. Pads the vocab to
    the setup's."""
    params = weights.pad_vocab(params, setup.model_cfg.vocab_size)
    order = setup.layer_order
    have_layers = layer_order.stored_rows(params)
    if have_layers is not None and have_layers != order.num_layers:
        raise CheckpointMismatchError(f"params have {have_layers} layers but the configured "
                                      f"model has model.num_layers={order.num_layers}")
    params = layer_order.convert(params, LayerOrder.natural(order.num_layers), order)
    abstract = setup.abstract_train_state
    check_shapes(params, abstract["params"], "params", missing="they were made for another model",
                 different="they were made for another model config")

    def place(spec, x):
        x = np.asarray(x).astype(spec.dtype)
        return jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx: x[idx])
    placed = jax.tree.map(place, abstract["params"], params)
    # donated: the placed params become the state's, not a second copy
    return jax.jit(lambda p: fresh_state(setup, p), out_shardings=setup.state_shardings,
                   donate_argnums=0)(placed)


def split_microbatches(batch, m: int, mesh: Mesh | None = None):
    """[B, ...] -> [m, B/m, ...]. Row r of a device's rows goes to microbatch r % m, so the
    sharding of dim 0 carries over to dim 1 without moving data: over fsdp inside the step's
    per-replica shard_map, over data x fsdp for the whole batch on `mesh` (the pipeline's
    microbatches: then constrained so, and each device's rows must split into m)."""
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


def loss_sums(setup: Setup, params, mb, fp8_meta=None):
    """(summed token loss, token count) of one microbatch on one replica. With FP8 on,
    `fp8_meta` supplies the scales; without it every layer runs in the compute dtype."""
    model = setup.bind(params, fp8_meta)
    logits = model(mb["inputs"], mb["positions"], mb["segment_ids"],
                   use_fp8=fp8_meta is not None)
    return model_lib.cross_entropy_sum(logits, mb["targets"], mb["loss_mask"])


def per_replica(setup: Setup, fn):
    """`fn(params, meta, rows) -> outputs` run once per data replica on its rows of the batch:
    a shard_map with `data` manual (every other axis stays automatic), each output stacked on
    a new leading dim over `data`. The caller reduces that dim once, after everything the
    replicas accumulate: the one data-parallel reduction of the step (GSPMD alone all-reduces
    each microbatch's gradients inside the loop). Under context parallelism `context` is
    manual too: each (data, context) replica runs the model on its part of the sequence (the
    attention moves K/V over `context` itself, sharding.ShardedAttention) and keeps its own
    partial gradient sums, reduced with the data-parallel ones (Megatron's CP ranks are part
    of the data-parallel group), not in every layer of every microbatch.

    Untyped (check_vma=False), as the executor reduces by itself: a gradient w.r.t. the
    replicated params is this replica's part, never psum'd by autodiff, and an opaque kernel
    (Pallas attention) needs no varying-axes types inside."""
    def body(params, meta, rows):
        return jax.tree.map(lambda a: a[None], fn(params, meta, rows))
    mesh = setup.mesh
    manual = sharding.replica_axes(mesh)
    if not manual:
        return body
    rows = sharding.replica_rows_spec(mesh)
    stacked = P(manual[0] if len(manual) == 1 else manual)
    return jax.shard_map(body, mesh=mesh, axis_names=set(manual), in_specs=(P(), P(), rows),
                         out_specs=stacked, check_vma=False)


def compute_params(setup: Setup, params):
    """The params a step computes with: the fp32 masters cast to the compute dtype once per
    step and placed where `compute_shardings` puts them (under ZeRO-1 that gathers them over
    data: the distributed optimizer's copy). Gradients are taken w.r.t. this copy, so one
    microbatch's gradient is compute-dtype sized before it joins the fp32 accumulator
    (Megatron's bf16 wgrad added into main_grad), and no layer casts its weights again per
    microbatch."""
    dtype = jnp.dtype(setup.cfg.model.compute_dtype)
    return jax.tree.map(lambda p, sh: jax.lax.with_sharding_constraint(p.astype(dtype), sh),
                        params, setup.compute_shardings)


def loss_and_grads(setup: Setup):
    """`fn(params, batch, fp8_meta=None) -> (loss, tokens, grads, meta_grad)` for a whole
    global batch: microbatch accumulation with one data-parallel reduction at the end (the
    module docstring). `meta_grad` (None without `fp8_meta`) holds the step's amax
    observations, max-reduced over microbatches and replicas: feed it to
    `fp8.apply_meta_update`. With pipeline stages the schedule runs the microbatches.

    The contract of both executors (`grad_sums` here, pipeline_model.grad_sums for stage >
    1): from the compute params, (summed token loss, token count, fp32 gradients of that sum,
    amax observations); the one normalisation by the token count is here."""
    sums = _pipelined().grad_sums(setup) if setup.mesh.shape[STAGE] > 1 else grad_sums(setup)

    def fn(params, batch, fp8_meta=None):
        loss_sum, count, grad_sum, meta_grad = sums(compute_params(setup, params), batch,
                                                    fp8_meta)
        total = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g, sh: jax.lax.with_sharding_constraint(g / total, sh),
                             grad_sum, setup.param_shardings)
        return loss_sum / total, count, grads, meta_grad
    return fn


def _pipelined():
    from jaxtrain import pipeline_model  # it builds on this module
    return pipeline_model


def grad_sums(setup: Setup):
    """`fn(compute params, batch, fp8_meta=None) -> (loss sum, tokens, fp32 gradient sums,
    amax observations or None)` of the unpipelined step: each replica scans its microbatches,
    then the one data-parallel reduction of the step."""
    m = setup.cfg.parallel.microbatches

    def replica_sums(params, meta, rows):
        """One replica: (loss sum, tokens, fp32 gradient sums, max amax observations)."""
        def mb_grads(mb):
            if meta is None:
                (s, c), g = jax.value_and_grad(lambda p: loss_sums(setup, p, mb),
                                               has_aux=True)(params)
                return s, c, g, None
            (s, c), (g, mg) = jax.value_and_grad(
                lambda p, mt: loss_sums(setup, p, mb, mt), argnums=(0, 1),
                has_aux=True)(params, meta)
            return s, c, g, mg

        def accumulate(carry, mb):
            loss_acc, count_acc, grad_acc, meta_acc = carry
            s, c, g, mg = mb_grads(mb)
            grad_acc = jax.tree.map(lambda a, x, sh: sharding.constrain(
                a + x.astype(jnp.float32), sh), grad_acc, g, setup.compute_shardings)
            if meta_acc is not None:
                # Observations are max-combined, never summed: the step's amax is the max over
                # microbatches (and below, over replicas), as TE's amax reduction.
                meta_acc = fp8_lib.combine_meta_grads(meta_acc, mg)
            return (loss_acc + s, count_acc + c, grad_acc, meta_acc), None

        zeros = jax.tree.map(lambda p, sh: sharding.constrain(
            jnp.zeros(p.shape, jnp.float32), sh), params, setup.compute_shardings)
        # A zero observation has use count 0: it means "not seen" to combine_meta_grads.
        no_obs = None if meta is None else jax.tree.map(jnp.zeros_like, meta)
        zero = jnp.zeros((), jnp.float32)
        out, _ = jax.lax.scan(accumulate, (zero, zero, zeros, no_obs),
                              split_microbatches(rows, m))
        return out
    run = per_replica(setup, replica_sums)

    def fn(params, batch, fp8_meta=None):
        loss_sum, count, grad_sum, meta_obs = run(params, fp8_meta, batch)
        # The one data-parallel reduction of the step.
        grad_sum = jax.tree.map(lambda g: jnp.sum(g, axis=0), grad_sum)
        meta_grad = None if meta_obs is None else fp8_lib.max_meta_grads(meta_obs, axis=0)
        return jnp.sum(loss_sum), jnp.sum(count), grad_sum, meta_grad
    return fn


def make_grad_step(setup: Setup):
    """Jitted `(params, batch) -> (loss, tokens, grads)`: the train step without the update,
    for layout comparisons and inspection. With FP8 on: `(params, batch, fp8_meta) -> (loss,
    tokens, grads, next fp8_meta)`."""
    state_sh, batch_sh = setup.state_shardings, setup.batch_shardings
    compute = loss_and_grads(setup)
    if setup.fp8 is None:
        return jax.jit(lambda p, b: compute(p, b)[:3], in_shardings=(state_sh["params"], batch_sh),
                       out_shardings=(None, None, state_sh["params"]),
                       compiler_options=_xla_options(setup))

    def grad_step(params, batch, fp8_meta):
        loss, tokens, grads, meta_grad = compute(params, batch, fp8_meta)
        return loss, tokens, grads, fp8_lib.apply_meta_update(fp8_meta, meta_grad, setup.fp8)
    return jax.jit(grad_step, in_shardings=(state_sh["params"], batch_sh, state_sh["fp8_meta"]),
                   out_shardings=(None, None, state_sh["params"], state_sh["fp8_meta"]),
                   compiler_options=_xla_options(setup))


def _xla_options(setup: Setup) -> dict:
    return xla_flags.for_platform(setup.cfg, sharding.platform(setup.mesh), setup.mesh.shape)


def make_train_step(setup: Setup, *, donate: bool = True):
    cfg = setup.cfg
    compute = loss_and_grads(setup)

    def train_step(state, batch):
        loss, tokens, grads, meta_grad = compute(state["params"], batch, state.get("fp8_meta"))
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": optim.learning_rate(cfg.train)(state["step"]), "tokens": tokens}
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        if setup.fp8 is not None:
            # Replaced, not optimised: the observations become next step's scales.
            new_state["fp8_meta"] = fp8_lib.apply_meta_update(state["fp8_meta"], meta_grad,
                                                              setup.fp8)
        return new_state, metrics

    state_sh, batch_sh = setup.state_shardings, setup.batch_shardings
    return jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=(0,) if donate else (), compiler_options=_xla_options(setup))


def eval_sums(setup: Setup):
    """`fn(params, batch, fp8_meta=None) -> (summed token loss, tokens)` of the unpipelined
    forward (pipeline_model.eval_sums for stage > 1)."""
    replica_sums = per_replica(setup, lambda p, meta, rows: loss_sums(setup, p, rows, meta))

    def fn(params, batch, fp8_meta=None):
        s, c = replica_sums(params, fp8_meta, batch)
        return jnp.sum(s), jnp.sum(c)
    return fn


def make_eval_step(setup: Setup):
    """Jitted `(params, batch, fp8_meta=None) -> (loss sum, tokens)`. With FP8 on, passing the
    train state's metas evaluates in FP8 as training runs; without them, in the compute dtype."""
    batch_sh = setup.batch_shardings
    eval_step = (_pipelined().eval_sums(setup) if setup.mesh.shape[STAGE] > 1
                 else eval_sums(setup))
    plain = jax.jit(lambda params, batch: eval_step(params, batch),
                    in_shardings=(setup.param_shardings, batch_sh),
                    compiler_options=_xla_options(setup))
    if setup.fp8 is None:
        return lambda params, batch, fp8_meta=None: plain(params, batch)
    meta_sh = setup.state_shardings["fp8_meta"]
    with_meta = jax.jit(eval_step, in_shardings=(setup.param_shardings, batch_sh, meta_sh),
                        compiler_options=_xla_options(setup))

    def dispatch(params, batch, fp8_meta=None):
        return plain(params, batch) if fp8_meta is None else with_meta(params, batch, fp8_meta)
    return dispatch

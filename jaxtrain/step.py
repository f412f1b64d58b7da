"""The model on a mesh: abstract init -> shardings -> sharded init, and the jitted train/eval steps.

Gradient accumulation: the global batch [B, S] is viewed as [m, n_data, b, S] (m microbatches,
n_data data-parallel replicas, b rows per replica and microbatch). The loss is vmapped over
n_data with `spmd_axis_name="data"`, so each replica keeps its own gradient sum through the
microbatch scan and the data-parallel reduction happens once, after the last microbatch
(Megatron's behaviour; GSPMD would otherwise all-reduce inside the loop). FSDP's per-use
gather/reduce-scatter over `fsdp` stays inside the loop, as in ZeRO-3.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import attention as attention_lib
from jaxtrain import model as model_lib
from jaxtrain import optim, remat, sharding
from jaxtrain.checkpoint import CheckpointMismatchError
from jaxtrain.config import Config
from jaxtrain.ledger.memory import padded_vocab

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass
class Setup:
    """Everything static about a run on a mesh."""
    cfg: Config
    mesh: Mesh
    graphdef: Any
    abstract_state: Any       # nnx.State of ShapeDtypeStruct (carries logical names)
    logical: Any              # pure dict of P(logical names)
    param_shardings: Any      # where the fp32 master params live
    compute_shardings: Any    # where the params a step computes with live (differs under ZeRO-1)
    optimizer: optax.GradientTransformation
    model_cfg: Any

    def bind(self, params):
        """A Llama module over the pure-dict `params` (works on tracers inside jit)."""
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def make_ops(cfg: Config, mesh: Mesh | None) -> model_lib.Ops:
    constrain = model_lib._identity_constrain
    if mesh is not None:
        constrain = sharding.ActivationSharding(mesh, cfg.parallel.sequence_parallel,
                                                inside_data_vmap=True)
    return model_lib.Ops(constrain=constrain, attention=attention_lib.select(cfg.model),
                         run_layers=remat.layer_runner(cfg.remat))


def build(cfg: Config, mesh: Mesh) -> Setup:
    layout = sharding.validate_layout(cfg, mesh.size)
    remat.validate(cfg.remat, cfg.model.num_layers // layout["stage"])
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=padded_vocab(cfg.model.vocab_size, layout["tensor"]))
    ops = make_ops(cfg, mesh)
    abstract = nnx.eval_shape(lambda: model_lib.Llama(model_cfg, rngs=nnx.Rngs(0), ops=ops,
                                                      real_vocab=cfg.model.vocab_size))
    graphdef, abstract_state = nnx.split(abstract)
    logical = sharding.logical_axes(abstract_state)
    shapes = nnx.to_pure_dict(abstract_state)
    master = sharding.param_specs(logical, shapes, mesh, zero1=cfg.parallel.zero1)
    compute = sharding.param_specs(logical, shapes, mesh)
    return Setup(cfg, mesh, graphdef, abstract_state, logical, sharding.named(mesh, master),
                 sharding.named(mesh, compute), optim.make_optimizer(cfg.train), model_cfg)


def abstract_train_state(setup: Setup):
    """Shapes and shardings of the train state, allocating nothing."""
    def init_abstract():
        params = nnx.to_pure_dict(setup.abstract_state)
        return {"params": params, "opt_state": setup.optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}
    shapes = jax.eval_shape(init_abstract)
    shardings = state_shardings(setup, shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)


def state_shardings(setup: Setup, shapes):
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
    return {"params": params_sh, "opt_state": opt_shardings(shapes["opt_state"]),
            "step": replicated}


def init_train_state(setup: Setup, seed: int):
    """Sharded init: each device materialises only its own shards."""
    abstract = abstract_train_state(setup)
    out_shardings = jax.tree.map(lambda s: s.sharding, abstract)
    ops = make_ops(setup.cfg, None)

    def init():
        model = model_lib.Llama(setup.model_cfg, rngs=nnx.Rngs(seed), ops=ops,
                                real_vocab=setup.cfg.model.vocab_size)
        params = nnx.to_pure_dict(nnx.state(model))
        return {"params": params, "opt_state": setup.optimizer.init(params),
                "step": jnp.zeros((), jnp.int32)}
    return jax.jit(init, out_shardings=out_shardings)()


def train_state_from_params(setup, params: dict):
    """A fresh train state (step 0, new optimizer state) around `params`, on `setup`'s
    shardings: how a run starts from imported weights. Pads the vocab to the setup's."""
    abstract = abstract_train_state(setup)
    want = dict(jax.tree_util.tree_flatten_with_path(abstract["params"])[0])
    have = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for key_path, spec in want.items():
        name = jax.tree_util.keystr(key_path)
        if key_path not in have:
            raise CheckpointMismatchError(f"params have no {name}; they were made for another model")
        if tuple(have[key_path].shape) != tuple(spec.shape):
            raise CheckpointMismatchError(f"params {name} has shape {tuple(have[key_path].shape)} but "
                                    f"the configured model needs {tuple(spec.shape)}")

    def place(spec, x):
        x = np.asarray(x).astype(spec.dtype)
        return jax.make_array_from_callback(spec.shape, spec.sharding, lambda idx: x[idx])
    placed = jax.tree.map(place, abstract["params"], params)
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    opt_state = jax.jit(setup.optimizer.init, out_shardings=shardings["opt_state"])(placed)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])
    return {"params": placed, "opt_state": opt_state, "step": step}


def split_microbatches(batch, n_data: int, m: int):
    """[B, ...] -> [m, n_data, b, ...]. Row r of replica i's shard goes to microbatch r % m, so
    the (data, fsdp) sharding of dim 0 carries over without moving data."""
    def one(x):
        b = x.shape[0] // (n_data * m)
        return jnp.moveaxis(x.reshape(n_data, b, m, *x.shape[1:]), 2, 0)
    return {k: one(v) for k, v in batch.items()}


def loss_sums(setup: Setup, params, mb):
    """(summed token loss, token count) of one microbatch on one replica."""
    model = setup.bind(params)
    logits = model(mb["inputs"], mb["positions"], mb["segment_ids"])
    return model_lib.cross_entropy_sum(logits, mb["targets"], mb["loss_mask"])


def loss_and_grads(setup: Setup):
    """`fn(params, batch) -> (loss, tokens, grads)` for a whole global batch: microbatch
    accumulation with one data-parallel reduction at the end (the module docstring)."""
    cfg, mesh = setup.cfg, setup.mesh
    n_data, m = mesh.shape["data"], cfg.parallel.microbatches
    compute_dtype = jnp.dtype(cfg.model.compute_dtype)
    acc_shardings = jax.tree.map(
        lambda sh: NamedSharding(mesh, P("data", *sh.spec)), setup.compute_shardings)

    def per_replica(params, mb):
        (s, c), g = jax.value_and_grad(lambda p: loss_sums(setup, p, mb), has_aux=True)(params)
        return s, c, g
    replica_grads = jax.vmap(per_replica, in_axes=(None, 0), spmd_axis_name="data")

    def fn(params, batch):
        if cfg.parallel.zero1:
            # Distributed optimizer: gather a compute-dtype copy once per step.
            params = jax.tree.map(lambda p, sh: jax.lax.with_sharding_constraint(
                p.astype(compute_dtype), sh), params, setup.compute_shardings)

        def accumulate(carry, mb):
            loss_acc, count_acc, grad_acc = carry
            s, c, g = replica_grads(params, mb)
            grad_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grad_acc, g)
            grad_acc = jax.tree.map(jax.lax.with_sharding_constraint, grad_acc, acc_shardings)
            return (loss_acc + s, count_acc + c, grad_acc), None

        zeros = jax.tree.map(lambda p, sh: jax.lax.with_sharding_constraint(
            jnp.zeros((n_data, *p.shape), jnp.float32), sh), params, acc_shardings)
        init = (jnp.zeros((n_data,), jnp.float32), jnp.zeros((n_data,), jnp.float32), zeros)
        (loss_sum, count, grad_sum), _ = jax.lax.scan(
            accumulate, init, split_microbatches(batch, n_data, m))
        # The one data-parallel reduction of the step.
        total = jnp.maximum(jnp.sum(count), 1.0)
        grads = jax.tree.map(lambda g, sh: jax.lax.with_sharding_constraint(
            jnp.sum(g, axis=0) / total, sh), grad_sum, setup.param_shardings)
        return jnp.sum(loss_sum) / total, jnp.sum(count), grads
    return fn


def _shardings(setup: Setup):
    abstract = abstract_train_state(setup)
    state_sh = jax.tree.map(lambda s: s.sharding, abstract)
    batch_sh = {k: NamedSharding(setup.mesh, sharding.batch_spec(setup.mesh)) for k in BATCH_KEYS}
    return state_sh, batch_sh


def make_grad_step(setup: Setup):
    """Jitted `(params, batch) -> (loss, tokens, grads)`: the train step without the update,
    for layout comparisons and inspection."""
    state_sh, batch_sh = _shardings(setup)
    return jax.jit(loss_and_grads(setup), in_shardings=(state_sh["params"], batch_sh),
                   out_shardings=(None, None, state_sh["params"]))


def make_train_step(setup: Setup, *, donate: bool = True):
    cfg = setup.cfg
    compute = loss_and_grads(setup)

    def train_step(state, batch):
        loss, tokens, grads = compute(state["params"], batch)
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": optim.learning_rate(cfg.train)(state["step"]), "tokens": tokens}
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    state_sh, batch_sh = _shardings(setup)
    return jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=(0,) if donate else ())


def make_eval_step(setup: Setup):
    mesh = setup.mesh
    n_data = mesh.shape["data"]

    def eval_step(params, batch):
        mbs = split_microbatches(batch, n_data, 1)
        mb = {k: v[0] for k, v in mbs.items()}
        s, c = jax.vmap(lambda mbi: loss_sums(setup, params, mbi), spmd_axis_name="data")(mb)
        return jnp.sum(s), jnp.sum(c)

    batch_sh = {k: NamedSharding(mesh, sharding.batch_spec(mesh)) for k in BATCH_KEYS}
    return jax.jit(eval_step, in_shardings=(setup.param_shardings, batch_sh))

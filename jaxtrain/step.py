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
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import attention as attention_lib
from jaxtrain import model as model_lib
from jaxtrain import optim, remat, sharding
from jaxtrain.config import Config

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
        cfg.model, vocab_size=sharding.padded_vocab_size(cfg.model.vocab_size, layout["tensor"]))
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
    with jax.sharding.use_mesh(setup.mesh) if hasattr(jax.sharding, "use_mesh") else setup.mesh:
        return jax.jit(init, out_shardings=out_shardings)()


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


def _vg(setup, params, mb):
    return jax.value_and_grad(lambda p: loss_sums(setup, p, mb), has_aux=True)(params)


def make_train_step(setup: Setup):
    cfg, mesh = setup.cfg, setup.mesh
    n_data, m = mesh.shape["data"], cfg.parallel.microbatches
    compute_dtype = jnp.dtype(cfg.model.compute_dtype)
    acc_shardings = jax.tree.map(
        lambda sh: NamedSharding(mesh, P("data", *sh.spec)), setup.compute_shardings)

    def per_replica(params, mb):
        (s, c), g = _vg(setup, params, mb)
        return s, c, g
    replica_grads = jax.vmap(per_replica, in_axes=(None, 0), spmd_axis_name="data")

    def train_step(state, batch):
        params = state["params"]
        if cfg.parallel.zero1:
            # Distributed optimizer: gather a compute-dtype copy once per step.
            params = jax.tree.map(lambda p, sh: jax.lax.with_sharding_constraint(
                p.astype(compute_dtype), sh), params, setup.compute_shardings)
        mbs = split_microbatches(batch, n_data, m)

        def accumulate(carry, mb):
            loss_acc, count_acc, grad_acc = carry
            s, c, g = replica_grads(params, mb)
            grad_acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grad_acc, g)
            grad_acc = jax.tree.map(jax.lax.with_sharding_constraint, grad_acc, acc_shardings)
            return (loss_acc + s, count_acc + c, grad_acc), None

        zeros = jax.tree.map(lambda p, sh: jax.lax.with_sharding_constraint(
            jnp.zeros((n_data, *p.shape), jnp.float32), sh), params, acc_shardings)
        init = (jnp.zeros((n_data,), jnp.float32), jnp.zeros((n_data,), jnp.float32), zeros)
        (loss_sum, count, grad_sum), _ = jax.lax.scan(accumulate, init, mbs)
        # The one data-parallel reduction of the step.
        total = jnp.maximum(jnp.sum(count), 1.0)
        grads = jax.tree.map(lambda g, sh: jax.lax.with_sharding_constraint(
            jnp.sum(g, axis=0) / total, sh), grad_sum, setup.param_shardings)
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": jnp.sum(loss_sum) / total, "grad_norm": optax.global_norm(grads),
                   "lr": optim.learning_rate(cfg.train)(state["step"]), "tokens": jnp.sum(count)}
        return {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    abstract = abstract_train_state(setup)
    state_sh = jax.tree.map(lambda s: s.sharding, abstract)
    batch_sh = {k: NamedSharding(mesh, sharding.batch_spec(mesh)) for k in BATCH_KEYS}
    return jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=(0,))


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

"""The jitted train, grad and eval steps: which executor runs, the one normalisation, the update.

    batch -> executor (replica.py when stage = 1, pipeline.py when stage > 1) -> contract.Sums
          -> contract.normalise (loss, gradients, metrics divided once)
          -> optax update of the fp32 masters; the FP8 converter's update of the metas; the
             MoE balancing bias moved by the step's expert loads (model/moe_balance.py)

The model on the mesh (Setup, the train state's shapes and shardings, init) is
executors/setup.py's; the train state is train_state.TrainState.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain import optim, xla_flags
from jaxtrain.executors import pipeline, replica
from jaxtrain.executors.contract import Normalised, normalise
from jaxtrain.executors.setup import Setup, compute_params
from jaxtrain.model import moe_balance, mtp
from jaxtrain.parallel import sharding
from jaxtrain.parallel.mesh_axes import STAGE
from jaxtrain.train_state import TrainState


def _pipelined(setup: Setup) -> bool:
    return setup.mesh.shape[STAGE] > 1


def loss_and_grads(setup: Setup):
    """`fn(params, batch, fp8_meta) -> Normalised` for a whole global batch: the executor's sums
    from the compute params (microbatch accumulation, one data-parallel reduction at the end),
    normalised once by the token count. `fp8_meta`: the train state's ({} without FP8); the
    result's `fp8` holds the step's amax observations, for `setup.fp8.update`."""
    sums = (pipeline.grad_sums if _pipelined(setup) else replica.grad_sums)(setup)

    def fn(params, batch, fp8_meta, step=0) -> Normalised:
        return normalise(sums(compute_params(setup, params), with_mtp_weight(setup, batch, step),
                              fp8_meta), setup.param_shardings)
    return fn


def with_mtp_weight(setup: Setup, batch, step):
    """The batch with multi-token prediction's factor at `step` (traced: a schedule change
    does not recompile) as a per-token `mtp_weight`, sharded as the batch (model/mtp.py)."""
    m = setup.cfg.model
    if not m.mtp_depths:
        return batch
    weight_BS = jnp.broadcast_to(mtp.factor(m, step), batch["loss_mask"].shape)
    return {**batch, mtp.WEIGHT_KEY: jax.lax.with_sharding_constraint(
        weight_BS, setup.batch_shardings["loss_mask"])}


def _xla_options(setup: Setup) -> dict:
    return xla_flags.for_platform(setup.cfg, sharding.platform(setup.mesh), setup.mesh.shape)


def make_grad_step(setup: Setup):
    """Jitted `(params, batch, fp8_meta) -> (loss, tokens, grads, next fp8_meta)`: the train step
    without the optimizer, for layout comparisons and inspection (`fp8_meta`: the train
    state's, {} without FP8)."""
    state_sh, batch_sh = setup.state_shardings, setup.batch_shardings
    compute = loss_and_grads(setup)

    def grad_step(params, batch, fp8_meta):
        out = compute(params, batch, fp8_meta)
        return out.loss, out.tokens, out.grads, setup.fp8.update(fp8_meta, out.fp8)
    return jax.jit(grad_step, in_shardings=(state_sh.params, batch_sh, state_sh.fp8_meta),
                   out_shardings=(None, None, state_sh.params, state_sh.fp8_meta),
                   compiler_options=_xla_options(setup))


def make_train_step(setup: Setup, *, donate: bool = True):
    """Jitted `(TrainState, batch) -> (TrainState, metrics)`: loss, grad_norm, lr, tokens and the
    model's auxiliary metrics (model/loss.py) per step."""
    cfg = setup.cfg
    compute = loss_and_grads(setup)
    e = cfg.model.moe
    moe_bias_rate = e.bias_update_rate if e is not None and e.expert_bias else None

    def train_step(state: TrainState, batch):
        out = compute(state.params, batch, state.fp8_meta, state.step)
        updates, opt_state = setup.optimizer.update(out.grads, state.opt_state, state.params)
        metrics = {"loss": out.loss, "grad_norm": optax.tree.norm(out.grads),
                   "lr": optim.learning_rate(cfg.train)(state.step), "tokens": out.tokens,
                   **out.metrics}
        params = optax.apply_updates(state.params, updates)
        if moe_bias_rate is not None:   # the balancing bias moved by the step's loads
            params = moe_balance.update(params, out.loads, moe_bias_rate)
        # the metas are replaced, not optimised: the observations become next step's scales
        return state.replace(params=params,
                             opt_state=opt_state, step=state.step + 1,
                             fp8_meta=setup.fp8.update(state.fp8_meta, out.fp8)), metrics

    state_sh, batch_sh = setup.state_shardings, setup.batch_shardings
    return jax.jit(train_step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=(0,) if donate else (), compiler_options=_xla_options(setup))


def make_eval_step(setup: Setup):
    """`(params, batch, fp8_meta=None) -> (loss sum, tokens)`, jitted. With FP8 on, passing the
    train state's metas evaluates in FP8 as training runs; without them, in the compute dtype
    (Fp8Converter.for_run; one compile each)."""
    sums = (pipeline.eval_sums if _pipelined(setup) else replica.eval_sums)(setup)

    def eval_step(params, batch, fp8_meta):
        losses = sums(params, batch, fp8_meta)
        return losses.loss, losses.tokens
    # the metas (when given) are replicated, as the train state holds them
    jitted = jax.jit(eval_step, in_shardings=(setup.param_shardings, setup.batch_shardings, None),
                     compiler_options=_xla_options(setup))
    return lambda params, batch, fp8_meta=None: jitted(params, batch, fp8_meta)

"""The Llama model on the pipeline equals the unpipelined train step (fp32, 8 fake devices).

Every layout gets the same params (4 layers, vocab 512, in model order; each setup stores them
in its own layer order) and batch; the reference is step.loss_and_grads (the replica executor)
on one device.
Compiling dominates the run time, so the layouts are a representative subset: p in {2, 4},
v in {1, 2}, m in {4, 8}, all three schedules, with data, tensor and fsdp filling the rest.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import step
from jaxtrain.executors import pipeline as pipeline_executor
from jaxtrain.executors import setup as setup_lib
from jaxtrain.model import loss as loss_lib
from jaxtrain.parallel import layer_order, sharding
from jaxtrain.tools import hlo, pipeline_flops
from jaxtrain.parallel.layer_order import LayerOrder
from util import random_batch, tiny_config

BASE = ("--model.vocab_size=512", "--model.num_layers=4", "--train.global_batch=16",
        "--train.seq_len=16")
TOL = 1e-5

# name -> overrides. Together: p in {2, 4}, v in {1, 2}, m in {4, 8}, the three schedules, with
# data (ZeRO-1), fsdp or tensor (+SP, +data) filling the other devices, full remat in chunks,
# and uneven stages.
LAYOUTS = {
    "gpipe_p2_m4_data4_zero1": ["--parallel.stage=2", "--parallel.data=-1",
                                "--parallel.schedule=gpipe", "--parallel.microbatches=4",
                                "--parallel.zero1=true"],
    "1f1b_p4_m8_fsdp2_remat": ["--parallel.stage=4", "--parallel.fsdp=2", "--parallel.data=1",
                               "--parallel.schedule=1f1b", "--parallel.microbatches=8",
                               "--remat.granularity=full", "--remat.method=uniform",
                               "--remat.num_layers=1"],
    "interleaved_p2_v2_m4_tensor2_sp_data2_zero1": [
        "--parallel.stage=2", "--parallel.tensor=2", "--parallel.sequence_parallel=true",
        "--parallel.data=-1",
        "--parallel.schedule=interleaved_1f1b", "--parallel.virtual_stages=2",
        "--parallel.microbatches=4", "--parallel.zero1=true"],
    # uneven stages (1 + 3 layers: chunks padded to 3, padding skipped per rank)
    "1f1b_p2_m4_first1_tensor2_data2_remat": [
        "--parallel.stage=2", "--parallel.first_stage_layers=1", "--parallel.tensor=2",
        "--parallel.data=-1", "--parallel.schedule=1f1b", "--parallel.microbatches=4",
        "--remat.granularity=full", "--remat.method=uniform", "--remat.num_layers=1"],
    # uneven without remat: the per-layer switch's weight copies are parameter-only residuals
    # (recomputed by the B, not stashed)
    "1f1b_p2_m4_last1_data4": ["--parallel.stage=2", "--parallel.last_stage_layers=1",
                               "--parallel.data=-1", "--parallel.schedule=1f1b",
                               "--parallel.microbatches=4"],
    # selective recompute: the stash holds what its policy saves, the B recomputes the rest
    "interleaved_p2_v2_m4_selective_data4": [
        "--parallel.stage=2", "--parallel.data=-1", "--parallel.schedule=interleaved_1f1b",
        "--parallel.virtual_stages=2", "--parallel.microbatches=4",
        "--remat.granularity=selective", "--remat.modules=core_attn,mlp"],
    # tied embeddings: rank 0's and rank 1's copies of the table; a block:1 recompute
    "1f1b_p2_m4_tied_tensor2_data2_block": [
        "--parallel.stage=2", "--parallel.tensor=2", "--parallel.data=-1",
        "--parallel.schedule=1f1b", "--parallel.microbatches=4", "--model.tie_embeddings=true",
        "--remat.granularity=full", "--remat.method=block", "--remat.num_layers=1"],
    # tied under ZeRO-1 and FSDP: the one table's master split over (data, stage) and fsdp,
    # its two edge rows' gradients summed into it (issue 31)
    "1f1b_p2_m4_tied_fsdp2_data2_zero1": [
        "--parallel.stage=2", "--parallel.fsdp=2", "--parallel.data=-1",
        "--parallel.schedule=1f1b", "--parallel.microbatches=4", "--model.tie_embeddings=true",
        "--parallel.zero1=true"],
}
TIED = "--model.tie_embeddings=true"


def build_setup(cfg, devices):
    return setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, devices))


def place(setup, params, batch):
    """Params in model order -> the setup's layer order and shardings; the batch sharded; the
    (empty) FP8 metas: loss_and_grads' arguments."""
    params = layer_order.convert(params, LayerOrder.natural(4), setup.layer_order)
    batch_sh = NamedSharding(setup.mesh, sharding.batch_spec(setup.mesh))
    return (jax.device_put(params, setup.param_shardings),
            {k: jax.device_put(v, batch_sh) for k, v in batch.items()}, setup.meta_shapes)


def compile_fast(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def random_params(setup, seed=0):
    """Host params of the setup's shapes (no init compile): norm scales near 1, kernels small."""
    rng = np.random.default_rng(seed)

    def one(path, a):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        std = 1.0 if "embed" in name and "lm_head" not in name else 0.1
        return (std * rng.standard_normal(a.shape)).astype(a.dtype)
    return jax.tree_util.tree_map_with_path(one, nnx.to_pure_dict(setup.abstract_state))


@functools.cache
def reference(*extra):
    """(params, batch, loss, tokens, grads, metrics) of step.loss_and_grads on one device."""
    cfg = tiny_config(*BASE, *extra, "--parallel.data=1")
    setup = build_setup(cfg, jax.devices()[:1])
    params, batch = random_params(setup), random_batch(cfg, 0)
    args = place(setup, params, batch)
    out = compile_fast(step.loss_and_grads(setup), *args)(*args)
    return (params, batch, float(out.loss), float(out.tokens), jax.device_get(out.grads),
            jax.device_get(out.metrics))


@functools.cache
def pipelined(name):
    """Compile and run the pipelined grad step of a layout: (setup, loss, tokens, grads, hlo,
    metrics)."""
    params, batch = reference(*_model_flags(name))[:2]
    setup = build_setup(tiny_config(*BASE, *LAYOUTS[name]), jax.devices())
    args = place(setup, params, batch)
    compiled = compile_fast(step.loss_and_grads(setup), *args)
    out = compiled(*args)
    grads = layer_order.convert(jax.device_get(out.grads), setup.layer_order,
                                LayerOrder.natural(4))
    return (setup, float(out.loss), float(out.tokens), grads, compiled,
            jax.device_get(out.metrics))


def max_diff(a, b):
    """Largest |a - b| over all leaves; a NaN anywhere counts as infinitely far."""
    return max(float(np.max(np.nan_to_num(np.abs(np.asarray(u) - np.asarray(w)), nan=np.inf)))
               for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _model_flags(name):
    return tuple(f for f in LAYOUTS[name] if f == TIED)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipelined_step_equals_unpipelined(name):
    _, _, ref_loss, ref_tokens, ref_grads, _ = reference(*_model_flags(name))
    setup, loss, tokens, grads, *_ = pipelined(name)
    if "first1" in name or "last1" in name:   # the uneven split really is padded
        pm = pipeline_executor.build(setup)
        assert sorted(pm.stage_layers) == [1, 3] and pm.uniform_mode(False) is None
    assert tokens == ref_tokens
    assert abs(loss - ref_loss) < TOL
    assert max_diff(grads, ref_grads) < TOL


def test_the_b_taps_its_weight_gradients_and_equals_the_b_that_returns_them(monkeypatch):
    """Dense layers without tensor or fsdp sharding are tapped (the B adds each layer's
    weight gradient into the rank's fp32 accumulator; the modes are not); the same layout
    with a B that returns its chunk's gradient (taps off) gives the same gradients to float
    rounding. With tensor parallelism the B is not tapped."""
    name = "interleaved_p2_v2_m4_selective_data4"
    setup, loss, _, grads, *_ = pipelined(name)
    pm = pipeline_executor.build(setup)
    taps = pm.taps(nnx.to_pure_dict(setup.abstract_state)["blocks"])
    assert all(jax.tree.leaves(taps[0])) and taps[1] is False
    tensor = pipelined("interleaved_p2_v2_m4_tensor2_sp_data2_zero1")[0]
    assert pipeline_executor.build(tensor).taps(taps[0]) is None
    monkeypatch.setattr(pipeline_executor.PipelineModel, "taps", lambda self, chunks: None)
    params, batch = reference(*_model_flags(name))[:2]
    plain = build_setup(tiny_config(*BASE, *LAYOUTS[name]), jax.devices())
    args = place(plain, params, batch)
    out = compile_fast(step.loss_and_grads(plain), *args)(*args)
    assert abs(float(out.loss) - loss) < TOL
    assert max_diff(layer_order.convert(jax.device_get(out.grads), plain.layer_order,
                                        LayerOrder.natural(4)), grads) < TOL


def test_data_parallel_reduction_happens_once_after_the_schedule_loop():
    """hlo finds no data-parallel collective inside the schedule loop: each data replica keeps
    its own gradient sums and the step all-reduces them over `data` once, after the loop."""
    setup, *_, compiled, _ = pipelined("gpipe_p2_m4_data4_zero1")
    colls = hlo.collectives(compiled, setup.mesh)
    assert hlo.loop_collectives(colls, "data", kinds=("all-reduce", "reduce-scatter")) == []
    # the loop is there (stage permutes in it) and so is the one reduction over data, outside
    assert any(c.kind == "collective-permute" and c.in_loop and c.axes == ("stage",)
               for c in colls)
    assert any(c.kind == "all-reduce" and not c.in_loop and "data" in (c.axes or ())
               for c in colls)


@pytest.mark.parametrize("name", ["interleaved_p2_v2_m4_tensor2_sp_data2_zero1",
                                  "1f1b_p2_m4_first1_tensor2_data2_remat"])
def test_layers_stored_in_chunk_order_never_move_between_stages(name):
    """Interleaved and uneven chunks hold layers out of model order; stored in chunk order
    (layer_order) each rank already has its own. In model order this step had 18 all-to-alls
    (interleaved) or 18 collective-permutes (uneven) over `stage` per step; now the `stage`
    collectives outside the schedule loop are the loss's all-reduce, the vocab tables'
    gradients reduced to their masters' stage shards (XLA:CPU: an all-reduce and a slice) and
    their compute copy gathered over stage (with ZeRO-1 over stage and data at once)."""
    setup, *_, compiled, _ = pipelined(name)
    outside = {(c.kind, c.axes) for c in hlo.collectives(compiled, setup.mesh)
               if "stage" in (c.axes or ()) and not c.in_loop}
    gather = ("stage", "data") if setup.cfg.parallel.zero1 else ("stage",)
    assert outside == {("all-reduce", ("stage", "data")), ("all-reduce", ("stage",)),
                       ("all-gather", gather)}


def test_forward_only_eval_sums_match():
    params, batch, ref_loss, ref_tokens, *_ = reference()
    setup = pipelined("interleaved_p2_v2_m4_tensor2_sp_data2_zero1")[0]
    args = place(setup, params, batch)
    sums = compile_fast(pipeline_executor.eval_sums(setup), *args)(*args)
    assert float(sums.tokens) == ref_tokens
    assert abs(float(sums.loss) / float(sums.tokens) - ref_loss) < TOL


TOKEN_LOSS = loss_lib.token_loss


def _loss_with_an_auxiliary_term(logits_BSV, targets_BS, mask_BS):
    """The model's token loss plus what a model may add (as a mixture-of-experts layer will):
    a term in the objective (a mean-square-logit penalty per token) and two metrics."""
    objective, sums = TOKEN_LOSS(logits_BSV, targets_BS, mask_BS)
    penalty = jnp.sum(jnp.mean(jnp.square(logits_BSV), axis=-1) * mask_BS)
    aux = {"logit_square": loss_lib.Mean(penalty, sums.tokens),
           "loss_token_fraction": loss_lib.Mean(sums.tokens, jnp.float32(mask_BS.size))}
    return objective + 0.5 * penalty, sums.replace(aux=aux)


def test_an_auxiliary_loss_reaches_both_executors_gradients_and_metrics(monkeypatch):
    """The contract's aux slot: a loss that adds a term to the objective and two Means sends
    the term into both executors' gradients (equal, and unlike the plain loss's), and the
    Means through the pipeline's head, microbatches and data replicas as through the replica
    executor's scan; the step divides each by its own count and logs it."""
    params, batch, _, ref_tokens, plain_grads, plain_metrics = reference()
    assert plain_metrics == {}   # the language-model loss alone adds no metric
    monkeypatch.setattr(loss_lib, "token_loss", _loss_with_an_auxiliary_term)
    got, setups = {}, {}
    for name, overrides, devices in (("replica", ["--parallel.data=1"], jax.devices()[:1]),
                                     ("pipeline", LAYOUTS["gpipe_p2_m4_data4_zero1"],
                                      jax.devices())):
        setup = setups[name] = build_setup(tiny_config(*BASE, *overrides), devices)
        args = place(setup, params, batch)
        out = jax.device_get(compile_fast(step.loss_and_grads(setup), *args)(*args))
        got[name] = (out, layer_order.convert(out.grads, setup.layer_order,
                                              LayerOrder.natural(4)))
    # the train step's metrics (what the trainer logs) carry them too
    setup = setups["replica"]
    state = setup_lib.train_state_from_params(setup, params)
    logged = jax.device_get(step.make_train_step(setup, donate=False)(
        state, place(setup, params, batch)[1])[1])
    (replica_out, replica_grads), (piped_out, piped_grads) = got["replica"], got["pipeline"]
    assert max_diff(piped_grads, replica_grads) < TOL
    assert max_diff(replica_grads, plain_grads) > 100 * TOL   # the term is in the gradients
    assert piped_out.metrics.keys() == replica_out.metrics.keys() == {
        "logit_square", "loss_token_fraction"}
    for key, value in replica_out.metrics.items():
        np.testing.assert_allclose(piped_out.metrics[key], value, rtol=1e-5)
        np.testing.assert_allclose(logged[key], value, rtol=1e-5)
    positions = 16 * 16   # train.global_batch x train.seq_len
    assert ref_tokens < positions   # the batch's masked targets make the fraction informative
    np.testing.assert_allclose(replica_out.metrics["loss_token_fraction"],
                               ref_tokens / positions, rtol=1e-6)


def test_executed_matmul_flops_equal_the_unpipelined_steps():
    """Without recompute a device executes the matmuls the unpipelined step's device does
    (same model, batch and device count): each rank runs only its own F and B branches (idle
    steps run none), an F stashes what its B needs (no forward again), and the last stage's
    forward is folded into its B. Counting every branch of every step, as hlo.matmul_flops
    does, gives several times as much."""
    name = "interleaved_p2_v2_m4_tensor2_sp_data2_zero1"
    setup, *_, compiled, _ = pipelined(name)
    s = pipeline_executor.build(setup).schedule
    executed = pipeline_flops.executed_matmul_flops(compiled.as_text(), s.table.columns,
                                                    s.stages, s.virtual_stages)
    flat = [f for f in LAYOUTS[name] if not f.startswith(("--parallel.stage", "--parallel.sch",
                                                          "--parallel.virt", "--parallel.micro"))]
    unpiped = build_setup(tiny_config(*BASE, *flat), jax.devices())
    assert unpiped.mesh.size == setup.mesh.size and unpiped.mesh.shape["stage"] == 1
    args = place(unpiped, *reference()[:2])
    reference_flops = hlo.matmul_flops(compile_fast(step.loss_and_grads(unpiped), *args))
    assert executed.mean / reference_flops <= 1.03, (executed, reference_flops)
    assert executed.mean / reference_flops >= 0.97
    assert executed.every_branch > 3 * executed.max


@pytest.mark.parametrize("name, embed, compute", [
    ("gpipe_p2_m4_data4_zero1", P(("data", "stage"), None), P(None, None)),
    ("1f1b_p2_m4_tied_fsdp2_data2_zero1", P(("data", "stage"), "fsdp"), P(None, "fsdp")),
    ("1f1b_p4_m8_fsdp2_remat", P("stage", "fsdp"), P(None, "fsdp")),
])
def test_vocab_tables_masters_split_over_stage_their_compute_copy_does_not(name, embed,
                                                                            compute):
    """Issue 31: the tables' and the final norm's masters (and so Adam's moments) are split
    over `stage`, minor to ZeRO-1's data group, on the dim it takes; the compute copy the
    edge rows are built from stays whole over stage (gathered once per step), and the layers
    keep their one `stage` (the layer dim)."""
    setup = build_setup(tiny_config(*BASE, *LAYOUTS[name]), jax.devices())
    master = jax.tree.map(lambda s: s.spec, setup.param_shardings)
    assert master["embed"] == embed
    assert setup.compute_shardings["embed"].spec == compute
    has_stage = lambda spec: any("stage" in sharding.flat_axes(a) for a in spec)  # noqa: E731
    assert has_stage(jax.tree.leaves(master["final_norm"], is_leaf=lambda s: isinstance(s, P))[0])
    assert TIED in LAYOUTS[name] or has_stage(master["lm_head"])
    for spec in jax.tree.leaves(master["blocks"], is_leaf=lambda s: isinstance(s, P)):
        assert sharding.flat_axes(spec[0])[0] == "stage"   # the layer dim (ZeRO-1: then data)
        assert sum("stage" in sharding.flat_axes(a) for a in spec) == 1
    opt = jax.tree.leaves(setup.state_shardings.opt_state,
                          is_leaf=lambda s: isinstance(s, NamedSharding))
    assert sum(s.spec == embed for s in opt) >= 2   # Adam's mu and nu of the embedding

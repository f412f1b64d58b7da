"""Expert parallelism: the dispatch's two transports move the same rows, the dispatch is the
local one, and MoE models train through train.py on expert layouts as on one device (fp32,
3 steps), checkpoints resuming under another expert degree."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from jaxtrain import step, trainer
from jaxtrain.config import load_config
from jaxtrain.executors import setup as setup_lib
from jaxtrain.model import moe
from jaxtrain.parallel import expert_dispatch, sharding
from jaxtrain.parallel.mesh_axes import EXPERT
from util import (TINY_MOE, logged_losses, metric_records, random_batch, random_params,
                  tiny_moe_config, train_on_one_device)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _expert_mesh(n):
    return jax.make_mesh((n,), (EXPERT,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- the transports

def test_both_transports_move_the_same_rows():
    """What the fixed-capacity all_to_all delivers is what lax.ragged_all_to_all's plan says
    (its semantics applied in numpy: XLA:CPU cannot run it): block i of rank j's buffer holds
    rank i's rows for j, zeros after them."""
    ep, m, d = 4, 6, 3
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ep, m, d)).astype(np.float32) + 1.0   # no zero rows
    sizes = np.stack([rng.multinomial(int(rng.integers(0, m + 1)), [1 / ep] * ep)
                      for _ in range(ep)]).astype(np.int32)        # [sender, receiver]

    def body(x_MD, send_P):
        x_MD, send_P = x_MD[0], send_P[0]
        recv_P = jax.lax.all_to_all(send_P, EXPERT, 0, 0, tiled=True)
        plan = expert_dispatch.plan(send_P, recv_P, m)
        return expert_dispatch.fixed(x_MD, plan, m)[None], jax.tree.map(lambda a: a[None], plan)
    got, plans = jax.jit(jax.shard_map(body, mesh=_expert_mesh(ep), in_specs=P(EXPERT),
                                       out_specs=P(EXPERT)))(x, sizes)
    got, plans = np.asarray(got), jax.tree.map(np.asarray, plans)
    want = np.zeros((ep, ep * m, d), np.float32)
    for i in range(ep):
        for j in range(ep):
            n, src, dst = (int(plans.send_sizes[i, j]), int(plans.input_offsets[i, j]),
                           int(plans.output_offsets[i, j]))
            assert plans.recv_sizes[j, i] == n == sizes[i, j]
            want[j, dst:dst + n] = x[i, src:src + n]
    np.testing.assert_array_equal(got.reshape(ep, ep * m, d), want)


def test_expert_parallel_dispatch_equals_the_local_one():
    """Each rank's tokens reach experts held by other ranks and come back weighted: the output
    and its gradients (tokens, router weights, expert weights) equal the one-rank dispatch on
    all tokens, dropped assignments included."""
    ep, e, t, k, d = 4, 8, 6, 2, 5
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((ep * t, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(ep * t)]),
                          jnp.int32)
    weights = jnp.asarray(rng.random((ep * t, k)), jnp.float32)
    keep = jnp.asarray(rng.random((ep * t, k)) > 0.2)
    weights = jnp.where(keep, weights, 0.0)
    w_EDD = jnp.asarray(rng.standard_normal((e, d, d)), jnp.float32)

    def run(dispatch, x, weights, w, experts, keep):
        experts_fn = lambda w, rows, sizes: jax.lax.ragged_dot(rows, w, sizes)  # noqa: E731
        return dispatch(x, experts, weights, keep, e, experts_fn, w)

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))
    local = jax.value_and_grad(loss(lambda *a: run(moe.local_dispatch, *a)), argnums=(0, 1, 2))
    want = local(x, weights, w_EDD, experts, keep)

    dispatch = expert_dispatch.ExpertParallelDispatch(ep, "fixed")

    def per_rank(*a):
        v, g = jax.value_and_grad(loss(lambda *b: run(dispatch, *b)), argnums=(0, 1, 2))(*a)
        return v[None], g
    rows = P(EXPERT)
    got = jax.jit(jax.shard_map(per_rank, mesh=_expert_mesh(ep), in_specs=rows,
                                out_specs=(rows, rows), check_vma=False))(
        x, weights, w_EDD, experts, keep)
    np.testing.assert_allclose(np.sum(got[0]), want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_aux_loss_is_unchanged_by_carving_experts_out_of_the_data_ranks():
    """With the load-balancing loss on, expert=4 on data=8 computes data=8's step exactly:
    each replica's tokens, losses and statistics are the same, the experts elsewhere."""
    def grads(*overrides):
        cfg = tiny_moe_config("--model.moe.aux_loss_coeff=0.1", "--model.vocab_size=512",
                              "--train.global_batch=16", *overrides)
        setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))
        loss, _, g, _ = step.make_grad_step(setup)(random_params(setup), random_batch(cfg, 0),
                                                   {})
        return float(loss), jax.device_get(g)
    want, got = grads("--parallel.data=8"), grads("--parallel.data=8", "--parallel.expert=4")
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


# ----------------------------------------------------------------------------- through train.py

# configs/tiny.py made small; every layer an MoE layer of 8 experts (util.TINY_MOE).
TRAIN_ARGS = ["--train.steps=3", "--train.log_every=1", "--train.eval_every=0",
              "--model.num_layers=2", "--train.seq_len=32", "--data.corpus_max_bytes=400000",
              "--checkpoint.async_save=false", "--model.vocab_size=512", *TINY_MOE]
LAYOUTS = {
    "expert2_data8": ["--parallel.data=8", "--parallel.expert=2"],
    "expert8_data8": ["--parallel.data=8", "--parallel.expert=8"],
    "expert4_fsdp2_zero1": ["--parallel.data=4", "--parallel.expert=4", "--parallel.fsdp=2",
                            "--parallel.zero1=true"],
    "expert2_tensor2_sp": ["--parallel.data=4", "--parallel.expert=2", "--parallel.tensor=2",
                           "--parallel.sequence_parallel=true"],
    "expert2_tensor2_sp_context2": ["--parallel.data=2", "--parallel.expert=2",
                                    "--parallel.tensor=2", "--parallel.sequence_parallel=true",
                                    "--parallel.context=2"],
    "expert4_context2": ["--parallel.data=4", "--parallel.expert=4", "--parallel.context=2"],
    "expert2_stage2": ["--parallel.data=4", "--parallel.expert=2", "--parallel.stage=2",
                       "--parallel.microbatches=2"],
}
MOE_LOGGED = ("moe_aux_loss", "moe_z_loss")   # layout-independent with the aux loss off


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """`python train.py` on one device: the logged records of its 3 steps."""
    workdir = tmp_path_factory.mktemp("one_device")
    stdout = train_on_one_device("configs/tiny.py", TRAIN_ARGS, workdir)
    assert "moe aux" in stdout   # the console line carries the MoE statistics
    return _by_step(workdir)


def _by_step(workdir) -> dict:
    """step -> its logged records merged (a step's train and eval records)."""
    out = {}
    for r in metric_records(workdir):
        out.setdefault(r["step"], {}).update(r)
    return out


def _train(workdir, layout, *extra):
    trainer.train(load_config(ROOT / "configs/tiny.py", [*TRAIN_ARGS, *LAYOUTS[layout], *extra,
                                                         f"--train.workdir={workdir}"]))
    return _by_step(workdir)


def _assert_same_run(got, want, steps=(1, 2, 3)):
    assert sorted(got) == sorted(want) == list(steps)
    for key in ("loss", *MOE_LOGGED):
        np.testing.assert_allclose([got[s][key] for s in steps], [want[s][key] for s in steps],
                                   rtol=1e-4, err_msg=key)
    for s in steps:   # every statistic is logged; loads are per replica's tokens
        assert got[s]["moe_load_min"] <= 1.0 <= got[s]["moe_load_max"]
        assert got[s]["moe_dropped_fraction"] == 0.0


def test_a_checkpoint_resumes_under_another_expert_layout(one_device, tmp_path):
    """Steps 1-2 with the experts split over 4 ranks (FSDP and ZeRO-1 sharding their state),
    step 3 resumed from that checkpoint with them over 2 ranks (tensor + SP, context 2): the
    run is the one device's."""
    _train(tmp_path, "expert4_fsdp2_zero1", "--train.exit_interval=2")
    assert max(logged_losses(tmp_path)) == 2
    got = _train(tmp_path, "expert2_tensor2_sp_context2", "--train.eval_every=3",
                 "--train.eval_batches=1")
    assert np.isfinite(got[3].pop("eval_loss"))   # the eval step runs the dispatch too
    _assert_same_run(got, one_device)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n not in (
    "expert4_fsdp2_zero1", "expert2_tensor2_sp_context2")])
def test_expert_layout_trains_as_one_device(one_device, tmp_path, layout):
    _assert_same_run(_train(tmp_path, layout), one_device)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("layout", [("--parallel.data=8", "--parallel.expert=4"),
                                    ("--parallel.data=4", "--parallel.expert=2",
                                     "--parallel.stage=2", "--parallel.microbatches=2")],
                         ids=["expert4", "expert2_stage2"])
def test_the_h100_program_moves_tokens_by_ragged_all_to_all_pairs(h100, layout):
    """On GPUs the dispatch is lax.ragged_all_to_all: async start/done pairs in the H100
    program, there and back in the forward and in the backward (the layer scan's body holds
    them once; in the pipeline inside the per-rank branches too)."""
    from jaxtrain.tools.compile_step import compile_step
    cfg = tiny_moe_config("--model.compute_dtype=bfloat16", "--model.vocab_size=512",
                          "--train.global_batch=16", *layout)
    text = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8))).text
    starts = text.count("ragged-all-to-all-start(")
    assert starts >= 4 and starts == text.count("ragged-all-to-all-done(")

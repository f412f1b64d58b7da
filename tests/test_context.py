"""Context parallelism computes what one device computes (fp32, 1e-5).

Every case runs the real grad step at context = 2 or 4 on the batch the data pipeline feeds it
(util.random_batch = data.synthetic_batch: packed documents, reordered for causal load
balancing) and compares loss and gradients with one device on the natural order, from the
same parameters: both strategies, the XLA core and the Pallas kernel (interpreted), and with
the other parallelism kinds, remat policies and FP8. Then the bad inputs, the data order,
fully masked ranks and checkpoints across context degrees.
"""
import shutil

import jax
import numpy as np
import pytest

from jaxtrain import data, step, trainer
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import context_attention, sharded_kernels, sharding
from jaxtrain.config import ConfigError
from jaxtrain.data.context import context_order, reorder_batch, restore_order
from jaxtrain.ledger.layout import LayoutError
from util import logged_losses, random_batch, random_params, tiny_config

# 1 layer (2 with stages), seq 32 so that c=4 leaves 4-token chunks; 4 heads / 2 KV heads.
BASE = ("--model.vocab_size=512", "--model.num_layers=1", "--train.global_batch=8",
        "--train.lr=1e-2")


def _grads(overrides, n_devices, params0=None, batch=None):
    """(loss, grads, params0, next fp8 metas ({} without FP8)) of one grad step on n_devices."""
    cfg = tiny_config(*BASE, *overrides)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:n_devices]))
    params0 = random_params(setup) if params0 is None else params0
    params = jax.device_put(params0, setup.param_shardings)
    batch = random_batch(cfg, 0, docs_per_row=3) if batch is None else batch
    args = (params, batch, jax.device_put(setup.fp8.fresh(setup.meta_shapes),
                                          setup.state_shardings.fp8_meta))
    lowered = step.make_grad_step(setup).lower(*args)
    if cfg.model.attention == "pallas":  # the kernels really run, not an XLA fallback
        hlo_text = lowered.as_text(debug_info=True)
        assert all(k in hlo_text for k in ("jaxtrain_flash_fwd", "jaxtrain_flash_bwd_dq"))
    out = lowered.compile()(*args)
    return float(out[0]), jax.device_get(out[2]), params0, jax.device_get(out[3])


def _assert_same(got, want):
    loss, grads = got[:2]
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def one_device():
    return _grads(["--parallel.data=1", "--model.attention=xla"], 1)


CASES = {  # name: (devices, overrides)
    "all_gather_c2": (2, ["--parallel.context=2"]),
    "ring_c2": (2, ["--parallel.context=2", "--parallel.context_strategy=ring"]),
    "all_gather_c4": (4, ["--parallel.context=4"]),
    "ring_c4": (4, ["--parallel.context=4", "--parallel.context_strategy=ring"]),
    "ring_c4_unbalanced": (4, ["--parallel.context=4", "--parallel.context_strategy=ring",
                               "--parallel.context_load_balance=false"]),
    "pallas_all_gather_c2": (2, ["--parallel.context=2", "--model.attention=pallas"]),
    "pallas_ring_c4": (4, ["--parallel.context=4", "--parallel.context_strategy=ring",
                           "--model.attention=pallas"]),
    # context 4 x tensor 2 with sequence parallelism: the residual stream over (context, tensor)
    "ring_c4_tensor2_sp": (8, ["--parallel.context=4", "--parallel.tensor=2",
                               "--parallel.sequence_parallel=true",
                               "--parallel.context_strategy=ring"]),
    "pallas_ring_c2_tensor2_sp": (4, ["--parallel.context=2", "--parallel.tensor=2",
                                      "--parallel.sequence_parallel=true",
                                      "--parallel.context_strategy=ring",
                                      "--model.attention=pallas"]),
    "all_gather_c2_fsdp2_data2": (8, ["--parallel.context=2", "--parallel.fsdp=2",
                                      "--parallel.data=2"]),
    "ring_c2_fsdp4_mb2": (8, ["--parallel.context=2", "--parallel.fsdp=4",
                              "--parallel.context_strategy=ring", "--parallel.microbatches=2"]),
    "ring_c2_zero1_data4": (8, ["--parallel.context=2", "--parallel.data=4",
                                "--parallel.zero1=true", "--parallel.context_strategy=ring"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_equals_one_device(name, one_device):
    n, overrides = CASES[name]
    data_ = [] if any(o.startswith("--parallel.data=") for o in overrides) else [
        "--parallel.data=1"]
    _assert_same(_grads([*data_, *overrides], n, one_device[2]), one_device)


@pytest.mark.parametrize("remat", [
    ["--remat.granularity=full", "--remat.num_layers=1"],
    ["--remat.granularity=selective", "--remat.modules=core_attn"],
    ["--remat.policy=save:qkv_proj,core_attn"],
    ["--remat.granularity=full", "--remat.method=block", "--remat.num_layers=1",
     "--model.num_layers=2"],
], ids=["full", "selective", "save_names", "block"])
def test_context_parallel_under_every_remat_kind(remat, one_device):
    overrides = ["--parallel.data=1", "--parallel.context=2", "--parallel.context_strategy=ring",
                 *remat]
    want = one_device if "--model.num_layers=2" not in remat else _grads(
        ["--parallel.data=1", "--model.num_layers=2"], 1)
    _assert_same(_grads(overrides, 2, want[2]), want)


def test_eval_sums_equal_one_device(one_device):
    """The eval step (per_replica over data x context) sums the same loss and tokens."""
    sums = []
    for overrides, n in ((["--parallel.data=1"], 1),
                         (["--parallel.data=2", "--parallel.context=2",
                           "--parallel.context_strategy=all_gather"], 4)):
        cfg = tiny_config(*BASE, *overrides)
        setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:n]))
        params = jax.device_put(one_device[2], setup.param_shardings)
        sums.append([float(x) for x in step.make_eval_step(setup)(
            params, random_batch(cfg, 1, docs_per_row=3))])
    np.testing.assert_allclose(sums[1], sums[0], rtol=1e-5)


def test_context_parallel_with_pipeline_stages():
    """stage=2 x context=2 (the executor's shard_map over stage around the context
    attention's) against the same pipeline at context=1. The ring is refused on XLA:CPU
    before compiling (its hops in per-stage branches crash it); the GPU target compiles it."""
    piped = ["--model.num_layers=2", "--parallel.stage=2", "--parallel.microbatches=2",
             "--parallel.data=1"]
    want = _grads(piped, 2)
    _assert_same(_grads([*piped, "--parallel.context=2",
                         "--parallel.context_strategy=all_gather"], 4, want[2]), want)
    with pytest.raises(context_attention.ContextAttentionError, match="all_gather"):
        _grads([*piped, "--parallel.context=2", "--parallel.context_strategy=ring"], 4)


def test_context_parallel_with_fp8():
    """FP8 projections (delayed scaling): the amax each rank observes on its part of the
    sequence is max-reduced over context, so the next scales match one device's too."""
    fp8 = ["--fp8.enabled=true", "--model.hidden_size=64", "--model.mlp_size=128"]
    want = _grads(["--parallel.data=1", *fp8], 1)
    got = _grads(["--parallel.data=1", "--parallel.context=2", "--parallel.context_strategy=ring",
                  *fp8], 2, want[2])
    _assert_same(got, want)
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_rank_whose_tokens_are_all_masked_counts_and_stays_finite(one_device):
    """Context rank 0's tokens carry no loss in any row: its loss terms are 0, the token count
    comes from the other rank (the loss counts over `context`), and nothing is NaN."""
    cfg = tiny_config(*BASE, "--parallel.data=1", "--parallel.context=2",
                      "--parallel.context_strategy=ring")
    natural = random_batch(tiny_config(*BASE, "--parallel.data=1"), 0, docs_per_row=3)
    natural["loss_mask"] = natural["loss_mask"].copy()
    shard = cfg.train.seq_len // 2
    natural["loss_mask"][:, context_order(cfg.train.seq_len, 2)[:shard]] = 0.0
    want = _grads(["--parallel.data=1"], 1, one_device[2], batch=natural)
    got = _grads(["--parallel.data=1", "--parallel.context=2",
                  "--parallel.context_strategy=ring"], 2, one_device[2],
                 batch=reorder_batch(natural, 2))
    assert np.isfinite(got[0])
    _assert_same(got, want)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, error, message", [
    (["--parallel.context=2", "--train.seq_len=34"], ConfigError,
     "seq_len=34 does not split into 2 x parallel.context=2 = 4 chunks"),
    (["--parallel.context=3", "--parallel.data=1"], ConfigError,
     "parallel.context=3 is odd.*context_load_balance=false"),
    (["--parallel.context=2", "--parallel.context_strategy=ring", "--model.attention=cudnn",
      "--model.compute_dtype=bfloat16"], ConfigError,
     "context_strategy=ring is not supported by model.attention=cudnn; all_gather runs on "
     "xla, pallas, mosaic, cudnn; ring runs on xla, pallas, mosaic"),
    (["--parallel.context=-1", "--parallel.data=1"], ConfigError,
     "give parallel.context a number"),
    (["--parallel.context=3", "--parallel.context_load_balance=false",
      "--train.seq_len=32"], ConfigError, "seq_len=32 is not divisible by parallel.context=3"),
])
def test_bad_context_configs_fail_before_anything_compiles(overrides, error, message):
    with pytest.raises(error, match=message):
        tiny_config(*overrides)


def test_a_context_degree_that_does_not_divide_the_devices_fails_before_compiling():
    cfg = tiny_config("--parallel.context=4", "--parallel.data=1")
    with pytest.raises(LayoutError, match="context=4 tensor=1 needs 4 devices but there are 6"):
        sharding.validate_layout(cfg, 6)
    cfg = tiny_config("--parallel.context=4", "--parallel.data=-1")
    with pytest.raises(LayoutError, match="6 devices are not divisible by .*context=4"):
        sharding.validate_layout(cfg, 6)


def test_a_strategy_the_core_lacks_is_refused_by_the_attention_itself():
    mesh = sharding.make_mesh(tiny_config("--parallel.context=2", "--parallel.data=-1").parallel,
                              jax.devices()[:2])
    from jaxtrain.model import attention
    with pytest.raises(context_attention.ContextAttentionError,
                       match="ring is not supported by model.attention=cudnn"):
        sharded_kernels.shard_attention(attention.cudnn_attention, mesh,
                                        context_attention.ContextPlan("ring"))


# ----------------------------------------------------------------------------- data order

def test_the_reorder_gives_rank_r_chunks_r_and_2c_minus_1_minus_r():
    order = context_order(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    x = np.arange(3 * 16).reshape(3, 16)
    np.testing.assert_array_equal(restore_order(reorder_batch({"x": x}, 2)["x"], 2), x)


def test_every_batch_source_is_reordered_the_same_way():
    """make_batches (packing, then the reorder) and synthetic_batch follow the config; the
    labels were shifted before the reorder, so each slot's target is its own next token."""
    natural = tiny_config("--parallel.data=1")
    cp = tiny_config("--parallel.data=1", "--parallel.context=2")
    for make in (lambda cfg: next(data.make_batches(cfg)),
                 lambda cfg: data.synthetic_batch(cfg, 0)):
        want, got = make(natural), make(cp)
        for key in want:
            np.testing.assert_array_equal(got[key], reorder_batch(want, 2)[key])
    batch = next(data.make_batches(natural))
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    off = tiny_config("--parallel.data=1", "--parallel.context=2",
                      "--parallel.context_load_balance=false")
    np.testing.assert_array_equal(next(data.make_batches(off))["inputs"], batch["inputs"])


# ----------------------------------------------------------------------------- checkpoints

TRAIN = ["--train.steps=4", "--checkpoint.every=2", "--checkpoint.async_save=false",
         "--train.seq_len=32", "--model.num_layers=2", "--parallel.zero1=true"]


@pytest.mark.slow
def test_a_checkpoint_restores_across_context_degrees(tmp_path):
    """Steps 1-2 at context=2 (ring), 3-4 resumed at context=4 and at context=1: the same
    losses as the run that stayed at context=2 (up to fp32 summation order), the ZeRO-1
    optimizer state resharded from data x context to the new degrees."""
    a = tmp_path / "a"
    trainer.train(tiny_config(*TRAIN, "--parallel.data=-1", "--parallel.context=2",
                              "--parallel.context_strategy=ring", workdir=str(a)))
    for degree in (4, 1):
        b = tmp_path / f"c{degree}"
        shutil.copytree(a, b)
        shutil.rmtree(b / "checkpoints" / "4")
        trainer.train(tiny_config(*TRAIN, "--parallel.data=-1", f"--parallel.context={degree}",
                                  workdir=str(b)))
        assert logged_losses(b)[4] == pytest.approx(logged_losses(a)[4], rel=1e-4)

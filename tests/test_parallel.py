"""Every parallel layout computes what one device computes (fp32, 2 steps)."""
import pathlib

import jax
import numpy as np
import pytest

from jaxtrain import step, trainer
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import sharding
from jaxtrain.config import load_config
from jaxtrain.ledger.layout import LayoutError
from util import logged_losses, random_batch, tiny_config, train_on_one_device

LAYOUTS = {
    "data8": ["--parallel.data=8"],
    "fsdp8": ["--parallel.data=1", "--parallel.fsdp=8"],
    "tensor4_data2": ["--parallel.data=2", "--parallel.tensor=4"],
    "data2_fsdp2_tensor2": ["--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2"],
    "tensor2_sp_fsdp4": ["--parallel.data=1", "--parallel.fsdp=4", "--parallel.tensor=2",
                         "--parallel.sequence_parallel=true"],
    "zero1_data4_tensor2": ["--parallel.data=4", "--parallel.tensor=2", "--parallel.zero1=true"],
    "data2_fsdp2_tensor2_mb4": ["--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
                                "--parallel.microbatches=4"],
}
# vocab 512: the same padded size (multiple of 128 x tensor) for every layout here.
BASE = ("--model.vocab_size=512", "--train.global_batch=16", "--train.lr=1e-2")


def _run(overrides, devices, params0):
    cfg = tiny_config(*BASE, *overrides)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, devices))
    grad_step = step.make_grad_step(setup)
    b0, b1 = random_batch(cfg, 0), random_batch(cfg, 1)
    if params0 is None:
        params0 = jax.device_get(setup_lib.init_train_state(setup, 0).params)
    state = setup_lib.train_state_from_params(setup, params0)
    loss0, _, g0, _ = grad_step(state.params, b0, state.fp8_meta)
    # Gradients at a second point, reached by a plain SGD step (Adam's first step is
    # sign(g)·lr, which turns float noise in near-zero gradients into visible differences).
    params1 = jax.tree.map(lambda p, g: p - 0.5 * g, state.params, g0)
    loss1, _, g1, _ = grad_step(params1, b1, state.fp8_meta)
    # The real train step (Adam, ZeRO-1 sharded state) for two steps.
    train_step = step.make_train_step(setup)
    state, m0 = train_step(state, b0)
    state, m1 = train_step(state, b1)
    out = {"loss": [float(loss0), float(loss1)], "grads": jax.device_get([g0, g1]),
           "adam_loss": [float(m0["loss"]), float(m1["loss"])]}
    return out, params0


@pytest.fixture(scope="module")
def reference():
    out, params0 = _run(["--parallel.data=1"], jax.devices()[:1], None)
    return out, params0


def assert_runs_equal(got, want):
    """Two of _run's outputs: losses, Adam's loss and the gradients within fp32 1e-5."""
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["adam_loss"], want["adam_loss"], rtol=1e-5)
    for g_got, g_want in zip(got["grads"], want["grads"]):
        for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_device(name, reference):
    ref, params0 = reference
    got, _ = _run(LAYOUTS[name], jax.devices(), params0)
    assert_runs_equal(got, ref)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.data=7", "--train.global_batch=14"], "needs 7 devices but there are 8"),
    (["--parallel.data=1", "--parallel.tensor=8", "--model.num_heads=4"],
     "num_heads=4 is not divisible by tensor=8"),
    (["--parallel.data=-1", "--parallel.tensor=3"], "not divisible by"),
    (["--parallel.data=2", "--parallel.tensor=4", "--model.mlp_size=130"],
     "mlp_size=130 is not divisible by tensor=4"),
])
def test_bad_layouts_fail_before_compiling(overrides, message):
    cfg = tiny_config(*overrides)
    with pytest.raises(LayoutError, match=message):
        setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))


def test_sequence_parallel_without_tensor_is_a_config_error():
    from jaxtrain.config import ConfigError
    with pytest.raises(ConfigError, match="needs parallel.tensor > 1"):
        tiny_config("--parallel.sequence_parallel=true")


ROOT = pathlib.Path(__file__).resolve().parents[1]
# The recipe users run, small enough for the suite; vocab 384 pads to 384 at tensor=1 and to
# 512 at tensor=2, so the comparison covers the padded-vocab initialisation.
TRAIN_ARGS = ["--train.steps=3", "--train.log_every=1", "--train.eval_every=0",
              "--model.num_layers=2", "--train.seq_len=64", "--data.corpus_max_bytes=400000",
              "--checkpoint.async_save=false"]


@pytest.mark.slow
def test_trainer_from_one_seed_gives_one_model_on_any_layout(tmp_path):
    """`python train.py` on one device and the trainer at data=2 fsdp=2 tensor=2+SP, from the
    same seed, train the same model: the layout changes neither the initial weights nor the
    losses."""
    one = tmp_path / "one_device"
    train_on_one_device("configs/tiny.py", TRAIN_ARGS, one)
    layout = tmp_path / "layout"
    trainer.train(load_config(ROOT / "configs/tiny.py", [
        *TRAIN_ARGS, "--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
        "--parallel.sequence_parallel=true", f"--train.workdir={layout}"]))
    want, got = logged_losses(one), logged_losses(layout)
    assert sorted(want) == sorted(got) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)],
                               rtol=1e-5)

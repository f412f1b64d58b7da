"""parallel.collective_matmul computes what the plain TP+SP program computes (fp32: loss and
gradients within 1e-5, two points and two Adam steps, on 8 fake CPU devices), and is refused
where it does not apply."""
import jax
import pytest

from jaxtrain.config import ConfigError
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import sharding
from test_parallel import _run, assert_runs_equal
from util import tiny_config

LAYOUTS = {   # tiny_config: 4 heads, 2 KV heads (tensor=4 keeps K/V whole: the local path)
    "tensor2_sp_data4": ["--parallel.data=4", "--parallel.tensor=2"],
    "tensor4_sp_data2": ["--parallel.data=2", "--parallel.tensor=4"],
    "tensor2_sp_fsdp4": ["--parallel.data=1", "--parallel.fsdp=4", "--parallel.tensor=2"],
    "tensor4_sp_fsdp2_full_remat": ["--parallel.data=1", "--parallel.fsdp=2",
                                    "--parallel.tensor=4", "--remat.granularity=full",
                                    "--remat.num_layers=1"],
}
SP = ["--parallel.sequence_parallel=true"]


@pytest.fixture(scope="module")
def params0():
    cfg = tiny_config("--model.vocab_size=512")
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:1]))
    return jax.device_get(setup_lib.init_train_state(setup, 0).params)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collective_matmul_equals_plain_sp(name, params0):
    plain, _ = _run(LAYOUTS[name] + SP, jax.devices(), params0)
    ring, _ = _run(LAYOUTS[name] + SP + ["--parallel.collective_matmul=true"], jax.devices(),
                   params0)
    assert_runs_equal(ring, plain)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.tensor=2"], "set parallel.sequence_parallel=true"),
    (["--parallel.tensor=2", "--parallel.context=2", *SP], "parallel.context > 1"),
    (["--parallel.tensor=2", "--fp8.enabled=true", *SP], "fp8.enabled=true"),
    (["--parallel.tensor=4", "--train.seq_len=30", *SP], "seq_len=30 does not split"),
])
def test_collective_matmul_refused_where_it_does_not_apply(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("--parallel.data=1", "--parallel.collective_matmul=true", *overrides)


def test_collective_matmul_under_stages_is_refused_on_cpu():
    from jaxtrain.parallel.collective_matmul import CollectiveMatmulError
    cfg = tiny_config("--parallel.stage=2", "--parallel.data=2", "--parallel.tensor=2",
                      "--parallel.microbatches=4", "--train.global_batch=16", *SP,
                      "--parallel.collective_matmul=true")
    with pytest.raises(CollectiveMatmulError, match="crashes XLA:CPU"):
        setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()))

"""MoE parallel folding (parallel.expert_tensor=1): the expert ranks span expert x tensor, each
expert whole on one rank. The experts' specs, the step's gradients and train.py's runs equal
the unfolded layouts' and one device's; the invalid combinations are one-line errors; the
H100 program moves the rows by ragged all-to-alls over the folded group and runs the Mosaic
grouped GEMM under tensor 2."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import step
from jaxtrain.config import ConfigError, load_config
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import expert_dispatch, sharding
from jaxtrain.tools.hlo_groups import parse_replica_groups
from test_expert_parallel import ROOT, TRAIN_ARGS, _assert_same_run, _by_step
from util import random_batch, random_params, tiny_moe_config, train_on_one_device

FOLD = ["--parallel.expert_tensor=1"]
# expert 4 = 2 carved out of data 4 x tensor 2 (the mesh: data 2, expert 2, tensor 2)
FOLDED_TP2_SP = ["--parallel.data=4", "--parallel.tensor=2",
                 "--parallel.sequence_parallel=true", "--parallel.expert=4", *FOLD]


def _setup(*overrides):
    cfg = tiny_moe_config("--model.vocab_size=512", "--train.global_batch=16", *overrides)
    return cfg, setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))


def _grads(*overrides):
    cfg, setup = _setup(*overrides)
    loss, _, g, _ = step.make_grad_step(setup)(random_params(setup), random_batch(cfg, 0), {})
    return float(loss), jax.device_get(g)


def test_folded_experts_are_whole_and_split_over_expert_and_tensor():
    """The experts' dim takes (expert, tensor), their mlp dim stays whole; the dense MLP keeps
    tensor on mlp; the mesh's expert axis is expert / tensor."""
    _, setup = _setup(*FOLDED_TP2_SP)
    assert {a: n for a, n in setup.mesh.shape.items() if n > 1} == {
        "data": 2, "expert": 2, "tensor": 2}
    assert isinstance(setup.ops.dispatch, expert_dispatch.FoldedDispatch)
    assert setup.ops.dispatch.expert == 4
    blocks = setup.param_shardings["blocks"]
    for name in ("w_gate", "w_up", "w_down"):   # [layers, experts, ...]
        assert blocks["moe"][name].spec == P(None, ("expert", "tensor"), None, None), name
    _, unfolded = _setup("--parallel.data=4", "--parallel.tensor=2", "--parallel.expert=2")
    assert unfolded.param_shardings["blocks"]["moe"]["w_gate"].spec == P(
        None, "expert", None, "tensor")


@pytest.fixture(scope="module")
def data8():
    return _grads("--parallel.data=8")


@pytest.mark.parametrize("layout", [
    FOLDED_TP2_SP,
    pytest.param(["--parallel.data=4", "--parallel.tensor=2", "--parallel.expert=2", *FOLD],
                 marks=pytest.mark.slow),   # the mesh's expert axis 1: tensor alone
    pytest.param(["--parallel.data=2", "--parallel.context=2", "--parallel.tensor=2",
                  "--parallel.sequence_parallel=true", "--parallel.expert=4", *FOLD],
                 marks=pytest.mark.slow),
], ids=["expert4_tensor2_sp", "expert2_is_tensor2", "expert4_tensor2_sp_context2"])
def test_a_folded_step_has_the_data_parallel_gradients(data8, layout):
    """Loss and every gradient (experts, router, attention) of one step equal data 8's."""
    want = data8
    got = _grads(*layout)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_folded_capacity_dispatch_drops_what_the_unfolded_one_drops():
    """dispatch=capacity: each replica's capacity comes from its own tokens (the router runs
    on all of them before the tensor ranks split the rows), so folding over the tensor ranks
    computes the unfolded layout's step: the same kept rows, loss and gradients."""
    capacity = ["--model.moe.dispatch=capacity", "--model.moe.capacity_factor=0.5"]
    base = ["--parallel.data=4", "--parallel.tensor=2", "--parallel.sequence_parallel=true"]
    want = _grads(*capacity, *base, "--parallel.expert=2")
    got = _grads(*capacity, *base, "--parallel.expert=4", *FOLD)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_a_folded_pipeline_step_has_the_data_parallel_gradients():
    want = _grads("--parallel.data=8", "--parallel.microbatches=2")
    got = _grads("--parallel.data=2", "--parallel.stage=2", "--parallel.microbatches=2",
                 "--parallel.tensor=2", "--parallel.sequence_parallel=true",
                 "--parallel.expert=4", *FOLD)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_folded_tensor2_sp_expert4_trains_as_one_device(tmp_path):
    """train.py, 3 steps fp32: expert 4 folded over data 4 x tensor 2 + SP = one device."""
    want = tmp_path / "one"
    train_on_one_device("configs/tiny.py", TRAIN_ARGS, want)
    from jaxtrain import trainer
    got = tmp_path / "folded"
    trainer.train(load_config(ROOT / "configs/tiny.py", [*TRAIN_ARGS, *FOLDED_TP2_SP,
                                                         f"--train.workdir={got}"]))
    _assert_same_run(_by_step(got), _by_step(want))


DEEPSEEK_ARGS = ["--train.steps=2", "--train.log_every=1", "--train.eval_every=0",
                 "--train.seq_len=32", "--data.corpus_max_bytes=400000",
                 "--checkpoint.async_save=false", "--model.vocab_size=512",
                 "--model.compute_dtype=float32", "--model.param_dtype=float32"]


@pytest.mark.slow
def test_folded_tiny_deepseek_trains_as_one_device(tmp_path):
    """tiny_deepseek (MLA, sigmoid group-limited router with the balancing bias, shared
    experts, a first dense layer): expert 4 folded over data 4 x tensor 2 + SP = one device."""
    want = tmp_path / "one"
    train_on_one_device("configs/tiny_deepseek.py", DEEPSEEK_ARGS, want)
    from jaxtrain import trainer
    got = tmp_path / "folded"
    trainer.train(load_config(ROOT / "configs/tiny_deepseek.py", [
        *DEEPSEEK_ARGS, *FOLDED_TP2_SP, f"--train.workdir={got}"]))
    got, want = _by_step(got), _by_step(want)
    assert sorted(got) == sorted(want) == [1, 2]
    np.testing.assert_allclose([got[s]["loss"] for s in (1, 2)],
                               [want[s]["loss"] for s in (1, 2)], rtol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["--parallel.data=4", "--parallel.tensor=2", "--parallel.expert=2",
      "--parallel.expert_tensor=3"], "expert_tensor=3"),
    (["--parallel.data=2", "--parallel.tensor=4", "--parallel.expert=2", *FOLD],
     "make parallel.expert a multiple of parallel.tensor=4"),
    (["--parallel.data=2", "--parallel.tensor=2", "--parallel.context=2",
      "--parallel.expert=8", *FOLD], "carves expert/tensor=4 ranks out of parallel.data=2"),
    (["--parallel.data=4", "--parallel.tensor=2", "--parallel.expert=4", *FOLD,
      "--fp8.enabled=true"], "fp8.enabled=true with parallel.expert_tensor=1"),
    (["--parallel.data=8", "--parallel.tensor=1", "--parallel.expert=16", *FOLD],
     "num_experts=8 is not divisible by parallel.expert=16"),
], ids=["value", "not_a_multiple", "data", "fp8", "experts"])
def test_invalid_folded_layouts_are_one_line_errors(overrides, message):
    from jaxtrain import config_check
    with pytest.raises(ConfigError) as err:
        config_check.check(tiny_moe_config("--model.vocab_size=512",
                                           "--train.global_batch=16", *overrides), 8)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_ledger_prices_the_folded_layout_as_the_program_holds_it():
    """Expert weights per device: E/ep experts whole (unfolded: E/ep_data experts / t); the
    same number either way at ep = ep_data x t; the all-to-all spans the folded group."""
    from jaxtrain.ledger import experts, layout_from_config
    cfg = tiny_moe_config("--model.vocab_size=512", "--train.global_batch=16", *FOLDED_TP2_SP)
    folded = layout_from_config(cfg, 8)
    assert folded.folded and folded.expert == 4 and folded.span("expert") == 4
    flat = layout_from_config(tiny_moe_config(
        "--model.vocab_size=512", "--train.global_batch=16", "--parallel.data=4",
        "--parallel.tensor=2", "--parallel.sequence_parallel=true", "--parallel.expert=2"), 8)
    m = cfg.model
    assert experts.expert_params_local(cfg, folded) == 8 / 4 * 3 * m.hidden_size * 32
    assert experts.expert_params_local(cfg, folded) == experts.expert_params_local(cfg, flat)
    assert experts.expert_data_ranks(folded) == 2 == experts.expert_data_ranks(flat)
    # each tensor rank sends its T/t rows to 3 of 4 ranks (unfolded: T rows to 1 of 2)
    seq = cfg.train.seq_len
    t_rows = experts.layer_tokens(cfg, folded, seq) * 2
    assert experts.all_to_all_pass_bytes(cfg, folded, seq) == 2 * 3 / 4 * t_rows / 2 * 64 * 2


@pytest.mark.gpu_compile
@pytest.mark.parametrize("layout", [
    FOLDED_TP2_SP,
    ["--parallel.data=2", "--parallel.stage=2", "--parallel.microbatches=2",
     "--parallel.tensor=2", "--parallel.sequence_parallel=true", "--parallel.expert=4", *FOLD],
], ids=["expert4_tensor2_sp", "expert4_tensor2_sp_stage2"])
def test_the_folded_h100_program_exchanges_over_expert_x_tensor_with_the_kernels(h100, layout):
    """Compiled for 8 H100s at expert 4 folded over 2 data-carved ranks x tensor 2 + SP (bf16,
    sizes the kernels take; and in the pipeline's per-rank branches): the ragged all-to-alls'
    replica groups hold 4 ranks (twice the mesh's expert axis), and the experts run the Mosaic
    grouped GEMM although tensor = 2. Measured: 10 ragged pairs at stage 2, 28 kernel calls."""
    from jaxtrain.tools.compile_step import compile_step
    cfg = tiny_moe_config("--model.compute_dtype=bfloat16", "--model.vocab_size=512",
                          "--model.hidden_size=128", "--model.moe.mlp_size=128",
                          "--train.global_batch=16", *layout)
    mesh = sharding.make_mesh(cfg.parallel, h100(8))
    dot, why = setup_lib.grouped_dot_for(cfg.model, mesh, setup_lib.folded(cfg, mesh))
    assert dot.__module__.endswith("grouped_matmul"), why
    text = compile_step(cfg, mesh).text
    lines = [ln for ln in text.splitlines() if "ragged-all-to-all-start(" in ln]
    assert len(lines) >= 4
    for ln in lines:   # devices d·4 + e·2 + t (s·4 + e·2 + t): each data rank's (stage's) group
        groups = sorted(map(sorted, parse_replica_groups(ln, 8)))
        assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]], ln[:300]
    assert 'custom_call_target="mosaic_gpu_v2"' in text

"""FP8 for the MoE experts: the per-expert grouped GEMM against the dense FP8 formulas, the
per-expert meta update, and tiny FP8 MoE models through the trainer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.config import Fp8Config
from jaxtrain.model import fp8, fp8_grouped, fp8_matmul

RECIPE = fp8_matmul.recipe_of(Fp8Config(enabled=True, amax_history_len=4))
DN = (((1,), (0,)), ((), ()))    # x_MK @ w_KF


def per_expert_meta(e, seed=0):
    """Per-expert metas with distinct scales, so a row quantized with the wrong expert's scale
    shows."""
    rng = np.random.default_rng(seed)
    meta = fp8_matmul.init_meta(RECIPE, (e,))

    def scaled(role, lo, hi):
        s = jnp.asarray(rng.uniform(lo, hi, e), jnp.float32)
        return fp8_matmul.TensorMeta(s, 1.0 / s, role.amax_history)
    return fp8_matmul.Fp8Meta(scaled(meta.x, 20, 200), scaled(meta.w, 200, 2000),
                              scaled(meta.g, 1e3, 1e4))


def slice_meta(meta, e):
    return jax.tree.map(lambda a: a[e], meta)


def grouped_loss(x, w, sizes, meta, dy):
    y = fp8_grouped.fp8_grouped_dot(x, w, sizes, meta=meta, recipe=RECIPE,
                                    grouped_dot=jax.lax.ragged_dot)
    return jnp.sum(y * dy)


def reference_loss(x, w, sizes, meta, dy):
    """Expert by expert: its rows through the dense FP8 matmul with its own meta."""
    total, start = 0.0, 0
    for e, n in enumerate(np.asarray(sizes)):
        if n:
            y = fp8_matmul.fp8_dot_general(x[start:start + n], w[e], DN,
                                           meta=slice_meta(meta, e), cfg=RECIPE)
            total = total + jnp.sum(y * dy[start:start + n])
        start += n
    return total


def operands(sizes, rows=None, k=32, f=64, seed=0):
    rng = np.random.default_rng(seed)
    rows = rows or int(sum(sizes))
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), k, f)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.normal(size=(rows, f)) * 1e-2, jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), dy


@pytest.mark.parametrize("sizes", [(5, 3, 0, 8), (1, 0, 0, 15)])
def test_grouped_fp8_equals_the_dense_formulas_per_expert_forward_and_gradients(sizes):
    x, w, sizes, dy = operands(sizes)
    meta = per_expert_meta(len(sizes))
    got = jax.jit(jax.value_and_grad(grouped_loss, argnums=(0, 1, 3)))(x, w, sizes, meta, dy)
    want = jax.value_and_grad(reference_loss, argnums=(0, 1, 3))(x, w, sizes, meta, dy)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-7)   # dX
    # dW: experts with rows as their dense matmul; an empty expert's is zero
    for e, n in enumerate(np.asarray(sizes)):
        if n:
            np.testing.assert_allclose(got[1][1][e], want[1][1][e], rtol=1e-5, atol=1e-7)
        else:
            np.testing.assert_array_equal(got[1][1][e], 0.0)
    # the observations: each expert's amaxes from its own rows (count 1, amax in slot 0)
    obs, ref = got[1][2], want[1][2]
    for e, n in enumerate(np.asarray(sizes)):
        if n:
            for role in ("x", "w", "g"):
                np.testing.assert_allclose(getattr(obs, role).amax_history[e, 0],
                                           getattr(ref, role).amax_history[e, 0], rtol=1e-6)
        else:   # no routed rows: x and g observed empty (amax 0), w as always
            assert obs.x.amax_history[e, 0] == 0 and obs.g.amax_history[e, 0] == 0
            np.testing.assert_allclose(obs.w.amax_history[e, 0], jnp.max(jnp.abs(w[e])))
        assert all(getattr(obs, role).scale[e] == 1 for role in ("x", "w", "g"))


def test_the_rows_past_the_groups_are_neither_observed_nor_written():
    """Expert parallelism's receive buffer pads after the routed rows: a huge padding row
    must not become an expert's amax, and its output is zero."""
    x, w, sizes, dy = operands((3, 2, 0, 1), rows=9)
    x = x.at[6:].set(1e4)
    meta = per_expert_meta(4)
    y = fp8_grouped.fp8_grouped_dot(x, w, sizes, meta=meta, recipe=RECIPE,
                                    grouped_dot=jax.lax.ragged_dot)
    np.testing.assert_array_equal(y[6:], 0.0)
    obs = jax.grad(grouped_loss, argnums=3)(x, w, sizes, meta, dy)
    assert float(jnp.max(obs.x.amax_history[:, 0])) < 10
    np.testing.assert_allclose(obs.x.amax_history[3, 0], jnp.max(jnp.abs(x[5])), rtol=1e-6)


def test_per_expert_update_rolls_every_history_and_keeps_an_empty_experts_scale():
    """The converter's update, per expert: a routed expert's scale follows its own amax; an
    expert with no rows (amax 0 this step) rolls its history with the others and keeps the
    scale its window gives (the old one while the window is all zero)."""
    x, w, sizes, dy = operands((6, 0, 10, 0))
    conv = fp8.Fp8Converter(RECIPE)
    meta = fp8_matmul.init_meta(RECIPE, (4,))
    meta = meta.replace(x=meta.x.replace(amax_history=meta.x.amax_history.at[3, 2].set(2.0)))
    obs = jax.grad(grouped_loss, argnums=3)(x, w, sizes, meta, dy)
    new = conv.update(meta, obs)
    for e, start, n in ((0, 0, 6), (2, 6, 10)):
        amax = float(jnp.max(jnp.abs(x[start:start + n])))
        np.testing.assert_allclose(new.x.scale[e], 448.0 / amax, rtol=1e-6)
        np.testing.assert_allclose(new.x.amax_history[e, -1], amax, rtol=1e-6)
    assert new.x.scale[1] == 1.0                       # window all zero: old scale kept
    np.testing.assert_array_equal(new.x.amax_history[1], 0.0)
    # expert 3's window still holds an older amax 2.0 (rolled one slot on): the scale follows it
    np.testing.assert_allclose(new.x.scale[3], 448.0 / 2.0, rtol=1e-6)
    np.testing.assert_array_equal(new.x.amax_history[3], [0.0, 2.0, 0.0, 0.0])
    assert np.all(np.isfinite(np.asarray(new.g.scale)))


def test_a_non_per_expert_meta_is_refused_with_the_fix():
    x, w, sizes, _ = operands((2, 2))
    with pytest.raises(fp8_matmul.Fp8Error, match="per-expert metas"):
        fp8_grouped.fp8_grouped_dot(x, w, sizes, meta=fp8_matmul.init_meta(RECIPE),
                                    recipe=RECIPE, grouped_dot=jax.lax.ragged_dot)


@pytest.mark.parametrize("overrides, message", [
    (["--model.moe.dispatch=capacity", "--model.moe.pad_to_capacity=true"],
     "fp8.enabled=true with model.moe.pad_to_capacity=true: .*set model.moe.pad_to_capacity"),
    (["--fp8.bf16_first_layers=1"], "an MoE model runs every layer in FP8; set both to 0"),
])
def test_fp8_moe_configs_it_cannot_run_are_one_line_errors(overrides, message):
    from jaxtrain.config import ConfigError
    with pytest.raises(ConfigError, match=message) as err:
        load_config("configs/tiny.py", [*TINY_MOE, "--fp8.enabled=true", *overrides])
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- through train.py

import pathlib       # noqa: E402

from jaxtrain import trainer                          # noqa: E402
from jaxtrain.checkpoint import Checkpointer          # noqa: E402
from jaxtrain.config import CheckpointConfig, load_config  # noqa: E402
from jaxtrain.executors import setup as setup_lib     # noqa: E402
from jaxtrain.parallel import sharding                # noqa: E402
from util import TINY_MOE, metric_records, train_on_one_device  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 4
# configs/tiny.py (fp32 compute) made small, every layer 8 experts top-2, FP8 on.
TRAIN_ARGS = [f"--train.steps={STEPS}", "--train.log_every=1", "--train.eval_every=0",
              "--model.num_layers=2", "--train.seq_len=32", "--data.corpus_max_bytes=400000",
              "--checkpoint.async_save=false", "--model.vocab_size=512", *TINY_MOE,
              "--model.moe.shared_experts=1", "--fp8.enabled=true", "--fp8.amax_history_len=4"]
LAYOUTS = {"expert2_data8": ["--parallel.data=8", "--parallel.expert=2"],
           "stage2_data4": ["--parallel.data=4", "--parallel.stage=2",
                            "--parallel.microbatches=2"],
           "expert2_stage2": ["--parallel.data=4", "--parallel.expert=2", "--parallel.stage=2",
                              "--parallel.microbatches=2"]}


def _losses(workdir):
    return {r["step"]: r["loss"] for r in metric_records(workdir) if "loss" in r}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fp8_moe_one_device")
    train_on_one_device("configs/tiny.py", TRAIN_ARGS, workdir)
    return workdir


def _train(workdir, *extra):
    cfg = load_config(ROOT / "configs/tiny.py", [*TRAIN_ARGS, *extra,
                                                 f"--train.workdir={workdir}"])
    trainer.train(cfg)
    return cfg


def test_fp8_moe_trains_on_one_device_with_falling_loss_and_per_expert_scales(one_device):
    losses = _losses(one_device)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(np.isfinite(list(losses.values())))
    assert losses[STEPS] < losses[1]


@pytest.mark.parametrize("layout", [
    "expert2_data8", "stage2_data4",
    pytest.param("expert2_stage2", marks=pytest.mark.slow)])   # ~2 min on this CPU
def test_fp8_moe_layout_trains_as_one_device(one_device, tmp_path, layout):
    """The layout's run is the one device's; the expert-parallel one stops after step 2 and
    resumes from its checkpoint, so its steps 3-4 run on the restored per-expert metas (fresh
    metas, scale 1, would quantize differently)."""
    if layout.startswith("expert"):
        _train(tmp_path, *LAYOUTS[layout], "--train.exit_interval=2")
        assert max(_losses(tmp_path)) == 2
    cfg = _train(tmp_path, *LAYOUTS[layout])
    got, want = _losses(tmp_path), _losses(one_device)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)],
                               rtol=1e-4)
    # the final metas: per expert ([layers, experts]) and trained (no longer the initial 1)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))
    ckpt = Checkpointer(tmp_path / "checkpoints", CheckpointConfig())
    metas = ckpt.restore(STEPS, setup.abstract_train_state)[0].fp8_meta
    if layout.startswith("expert"):   # the checkpoint it resumed from held trained metas too
        resumed_from = ckpt.restore(2, setup.abstract_train_state)[0].fp8_meta
        assert (np.asarray(resumed_from["blocks"]["moe"]["fp8_gate"].x.scale) != 1.0).all()
    ckpt.close()
    w_scale = np.asarray(metas["blocks"]["moe"]["fp8_up"].w.scale)
    assert w_scale.shape == (2, 8) and (w_scale != 1.0).all()
    assert len(np.unique(w_scale)) > 8    # one scale per expert, not one shared


# ----------------------------------------------------------------------------- compiled for H100

@pytest.mark.gpu_compile
def test_the_fp8_moe_layer_compiles_for_an_h100_on_the_grouped_gemm_kernels(h100):
    """With FP8 on the GPU path quantizes each expert's rows and weights to FP8 (E4M3
    forward, E5M2 gradients) and runs the grouped product on the Mosaic GPU kernels in bf16
    on the FP8-rounded values (3 forward, 6 backward): no FP8 GEMM, no dense GEMM but the
    router's (docs/design.md, "FP8 for the MoE experts")."""
    from flax import nnx
    from jax.sharding import SingleDeviceSharding
    from jaxtrain.tools import hlo
    from jaxtrain.config import ModelConfig, MoeConfig
    from jaxtrain.model import llama, moe
    from jaxtrain.model.kernels import grouped_matmul as gm
    sh = SingleDeviceSharding(h100(1)[0])
    t, d, f, e = 512, 256, 512, 8
    cfg = ModelConfig(hidden_size=d, compute_dtype="bfloat16", num_layers=1,
                      moe=MoeConfig(num_experts=e, top_k=2, mlp_size=f))
    ops = llama.Ops(grouped_dot=gm.grouped_matmul, fp8=fp8.Fp8Converter(RECIPE))
    layer = nnx.eval_shape(lambda: moe.MoeLayer(cfg, ops, nnx.Rngs(0)))
    graphdef, state = nnx.split(layer)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state)
    x = jax.ShapeDtypeStruct((1, t, d), jnp.bfloat16, sharding=sh)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, fp8=True)[0].astype(jnp.float32) ** 2)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    assert text.count('custom_call_target="mosaic_gpu_v2"') == 9
    assert "f8e4m3fn" in text and "f8e5m2" in text
    assert "__cublas$lt$matmul$f8" not in text
    assert hlo.matmul_flops_from_text(text) == pytest.approx(3 * 2 * t * d * e, rel=0.01)

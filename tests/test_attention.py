"""`model.attention`: the Pallas kernel (interpreted on CPU) gives the XLA path's loss and
gradients through the real train step, on one device and per shard under tensor/data/fsdp
layouts; selection fails early with clear errors.

Interpret mode compiles slowly, so shapes are tiny (1 layer, seq 32, head dim 16) and the grad
step compiles at XLA optimisation level 0 (the numbers are the same, the compile half as long).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain import compat, step
from jaxtrain.executors import setup as setup_lib
from jaxtrain.model import attention
from jaxtrain.parallel import context_attention, sharded_kernels, sharding
from jaxtrain.config import ModelConfig
from util import random_batch, random_params, tiny_config

BASE = ("--model.vocab_size=512", "--model.num_layers=1", "--train.global_batch=8")


def _loss_and_grads(overrides, devices, params0=None):
    cfg = tiny_config(*BASE, *overrides)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, devices))
    if params0 is None:
        params0 = random_params(setup)
    params = jax.device_put(params0, setup.param_shardings)
    batch = random_batch(cfg, 0, docs_per_row=3)  # packed rows: segments matter
    lowered = step.make_grad_step(setup).lower(params, batch, {})
    # The kernel really runs (its forward and both backward kernels), not an XLA fallback.
    kernels = {"pallas": ("jaxtrain_flash_fwd", "jaxtrain_flash_bwd_dkv", "jaxtrain_flash_bwd_dq"),
               "mosaic": ("jaxtrain_mosaic_flash_fwd", "jaxtrain_mosaic_flash_bwd_dkv",
                          "jaxtrain_mosaic_flash_bwd_dq")}
    hlo = lowered.as_text(debug_info=True)
    for impl, names in kernels.items():
        assert all((k in hlo) == (cfg.model.attention == impl) for k in names), impl
    grad_step = lowered.compile()
    loss, _, grads, _ = grad_step(params, batch, {})
    return float(loss), jax.device_get(grads), params0


@pytest.fixture(scope="module")
def xla_reference():
    """The XLA path on one device: (loss, grads, params)."""
    return _loss_and_grads(["--model.attention=xla", "--parallel.data=1"], jax.devices()[:1])


LAYOUTS = {  # name: (devices, layout); the model has 4 query heads and 2 KV heads
    "one_device": (1, ["--parallel.data=1"]),
    "tensor2": (2, ["--parallel.data=1", "--parallel.tensor=2"]),
    "data2_tensor2": (4, ["--parallel.data=2", "--parallel.tensor=2"]),
    # tensor=4 > 2 KV heads: K/V replicated, shards 2 and 3 must slice out KV head 1.
    "fsdp2_tensor4": (8, ["--parallel.data=1", "--parallel.fsdp=2", "--parallel.tensor=4"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pallas_train_step_equals_xla(name, xla_reference):
    n_devices, layout = LAYOUTS[name]
    ref_loss, ref_grads, params0 = xla_reference
    loss, grads, _ = _loss_and_grads(["--model.attention=pallas", *layout],
                                     jax.devices()[:n_devices], params0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _mesh(**degrees):
    shape = tuple(degrees.get(a, 1) for a in sharding.MESH_AXES)
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, sharding.MESH_AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def test_uneven_groups_and_unsplittable_batch():
    """Query heads whose groups straddle tensor shards unevenly (H=12, K=3, t=2: shard 0 reads
    KV heads 0,0,0,0,1,1) and a batch row per data replica that fsdp=2 cannot split, inside a
    shard_map with `data` manual, as the train step runs the model."""
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    sharded = sharded_kernels.ShardedAttention(attention.PallasAttention(interpret=True), mesh)
    rng = np.random.default_rng(0)
    b, s, h, k, e = 2, 32, 12, 3, 16
    q_BSHE, w_BSHE = (jnp.asarray(rng.standard_normal((b, s, h, e), np.float32))
                      for _ in range(2))
    k_BSKE, v_BSKE = (jnp.asarray(rng.standard_normal((b, s, k, e), np.float32))
                      for _ in range(2))
    seg_BS = jnp.asarray(np.tile(np.repeat([1, 2, 3], [10, 10, 12]), (b, 1)), jnp.int32)

    def loss(attn, q, k, v):
        # one batch row per data replica, as the train step's shard_map over data gives it
        o_BSHE = jax.shard_map(attn, mesh=mesh, axis_names={"data"}, in_specs=P("data"),
                               out_specs=P("data"), check_vma=False)(q, k, v, seg_BS)
        return jnp.sum(o_BSHE * w_BSHE)

    def loss_and_grads(attn):
        fn = jax.value_and_grad(lambda *x: loss(attn, *x), argnums=(0, 1, 2))
        return jax.jit(fn)(q_BSHE, k_BSKE, v_BSKE)

    (got_loss, got_grads), (want_loss, want_grads) = (
        loss_and_grads(sharded), loss_and_grads(attention.xla_attention))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b_ in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-5)


def _model(**kw):
    fields = dict(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  mlp_size=128, compute_dtype="float32")
    return ModelConfig(**{**fields, **kw})


def _on_mesh(model, mesh):
    return sharded_kernels.shard_attention(attention.select(model, sharding.platform(mesh)), mesh)


def test_interpreted_mosaic_across_devices_is_refused_not_hung():
    with pytest.raises(attention.AttentionConfigError, match="runs on one device only"):
        _on_mesh(_model(attention="mosaic", compute_dtype="bfloat16"), _mesh(tensor=2))


def test_mosaic_on_a_gpu_that_is_not_hopper_is_refused():
    with pytest.raises(attention.AttentionConfigError, match="model.attention=mosaic cannot "
                       "run here: the Mosaic kernels are Hopper's"):
        attention.select(_model(attention="mosaic", compute_dtype="bfloat16"), "gpu", "8.0")


def test_selection():
    assert attention.select(_model(attention="auto"), "cpu") is attention.xla_attention
    assert attention.select(_model(attention="auto"), "gpu") == attention.PallasAttention(False)
    # auto on Hopper: the Mosaic GPU kernel where the model fits it, else the Triton one
    bf16 = _model(attention="auto", compute_dtype="bfloat16")
    assert attention.select(bf16, "gpu", "9.0") == attention.PallasAttention(False, "mosaic")
    assert attention.select(bf16, "gpu", "8.0") == attention.PallasAttention(False)
    assert attention.choose(bf16, "gpu", "9.0")[1].startswith("auto: jax")
    assert "sm_80" in attention.choose(bf16, "gpu", "8.0")[1]
    assert "bf16/fp16" in attention.choose(_model(attention="auto"), "gpu", "9.0")[1]
    assert "head dim 256" in attention.choose(
        _model(attention="auto", compute_dtype="bfloat16", head_dim=256), "gpu", "9.0")[1]
    assert attention.select(_model(attention="mosaic", compute_dtype="bfloat16"), "cpu") == \
        attention.PallasAttention(True, "mosaic")
    interpreted = attention.PallasAttention(interpret=True)
    assert attention.select(_model(attention="pallas"), "cpu") == interpreted
    assert _on_mesh(_model(attention="pallas"), _mesh()) == interpreted
    sharded = _on_mesh(_model(attention="pallas"), _mesh(tensor=2))
    assert isinstance(sharded, sharded_kernels.ShardedAttention) and sharded.kernel == interpreted
    # GSPMD partitions the XLA path; it needs no shard_map.
    assert _on_mesh(_model(attention="xla"), _mesh(tensor=2)) is attention.xla_attention
    # Under context parallelism every core runs per shard with the context plan.
    cp = _on_mesh(_model(attention="xla"), _mesh(context=2, tensor=2))
    assert isinstance(cp, sharded_kernels.ShardedAttention) and cp.kernel is attention.xla_attention
    assert cp.context == context_attention.ContextPlan("all_gather", True)


@pytest.mark.parametrize("model, mesh, message", [
    (dict(attention="cudnn", compute_dtype="bfloat16"), None, "needs an NVIDIA GPU"),
    (dict(attention="cudnn"), None, "needs model.compute_dtype in"),
    (dict(attention="cudnn", compute_dtype="bfloat16", head_dim=12), None, "multiple of 8"),
    (dict(attention="pallas", head_dim=512), None, "head_dim=512 is unsupported"),
    (dict(attention="pallas", num_kv_heads=3), None, "num_heads=4 is not divisible by"),
    (dict(attention="flash"), None, "choose one of"),
    (dict(attention="mosaic"), None, "takes bfloat16 or float16"),
    (dict(attention="mosaic", compute_dtype="bfloat16", head_dim=256), None, "up to 192"),
])
def test_selection_errors(model, mesh, message):
    with pytest.raises(attention.AttentionConfigError, match=message):
        _on_mesh(_model(**model), _mesh(**mesh) if mesh else None)


@pytest.mark.parametrize("layout", [
    ["--parallel.data=1", "--parallel.stage=2"],
    ["--parallel.data=1", "--parallel.stage=2", "--parallel.tensor=2"],
], ids=["stage2", "stage2_tensor2"])
def test_pipelined_pallas_equals_pipelined_xla(layout):
    """Kernel attention inside the pipeline's shard_map (the kernel's shard_map nests in the
    executor's manual axes): the same loss and gradients as XLA attention on the same layout."""
    pipelined = [*layout, "--model.num_layers=2", "--parallel.microbatches=2"]
    n = 2 * (2 if "--parallel.tensor=2" in layout else 1)
    want_loss, want_grads, params0 = _loss_and_grads(["--model.attention=xla", *pipelined],
                                                     jax.devices()[:n])
    loss, grads, _ = _loss_and_grads(["--model.attention=pallas", *pipelined],
                                     jax.devices()[:n], params0)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_mosaic_train_step_equals_xla(tmp_path):
    """The Mosaic GPU kernel (jax's GPU interpreter: its checked products) in the real train
    step on one device gives the XLA core's loss and gradients at bf16 tolerance. One batch
    row and 2 query heads: each program costs the interpreter seconds."""
    small = ["--model.compute_dtype=bfloat16", "--model.num_heads=2", "--model.num_kv_heads=1",
             "--train.global_batch=1", "--parallel.data=1"]
    with compat.persistent_compile_cache(tmp_path):
        want_loss, want_grads, params0 = _loss_and_grads(["--model.attention=xla", *small],
                                                         jax.devices()[:1])
        loss, grads, _ = _loss_and_grads(["--model.attention=mosaic", *small],
                                         jax.devices()[:1], params0)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-3)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=5e-2)

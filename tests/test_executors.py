"""The executors' pieces that need no model: microbatch accumulation, the one normalisation,
and the typed train state at the checkpoint boundary (the executors themselves are checked
against each other in test_pipeline_model.py and against one device in test_parallel.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.executors.contract import Sums, normalise
from jaxtrain.executors.replica import microbatched
from jaxtrain.model.loss import LossSums, Mean
from jaxtrain.train_state import TrainState


def test_microbatched_accumulates_any_function_over_its_microbatches():
    """Whatever `fn` computes, the scan adds it per microbatch with the given rule: the sums
    of a linear function equal the whole batch's, a max rule gives the max, and row r of the
    batch lands in microbatch r % m (split_microbatches' order)."""
    batch = {"x": jnp.arange(12.0).reshape(12, 1)}

    def fn(scale, mb):
        return {"sum": scale * jnp.sum(mb["x"]), "max": jnp.max(mb["x"]), "first": mb["x"][0, 0]}

    def zeros(shapes):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def add(acc, out):
        return {"sum": acc["sum"] + out["sum"], "max": jnp.maximum(acc["max"], out["max"]),
                "first": acc["first"] + out["first"]}
    out = jax.jit(microbatched(fn, 4, zeros, add))(2.0, batch)
    assert float(out["sum"]) == 2.0 * 66.0 and float(out["max"]) == 11.0
    assert float(out["first"]) == 0.0 + 1.0 + 2.0 + 3.0   # microbatch k starts at row k


def test_normalise_divides_once_and_each_mean_by_its_own_count():
    sums = Sums(LossSums(jnp.float32(6.0), jnp.float32(3.0),
                         {"fraction": Mean(jnp.float32(3.0), jnp.float32(4.0))}),
                {"w": jnp.full((2,), 9.0)}, {})
    sh = {"w": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
    out = normalise(sums, sh)
    assert float(out.loss) == 2.0 and float(out.tokens) == 3.0
    np.testing.assert_array_equal(out.grads["w"], [3.0, 3.0])
    assert out.metrics == {"fraction": 0.75} and out.fp8 == {}
    # a batch without a counted token gives zeros, not NaN
    empty = normalise(Sums(LossSums(jnp.float32(0.0), jnp.float32(0.0), {}),
                           {"w": jnp.zeros(2)}, {}), sh)
    assert float(empty.loss) == 0.0 and not np.isnan(np.asarray(empty.grads["w"])).any()


def test_the_train_state_is_the_checkpoints_old_dict():
    """to_tree gives the dict checkpoints always held; fp8_meta only when there are metas;
    from_tree inverts it; the state is a pytree jit and tree maps see field by field."""
    params = {"embed": jnp.ones((2, 3))}
    bf16 = TrainState(params, (), jnp.int32(4))
    assert list(bf16.to_tree()) == ["params", "opt_state", "step"]
    assert TrainState.from_tree(bf16.to_tree()) == bf16 and bf16.fp8_meta == {}
    metas = {"blocks": {"scale": jnp.ones(2)}}
    fp8 = bf16.replace(fp8_meta=metas)
    assert list(fp8.to_tree()) == ["params", "opt_state", "step", "fp8_meta"]
    doubled = jax.jit(lambda s: jax.tree.map(lambda a: a * 2, s))(fp8)
    assert isinstance(doubled, TrainState) and int(doubled.step) == 8
    np.testing.assert_array_equal(doubled.fp8_meta["blocks"]["scale"], [2.0, 2.0])


# ----------------------------------------------------------------------------- fused accumulation

def _grad_sums_both_ways(*overrides, n):
    """The replica executor's Sums with each microbatch's gradients added into the fp32
    accumulator as the backward makes them (grad_accumulation) and added after it."""
    from jaxtrain.executors import replica, setup as setup_lib
    from jaxtrain.parallel import sharding
    from util import random_params, tiny_config
    cfg = tiny_config("--parallel.microbatches=2", *overrides)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:n]))
    params = setup_lib.compute_params(setup, random_params(setup))
    B, S = cfg.train.global_batch, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, S), np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, 1),
             "segment_ids": np.ones((B, S), np.int32), "loss_mask": np.ones((B, S), np.float32),
             "positions": np.tile(np.arange(S, dtype=np.int32), (B, 1))}
    meta = setup.fp8.fresh(setup.meta_shapes)
    return [jax.jit(replica.grad_sums(setup, fuse=fuse))(params, batch, meta)
            for fuse in (True, False)]


@pytest.mark.parametrize("overrides,n", [
    # a mesh (GSPMD shards the accumulator's rows) and block remat (two scans, the first a
    # fenced one-row scan: the accumulator carried from one into the next)
    (("--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
      "--remat.granularity=full", "--remat.method=block", "--remat.num_layers=1"), 8),
    # FP8 with a bf16 first layer: two layer ranges (rows 0 and 1), the metas' observations
    (("--fp8.enabled=true", "--fp8.bf16_first_layers=1"), 1),
])
def test_fused_accumulation_gives_the_same_sums(overrides, n):
    fused, added = _grad_sums_both_ways(*overrides, n=n)
    assert float(fused.losses.loss) == float(added.losses.loss)
    for a, b in zip(jax.tree.leaves(fused.grads), jax.tree.leaves(added.grads)):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(fused.fp8), jax.tree.leaves(added.fp8)):
        np.testing.assert_array_equal(a, b)

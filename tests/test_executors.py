"""The executors' pieces that need no model: microbatch accumulation, the one normalisation,
and the typed train state at the checkpoint boundary (the executors themselves are checked
against each other in test_pipeline_model.py and against one device in test_parallel.py)."""
import jax
import jax.numpy as jnp
import numpy as np

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

"""Layer orders: the pipeline's chunk order, padding, and conversion of whole train states."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.parallel import layer_order
from jaxtrain.parallel.layer_order import PAD, LayerOrder


def test_chunk_order_puts_each_ranks_chunks_together():
    # p=2, v=2, even: virtual stage g = j*p + r; rank 0 holds g=0 (layer 0), g=2 (layer 2)
    assert LayerOrder.chunks(np.array([[1, 1], [1, 1]])).rows == (0, 2, 1, 3)
    # v=1, even: model order
    assert LayerOrder.chunks(np.array([[2], [2]])).is_natural
    # uneven (1, 3) layers over 2 stages: rank 0's chunk padded to 3 rows
    order = LayerOrder.chunks(np.array([[1], [3]]))
    assert order.rows == (0, PAD, PAD, 1, 2, 3) and order.num_layers == 4


@pytest.mark.parametrize("xp", [np, jnp])
def test_round_trip_and_zero_padding(xp):
    order = LayerOrder.chunks(np.array([[1, 1], [3, 3]]))    # 8 layers, p=2, v=2, Lc=3
    a = xp.arange(8.0)[:, None] + xp.zeros((8, 2))
    stored = order.from_natural(a)
    assert stored.shape == (12, 2)
    np.testing.assert_array_equal(np.asarray(stored)[:, 0],
                                  [0, 0, 0, 4, 0, 0, 1, 2, 3, 5, 6, 7])
    np.testing.assert_array_equal(order.to_natural(stored), a)


def test_convert_touches_only_layer_stacked_leaves_of_a_state():
    natural, chunked = LayerOrder.natural(4), LayerOrder.chunks(np.array([[1, 1], [1, 1]]))
    state = {"params": {"blocks": {"w": np.arange(4)}, "embed": np.arange(4)},
             "opt_state": ({"mu": {"blocks": {"w": np.arange(4) * 10}}},), "step": np.int32(3)}
    out = layer_order.convert(state, natural, chunked)
    np.testing.assert_array_equal(out["params"]["blocks"]["w"], [0, 2, 1, 3])
    np.testing.assert_array_equal(out["opt_state"][0]["mu"]["blocks"]["w"], [0, 20, 10, 30])
    np.testing.assert_array_equal(out["params"]["embed"], np.arange(4))
    assert layer_order.stored_rows(out) == 4
    back = layer_order.convert(out, chunked, natural)
    np.testing.assert_array_equal(back["params"]["blocks"]["w"], np.arange(4))
    with pytest.raises(ValueError, match="hold 4 model layers but this model has 6"):
        layer_order.convert(state, natural, LayerOrder.natural(6))


def test_json_round_trip_and_old_checkpoints_read_as_model_order():
    order = LayerOrder.chunks(np.array([[1], [3]]))
    assert layer_order.from_json(layer_order.to_json(order), 4) == order
    assert layer_order.from_json(None, 4) == LayerOrder.natural(4)


def test_imported_weights_land_in_their_chunk_rows():
    """train_state_from_params takes model order; an interleaved setup stores chunk order."""
    import jax
    from flax import nnx

    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from util import tiny_config
    cfg = tiny_config("--model.num_layers=4", "--parallel.stage=2", "--parallel.virtual_stages=2",
                      "--parallel.schedule=interleaved_1f1b", "--parallel.microbatches=2",
                      "--parallel.data=-1")
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()))
    assert setup.layer_order.rows == (0, 2, 1, 3)
    natural = setup_lib.build(tiny_config("--model.num_layers=4"),
                              sharding.make_mesh(tiny_config().parallel, jax.devices()[:1]))
    params = jax.tree.map(lambda a: np.random.default_rng(0).standard_normal(a.shape)
                          .astype(a.dtype), nnx.to_pure_dict(natural.abstract_state))
    state = setup_lib.train_state_from_params(setup, params)
    wq = params["blocks"]["attn"]["wq"]["kernel"]
    np.testing.assert_array_equal(np.asarray(state.params["blocks"]["attn"]["wq"]["kernel"]),
                                  wq[[0, 2, 1, 3]])
    with pytest.raises(ValueError, match="params have 4 layers but the configured model has"):
        setup_lib.train_state_from_params(
            setup_lib.build(tiny_config("--model.num_layers=6"), natural.mesh), params)


def test_imported_weights_of_a_model_with_dense_first_layers_start_a_run():
    """An MoE model with dense first layers keeps them in `dense_blocks`: its `blocks` rows are
    its MoE layers (an HF DeepSeek-V3 import starts a run from such params)."""
    import jax
    from flax import nnx

    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from util import TINY_MOE, tiny_config
    one = jax.devices()[:1]
    cfg = tiny_config(*TINY_MOE, "--model.num_layers=3", "--model.moe.first_k_dense=1")
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, one))
    params = jax.tree.map(lambda a: np.full(a.shape, 0.5, a.dtype),
                          nnx.to_pure_dict(setup.abstract_state))
    state = setup_lib.train_state_from_params(setup, params)
    np.testing.assert_array_equal(np.asarray(state.params["dense_blocks"]["mlp"]["w_up"]["kernel"]),
                                  params["dense_blocks"]["mlp"]["w_up"]["kernel"])
    deeper = tiny_config(*TINY_MOE, "--model.num_layers=4", "--model.moe.first_k_dense=1")
    with pytest.raises(ValueError, match=r"params have 2 MoE layers but the configured model "
                       r"has model.num_layers=4 \(3 of them MoE\)"):
        setup_lib.train_state_from_params(
            setup_lib.build(deeper, sharding.make_mesh(deeper.parallel, one)), params)

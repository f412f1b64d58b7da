"""The MoE recipes: tiny_moe's model and optimizer train on a CPU with falling loss (the model
driven directly, to read its router statistics; train.py's MoE runs are
test_expert_parallel.py's), and both recipes validate.
The Mixtral recipe's planner numbers are test_docs.py's, its ledger test_ledger_moe.py's."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain import optim
from jaxtrain.config import load_recipe
from jaxtrain.model import llama as model_lib
from jaxtrain.model import loss as loss_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_both_moe_recipes_validate():
    for name in ("tiny_moe", "mixtral_8x7b"):
        cfg = load_recipe(ROOT / "configs" / f"{name}.py").validate()
        assert all(cfg.model.moe_layers)


def test_tiny_moe_trains_with_falling_loss():
    """Twenty steps of the recipe's model and optimizer on text bytes (two sequences of this
    repository's design notes): the token loss falls well below its start and the router's
    load-balancing loss stays near 1 (balanced) per layer."""
    cfg = load_recipe(ROOT / "configs" / "tiny_moe.py")
    text = (ROOT / "docs" / "design.md").read_bytes()[:2 * (cfg.train.seq_len + 1)]
    rows = np.frombuffer(text, np.uint8).astype(np.int32).reshape(2, -1)
    inputs, targets = jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])
    model = model_lib.Llama(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optim.make_optimizer(cfg.train)   # the recipe's AdamW, warmup and clipping
    opt_state = tx.init(params)

    def loss_fn(p):
        logits, stats = nnx.merge(graphdef, p)(inputs)
        ce, tokens = loss_lib.cross_entropy_sum(logits, targets, jnp.ones_like(targets))
        return ce / tokens, stats

    @jax.jit
    def step(p, s):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, stats

    losses = []
    for _ in range(20):
        params, opt_state, loss, stats = step(params, opt_state)
        losses.append(float(loss))
    print("tiny_moe losses:", [round(x, 3) for x in losses])
    assert losses[-1] < 0.6 * losses[0], losses
    assert float(stats.layers) == cfg.model.num_layers
    assert 0.9 < float(stats.load_balancing_loss) / cfg.model.num_layers < 1.5

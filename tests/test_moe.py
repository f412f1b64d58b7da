"""The MoE layer against references: a dense one that runs every expert on every token, the
published loss formulas, a hand-built capacity case, and (for the Llama) the same layers run
one by one outside the grouped scans."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ModelConfig, MoeConfig, RematConfig
from jaxtrain.model import llama as model_lib
from jaxtrain.model import loss as loss_lib
from jaxtrain.model import moe
from util import random_model_params

F32 = jnp.float32
CFG = ModelConfig(vocab_size=128, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  mlp_size=24, max_seq_len=32, compute_dtype="float32",
                  moe=MoeConfig(num_experts=4, top_k=2, mlp_size=32, aux_loss_coeff=0.0))


def _layer(cfg, shared=False):
    """A MoE layer (with shared experts when asked) as (graphdef, state), params ~ N(0, 1/D)."""
    ops = model_lib.Ops()
    mlp = (lambda r: model_lib.Mlp(cfg, ops, r, size=cfg.shared_mlp_size,
                                   name="blocks/moe/shared")) if shared else None
    layer = moe.MoeLayer(cfg, ops, nnx.Rngs(0), shared=mlp(nnx.Rngs(1)) if shared else None)
    return nnx.split(layer)


def _x(b=2, s=12, d=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (b, s, d), F32)


def _dense_reference(x_TD, p, e: MoeConfig):
    """Every expert on every token, weighted by the router (Mixtral's formula: softmax over
    the top-k logits; pre_softmax: the top-k of the full softmax)."""
    logits_TE = x_TD @ p["router"]
    if e.pre_softmax:
        w_TK, idx_TK = jax.lax.top_k(jax.nn.softmax(logits_TE), e.top_k)
    else:
        top_TK, idx_TK = jax.lax.top_k(logits_TE, e.top_k)
        w_TK = jax.nn.softmax(top_TK)
    t = x_TD.shape[0]
    combine_TE = jnp.zeros(logits_TE.shape).at[jnp.arange(t)[:, None], idx_TK].set(w_TK)
    gate = jnp.einsum("td,edf->tef", x_TD, p["w_gate"])
    up = jnp.einsum("td,edf->tef", x_TD, p["w_up"])
    out_TED = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, p["w_down"])
    return jnp.einsum("te,ted->td", combine_TE, out_TED)


def _grads(fn, *args):
    return jax.jit(jax.grad(fn, argnums=tuple(range(len(args)))))(*args)


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_dropless_output_and_gradients_equal_the_dense_reference(pre_softmax):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, pre_softmax=pre_softmax))
    graphdef, state = _layer(cfg)
    x = _x()
    ct = jax.random.normal(jax.random.key(9), x.shape, F32)

    def ours(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] * ct)

    def reference(state, x):
        p = nnx.to_pure_dict(state)
        return jnp.sum(_dense_reference(x.reshape(-1, 16), p, cfg.moe).reshape(x.shape) * ct)

    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x)
    p = nnx.to_pure_dict(state)
    _close(y, _dense_reference(x.reshape(-1, 16), p, cfg.moe).reshape(x.shape))
    assert float(jnp.abs(y).max()) > 0.1
    _close(_grads(ours, state, x), _grads(reference, state, x))


def test_shared_experts_add_a_dense_swiglu_every_token_sees():
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, shared_experts=2,
                                                           shared_mlp_size=8))
    assert cfg.shared_mlp_size == 16
    graphdef, state = _layer(cfg, shared=True)
    x = _x()
    y = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x)
    p = nnx.to_pure_dict(state)
    sh = p["shared"]
    shared = (jax.nn.silu(x @ sh["w_gate"]["kernel"]) * (x @ sh["w_up"]["kernel"])) @ \
        sh["w_down"]["kernel"]
    _close(y, _dense_reference(x.reshape(-1, 16), p, cfg.moe).reshape(x.shape) + shared)


def _capacity_case(policy: str, pad: bool):
    """8 tokens, 2 experts, top-1, capacity ceil(8·1/2·0.5) = 2. Tokens 0-4 prefer expert 0
    by logit margins 1, 3, 2, 5, 4; tokens 5-7 expert 1 by 1, 6, 2."""
    e = MoeConfig(num_experts=2, top_k=1, pre_softmax=True, mlp_size=32, dispatch="capacity",
                  capacity_factor=0.5, drop_policy=policy, pad_to_capacity=pad,
                  aux_loss_coeff=0.0)
    cfg = dataclasses.replace(CFG, moe=e)
    graphdef, state = _layer(cfg)
    p = nnx.to_pure_dict(state)
    p["router"] = np.zeros((16, 2), np.float32)
    p["router"][0] = [0.5, -0.5]                   # logit margin = x[0]
    nnx.replace_by_pure_dict(state, p)
    x = np.array(_x(1, 8))
    x[0, :, 0] = [1, 3, 2, 5, 4, -1, -6, -2]
    y, stats = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(x))
    kept = np.abs(np.asarray(y[0])).max(axis=1) > 0
    full = _dense_reference(jnp.asarray(x[0]), nnx.to_pure_dict(state), e)
    np.testing.assert_allclose(np.asarray(y[0])[kept], np.asarray(full)[kept], atol=1e-5)
    return set(np.flatnonzero(~kept)), float(moe.summary(stats, 8)["moe_dropped_fraction"])


@pytest.mark.parametrize("pad", [False, True], ids=["sorted", "padded"])
@pytest.mark.parametrize("policy,dropped", [
    ("probs", {0, 1, 2, 5}),      # expert 0 keeps margins 5 and 4, expert 1 keeps 6 and 2
    ("position", {2, 3, 4, 7}),   # each expert keeps its first two tokens
])
def test_capacity_drops_exactly_the_tokens_its_policy_names(policy, dropped, pad):
    got, fraction = _capacity_case(policy, pad)
    assert got == dropped
    assert fraction == 0.5


def test_capacity_is_megatrons():
    e = MoeConfig(num_experts=8, top_k=2, capacity_factor=1.25)
    assert moe.capacity(4096, e) == 1280      # ceil(4096·2/8·1.25)
    assert moe.capacity(10, dataclasses.replace(e, capacity_factor=1.0)) == 3


def test_losses_equal_their_published_formulas():
    rng = np.random.default_rng(0)
    t, e, k = 40, 4, 2
    logits = rng.standard_normal((t, e)).astype(np.float32) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    top = np.argsort(-logits, axis=1)[:, :k]
    # Switch (Fedus et al.) with top-k, as Megatron normalises it: E·Σ_i f_i·P_i with f_i the
    # fraction of the T·k assignments that go to expert i and P_i its mean probability.
    f = np.array([(top == i).sum() for i in range(e)]) / (t * k)
    P = probs.mean(0)
    counts = moe.tokens_per_expert(jnp.asarray(top), e)
    np.testing.assert_allclose(moe.load_balancing_loss(jnp.asarray(probs), counts, k),
                               e * np.sum(f * P), rtol=1e-6)
    # ST-MoE (Zoph et al.): (1/T)·Σ_t (log Σ_e exp(l_te))²
    np.testing.assert_allclose(moe.z_loss(jnp.asarray(logits)),
                               np.mean(np.log(np.exp(logits).sum(1)) ** 2), rtol=1e-6)
    # balanced: uniform probabilities and every expert chosen equally often -> exactly 1
    uniform = jnp.full((8, 4), 0.25)
    balanced = moe.tokens_per_expert(jnp.asarray([[0, 1], [2, 3]] * 4), 4)
    assert float(moe.load_balancing_loss(uniform, balanced, 2)) == pytest.approx(1.0)


def test_load_statistics_are_the_per_expert_counts():
    experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [3, 0]])    # counts 4, 2, 1, 1
    routing = moe.Routing(experts, jnp.full((4, 2), 0.5), jnp.full((4, 4), 0.25),
                          jnp.zeros((4, 4)))
    st = moe.layer_stats(routing, MoeConfig(num_experts=4, top_k=2), dropped=2)
    counts = np.array([4, 2, 1, 1])
    out = moe.summary(st + st, tokens=8)
    assert float(out["moe_load_max"]) == pytest.approx(2.0)
    assert float(out["moe_load_min"]) == pytest.approx(0.5)
    assert float(out["moe_load_cv"]) == pytest.approx(counts.std() / counts.mean())
    assert float(out["moe_dropped_fraction"]) == pytest.approx(0.25)
    assert float((st + st).layers) == 2


def test_the_aux_losses_reach_the_gradients_with_seed_one():
    """The attached term's gradient is that of T·(aux·lb + z·zl) added to the summed loss,
    whatever scales the output's cotangent."""
    e = dataclasses.replace(CFG.moe, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    graphdef, state = _layer(dataclasses.replace(CFG, moe=e))
    plain_def, _ = _layer(CFG)                      # same params, no losses attached
    x = _x()
    ct = jax.random.normal(jax.random.key(9), x.shape, F32)

    def attached(state):
        return 3.0 * jnp.sum(nnx.merge(graphdef, state)(x)[0] * ct)

    def explicit(state):
        y = nnx.merge(plain_def, state)(x)[0]
        p = nnx.to_pure_dict(state)
        logits = x.reshape(-1, 16) @ p["router"]
        top = jax.lax.top_k(logits, 2)[1]
        lb = moe.load_balancing_loss(jax.nn.softmax(logits), moe.tokens_per_expert(top, 4), 2)
        return 3.0 * jnp.sum(y * ct) + 24 * (0.1 * lb + 0.01 * moe.z_loss(logits))

    g = _grads(attached, state)[0]
    _close(g, _grads(explicit, state)[0])
    no_aux = _grads(lambda s: 3.0 * jnp.sum(nnx.merge(plain_def, s)(x)[0] * ct), state)[0]
    assert float(jnp.abs(g["router"] - no_aux["router"]).max()) > 1e-4   # the test can fail


# ----------------------------------------------------------------------------- in the Llama
# The scanned groups against the layers one by one, each MoE layer as the dense reference with
# its losses added to the objective by hand: logits, stats and gradients agree, so the
# stacking maps rows right and the attached losses reach the gradients through the scans.

# (layers, moe keys, MoE layers): groups (moe, dense)x1 + (moe,)x1; (dense,)x1 + (moe,)x2.
# Every layer MoE is the second's last group (and Mixtral's HF parity, test_hf_mixtral.py).
PATTERNS = {
    "every_2nd": (3, dict(layer_freq=2), 2),
    "first_1_dense": (3, dict(first_k_dense=1), 2),
}


def _moe_llama(ops=model_lib.Ops(), num_layers=3, **moe_kw):
    e = dataclasses.replace(CFG.moe, aux_loss_coeff=0.05, z_loss_coeff=0.01, shared_experts=1,
                            **moe_kw)
    cfg = dataclasses.replace(CFG, num_layers=num_layers, moe=e)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0),
                                                                       ops=ops)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, random_model_params(cfg)))
    return cfg, (graphdef, state)


def _one_by_one(graphdef, state, tokens):
    """The Llama's layers in model order, each from its own stack's row, no scan; an MoE layer's
    experts as the dense reference, its shared experts and losses spelled out. Returns
    (logits, stats, the loss terms the attached gradients stand for)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    kinds = cfg.moe_layers
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = model_lib.rope_tables(cfg, positions)
    seg = jnp.ones_like(tokens)
    x = model.embed_tokens(tokens)
    stats, terms, seen = moe.MoeStats.zeros(), 0.0, {True: 0, False: 0}
    for kind in kinds:
        stack = model.blocks if kind else model.dense_blocks
        g, rows = nnx.split(stack)
        block = nnx.merge(g, jax.tree.map(lambda a: a[seen[kind]], rows))
        seen[kind] += 1
        x = x + block.attn(block.attn_norm(x), cos, sin, seg)
        h = block.mlp_norm(x)
        if not kind:
            x = x + block.mlp(h)
            continue
        p = nnx.to_pure_dict(nnx.state(block.moe))
        h_TD = h.reshape(-1, cfg.hidden_size)
        y = _dense_reference(h_TD, p, cfg.moe).reshape(h.shape)
        x = x + y + block.moe.shared(h)
        st = moe.layer_stats(moe.route(h_TD, p["router"], cfg.moe), cfg.moe, 0.0, h.shape[0])
        stats, terms = stats + st, terms + st.loss
    return model.logits(x), jax.tree.map(jax.lax.stop_gradient, stats), terms


def _loss(forward):
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 128)

    def fn(state):
        logits, stats, *terms = forward(state, tokens)
        ce = loss_lib.cross_entropy_sum(logits, tokens, jnp.ones_like(tokens))[0]
        return ce + sum(terms), stats
    return fn


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_llama_with_moe_layers_equals_the_dense_reference_layer_by_layer(pattern):
    num_layers, moe_kw, moe_layers = PATTERNS[pattern]
    cfg, (graphdef, state) = _moe_llama(num_layers=num_layers, **moe_kw)
    assert sum(cfg.moe_layers) == moe_layers
    scanned = _loss(lambda s, t: nnx.merge(graphdef, s)(t))
    reference = _loss(lambda s, t: _one_by_one(graphdef, s, t))   # CE + the terms, explicitly
    (loss, stats), grads = jax.jit(jax.value_and_grad(scanned, has_aux=True))(state)
    (ref_loss, ref_stats), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(state)
    _close(loss, ref_loss - ref_stats.loss)   # the attached terms add no value, only gradients
    _close(stats, ref_stats)
    assert float(stats.layers) == sum(cfg.moe_layers) and float(stats.loss) > 0
    _close(grads, ref_grads)


def test_remat_runners_carry_the_stats():
    """Full recompute (the trainer's checkpointed scans: the MoE group's carries (x, stats),
    the one-layer dense group's x alone, fenced) gives the plain scan's loss, statistics and
    gradients."""
    from jaxtrain.parallel import remat
    results = []
    for r in (RematConfig(), RematConfig(granularity="full", method="uniform", num_layers=1)):
        _, (graphdef, state) = _moe_llama(model_lib.Ops(run_layers=remat.layer_runner(r)),
                                          first_k_dense=1)
        fn = _loss(lambda s, t: nnx.merge(graphdef, s)(t))
        results.append(jax.jit(jax.value_and_grad(fn, has_aux=True))(state))
    for other in results[1:]:
        _close(other, results[0])


def test_moe_model_refuses_fp8_with_bf16_layer_ranges():
    from jaxtrain.config import Fp8Config
    from jaxtrain.model import fp8
    ops = model_lib.Ops(fp8=fp8.Fp8Converter.of(Fp8Config(enabled=True, bf16_first_layers=1)))
    with pytest.raises(ValueError, match="runs every layer in FP8"):
        nnx.eval_shape(lambda: _moe_llama(ops))

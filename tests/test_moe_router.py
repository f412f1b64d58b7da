"""DeepSeek-V3's router (model/router.py) and auxiliary-loss-free balancing (model/moe_balance.py):
the choice against a numpy transcription of transformers' DeepseekV3 gate, the bias steering
the choice only (never the weights, never the gradient), the bias update balancing a skewed
router, the sequence-wise loss against its formula, the bias through the train step on 8 ranks
as on one device, and through train.py's checkpoints bit for bit."""
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import step, trainer
from jaxtrain.checkpoint import read_saved_params
from jaxtrain.config import ConfigError, ModelConfig, MoeConfig, load_config
from jaxtrain.executors import setup as setup_lib
from jaxtrain.model import llama as model_lib
from jaxtrain.model import moe, moe_balance, router
from jaxtrain.parallel import sharding
from util import (logged_losses, metric_records, random_batch, random_params, tiny_moe_config,
                  train_on_one_device)

ROOT = pathlib.Path(__file__).resolve().parents[1]
F32 = jnp.float32
SIGMOID = MoeConfig(num_experts=16, top_k=4, score_function="sigmoid", n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, expert_bias=True, aux_loss_coeff=0.0)


def _hf_deepseek_v3_gate(logits, bias, top_k, n_group, topk_group, norm, scale,
                         score=lambda z: 1.0 / (1.0 + np.exp(-z))):
    """transformers' DeepseekV3MoE.route_tokens_to_experts, in numpy (fp32); `score`: the
    sigmoid there."""
    t, e = logits.shape
    scores = score(logits)
    choice = scores + bias[None]
    group_scores = np.sort(choice.reshape(t, n_group, e // n_group), axis=-1)[..., -2:].sum(-1)
    group_idx = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros((t, n_group))
    np.put_along_axis(group_mask, group_idx, 1.0, axis=1)
    score_mask = np.repeat(group_mask, e // n_group, axis=1)
    tmp = np.where(score_mask > 0, choice, 0.0)
    idx = np.argsort(-tmp, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(scores, idx, axis=1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * scale


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_group_limited_routing_equals_the_hf_deepseek_v3_gate(norm):
    e = dataclasses.replace(SIGMOID, norm_topk_prob=norm)
    x = jax.random.normal(jax.random.key(0), (64, 8), F32)
    w = jax.random.normal(jax.random.key(1), (8, 16), F32)
    bias = 0.3 * jax.random.uniform(jax.random.key(2), (16,), F32)  # positive: HF masks with 0
    got = router.route(x, w, e, bias)
    idx, want_w = _hf_deepseek_v3_gate(np.asarray(x @ w), np.asarray(bias), 4, 4, 2, norm, 2.5)
    np.testing.assert_array_equal(np.sort(np.asarray(got.experts_TK), 1), np.sort(idx, 1))
    order = np.argsort(idx, 1)   # compare weights expert by expert
    got_order = np.argsort(np.asarray(got.experts_TK), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got.weights_TK), got_order, 1),
                               np.take_along_axis(want_w, order, 1), rtol=1e-6)
    if norm:
        np.testing.assert_allclose(np.asarray(got.weights_TK).sum(-1), 2.5, rtol=1e-6)
    groups = np.asarray(got.experts_TK) // 4   # every token's experts lie in <= 2 groups
    assert max(len(set(g)) for g in groups.tolist()) <= 2
    # the bias steers: without it the choice differs for some tokens, the weights' scores not
    plain = router.route(x, w, e, jnp.zeros(16))
    assert (np.sort(plain.experts_TK, 1) != np.sort(got.experts_TK, 1)).any()


def test_the_softmax_router_limits_groups_the_same_way():
    """score_function=softmax with groups (DeepSeek-V2's device-limited routing): the same
    choice on the softmax probabilities, the top-k renormalised (pre_softmax=false)."""
    e = dataclasses.replace(SIGMOID, score_function="softmax", expert_bias=False,
                            routed_scaling_factor=1.0)
    x = jax.random.normal(jax.random.key(0), (64, 8), F32)
    w = jax.random.normal(jax.random.key(1), (8, 16), F32)
    got = router.route(x, w, e)
    softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(  # noqa: E731
        z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    idx, want_w = _hf_deepseek_v3_gate(np.asarray(x @ w), np.zeros(16), 4, 4, 2, True, 1.0,
                                       softmax)
    np.testing.assert_array_equal(np.sort(np.asarray(got.experts_TK), 1), np.sort(idx, 1))
    np.testing.assert_allclose(np.sort(np.asarray(got.weights_TK), 1), np.sort(want_w, 1),
                               rtol=1e-5)


def _layer_loss_fns(cfg):
    """(layer loss of (params, bias), the same with the bias a constant and a plain jnp choice):
    the MoE layer's summed output, and a dense reference of it (every expert on every token)."""
    layer = moe.MoeLayer(cfg, model_lib.Ops(), nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(3), (2, 16, cfg.hidden_size), F32)
    r = jax.random.normal(jax.random.key(4), x.shape, F32)

    def layer_loss(p, bias):
        s = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(s, {**p, "expert_bias": bias})
        return jnp.sum(nnx.merge(graphdef, s)(x)[0] * r)

    def reference_loss(p, bias):
        e = cfg.moe
        x_TD = x.reshape(-1, x.shape[-1])
        scores = jax.nn.sigmoid(x_TD @ p["router"])
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores) + bias, e.top_k)   # no groups
        wk = jnp.take_along_axis(scores, idx, 1)
        wk = wk / jnp.sum(wk, -1, keepdims=True) * e.routed_scaling_factor
        combine = jnp.zeros(scores.shape).at[jnp.arange(x_TD.shape[0])[:, None], idx].set(wk)
        h = jax.nn.silu(jnp.einsum("td,edf->tef", x_TD, p["w_gate"])) * jnp.einsum(
            "td,edf->tef", x_TD, p["w_up"])
        y = jnp.einsum("te,ted->td", combine, jnp.einsum("tef,efd->ted", h, p["w_down"]))
        return jnp.sum(y.reshape(x.shape) * r)
    return layer_loss, reference_loss, {k: v for k, v in params.items() if k != "expert_bias"}


def test_the_bias_steers_the_choice_only_and_never_enters_the_gradient():
    cfg = ModelConfig(vocab_size=128, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      mlp_size=24, max_seq_len=32, compute_dtype="float32",
                      moe=dataclasses.replace(SIGMOID, num_experts=8, top_k=2, n_group=1,
                                              topk_group=1, mlp_size=32))
    layer_loss, reference_loss, params = _layer_loss_fns(cfg)
    bias = 0.2 * jax.random.normal(jax.random.key(5), (8,), F32)
    loss, (g_params, g_bias) = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1)))(
        params, bias)
    want, want_g = jax.jit(jax.value_and_grad(reference_loss))(params, bias)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for name in want_g:   # the params' gradients are those with the bias a constant
        np.testing.assert_allclose(g_params[name], want_g[name], atol=1e-5, rtol=1e-5,
                                   err_msg=name)
    # the bias's cotangent slot holds the layer's tokens per expert, not a gradient ...
    assert float(jnp.sum(g_bias)) == 2 * 16 * 2 and np.all(np.asarray(g_bias) % 1 == 0)
    # ... which the contract takes out: the gradient the optimizer sees is 0 there
    loads, grads = moe_balance.take_loads({"blocks": {"moe": {"expert_bias": g_bias,
                                                              "router": g_params["router"]}}})
    np.testing.assert_array_equal(loads["blocks"]["moe"]["expert_bias"], g_bias)
    assert loads["blocks"]["moe"]["router"] is None
    assert not np.any(grads["blocks"]["moe"]["expert_bias"])


def _cv(load):
    return float(np.std(load) / np.mean(load))


def test_the_bias_update_moves_a_skewed_router_toward_balance():
    """A router whose logits favour the low experts (an offset of 3 down to 0 across the 8),
    groups on: 60 sign updates at rate 0.01 from the loads the backward carries bring the
    per-expert load's coefficient of variation from ~1.0 to ~0.1 (the sign rule then cycles
    around balance: the worst of the last 10 steps is compared)."""
    e = dataclasses.replace(SIGMOID, num_experts=8, top_k=2, n_group=2, topk_group=1,
                            routed_scaling_factor=1.0)
    x = jax.random.normal(jax.random.key(0), (512, 16), F32).at[:, 0].set(1.0)
    w = (0.3 * jax.random.normal(jax.random.key(1), (16, 8), F32)).at[0].set(
        jnp.linspace(3.0, 0.0, 8))

    def loads(bias):   # what train_step gets: the bias's cotangent of any loss of the weights
        return jax.grad(lambda b: jnp.sum(router.route(x, w, e, b).weights_TK))(bias)

    @jax.jit
    def run(bias):
        def body(b, _):
            load = loads(b)
            return moe_balance.update({"expert_bias": b}, {"expert_bias": load},
                                      0.01)["expert_bias"], load
        return jax.lax.scan(body, bias, None, length=60)
    bias, history = run(jnp.zeros(8))
    cvs = [_cv(h) for h in np.asarray(history)]
    print(f"per-expert load CV: {cvs[0]:.3f} at step 0 -> worst of steps 50-59 "
          f"{max(cvs[-10:]):.3f} (bias {np.round(np.asarray(bias), 2)})")
    assert cvs[0] > 0.8 and max(cvs[-10:]) < 0.2 * cvs[0]
    np.testing.assert_array_equal(history[0], router.tokens_per_expert(
        router.route(x, w, e, jnp.zeros(8)).experts_TK, 8))   # the loads are the counts


def test_the_sequence_wise_loss_is_deepseek_v3s_formula_and_joins_the_loss():
    e = dataclasses.replace(SIGMOID, expert_bias=False, seq_aux_loss_coeff=1e-2)
    b, s = 3, 10
    x = jax.random.normal(jax.random.key(0), (b * s, 8), F32)
    w = jax.random.normal(jax.random.key(1), (8, 16), F32)
    r = router.route(x, w, e)
    got = router.sequence_aux_loss(r.scores_TE, r.experts_TK, b)
    sig = 1 / (1 + np.exp(-np.asarray(x @ w)))
    want = []
    for i in range(b):   # eq. 17-20, one sequence at a time
        rows = slice(i * s, (i + 1) * s)
        chosen = np.zeros((s, 16))
        np.put_along_axis(chosen, np.asarray(r.experts_TK[rows]), 1.0, axis=1)
        f = 16 / (4 * s) * chosen.sum(0)
        p = (sig[rows] / sig[rows].sum(-1, keepdims=True)).mean(0)
        want.append(np.sum(f * p))
    np.testing.assert_allclose(got, np.mean(want), rtol=1e-5)
    stats = moe.layer_stats(r, e, 0.0, b)
    np.testing.assert_allclose(stats.loss, b * s * 1e-2 * np.mean(want), rtol=1e-5)
    assert "moe_seq_aux_loss" in moe.summary(stats, b * s)


BIAS_ARGS = ("--model.moe.score_function=sigmoid", "--model.moe.n_group=4",
             "--model.moe.topk_group=2", "--model.moe.expert_bias=true",
             "--model.moe.bias_update_rate=0.01", "--model.moe.seq_aux_loss_coeff=1e-3",
             "--model.moe.routed_scaling_factor=2.0")


def _bias(params):
    return np.asarray(params["blocks"]["moe"]["expert_bias"])


def _two_steps(*layout):
    """The bias before and after each of two train steps from random_params (its bias
    N(0, 0.1²)) on `layout`, checking on the way that its gradient is 0 and that every device
    holding the same rows of it holds the same values."""
    cfg = tiny_moe_config("--model.vocab_size=512", "--train.global_batch=16", *BIAS_ARGS,
                          *layout)
    p = cfg.parallel
    setup = setup_lib.build(cfg, sharding.make_mesh(p, jax.devices()[
        :p.data * p.fsdp * p.tensor * p.context * p.stage]))
    state = setup_lib.train_state_from_params(setup, random_params(setup))
    _, _, grads, _ = step.make_grad_step(setup)(state.params, random_batch(cfg, 0), {})
    assert not np.any(_bias(jax.device_get(grads)))
    train = step.make_train_step(setup, donate=False)
    biases = [_bias(jax.device_get(state.params))]
    for i in range(2):
        state, _ = train(state, random_batch(cfg, i))
        leaf = state.params["blocks"]["moe"]["expert_bias"]
        by_rows = {}
        for shard in leaf.addressable_shards:
            by_rows.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        for copies in by_rows.values():   # every rank's copy of the same rows is the same
            assert all(np.array_equal(copies[0], c) for c in copies[1:])
        biases.append(_bias(jax.device_get(state.params)))
    return biases


def test_the_train_step_moves_the_bias_alike_on_every_rank_and_as_on_one_device():
    """Experts over 2 of 8 data ranks (2 microbatches, every layer recomputed) against one
    device, from the same params and batches: each step moves every bias entry by +-rate or 0,
    on every rank as on one device."""
    got = _two_steps("--parallel.data=8", "--parallel.expert=2", "--parallel.microbatches=2",
                     "--remat.granularity=full", "--remat.num_layers=1")
    want = _two_steps("--parallel.data=1")
    steps = np.round(np.diff(want, axis=0) / 0.01, 4)
    assert set(np.unique(steps)) <= {-1.0, 0.0, 1.0} and np.any(steps)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("--parallel.data=4", "--parallel.expert=2", "--parallel.stage=2",
     "--parallel.microbatches=2"),
    ("--parallel.data=4", "--parallel.expert=4", "--parallel.fsdp=2", "--parallel.zero1=true"),
    ("--parallel.data=2", "--parallel.expert=2", "--parallel.tensor=2",
     "--parallel.sequence_parallel=true", "--parallel.context=2"),
], ids=["expert2_stage2", "expert4_fsdp2_zero1", "expert2_tensor2_sp_context2"])
def test_other_layouts_move_the_bias_as_on_one_device(layout):
    """Stage 2 (the loads reach the bias through the pipeline executor's gradient sums as
    through the replica executor's), ZeRO-1 (the bias's master sharded), tensor + context:
    the bias as on one device, bit for bit."""
    got = _two_steps(*layout)
    for a, b in zip(got, _two_steps("--parallel.data=1")):
        np.testing.assert_array_equal(a, b)


def test_the_bias_survives_a_restart_bit_for_bit(tmp_path):
    """Steps 1-2 straight, and step 1, a restart, step 2: the bias each checkpoint holds and
    the logged losses are the same bits (the bias moved at each step, so a restart that lost
    it, or restored it as zeros, would differ)."""
    common = ("--train.steps=2", "--checkpoint.every=1", "--checkpoint.async_save=false",
              "--model.vocab_size=512", *BIAS_ARGS)
    trainer.train(tiny_moe_config(*common, workdir=str(tmp_path / "a")))
    stopped = tiny_moe_config(*common, "--train.exit_interval=1", workdir=str(tmp_path / "b"))
    trainer.train(stopped)
    mid = _bias(read_saved_params(tmp_path / "b" / "checkpoints" / "1"))
    assert np.any(mid)
    trainer.train(stopped)   # resumes at 1
    a = _bias(read_saved_params(tmp_path / "a" / "checkpoints" / "2"))
    b = _bias(read_saved_params(tmp_path / "b" / "checkpoints" / "2"))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, mid)
    la, lb = logged_losses(tmp_path / "a"), logged_losses(tmp_path / "b")
    assert sorted(la) == sorted(lb) == [1, 2] and la == lb   # bit-exact


@pytest.mark.parametrize("override, match", [
    ("--model.moe.topk_group=5 --model.moe.n_group=4", r"topk_group=5 > n_group=4.*set "
     r"topk_group <= n_group"),
    ("--model.moe.n_group=3", r"n_group=3 does not divide num_experts=8"),
    ("--model.moe.n_group=4 --model.moe.topk_group=1 --model.moe.top_k=3",
     r"top_k=3 > topk_group=1 x 2 experts per group.*raise topk_group"),
    ("--model.moe.expert_bias=true", r"expert_bias=true with score_function=softmax.*set "
     r"model.moe.score_function=sigmoid"),
])
def test_bad_router_configs_are_refused_in_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny_moe_config(*override.split())
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_expert2_with_the_sigmoid_router_and_the_bias_trains_as_one_device(tmp_path):
    """train.py from the same seed (fp32, 3 steps): experts over 2 of 8 data ranks against one
    device, the loss, the MoE losses and the bias the checkpoint holds."""
    args = ["--train.steps=3", "--train.log_every=1", "--train.eval_every=0",
            "--model.num_layers=2", "--train.seq_len=32", "--data.corpus_max_bytes=400000",
            "--checkpoint.async_save=false", "--model.vocab_size=512",
            "--model.moe.num_experts=8", "--model.moe.top_k=2", "--model.moe.mlp_size=32",
            "--model.moe.aux_loss_coeff=0", *BIAS_ARGS]
    train_on_one_device("configs/tiny.py", args, tmp_path / "one")
    trainer.train(load_config(ROOT / "configs/tiny.py", [
        *args, "--parallel.data=8", "--parallel.expert=2", f"--train.workdir={tmp_path / 'ep'}"]))
    one, ep = ({r["step"]: r for r in metric_records(tmp_path / d) if "loss" in r}
               for d in ("one", "ep"))
    assert sorted(one) == sorted(ep) == [1, 2, 3]
    for key in ("loss", "moe_seq_aux_loss"):
        np.testing.assert_allclose([ep[s][key] for s in one], [one[s][key] for s in one],
                                   rtol=1e-4, err_msg=key)
    np.testing.assert_array_equal(_bias(read_saved_params(tmp_path / "ep" / "checkpoints" / "3")),
                                  _bias(read_saved_params(tmp_path / "one" / "checkpoints" / "3")))


def test_hf_mixtral_export_refuses_deepseeks_router():
    from jaxtrain.tools.hf_config import HfConversionError, check_mixtral
    with pytest.raises(HfConversionError, match=r"moe.score_function=sigmoid, which HF's "
                       r"Mixtral cannot express"):
        check_mixtral(tiny_moe_config(*BIAS_ARGS).model)

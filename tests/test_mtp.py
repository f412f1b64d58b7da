"""Multi-token prediction (model/mtp.py): its loss against a reference computed here from the
params, the step without it, document boundaries, layouts through train.py against one
device, the refusals, and the ledger's FLOPs against the compiled program's."""
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import config_check, step, trainer
from jaxtrain.config import ConfigError, MtpConfig, load_config
from jaxtrain.executors import setup as setup_lib
from jaxtrain.executors.contract import model_loss
from jaxtrain.model import llama as model_lib
from jaxtrain.model import mtp
from jaxtrain.parallel import sharding
from util import logged_losses, metric_records, model_leaf_count, \
    one_device_grad_step_matmul_flops, random_batch, random_params, tiny_config, \
    train_on_one_device

ROOT = pathlib.Path(__file__).resolve().parents[1]
MTP2 = ("--model.mtp.num_layers=2", "--model.mtp.loss_scaling_factor=0.3")


def _model(cfg, params):
    model = nnx.eval_shape(lambda: model_lib.Llama(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def _params(cfg):
    return random_params(setup_lib.build(cfg, sharding.make_mesh(cfg.parallel,
                                                                 jax.devices()[:1])))


def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _reference(cfg, params, batch, weight):
    """(objective term, mtp_loss total, counted positions per depth): each module run by hand
    from the params (its block through llama.Block), the masks by loops over positions."""
    model = _model(cfg, params)
    m, d = cfg.model, cfg.model.mtp_depths
    tokens, seg = np.asarray(batch["inputs"]), np.asarray(batch["segment_ids"])
    targets, lmask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"])
    b, s = tokens.shape
    emb = jnp.asarray(params["embed"])[tokens]
    h = model.run_blocks(emb, jnp.asarray(batch["positions"]), jnp.asarray(seg))
    cos, sin = model_lib.rope_tables(m, jnp.asarray(batch["positions"]))
    objective, total, counts = 0.0, 0.0, []
    for k in range(1, d + 1):
        p = params["mtp"][f"depth{k}"]
        e_shift = np.zeros_like(np.asarray(emb))
        e_shift[:, :s - k] = np.asarray(emb)[:, k:]
        x = jnp.concatenate([_rms(e_shift, p["enorm"]["scale"], m.norm_eps),
                             _rms(h, p["hnorm"]["scale"], m.norm_eps)], -1)
        x = x @ np.asarray(p["eh_proj"]["kernel"]).reshape(2 * m.hidden_size, m.hidden_size)
        h = getattr(model.mtp, f"depth{k}").block(x, cos, sin, jnp.asarray(seg))
        logits = _rms(h, p["norm"]["scale"], m.norm_eps) @ params["lm_head"]
        logp = np.asarray(jax.nn.log_softmax(logits, -1))
        n = 0
        for r in range(b):
            for i in range(s - k):
                if lmask[r, i + k] and seg[r, i + k] == seg[r, i]:
                    ce = -logp[r, i, targets[r, i + k]]
                    total += ce / d
                    objective += weight * ce / d
                    n += 1
        counts.append(n)
    return objective, total, counts


def test_mtp_loss_equals_the_hand_computed_reference():
    cfg = tiny_config(*MTP2, "--train.global_batch=2", "--train.seq_len=16")
    params = _params(cfg)
    batch = random_batch(cfg, docs_per_row=2)
    weight = 0.3
    mb = {**batch, mtp.WEIGHT_KEY: np.full(batch["loss_mask"].shape, weight, np.float32)}
    out = _model(cfg, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
    objective, sums = model_loss(out, mb)
    main, _ = model_loss(out[0], mb)
    want_obj, want_total, counts = _reference(cfg, params, batch, weight)
    np.testing.assert_allclose(objective - main, want_obj, rtol=2e-5)
    np.testing.assert_allclose(sums.aux["mtp_loss"].total, want_total, rtol=2e-5)
    assert float(sums.aux["mtp_loss"].count) == float(sums.tokens)   # the main normaliser
    # 2 rows x 16: depth k loses k positions at the end and k + 1 at the document boundary
    # (the first document's last target is masked, and k positions see the next document)
    assert counts == [2 * (16 - 1 - 2), 2 * (16 - 2 - 3)]
    assert float(objective - main) > 0


def test_off_the_step_equals_the_model_without_the_module():
    """num_layers=0: the plain model's params and step; lambda 0: the shared params' loss and
    gradients are the plain model's, the modules' gradients 0."""
    plain = tiny_config("--train.global_batch=2", "--train.seq_len=16")
    mesh = sharding.make_mesh(plain.parallel, jax.devices()[:1])
    cfg = tiny_config("--model.mtp.num_layers=1", "--model.mtp.loss_scaling_factor=0",
                      "--train.global_batch=2", "--train.seq_len=16")
    params = _params(cfg)
    base = {k: v for k, v in params.items() if k != "mtp"}
    batch = random_batch(plain)
    off = tiny_config("--model.mtp.num_layers=0", "--train.global_batch=2",
                      "--train.seq_len=16")
    assert "mtp" not in nnx.to_pure_dict(setup_lib.build(off, mesh).abstract_state)

    def run(c, p):
        return step.make_grad_step(setup_lib.build(c, mesh))(p, batch, {})[:3]
    loss0, tokens0, grads0 = run(plain, base)
    loss1, tokens1, grads1 = run(cfg, params)
    loss2, _, grads2 = run(off, base)
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-6) and tokens1 == tokens0
    assert float(loss2) == float(loss0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads0,
                 {k: v for k, v in grads1.items() if k != "mtp"})
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), grads0, grads2)
    assert all(not np.any(g) for g in jax.tree.leaves(grads1["mtp"]))


def test_the_modules_recompute_under_the_stacks_policy_with_the_same_gradients():
    """remat.single_layer_runner runs the MTP block under the stack's policy: full (uniform
    groups of 2, which a block of one cannot form) and selective give the step of none."""
    def run(*remat):
        cfg = tiny_config("--model.mtp.num_layers=1", "--train.global_batch=2",
                          "--train.seq_len=16", *remat)
        setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:1]))
        return step.make_grad_step(setup)(random_params(setup), random_batch(cfg), {})[:3]
    loss0, _, grads0 = run()
    for remat in (("--remat.granularity=full", "--remat.num_layers=2"),
                  ("--remat.granularity=selective", "--remat.modules=core_attn,mlp")):
        loss, _, grads = run(*remat)
        assert float(loss) == pytest.approx(float(loss0), rel=1e-6), remat
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     grads0, grads)


def test_positions_past_a_document_end_do_not_count_or_leak():
    cfg = tiny_config("--model.mtp.num_layers=1", "--train.global_batch=1",
                      "--train.seq_len=16")
    params = _params(cfg)
    s = 16
    seg = np.array([[1] * 6 + [2] * 10], np.int32)
    lmask = np.ones((1, s), np.float32)
    lmask[0, 5] = 0   # the first document's last target is the next document's token
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (1, s + 1)).astype(np.int32)
    pos = np.array([list(range(6)) + list(range(10))], np.int32)
    mb = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "positions": pos, "loss_mask": lmask}
    mask = np.asarray(mtp.depth_mask(mb, 1))[0]
    # depth 1 at i: target t_{i+2}; positions 4 (target across the boundary), 5 (token 6 is in
    # the next document) and 15 (past the end) are out
    assert mask.tolist() == [1, 1, 1, 1, 0, 0] + [1] * 9 + [0]

    def depth_ce(inputs):
        out = _model(cfg, params)(inputs[:, :-1], pos, seg)
        batch = {**mb, "inputs": inputs[:, :-1], "targets": inputs[:, 1:]}
        from jaxtrain.model.loss import token_cross_entropy
        ce = token_cross_entropy(out[1].logits[0], mtp.shift_left(batch["targets"], 1))
        return np.asarray(ce * mtp.depth_mask(batch, 1))[0]
    before = depth_ce(tokens)
    changed = tokens.copy()
    changed[0, 6:] = (changed[0, 6:] + 7) % 256   # the second document's tokens
    after = depth_ce(changed)
    np.testing.assert_array_equal(before[:6], after[:6])   # nothing leaks into document 1
    assert np.any(before[6:] != after[6:])
    total, _ = mtp.losses(mtp.DepthLogits((jnp.zeros((1, s, cfg.model.vocab_size)),)), mb,
                          jnp.float32(15), lambda lg, t: jnp.ones(t.shape))
    assert float(total) == 0.0   # no weight in the batch: evaluation's objective term


def test_schedule_changes_lambda_at_its_steps():
    cfg = tiny_config("--model.mtp.num_layers=1", "--model.mtp.loss_scaling_factor=0.3",
                      "--model.mtp.schedule=10:0.1,20:0")
    f = jax.jit(lambda t: mtp.factor(cfg.model, t))
    assert [float(f(t)) for t in (0, 9, 10, 19, 20, 99)] == pytest.approx(
        [0.3, 0.3, 0.1, 0.1, 0.0, 0.0])


@pytest.mark.parametrize("overrides,n,match", [
    (("--parallel.stage=2",), 2, r"parallel\.stage=2 with model\.mtp\.num_layers=1: .*set "
     r"parallel\.stage=1 or model\.mtp\.num_layers=0"),
    (("--parallel.context=2",), 2, r"parallel\.context=2 with model\.mtp\.num_layers=1: .*set "
     r"parallel\.context=1"),
    (("--fp8.enabled=true",), 1, r"fp8\.enabled=true with model\.mtp\.num_layers>0"),
    (("--model.mtp.schedule=10:0.1,5:0",), 1, r"steps must be positive and increasing"),
    (("--model.mtp.schedule=ten",), 1, r"'ten' is not STEP:FACTOR"),
])
def test_unsupported_mtp_configs_fail_in_one_line(overrides, n, match):
    with pytest.raises(ConfigError, match=match) as e:
        config_check.check(tiny_config("--model.mtp.num_layers=1", *overrides), n)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- through train.py

TRAIN_ARGS = ["--train.steps=3", "--train.log_every=1", "--train.eval_every=0",
              "--model.num_layers=2", "--train.seq_len=32", "--data.corpus_max_bytes=400000",
              "--checkpoint.async_save=false", "--train.global_batch=8", "--model.mtp.num_layers=1",
              "--model.mtp.loss_scaling_factor=0.3", "--model.mtp.schedule=2:0.1"]


def _mtp_losses(workdir):
    return {r["step"]: r["mtp_loss"] for r in metric_records(workdir) if "mtp_loss" in r}


@pytest.mark.slow
def test_mtp_data2_fsdp2_tensor2_trains_as_one_device(tmp_path):
    train_on_one_device("configs/tiny.py", TRAIN_ARGS, tmp_path / "one")
    trainer.train(load_config(ROOT / "configs/tiny.py", [
        *TRAIN_ARGS, "--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2",
        "--parallel.sequence_parallel=true", f"--train.workdir={tmp_path / 'dft'}"]))
    for read in (logged_losses, _mtp_losses):
        want, got = read(tmp_path / "one"), read(tmp_path / "dft")
        assert sorted(got) == sorted(want) == [1, 2, 3]
        np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)],
                                   rtol=1e-4)
    assert logged_losses(tmp_path / "one")[3] < logged_losses(tmp_path / "one")[1]


@pytest.mark.slow
def test_tiny_deepseek_expert4_tensor2_trains_as_one_device(tmp_path):
    args = ["--train.steps=2", "--train.log_every=1", "--train.eval_every=0",
            "--train.seq_len=32", "--train.global_batch=8", "--data.corpus_max_bytes=400000",
            "--checkpoint.async_save=false", "--model.compute_dtype=float32",
            "--model.moe.seq_aux_loss_coeff=0"]
    train_on_one_device("configs/tiny_deepseek.py", args, tmp_path / "one")
    trainer.train(load_config(ROOT / "configs/tiny_deepseek.py", [
        *args, "--parallel.data=4", "--parallel.expert=4", "--parallel.tensor=2",
        f"--train.workdir={tmp_path / 'ep'}"]))
    for read in (logged_losses, _mtp_losses):
        want, got = read(tmp_path / "one"), read(tmp_path / "ep")
        assert sorted(got) == sorted(want) == [1, 2]
        np.testing.assert_allclose([got[s] for s in (1, 2)], [want[s] for s in (1, 2)],
                                   rtol=1e-4)


# ----------------------------------------------------------------------------- ledger

def test_ledger_counts_mtp_params_and_the_compiled_matmul_flops():
    """The ledger's parameters are the model's (the modules included); its full-square model
    FLOPs are every matmul FLOP XLA compiles for the gradient step (the MTP blocks, eh_proj
    and the head once more per module), less the norm weights 6N counts."""
    from jaxtrain.ledger import estimate, layout_from_config, param_counts
    cfg = tiny_config(*MTP2, "--model.num_layers=1", "--train.global_batch=2",
                      "--train.seq_len=32")
    counts = param_counts(cfg.model)
    assert counts.total == model_leaf_count(cfg.model)
    flops = one_device_grad_step_matmul_flops(cfg)
    est = estimate(cfg, layout_from_config(cfg, 1), "cpu", flash=False)
    h = cfg.model.hidden_size
    norms = (counts.per_layer["norms"] * (counts.num_layers + 2) + counts.final_norm
             + 2 * 3 * h)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert flops == pytest.approx(
        est.model_flops_per_step_full_attn - 6 * norms * tokens, rel=1e-6)
    plain = dataclasses.replace(cfg.model, mtp=MtpConfig(num_layers=0))
    assert counts.total - param_counts(plain).total == 2 * (
        sum(counts.per_layer.values()) + 2 * h * h + 3 * h)


def test_hf_export_drops_the_modules(tmp_path, capsys):
    from jaxtrain import weights
    from jaxtrain.tools import hf
    from util import random_model_params
    cfg = tiny_config("--model.mtp.num_layers=1")
    params = random_model_params(cfg.model)
    assert "mtp" in params
    weights.save_params(tmp_path / "ours", params, cfg)
    hf.export_hf(tmp_path / "ours", tmp_path / "hf")
    assert "dropping the 1 multi-token prediction module(s)" in capsys.readouterr().err
    exported = weights.read_safetensors(tmp_path / "hf" / "model.safetensors")
    plain = {k: v for k, v in params.items() if k != "mtp"}
    want = hf.params_to_hf(plain, dataclasses.replace(cfg.model, mtp=None))
    assert set(exported) == set(want)
    assert all(np.array_equal(exported[k], want[k]) for k in want)

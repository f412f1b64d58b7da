"""Multi-head latent attention (model/mla.py): against a reference written here from
DeepSeek-V3's formulas (K/V up-projected explicitly, per head), with and without the query's
low-rank path; the cores that take its value head size; through train.py, tensor 2 against
one device; and its bad inputs."""
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import trainer
from jaxtrain.config import ConfigError, MlaConfig, ModelConfig, load_config
from jaxtrain.model import attention as attention_lib
from jaxtrain.model import llama as model_lib
from jaxtrain.model import mla
from util import logged_losses, model_leaf_count, one_device_grad_step_matmul_flops, \
    train_on_one_device

F32 = jnp.float32
H, D, NOPE, ROPE, VDIM, KV_RANK, Q_RANK = 4, 32, 8, 4, 6, 12, 10


def _cfg(q_lora_rank=0, **mla_kw):
    return ModelConfig(vocab_size=128, hidden_size=D, num_layers=2, num_heads=H, num_kv_heads=H,
                       mlp_size=48, max_seq_len=32, compute_dtype="float32",
                       mla=MlaConfig(q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
                                     qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                     v_head_dim=VDIM, **mla_kw))


def _rms(x, scale, eps=1e-5):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x, pos, cfg):
    """Rotate-half RoPE over x's last dim, written out from the frequencies: plain, or YaRN's
    (rope_frequencies, checked against transformers' in test_hf_deepseek) with cos/sin times
    its attention factor."""
    half = x.shape[-1] // 2
    inv = 1.0 / (10000.0 ** (np.arange(0, 2 * half, 2) / (2 * half)))
    if cfg.mla.yarn:
        inv = model_lib.rope_frequencies(cfg)
    ang = pos[:, None] * inv[None]                       # [S, half]
    factor = cfg.mla.attention_factor
    cos, sin = factor * jnp.cos(ang)[None, :, None], factor * jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _reference(p, x, seg, cfg):
    """DeepSeek-V3's attention with K and V up-projected per head, a plain masked softmax."""
    a = cfg.mla
    s = x.shape[1]
    pos = jnp.arange(s, dtype=F32)
    if a.q_lora_rank:
        q = jnp.einsum("bsr,rhe->bshe", _rms(x @ p["wq_a"]["kernel"], p["q_norm"]["scale"]),
                       p["wq_b"]["kernel"])
    else:
        q = jnp.einsum("bsd,dhe->bshe", x, p["wq"]["kernel"])
    kv = x @ p["wkv_a"]["kernel"]
    latent, k_pe = kv[..., :a.kv_lora_rank], kv[..., a.kv_lora_rank:]
    kvb = jnp.einsum("bsc,chg->bshg", _rms(latent, p["kv_norm"]["scale"]), p["wkv_b"]["kernel"])
    k_nope, v = kvb[..., :NOPE], kvb[..., NOPE:]
    q = jnp.concatenate([q[..., :NOPE], _rope(q[..., NOPE:], pos, cfg)], -1)
    k_pe = _rope(k_pe[:, :, None, :], pos, cfg)
    k = jnp.concatenate([k_nope, jnp.repeat(k_pe, H, axis=2)], -1)
    scale = (NOPE + ROPE) ** -0.5 * a.softmax_mscale
    scores = jnp.einsum("bshe,bthe->bhst", q, k) * scale
    mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((s, s), bool))[None]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), -1)
    o = jnp.einsum("bhst,bthf->bshf", probs, v)
    return jnp.einsum("bshf,hfd->bsd", o, p["wo"]["kernel"])


def _module(cfg, attention=attention_lib.xla_attention):
    layer = mla.LatentAttention(cfg, model_lib.Ops(attention=attention), nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda v: jnp.asarray(
        1.0 + 0.2 * rng.standard_normal(v.shape) if v.ndim == 1
        else 0.3 * rng.standard_normal(v.shape), F32), nnx.to_pure_dict(state))
    return graphdef, state, params


def _apply(graphdef, state, params, x, seg, cfg):
    nnx.replace_by_pure_dict(state, params)
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = model_lib.rope_tables(cfg, pos)
    return nnx.merge(graphdef, state)(x, cos, sin, seg)


def _inputs(b=2, s=16):
    x = jax.random.normal(jax.random.key(0), (b, s, D), F32)
    seg = jnp.asarray([[1] * s, [1] * 9 + [2] * (s - 9)], jnp.int32)   # packed documents
    return x, seg


# YaRN over a 4-dim rope part trained at 4 positions (the test's 16 reach past it), a ramp
# that keeps pair 0 and interpolates pair 1, an attention factor != 1 (mscale 0.7 / 1)
YARN = dict(yarn_factor=4.0, yarn_original_max_position=4, yarn_beta_fast=0.2,
            yarn_beta_slow=0.05, yarn_mscale=0.7, mscale_all_dim=1.0)


@pytest.mark.parametrize("q_lora_rank,yarn", [(0, False), (Q_RANK, False), (Q_RANK, True)],
                         ids=["plain_q", "q_lora", "q_lora_yarn"])
def test_mla_output_and_gradients_equal_the_explicit_reference(q_lora_rank, yarn):
    cfg = _cfg(q_lora_rank, **(YARN if yarn else {}))
    assert (cfg.mla.softmax_mscale != 1.0) == (cfg.mla.attention_factor != 1.0) == yarn
    if yarn:   # one pair kept, one interpolated
        plain = model_lib.rope_frequencies(_cfg(q_lora_rank))
        np.testing.assert_allclose(model_lib.rope_frequencies(cfg), plain / [1.0, 4.0],
                                   rtol=1e-6)
    graphdef, state, params = _module(cfg)
    x, seg = _inputs()
    ours = lambda p, x: _apply(graphdef, state, p, x, seg, cfg)   # noqa: E731
    ref = lambda p, x: _reference(p, x, seg, cfg)                  # noqa: E731
    np.testing.assert_allclose(ours(params, x), ref(params, x), atol=1e-5, rtol=1e-5)
    cot = jax.random.normal(jax.random.key(2), (2, 16, D), F32)
    g_ours = jax.grad(lambda p, x: jnp.sum(ours(p, x) * cot), argnums=(0, 1))(params, x)
    g_ref = jax.grad(lambda p, x: jnp.sum(ref(p, x) * cot), argnums=(0, 1))(params, x)
    assert jax.tree.structure(g_ours) == jax.tree.structure(g_ref)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_the_pallas_kernel_runs_mla_interpreted():
    """The flash kernel takes v's head size (6) apart from q/k's (12): the same output."""
    cfg = _cfg(Q_RANK)
    graphdef, state, params = _module(cfg, attention_lib.PallasAttention(interpret=True))
    x, seg = _inputs(s=16)
    np.testing.assert_allclose(_apply(graphdef, state, params, x, seg, cfg),
                               _reference(params, x, seg, cfg), atol=1e-5, rtol=1e-5)


def test_mla_weights_shard_heads_over_tensor_and_keep_latents_whole():
    from jaxtrain.parallel import sharding
    cfg = _cfg(Q_RANK)
    state = nnx.state(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))))
    specs = sharding.logical_axes(state)["blocks"]["attn"]
    assert specs["wq_a"]["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "latent")
    assert specs["wkv_b"]["kernel"] == jax.sharding.PartitionSpec("layers", "latent", "heads",
                                                                  "head_dim")
    assert sharding.RULES["latent"] == ("fsdp", None)
    assert sharding.RULES["heads"] == ("tensor", "tensor")


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides,match", [
    (("--model.num_kv_heads=2",), "num_kv_heads=2 != model.num_heads=4"),
    (("--model.head_dim=16",), r"qk_nope_head_dim \+ qk_rope_head_dim = 24"),
    (("--model.mla.qk_rope_head_dim=5",), "qk_rope_head_dim=5 must be even"),
    (("--model.mla.v_head_dim=0",), "v_head_dim=0 must be positive"),
    (("--fp8.enabled=true",), "no FP8 path"),
    (("--model.mla.yarn_factor=0.5",), "yarn_factor=0.5 must be >= 1"),
    (("--model.mla.yarn_factor=40",), "needs model.mla.yarn_original_max_position"),
    (("--model.mla.yarn_factor=40", "--model.mla.yarn_original_max_position=4096",
      "--model.mla.yarn_beta_fast=1"), "beta_fast > beta_slow > 0"),
    (("--model.mla.yarn_factor=40", "--model.mla.yarn_original_max_position=4096",
      "--model.rope_scaling.factor=8"), "both rescale the rope frequencies"),
    (("--model.mla.mscale_all_dim=-1",), "mscale_all_dim=-1.0 and yarn_mscale=0.0 must be >= 0"),
])
def test_inconsistent_mla_configs_fail_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(ROOT / "configs/tiny.py", [*MLA_ARGS, *overrides])
    assert "\n" not in str(err.value)


def test_cores_that_cannot_take_the_value_head_size_refuse_in_one_line():
    bf16 = dataclasses.replace(_cfg(0), compute_dtype="bfloat16")
    with pytest.raises(attention_lib.AttentionConfigError, match="one head size for K and V"):
        attention_lib.select(dataclasses.replace(bf16, attention="cudnn"), "gpu", "9.0")
    big = dataclasses.replace(bf16, attention="mosaic", mla=MlaConfig(
        kv_lora_rank=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=256))
    with pytest.raises(attention_lib.AttentionConfigError, match="v 256") as err:
        attention_lib.select(big, "gpu", "9.0")
    assert "\n" not in str(err.value)
    # auto never picks a core that cannot run the model: the Triton kernel here, which takes
    # these sizes (checked on abstract inputs, as select does before building the model).
    core, why = attention_lib.choose(dataclasses.replace(big, attention="auto"), "gpu", "9.0")
    assert core == "pallas" and "v 256" in why
    attention_lib.select(dataclasses.replace(big, attention="pallas"), "gpu", "9.0")
    # DeepSeek-V3's sizes (q/k 192, v 128) fit the Mosaic kernel.
    v3 = dataclasses.replace(big, attention="auto", mla=MlaConfig(
        kv_lora_rank=8, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128))
    if attention_lib.compat.mosaic_gpu() is not None:
        assert attention_lib.choose(v3, "gpu", "9.0")[0] == "mosaic"
        attention_lib.select(dataclasses.replace(v3, attention="mosaic"), "gpu", "9.0")


# ----------------------------------------------------------------------------- through train.py

ROOT = pathlib.Path(__file__).resolve().parents[1]
MLA_ARGS = ["--model.mla.q_lora_rank=24", "--model.mla.kv_lora_rank=16",
            "--model.mla.qk_nope_head_dim=16", "--model.mla.qk_rope_head_dim=8",
            "--model.mla.v_head_dim=12", "--model.num_kv_heads=4"]
TRAIN_ARGS = ["--train.steps=3", "--train.log_every=1", "--train.eval_every=0",
              "--model.num_layers=2", "--train.seq_len=32", "--data.corpus_max_bytes=400000",
              "--checkpoint.async_save=false", "--train.global_batch=8", *MLA_ARGS]


def test_mla_tensor2_trains_as_one_device(tmp_path):
    train_on_one_device("configs/tiny.py", TRAIN_ARGS, tmp_path / "one")
    want = logged_losses(tmp_path / "one")
    trainer.train(load_config(ROOT / "configs/tiny.py", [
        *TRAIN_ARGS, "--parallel.data=4", "--parallel.tensor=2",
        "--parallel.sequence_parallel=true", f"--train.workdir={tmp_path / 'tp2'}"]))
    got = logged_losses(tmp_path / "tp2")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [want[s] for s in (1, 2, 3)],
                               rtol=1e-4)
    assert want[3] < want[1]


# ----------------------------------------------------------------------------- ledger

def _ledger_cfg(q_lora_rank, b=2, s=64, yarn=False):
    from jaxtrain.config import Config, TrainConfig
    return Config(model=dataclasses.replace(_cfg(q_lora_rank, **(YARN if yarn else {})),
                                            num_layers=1, max_seq_len=s),
                  train=TrainConfig(global_batch=b, seq_len=s)).validate()


@pytest.mark.parametrize("q_lora_rank,yarn", [(0, False), (Q_RANK, False), (Q_RANK, True)],
                         ids=["plain_q", "q_lora", "q_lora_yarn"])
def test_ledger_counts_mla_params_and_the_compiled_matmul_flops(q_lora_rank, yarn):
    """The ledger's parameters are the model's; 6N + 12·L·H·(E+F)/2·s (full square) is every
    matmul FLOP XLA compiles for the gradient step, less the norm weights 6N counts. YaRN
    changes the rope tables only: the same FLOPs as without it, compiled and in the ledger."""
    from jaxtrain.ledger import estimate, layout_from_config, param_counts
    cfg = _ledger_cfg(q_lora_rank, yarn=yarn)
    counts = param_counts(cfg.model)
    assert counts.total == model_leaf_count(cfg.model)
    flops = one_device_grad_step_matmul_flops(cfg)
    est = estimate(cfg, layout_from_config(cfg, 1), "cpu", flash=False)
    per = counts.per_layer
    norms = (per["norms"] + per.get("q_norm", 0) + per["kv_norm"]) * counts.num_layers \
        + counts.final_norm
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert flops == pytest.approx(
        est.model_flops_per_step_full_attn - 6 * norms * tokens, rel=1e-6)
    plain = estimate(_ledger_cfg(q_lora_rank), layout_from_config(cfg, 1), "cpu", flash=False)
    assert est.model_flops_per_step_full_attn == plain.model_flops_per_step_full_attn
    assert est.hfu_flops_per_step_full_attn == plain.hfu_flops_per_step_full_attn


def test_ledger_mla_width_recompute_and_tensor_split():
    from jaxtrain.ledger import latent, recompute_flops_per_token
    from jaxtrain.config import RematConfig
    m = _ledger_cfg(Q_RANK).model
    E, F = NOPE + ROPE, VDIM
    assert latent.attention_width(m) == H * (E + F) / 2
    up = 2 * (Q_RANK * H * E + KV_RANK * H * (NOPE + F))
    own = [recompute_flops_per_token(_ledger_cfg(Q_RANK), RematConfig(
        granularity="selective", modules=modules)) for modules in (
            ("core_attn", "mla_up_proj"), ("core_attn",))]
    assert own[0] - own[1] == up
    whole = D * Q_RANK + Q_RANK + D * (KV_RANK + ROPE) + KV_RANK + 2 * D
    split = Q_RANK * H * E + KV_RANK * H * (NOPE + F) + H * F * D
    assert latent.attention_params_local(m, 2) == whole + split / 2
    assert latent.attention_activation_elements(m, 2) == 2 * (Q_RANK + KV_RANK) + H * (E + F)


def test_mla_up_proj_recomputes_exactly_the_up_projections():
    """remat modules=[mla_up_proj] against modules=[core_attn] (which drops no tag): the
    compiled gradient step runs the q and KV up-projections' forward again, the ledger's
    recompute FLOPs, and nothing else; the gradients are the same."""
    from jaxtrain import step
    from jaxtrain.config import RematConfig
    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.ledger import recompute_flops_per_token
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import hlo
    from jaxtrain.tools.compile_step import CPU_COMPILER_OPTIONS
    from util import random_batch, random_params

    def run(module):
        cfg = dataclasses.replace(_ledger_cfg(Q_RANK), remat=RematConfig(
            granularity="selective", modules=(module,)))
        setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:1]))
        params, batch = random_params(setup), random_batch(cfg, 0)
        fn = step.make_grad_step(setup)
        flops = hlo.matmul_flops(fn.lower(params, batch, {}).compile(
            compiler_options=CPU_COMPILER_OPTIONS))
        return cfg, flops, jax.device_get(fn(params, batch, {})[2])
    cfg, up, g_up = run("mla_up_proj")
    _, base, g_base = run("core_attn")
    tokens = cfg.train.global_batch * cfg.train.seq_len
    core = dataclasses.replace(cfg, remat=RematConfig(granularity="selective",
                                                      modules=("core_attn",)))
    want = (recompute_flops_per_token(cfg) - recompute_flops_per_token(core)) * tokens
    assert want > 0 and up - base == pytest.approx(want, rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_up), jax.tree.leaves(g_base)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- context parallel

def _context_grads(overrides, n_devices, params0=None):
    """(loss, grads, params0) of one grad step of a 1-layer MLA model on n_devices."""
    from jaxtrain import step
    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from util import random_batch, random_params, tiny_config
    cfg = tiny_config(*MLA_ARGS, "--model.vocab_size=512", "--model.num_layers=1", *overrides)
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:n_devices]))
    params0 = random_params(setup) if params0 is None else params0
    out = step.make_grad_step(setup)(jax.device_put(params0, setup.param_shardings),
                                     random_batch(cfg, 0, docs_per_row=3), {})
    return float(out[0]), jax.device_get(out[2]), params0


@pytest.mark.parametrize("overrides,n", [
    (["--parallel.context=2", "--parallel.context_strategy=ring"], 2),
    (["--parallel.context=2", "--parallel.tensor=2", "--parallel.sequence_parallel=true",
      "--model.attention=pallas"], 4),
], ids=["ring_c2", "pallas_all_gather_c2_tensor2_sp"])
def test_mla_under_context_parallelism_equals_one_device(overrides, n):
    """The up-projected K (q/k head size) and V (its own) move between context ranks."""
    want = _context_grads(["--parallel.data=1", "--model.attention=xla"], 1)
    got = _context_grads(["--parallel.data=1", *overrides], n, want[2])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU compile

# q/k 128 = 96 + 32, v 64: DeepSeek-V3's 192 = 128 + 64 / 128 scaled down, sizes the kernels
# take unpadded. (MLA_ARGS's 24-wide q latent makes XLA:GPU's GEMM tiling fail: "Couldn't
# find output tile sizes".)
GPU_DIMS = ("--model.mla.q_lora_rank=64", "--model.mla.kv_lora_rank=32",
            "--model.mla.qk_nope_head_dim=96", "--model.mla.qk_rope_head_dim=32",
            "--model.mla.v_head_dim=64")


@pytest.mark.gpu_compile
@pytest.mark.parametrize("impl", ["pallas", "mosaic", "auto"])
def test_mla_compiles_for_h100_with_each_kernel_that_takes_it(h100, tmp_path, impl):
    """A bf16 MLA model at tensor 2 + SP compiles for compile-only H100s with the kernel each
    choice means in the program (auto: Mosaic, whose limits DeepSeek's sizes fit), and the
    dry run's executed FLOPs read the kernels at MLA's two head sizes: the ledger's count
    (the sequence a multiple of the kernels' blocks, so no padded rows are counted)."""
    from jaxtrain import ledger
    from jaxtrain.tools import pipeline_flops
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import gpu_kernels
    from jaxtrain.tools.compile_step import compile_step
    from util import tiny_config

    def compile_(attention):
        cfg = tiny_config(*MLA_ARGS, *GPU_DIMS, "--model.compute_dtype=bfloat16",
                          "--model.vocab_size=512",
                          "--train.global_batch=16", "--train.seq_len=256",
                          "--model.max_seq_len=256", "--parallel.data=2", "--parallel.fsdp=2",
                          "--parallel.tensor=2", "--parallel.sequence_parallel=true",
                          f"--model.attention={attention}")
        with gpu_kernels.mosaic_dump(tmp_path):
            return cfg, compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8)))
    cfg, out = compile_(impl)
    pallas = gpu_kernels.pallas_kernel_names(out.text)
    mosaic = gpu_kernels.mosaic_kernel_names(out.text)
    assert bool(pallas) == (impl == "pallas") and bool(mosaic) == (impl != "pallas")
    m = cfg.model
    executed = pipeline_flops.executed_matmul_flops(
        out.text, None, head_dims=(m.resolved_head_dim, m.v_head_dim)).mean
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 8), "h100")
    assert executed == pytest.approx(est.hfu_flops_per_step_full_attn / 8, rel=0.03)

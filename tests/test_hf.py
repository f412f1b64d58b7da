"""HF Llama interop: logits match transformers, conversions are exact, errors are clear."""
import dataclasses
import json
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import weights
from jaxtrain.tools import hf
from jaxtrain.model import llama as model_lib
from jaxtrain.config import CheckpointConfig, Config, ModelConfig, RopeScaling, load_recipe
from util import decisive_hf_weights, random_model_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 48  # > original_max_position_embeddings: the llama3 frequency scaling matters
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}


def _hf_model(tied: bool, seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        rope_scaling=dict(ROPE), rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        attn_implementation="eager")
    torch.manual_seed(seed)
    return decisive_hf_weights(transformers.LlamaForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp("tied" if request.param else "untied")
    model.save_pretrained(path)
    return path, model


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (2, SEQ)).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _our_logits(params, cfg: ModelConfig, tokens, real_vocab=None):
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention="xla")
    model = nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0), real_vocab=real_vocab))
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def _assert_bitwise_equal(a: dict, b: dict):
    fa, fb = weights.flatten(a), weights.flatten(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        assert np.array_equal(fa[k].view(np.uint32), fb[k].view(np.uint32)), k


# ----------------------------------------------------------------------------- import

def test_config_from_hf(hf_dir):
    path, model = hf_dir
    hf_config, _ = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    got = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
           cfg.mlp_size, cfg.resolved_head_dim, cfg.max_seq_len)
    assert got == (256, 64, 2, 4, 2, 128, 16, 128)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert cfg.tie_embeddings == model.config.tie_word_embeddings
    assert cfg.norm_eps == 1e-5 and cfg.rope_theta == 10000.0
    # Same RoPE frequencies as transformers computes for this config.
    np.testing.assert_allclose(model_lib.rope_frequencies(cfg),
                               model.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_logits_match_transformers(hf_dir):
    path, model = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    params = hf.params_from_hf(state_dict, cfg)
    assert ("lm_head" in params) == (not cfg.tie_embeddings)
    tokens = _tokens()
    ours, theirs = _our_logits(params, cfg, tokens), _hf_logits(model, tokens)
    assert np.abs(theirs).max() > 1.0  # the comparison is not between near-zero logits
    assert np.abs(ours - theirs).max() <= 1e-4


def test_legacy_and_v5_config_layouts_agree():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 64}
    legacy = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **{
        k: v for k, v in ROPE.items() if k != "rope_type"}}}
    v5 = {**base, "rope_parameters": {**ROPE, "rope_theta": 5e5}}
    assert hf.model_config_from_hf(legacy) == hf.model_config_from_hf(v5)
    plain = hf.model_config_from_hf(base)
    assert plain.rope_scaling is None and plain.num_kv_heads == 2 and plain.rope_theta == 1e4
    odd = hf.model_config_from_hf({**base, "head_dim": 8})  # head_dim != hidden / heads
    assert odd.resolved_head_dim == 8
    assert hf.model_config_from_hf(hf.hf_config_from_model(odd)) == odd


def test_import_pads_vocab_with_zeros(hf_dir):
    path, _ = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    padded = hf.params_from_hf(state_dict, dataclasses.replace(cfg, vocab_size=384))
    exact = hf.params_from_hf(state_dict, cfg)
    assert padded["embed"].shape == (384, 64)
    np.testing.assert_array_equal(padded["embed"][:256], exact["embed"])
    assert not padded["embed"][256:].any()
    if "lm_head" in padded:
        assert padded["lm_head"].shape == (64, 384) and not padded["lm_head"][:, 256:].any()
    # Export strips the padding again: the HF tensors come back bit for bit.
    back = hf.params_to_hf(padded, cfg)
    for name, w in state_dict.items():
        assert np.array_equal(back[name], w), name


# ----------------------------------------------------------------------------- export

def test_export_import_roundtrip_is_bitwise(hf_dir, tmp_path):
    path, _ = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    params = hf.params_from_hf(state_dict, cfg)
    hf.save_hf_checkpoint(tmp_path, params, cfg)
    hf_config2, state_dict2 = hf.load_hf_checkpoint(tmp_path)
    assert hf.model_config_from_hf(hf_config2) == cfg
    assert sorted(state_dict2) == sorted(state_dict)
    for name in state_dict:
        assert np.array_equal(state_dict2[name].view(np.uint32), state_dict[name].view(np.uint32))
    _assert_bitwise_equal(hf.params_from_hf(state_dict2, cfg), params)


def test_export_loads_in_transformers_with_padded_vocab(tmp_path):
    """Our params with a padded vocab (300 real ids in 384 rows), exported in two shards."""
    real = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       mlp_size=128, max_seq_len=128, rope_theta=5e5, norm_eps=1e-5,
                       rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32), compute_dtype="float32")
    padded = dataclasses.replace(real, vocab_size=384)
    params = random_model_params(padded)
    hf.save_hf_checkpoint(tmp_path, params, real, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").float().eval()
    assert model.config.vocab_size == 300
    tokens = np.random.default_rng(1).integers(0, 300, (2, SEQ)).astype(np.int32)
    ours = _our_logits(params, padded, tokens, real_vocab=300)[..., :300]
    theirs = _hf_logits(model, tokens)
    assert np.abs(theirs).max() > 1.0
    assert np.abs(ours - theirs).max() <= 1e-4
    # The sharded export reads back to the same params (the padding rows were dropped).
    _, state_dict = hf.load_hf_checkpoint(tmp_path)
    back = hf.params_from_hf(state_dict, padded)
    np.testing.assert_array_equal(back["embed"][:300], params["embed"][:300])
    np.testing.assert_array_equal(back["blocks"]["attn"]["wq"]["kernel"],
                                  params["blocks"]["attn"]["wq"]["kernel"])


def test_bfloat16_export_reads_back(tmp_path):
    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                      mlp_size=32)
    params = random_model_params(cfg)
    hf.save_hf_checkpoint(tmp_path, params, cfg, dtype="bfloat16")
    hf_config, state_dict = hf.load_hf_checkpoint(tmp_path)
    assert hf_config["torch_dtype"] == "bfloat16"
    assert state_dict["model.embed_tokens.weight"].dtype.name == "bfloat16"
    back = hf.params_from_hf(state_dict, cfg)
    assert back["embed"].dtype == np.float32
    np.testing.assert_allclose(back["embed"], params["embed"], rtol=1e-2)


# ----------------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("errors")
    _hf_model(tied=False, seed=1).save_pretrained(path)
    return hf.load_hf_checkpoint(path)


def test_unsupported_config_is_named(untied):
    hf_config, _ = untied
    bad = {**hf_config, "rope_parameters": {**hf_config["rope_parameters"], "rope_type": "yarn"}}
    with pytest.raises(hf.HfConversionError, match="rope_type='yarn'"):
        hf.model_config_from_hf(bad)
    with pytest.raises(hf.HfConversionError, match="attention_bias"):
        hf.model_config_from_hf({**hf_config, "attention_bias": True})
    with pytest.raises(hf.HfConversionError, match="model_type='mistral'"):
        hf.model_config_from_hf({**hf_config, "model_type": "mistral"})
    no_factor = {k: v for k, v in hf_config["rope_parameters"].items() if k != "low_freq_factor"}
    with pytest.raises(hf.HfConversionError, match="low_freq_factor"):
        hf.model_config_from_hf({**hf_config, "rope_parameters": no_factor})


def test_tensor_problems_are_named(untied):
    hf_config, state_dict = untied
    cfg = hf.model_config_from_hf(hf_config)
    name = "model.layers.1.mlp.up_proj.weight"
    missing = {k: v for k, v in state_dict.items() if k != name}
    with pytest.raises(hf.HfConversionError, match=f"missing tensor '{re.escape(name)}'"):
        hf.params_from_hf(missing, cfg)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    wrong = {**state_dict, k_proj: np.zeros((16, 64), np.float32)}
    shapes = re.escape(f"{k_proj}' has shape (16, 64)") + r".*\(32, 64\)"
    with pytest.raises(hf.HfConversionError, match=shapes):
        hf.params_from_hf(wrong, cfg)
    bias = "model.layers.0.self_attn.q_proj.bias"
    extra = {**state_dict, bias: np.zeros(64, np.float32)}
    with pytest.raises(hf.HfConversionError, match=re.escape(f"unexpected tensor(s) {bias}")):
        hf.params_from_hf(extra, cfg)
    with pytest.raises(hf.HfConversionError, match="vocab_size=128"):
        hf.params_from_hf(state_dict, dataclasses.replace(cfg, vocab_size=128))


def test_missing_shard_and_folder_errors(untied, tmp_path):
    with pytest.raises(hf.HfConversionError, match="no config.json"):
        hf.load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(untied[0]))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(hf.HfConversionError, match="model-00001-of-00002.safetensors"):
        hf.load_hf_checkpoint(tmp_path)


# ----------------------------------------------------------------------------- CLI and training

def test_cli_import_then_export(hf_dir, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(hf_dir[0], path)
    (path / "tokenizer.json").write_text("{}")  # copied along, and named by the recipe
    ours, back = tmp_path / "ours", tmp_path / "back"
    assert hf.main(["import", "--hf-dir", str(path), "--out", str(ours)]) == 0
    params, cfg = weights.load_params(ours)
    assert cfg.model == hf.model_config_from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.data.tokenizer == str(ours.resolve()) and (ours / "tokenizer.json").is_file()
    recipe = load_recipe(ours / "recipe.py")
    assert recipe.model == cfg.model
    _, state_dict = hf.load_hf_checkpoint(path)
    _assert_bitwise_equal(params, hf.params_from_hf(state_dict, cfg.model))
    # A second import into the same folder refuses rather than mixing files.
    assert hf.main(["import", "--hf-dir", str(path), "--out", str(ours)]) == 2
    assert hf.main(["export", "--checkpoint", str(ours), "--out", str(back)]) == 0
    _, exported = hf.load_hf_checkpoint(back)
    assert sorted(exported) == sorted(state_dict)
    assert all(np.array_equal(exported[k], state_dict[k]) for k in state_dict)
    assert (back / "tokenizer.json").is_file()
    assert hf.main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(back)]) == 2


def test_cli_module_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxtrain.hf", "import", "--hf-dir",
                          str(tmp_path), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no config.json" in out.stderr


def test_export_from_training_checkpoint_and_train_state(tmp_path, monkeypatch):
    """A trainer workdir (config.json + orbax checkpoints of a padded-vocab state) exports, and
    imported params become a train state on the setup's mesh and shardings."""
    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from jaxtrain.checkpoint import Checkpointer
    cfg = Config(model=ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, mlp_size=64, max_seq_len=64,
                                   compute_dtype="float32"))
    cfg.parallel.data, cfg.parallel.tensor = 4, 2
    cfg.train.global_batch, cfg.train.seq_len = 8, 16
    cfg.validate()
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))
    assert setup.model_cfg.vocab_size == 256
    params = random_model_params(setup.model_cfg)
    unpadded = {**params, "embed": params["embed"][:200], "lm_head": params["lm_head"][:, :200]}
    state = setup_lib.train_state_from_params(setup, weights.pad_vocab(unpadded, 256))
    abstract = setup.abstract_train_state
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        assert got.shape == want.shape and got.sharding == want.sharding
    assert not np.asarray(state.params["embed"][200:]).any()
    np.testing.assert_array_equal(state.params["embed"][:200], params["embed"][:200])

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(cfg.to_json())
    ckpt = Checkpointer(workdir / "checkpoints", CheckpointConfig(async_save=False))
    ckpt.save(3, state, {"pos": 0})
    ckpt.close()
    monkeypatch.chdir(tmp_path)  # the README's relative spelling (orbax wants absolute paths)
    assert hf.main(["export", "--checkpoint", "run", "--out", "hf"]) == 0
    _, state_dict = hf.load_hf_checkpoint(tmp_path / "hf")
    np.testing.assert_array_equal(state_dict["model.embed_tokens.weight"], params["embed"][:200])
    np.testing.assert_array_equal(state_dict["lm_head.weight"], params["lm_head"][:, :200].T)
    wq = params["blocks"]["attn"]["wq"]["kernel"][1]  # [D, H, E] -> HF [H*E, D]
    np.testing.assert_array_equal(state_dict["model.layers.1.self_attn.q_proj.weight"],
                                  wq.reshape(32, -1).T)
    with pytest.raises(hf.HfConversionError, match="no step 7"):
        hf.read_checkpoint(workdir, step=7)
    _, cfg_from_step = hf.read_checkpoint(workdir / "checkpoints" / "3")
    assert cfg_from_step.model == cfg.model

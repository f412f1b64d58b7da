"""HF Mixtral interop: logits (router included) match transformers, export loads there, the
conversion round-trips bit for bit, router variants we do not run are one-line errors."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import ModelConfig, MoeConfig
from jaxtrain.model import llama as model_lib
from jaxtrain.tools import hf
from util import decisive_hf_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 24


def _hf_model(seed: int = 0):
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        router_aux_loss_coef=0.02, attn_implementation="eager")
    torch.manual_seed(seed)
    return decisive_hf_weights(transformers.MixtralForCausalLM(cfg).float().eval())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    model = _hf_model()
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return path, model


def _tokens():
    return np.random.default_rng(0).integers(0, 128, (2, SEQ)).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _our_logits(params, cfg: ModelConfig, tokens):
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention="xla")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, tokens))


def test_mixtral_config_and_logits_match_transformers(hf_dir):
    path, model = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    assert cfg.moe == MoeConfig(num_experts=4, top_k=2, aux_loss_coeff=0.02 * 2 / 2)
    assert cfg.mlp_size == cfg.expert_mlp_size == 96 and all(cfg.moe_layers)
    params = hf.params_from_hf(state_dict, cfg)
    assert params["blocks"]["moe"]["w_gate"].shape == (2, 4, 64, 96)
    assert params["blocks"]["moe"]["router"].shape == (2, 64, 4)
    tokens = _tokens()
    ours, theirs = _our_logits(params, cfg, tokens), _hf_logits(model, tokens)
    assert np.abs(theirs).max() > 1.0
    assert np.abs(ours - theirs).max() <= 1e-4
    # the router matters: another expert order in one layer changes the logits
    swapped = jax.tree.map(np.copy, params)
    swapped["blocks"]["moe"]["router"][0] = swapped["blocks"]["moe"]["router"][0][:, ::-1]
    assert np.abs(_our_logits(swapped, cfg, tokens) - theirs).max() > 1e-2


def test_mixtral_export_roundtrips_and_loads_in_transformers(hf_dir, tmp_path):
    path, model = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    hf.save_hf_checkpoint(tmp_path, hf.params_from_hf(state_dict, cfg), cfg)
    config2, state_dict2 = hf.load_hf_checkpoint(tmp_path)
    assert config2["architectures"] == ["MixtralForCausalLM"]
    assert config2["router_aux_loss_coef"] == pytest.approx(0.02)
    assert hf.model_config_from_hf(config2) == cfg
    assert sorted(state_dict2) == sorted(state_dict)
    for name in state_dict:
        assert np.array_equal(state_dict2[name].view(np.uint32), state_dict[name].view(np.uint32))
    loaded = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").float().eval()
    tokens = _tokens()
    np.testing.assert_array_equal(_hf_logits(loaded, tokens), _hf_logits(model, tokens))


@pytest.mark.parametrize("key,value,match", [
    ("router_jitter_noise", 0.01, "router_jitter_noise=0.01"),
    ("scoring_func", "sigmoid", "scoring_func='sigmoid'"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("model_type", "qwen2_moe", "model_type='qwen2_moe'"),
])
def test_router_variants_we_do_not_run_are_named(hf_dir, key, value, match):
    hf_config, _ = hf.load_hf_checkpoint(hf_dir[0])
    with pytest.raises(hf.HfConversionError, match=match) as err:
        hf.model_config_from_hf({**hf_config, key: value})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("moe_kw,match", [
    (dict(first_k_dense=1), "dense layers"),
    (dict(shared_experts=1), "shared experts"),
    (dict(pre_softmax=True), "pre_softmax"),
])
def test_export_refuses_what_mixtral_cannot_express(moe_kw, match):
    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      mlp_size=96, moe=MoeConfig(num_experts=4, top_k=2, **moe_kw))
    with pytest.raises(hf.HfConversionError, match=match):
        hf.params_to_hf({"embed": np.zeros((128, 64), np.float32)}, cfg)

"""HF DeepSeek-V3 interop: logits (MLA with its interleaved rope layout, the group-limited
sigmoid router with its correction bias, a shared expert, a first dense layer) match
transformers' DeepseekV3ForCausalLM, export loads there and round-trips bit for bit, MTP layers
are skipped, what either side cannot express is a one-line error."""
import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config import MlaConfig, ModelConfig, MoeConfig, load_recipe
from jaxtrain.model import llama as model_lib
from jaxtrain.tools import hf
from util import decisive_hf_weights, random_model_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 24, 128


# YaRN with the context trained at 8 positions (the tests run 24): over the rope part's 4 pairs
# the ramp (bounds 1 and 3 at these betas) keeps pairs 0-1, blends pair 2 half and half and
# interpolates pair 3; mscale 0.7 / mscale_all_dim 1 put an attention factor != 1 on cos/sin.
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 0.05, "beta_slow": 0.01,
        "mscale": 0.7, "mscale_all_dim": 1.0}
YARN_MLA = dict(yarn_factor=4.0, yarn_original_max_position=8, yarn_beta_fast=0.05,
                yarn_beta_slow=0.01, yarn_mscale=0.7, mscale_all_dim=1.0)


def _hf_model(q_lora_rank, yarn: bool = False, seed: int = 0):
    rope = dict(rope_parameters=YARN, max_position_embeddings=32) if yarn else dict(
        max_position_embeddings=64)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        rms_norm_eps=1e-6, attn_implementation="eager", **rope)
    torch.manual_seed(seed)
    model = decisive_hf_weights(transformers.DeepseekV3ForCausalLM(cfg).float().eval())
    with torch.no_grad():   # a bias that moves choices, so its mapping shows in the logits
        for i in (1, 2):
            bias = model.model.layers[i].mlp.gate.e_score_correction_bias
            bias.copy_(0.3 * torch.randn_like(bias))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(q_lora_rank, yarn) -> (folder, model) of a saved HF model, made on first use."""
    made = {}

    def get(q_lora_rank, yarn=False):
        if (q_lora_rank, yarn) not in made:
            model = _hf_model(q_lora_rank, yarn)
            path = tmp_path_factory.mktemp("deepseek")
            model.save_pretrained(path)
            made[q_lora_rank, yarn] = path, model
        return made[q_lora_rank, yarn]
    return get


@pytest.fixture
def hf_dir(saved):
    """The q low-rank path (DeepSeek-V3's)."""
    return saved(24)


@pytest.fixture(params=[(24, False), (None, False), (24, True)],
                ids=["q_lora", "q_proj", "q_lora_yarn"])
def both_dirs(request, saved):
    """With the q low-rank path, with one q projection (q_lora_rank null), and the first with
    YaRN rope."""
    return saved(*request.param)


def _tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (2, SEQ)).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


_COMPILED: dict = {}   # one compiled forward per model config (CI has 2 cores)


def _our_logits(params, cfg: ModelConfig, tokens):
    cfg = dataclasses.replace(cfg, compute_dtype="float32", attention="xla")
    if repr(cfg) not in _COMPILED:
        graphdef, state = nnx.split(nnx.eval_shape(
            lambda: model_lib.Llama(cfg, rngs=nnx.Rngs(0))))
        _COMPILED[repr(cfg)] = state, jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])
    state, forward = _COMPILED[repr(cfg)]
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return np.asarray(forward(state, tokens))


def test_deepseek_config_and_logits_match_transformers(both_dirs):
    path, model = both_dirs
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    cfg = hf.model_config_from_hf(hf_config)
    q_lora = model.config.q_lora_rank or 0
    yarn = model.config.rope_parameters["rope_type"] == "yarn"
    assert model.model.rotary_emb.rope_type == model.config.rope_parameters["rope_type"]
    assert cfg.mla == MlaConfig(q_lora_rank=q_lora, kv_lora_rank=32, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=12, **(YARN_MLA if yarn else {}))
    assert cfg.moe == MoeConfig(num_experts=8, top_k=2, mlp_size=32, shared_experts=1,
                                first_k_dense=1, score_function="sigmoid",
                                routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                expert_bias=True, aux_loss_coeff=0.0)
    assert cfg.moe_layers == (False, True, True) and cfg.norm_eps == 1e-6
    params = hf.params_from_hf(state_dict, cfg, hf_config)
    assert params["blocks"]["moe"]["w_gate"].shape == (2, 8, 64, 32)
    assert params["dense_blocks"]["mlp"]["w_gate"]["kernel"].shape == (1, 64, 96)
    assert params["blocks"]["moe"]["expert_bias"].dtype == np.float32
    tokens = _tokens()
    ours, theirs = _our_logits(params, cfg, tokens), _hf_logits(model, tokens)
    assert np.abs(theirs).max() > 1.0
    assert np.abs(ours - theirs).max() <= 1e-4
    # each mapping matters: no correction bias, or the rope columns left interleaved, is off
    no_bias = jax.tree.map(np.copy, params)
    no_bias["blocks"]["moe"]["expert_bias"][...] = 0.0
    assert np.abs(_our_logits(no_bias, cfg, tokens) - theirs).max() > 1e-2
    as_halves = hf.params_from_hf(state_dict, cfg, {**hf_config, "rope_interleave": False})
    assert np.abs(_our_logits(as_halves, cfg, tokens) - theirs).max() > 1e-2
    if yarn:   # YaRN's interpolation matters: the plain frequencies (its scales kept) are
        # off. A trained context of 1000 puts the ramp's lower bound at pair 3, the last one:
        # every pair keeps its frequency.
        far = dataclasses.replace(cfg.mla, yarn_original_max_position=1000)
        no_interp = dataclasses.replace(cfg, mla=far)
        np.testing.assert_array_equal(model_lib.rope_frequencies(no_interp),
                                      model_lib.rope_frequencies(dataclasses.replace(
                                          cfg, mla=dataclasses.replace(cfg.mla, yarn_factor=1))))
        assert np.abs(_our_logits(params, no_interp, tokens) - theirs).max() > 1e-2


@pytest.mark.parametrize("rope", [
    YARN, {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None},
    {**YARN, "original_max_position_embeddings": 4096, "factor": 40.0, "mscale": 1.0,
     "beta_fast": None, "beta_slow": None},
    {**YARN, "mscale_all_dim": None, "factor": 2.5}], ids=["test", "no_mscale", "v3", "only_mscale"])
def test_yarn_frequencies_and_scales_equal_transformers(rope):
    """Our rope part's frequencies, cos/sin factor and softmax scale are HF's (including its
    defaults for absent betas and mscales), from the config our import reads."""
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64 if rope["factor"] == 40 else 8,
                                           max_position_embeddings=4096 * 40,
                                           rope_parameters=rope)
    inv_freq, attention_factor = _compute_yarn_parameters(hf_cfg)
    scaling = transformers.models.deepseek_v3.modeling_deepseek_v3.yarn_apply_mscale(
        hf_cfg.rope_parameters, 1.0)
    m = hf.model_config_from_hf(hf_cfg.to_dict())
    assert m.mla.yarn
    np.testing.assert_allclose(model_lib.rope_frequencies(m), inv_freq.numpy(), rtol=1e-6)
    assert m.mla.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    assert m.mla.softmax_mscale == pytest.approx(scaling, rel=1e-12)
    blend = model_lib.rope_frequencies(m) / model_lib.rope_frequencies(
        dataclasses.replace(m, mla=dataclasses.replace(m.mla, yarn_factor=1.0)))
    assert blend.min() == pytest.approx(1 / rope["factor"]) and blend.max() == 1.0


def test_deepseek_export_roundtrips_and_loads_in_transformers(both_dirs, tmp_path):
    path, model = both_dirs
    _, state_dict = hf.load_hf_checkpoint(path)
    hf.import_hf(path, tmp_path / "imported")
    hf.export_hf(tmp_path / "imported", tmp_path / "exported")
    config2, state_dict2 = hf.load_hf_checkpoint(tmp_path / "exported")
    assert config2["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config2["num_nextn_predict_layers"] == 0
    assert hf.model_config_from_hf(config2) == hf.model_config_from_hf(
        json.loads((path / "config.json").read_text()))
    assert sorted(state_dict2) == sorted(state_dict)
    for name in state_dict:   # the rope reorder and its inverse, the bias, every expert: exact
        assert np.array_equal(state_dict2[name].view(np.uint32), state_dict[name].view(np.uint32))
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "exported", attn_implementation="eager").float().eval()
    tokens = _tokens()
    np.testing.assert_array_equal(_hf_logits(loaded, tokens), _hf_logits(model, tokens))


def test_our_params_export_to_equal_logits_in_transformers(hf_dir, tmp_path):
    """Ours -> HF: random jaxtrain params (a nonzero balancing bias) give transformers' logits;
    a model without moe.expert_bias exports HF's bias as zeros."""
    hf_config, _ = hf.load_hf_checkpoint(hf_dir[0])
    cfg = hf.model_config_from_hf(hf_config)
    params = random_model_params(cfg, seed=1)
    params["blocks"]["moe"]["expert_bias"] = (
        0.3 * np.random.default_rng(1).standard_normal((2, 8))).astype(np.float32)
    hf.save_hf_checkpoint(tmp_path / "biased", params, cfg)
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "biased", attn_implementation="eager").float().eval()
    tokens = _tokens()
    theirs = _hf_logits(loaded, tokens)
    assert np.abs(_our_logits(params, cfg, tokens) - theirs).max() <= 1e-4

    unbiased = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_bias=False))
    no_bias = {**params, "blocks": {**params["blocks"], "moe": {
        k: v for k, v in params["blocks"]["moe"].items() if k != "expert_bias"}}}
    hf.save_hf_checkpoint(tmp_path / "unbiased", no_bias, unbiased)
    _, state_dict = hf.load_hf_checkpoint(tmp_path / "unbiased")
    assert not state_dict["model.layers.1.mlp.gate.e_score_correction_bias"].any()
    loaded = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "unbiased", attn_implementation="eager").float().eval()
    params["blocks"]["moe"]["expert_bias"][...] = 0.0
    assert np.abs(_our_logits(params, cfg, tokens) - _hf_logits(loaded, tokens)).max() <= 1e-4


def test_mtp_layers_are_skipped_with_a_note(hf_dir, caplog):
    path, _ = hf_dir
    hf_config, state_dict = hf.load_hf_checkpoint(path)
    hf_config = {**hf_config, "num_nextn_predict_layers": 1}
    cfg = hf.model_config_from_hf(hf_config)
    mtp = {f"model.layers.3.{k[len('model.layers.2.'):]}": v
           for k, v in state_dict.items() if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    with caplog.at_level(logging.WARNING, logger="jaxtrain.hf"):
        params = hf.params_from_hf({**state_dict, **mtp}, cfg, hf_config)
    assert "multi-token-prediction" in caplog.text
    assert params["blocks"]["moe"]["router"].shape[0] == 2
    with pytest.raises(hf.HfConversionError, match="unexpected tensor.*model.layers.3"):
        hf.params_from_hf({**state_dict, **mtp}, cfg, {**hf_config, "num_nextn_predict_layers": 0})


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     "rope_type='dynamic' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}),
     "needs factor and original_max_position_embeddings"),
    (dict(rope_parameters={**YARN, "truncate": False}), "truncate=false"),
    (dict(rope_parameters={**YARN, "attention_factor": 1.0}), "attention_factor=1.0"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3 >= num_hidden_layers"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
])
def test_configs_we_cannot_represent_are_named(hf_dir, change, match):
    hf_config, _ = hf.load_hf_checkpoint(hf_dir[0])
    with pytest.raises(hf.HfConversionError, match=match) as err:
        hf.model_config_from_hf({**hf_config, **change})
    assert "\n" not in str(err.value)


_MLA = MlaConfig(q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=12)
_MOE = MoeConfig(num_experts=8, top_k=2, mlp_size=32, shared_experts=1, first_k_dense=1,
                 score_function="sigmoid", n_group=4, topk_group=2, expert_bias=True)


@pytest.mark.parametrize("model_kw,match", [
    (dict(norm_eps=1e-5), "norm_eps=1e-05"),
    (dict(moe=dataclasses.replace(_MOE, shared_experts=0)), "no shared experts"),
    (dict(moe=dataclasses.replace(_MOE, layer_freq=2)), "moe.layer_freq=2"),
    (dict(moe=None), "no MoE layers"),
])
def test_export_refuses_what_deepseek_v3_cannot_express(model_kw, match):
    cfg = ModelConfig(**{**dict(vocab_size=128, hidden_size=64, num_layers=3, num_heads=4,
                                num_kv_heads=4, mlp_size=96, norm_eps=1e-6, mla=_MLA, moe=_MOE),
                         **model_kw})
    with pytest.raises(hf.HfConversionError, match=match) as err:
        hf.hf_config_from_model(cfg)
    assert "\n" not in str(err.value)


_HF_KNOBS = dict(bias_update_rate=1e-3, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                 dispatch="dropless")   # what HF's config does not hold: our defaults on import


@pytest.mark.parametrize("recipe", ["tiny_deepseek", "deepseek_v3_16b", "deepseek_v3"])
def test_deepseek_recipes_export_their_architecture(recipe):
    """Their multi-token prediction module is a training objective: the export drops it. The
    671B recipe's YaRN goes through transformers' own config (what from_pretrained reads)."""
    m = load_recipe(f"configs/{recipe}.py").model
    exported = hf.hf_config_from_model(m)
    hf_cfg = transformers.DeepseekV3Config.from_dict(exported)
    assert hf_cfg.rope_parameters["rope_type"] == ("yarn" if m.mla.yarn else "default")
    back = hf.model_config_from_hf(hf_cfg.to_dict())
    assert hf.model_config_from_hf(exported) == back
    assert back.mla == m.mla
    assert back.moe == dataclasses.replace(m.moe, **_HF_KNOBS)
    assert dataclasses.replace(back, moe=None, attention=m.attention, compute_dtype=m.compute_dtype,
                               param_dtype=m.param_dtype) == dataclasses.replace(m, moe=None,
                                                                                 mtp=None)


def test_the_671b_recipe_has_the_released_configs_yarn():
    """deepseek-ai/DeepSeek-V3's config.json rope_scaling (the legacy `type` key) imports as the
    recipe's model.mla."""
    released = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    m = load_recipe("configs/deepseek_v3.py").model
    hf_config = {**hf.hf_config_from_model(m), "rope_scaling": released,
                 "max_position_embeddings": 163840}
    assert hf.model_config_from_hf(hf_config).mla == m.mla
    assert m.mla.attention_factor == 1.0 and m.mla.softmax_mscale == pytest.approx(
        (0.1 * np.log(40) + 1) ** 2)

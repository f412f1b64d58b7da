"""Hugging Face DeepseekV3Config (`config.json`, model_type deepseek_v3) <-> our ModelConfig
with model.mla and model.moe; what either side cannot express exactly is refused.

    kv_lora_rank, q_lora_rank (null: 0),            model.mla (same names)
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    n_routed_experts, num_experts_per_tok,          model.moe.num_experts, top_k, mlp_size,
    moe_intermediate_size, n_shared_experts          shared_experts (each moe_intermediate_size)
    n_group, topk_group, routed_scaling_factor,     model.moe (same names), score_function
    norm_topk_prob, scoring_func sigmoid             sigmoid
    first_k_dense_replace (moe_layer_freq 1)        model.moe.first_k_dense (layer_freq 1)
    e_score_correction_bias (always there)          model.moe.expert_bias=true
    aux_loss_alpha with seq_aux                     model.moe.seq_aux_loss_coeff

    rope_scaling yarn: factor,                      model.mla.yarn_factor,
      original_max_position_embeddings,               yarn_original_max_position,
      beta_fast, beta_slow (absent: 32, 1),           yarn_beta_fast, yarn_beta_slow,
      mscale, mscale_all_dim (absent: 0)              yarn_mscale, mscale_all_dim

Refused: a rope_type but default or yarn; YaRN with truncate=false, partial_rotary_factor, or
an explicit attention_factor other than the one mscale/mscale_all_dim give; rms_norm_eps other
than 1e-6 (HF normalises the q and KV latents with eps 1e-6 whatever rms_norm_eps says; our
latent norms use model.norm_eps); another router (scoring_func, topk_method, moe_layer_freq);
attention biases; no MoE layer at all. Training-only knobs HF does not hold (the bias update
rate, aux_loss_coeff, z-loss, dispatch) take our defaults on import (aux_loss_coeff 0) and are
not written on export. num_nextn_predict_layers (multi-token prediction) is read by the weight
import to skip those layers, and written as 0.
"""
from __future__ import annotations

from jaxtrain.config import MlaConfig, ModelConfig, MoeConfig
from jaxtrain.weights import HfConversionError

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6   # HF's DeepseekV3RMSNorm default, used by q_a_ and kv_a_layernorm
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "moe_intermediate_size", "n_routed_experts",
             "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
             "first_k_dense_replace", "routed_scaling_factor", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Keys of DeepSeek's own config.json that HF's DeepseekV3 ignores, with the only value it
# runs: (key, value, what another value would be)
_FIXED = (("scoring_func", "sigmoid", "another score function"),
          ("topk_method", "noaux_tc", "another top-k method"),
          ("moe_layer_freq", 1, "MoE on every n-th layer only, which HF's DeepseekV3 ignores"),
          ("hidden_act", "silu", "another MLP activation; our MLP is SwiGLU"),
          ("attention_bias", False, "biases on the attention projections"))


def _fail(msg: str):
    raise HfConversionError(msg)


def model_config_from_hf(c: dict) -> ModelConfig:
    """A ModelConfig (model.mla, model.moe) from a DeepseekV3 config.json dict."""
    for key in _REQUIRED:
        if key not in c:
            _fail(f"DeepseekV3 config has no {key!r}; is this a DeepSeek-V3 config.json?")
    for key, value, other in _FIXED:
        if key in c and c[key] != value:
            _fail(f"{key}={c[key]!r} ({other}) is not what HF's DeepseekV3 runs; only "
                  f"{key}={value!r} converts")
    heads, layers = int(c["num_attention_heads"]), int(c["num_hidden_layers"])
    if int(c.get("num_key_value_heads") or heads) != heads:
        _fail(f"num_key_value_heads={c['num_key_value_heads']} != num_attention_heads={heads}: "
              "latent attention up-projects a key and value per head")
    eps = float(c.get("rms_norm_eps", LATENT_NORM_EPS))
    if eps != LATENT_NORM_EPS:
        _fail(f"rms_norm_eps={eps}: HF's DeepseekV3 normalises the q/KV latents with eps 1e-6 "
              "whatever rms_norm_eps says, jaxtrain's with model.norm_eps; only 1e-6 converts")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    first_k = int(c["first_k_dense_replace"])
    if first_k >= layers:
        _fail(f"first_k_dense_replace={first_k} >= num_hidden_layers={layers}: no MoE layer; "
              "jaxtrain converts DeepSeek-V3 models with MoE layers only")
    if not c.get("seq_aux", True) and float(c.get("aux_loss_alpha") or 0.0):
        _fail(f"seq_aux=false with aux_loss_alpha={c['aux_loss_alpha']} (a batch-wise balance "
              "loss) is not supported; jaxtrain has DeepSeek-V3's sequence-wise one")
    moe = MoeConfig(
        num_experts=int(c["n_routed_experts"]), top_k=int(c["num_experts_per_tok"]),
        mlp_size=int(c["moe_intermediate_size"]), shared_experts=int(c["n_shared_experts"]),
        first_k_dense=first_k, layer_freq=1, score_function="sigmoid",
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        routed_scaling_factor=float(c["routed_scaling_factor"]), n_group=int(c["n_group"]),
        topk_group=int(c["topk_group"]), expert_bias=True, aux_loss_coeff=0.0,
        seq_aux_loss_coeff=float(c.get("aux_loss_alpha") or 0.0))
    mla = MlaConfig(q_lora_rank=int(c["q_lora_rank"] or 0), kv_lora_rank=int(c["kv_lora_rank"]),
                    qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                    v_head_dim=int(c["v_head_dim"]), **_yarn_from_hf(rope))
    return ModelConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=heads, head_dim=0, mlp_size=int(c["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        max_seq_len=int(c.get("max_position_embeddings", ModelConfig.max_seq_len)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), norm_eps=eps, moe=moe, mla=mla)


def _yarn_from_hf(rope: dict) -> dict:
    """model.mla's YaRN fields from HF's rope parameters ({}: plain RoPE)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        _fail(f"rope_type={rope_type!r} is not supported for DeepSeek-V3; only 'default' and "
              "'yarn' convert")
    if rope_type == "default":
        return {}
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        _fail("rope_type='yarn' needs factor and original_max_position_embeddings (HF's "
              f"DeepseekV3 cannot run without them); got {sorted(rope)}")
    if float(rope["factor"]) < 1:
        _fail(f"rope_type='yarn' with factor={rope['factor']} < 1 does not convert (YaRN "
              "stretches the context: factor >= 1)")
    if not rope.get("truncate", True) or float(rope.get("partial_rotary_factor", 1.0)) != 1:
        _fail("rope_type='yarn' with truncate=false or partial_rotary_factor != 1 does not "
              "convert: jaxtrain's YaRN rounds the correction range out (HF's default) over "
              "the whole rope part")
    if float(rope["factor"]) == 1:
        return {}   # HF's yarn at factor 1 is plain RoPE at scale 1
    yarn = dict(yarn_factor=float(rope["factor"]),
                yarn_original_max_position=int(rope["original_max_position_embeddings"]),
                yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                yarn_mscale=float(rope.get("mscale") or 0.0),
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    derived = MlaConfig(**yarn).attention_factor
    given = rope.get("attention_factor")
    if given is not None and abs(float(given) - derived) > 1e-12 * derived:
        _fail(f"rope_type='yarn' with attention_factor={given}: jaxtrain derives it from "
              f"mscale/mscale_all_dim ({derived} here); only that value converts")
    return yarn


def _yarn_to_hf(a: MlaConfig):
    """HF's rope_scaling dict of model.mla's YaRN (None without)."""
    if not a.yarn:
        return None
    return {"rope_type": "yarn", "factor": a.yarn_factor,
            "original_max_position_embeddings": a.yarn_original_max_position,
            "beta_fast": a.yarn_beta_fast, "beta_slow": a.yarn_beta_slow,
            "mscale": a.yarn_mscale, "mscale_all_dim": a.mscale_all_dim}


def check_deepseek(m: ModelConfig) -> None:
    """What HF's DeepseekV3 can express of our MLA model (export)."""
    e = m.moe
    if e is None:
        _fail("this MLA model has no MoE layers, which HF's DeepseekV3 cannot express (its MoE "
              "layers always have routed and shared experts)")
    for ok, what in (
            (e.score_function == "sigmoid", f"moe.score_function={e.score_function}"),
            (e.layer_freq == 1, f"moe.layer_freq={e.layer_freq} (HF: every layer from "
                                "first_k_dense_replace on is MoE)"),
            (e.shared_experts > 0, "no shared experts (HF's always has them)"),
            (m.shared_mlp_size % m.expert_mlp_size == 0, f"shared experts of {m.shared_mlp_size}"
             f" in all, not a multiple of the routed experts' {m.expert_mlp_size}"),
            (m.norm_eps == LATENT_NORM_EPS, f"model.norm_eps={m.norm_eps} (HF's latent norms "
                                            "use 1e-6 whatever rms_norm_eps says; set 1e-6)"),
            (m.rope_scaling is None, "model.rope_scaling (llama3) on the rope part")):
        if not ok:
            _fail(f"this DeepSeek model has {what}, which HF's DeepseekV3 cannot express "
                  "exactly; it does not export")


def hf_config_from_model(m: ModelConfig, *, dtype: str = "float32") -> dict:
    """A DeepseekV3 config.json dict (top-level rope_theta, as transformers 4.x writes it and
    5.x reads it); `check_deepseek` first."""
    check_deepseek(m)
    a, e = m.mla, m.moe
    return {
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3",
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": m.mlp_size, "moe_intermediate_size": m.expert_mlp_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads, "n_routed_experts": e.num_experts,
        "num_experts_per_tok": e.top_k, "n_shared_experts": m.shared_mlp_size // m.expert_mlp_size,
        "n_group": e.n_group, "topk_group": e.topk_group, "first_k_dense_replace": e.first_k_dense,
        "routed_scaling_factor": e.routed_scaling_factor, "norm_topk_prob": e.norm_topk_prob,
        "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": _yarn_to_hf(a), "rope_interleave": True,
        "tie_word_embeddings": m.tie_embeddings, "num_nextn_predict_layers": 0,
        "aux_loss_alpha": e.seq_aux_loss_coeff, "seq_aux": True, "torch_dtype": dtype,
    }

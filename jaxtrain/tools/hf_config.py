"""Hugging Face `config.json` (Llama, Mixtral; DeepSeek-V3 in hf_deepseek_config.py) <->
jaxtrain's ModelConfig: the 4.x and 5.x layouts read, the 4.x one written, and what HF's
Mixtral cannot express refused; the weights' conversion is hf.py's."""
from __future__ import annotations

import dataclasses

from jaxtrain.config import ModelConfig, MoeConfig, RopeScaling
from jaxtrain.tools import hf_deepseek_config
from jaxtrain.weights import HfConversionError

SUPPORTED_ROPE_TYPES = ("default", "llama3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
# Router keys of other MoE families that transformers' Mixtral would silently ignore:
# (key, the value Mixtral's router means, what the other value would be)
_FOREIGN_ROUTER_KEYS = (("scoring_func", "softmax", "sigmoid or other scores"),
                        ("norm_topk_prob", True, "top-k weights left unnormalised"),
                        ("n_shared_experts", None, "shared experts"),
                        ("routed_scaling_factor", 1.0, "scaled routed outputs"),
                        ("topk_method", None, "group-limited routing"))


def model_config_from_hf(hf_config: dict) -> ModelConfig:
    """A `ModelConfig` from a HF Llama, Mixtral or DeepSeek-V3 `config.json` dict
    (transformers 4.x or 5.x layout)."""
    c = hf_config
    if c.get("model_type") == "deepseek_v3":
        return hf_deepseek_config.model_config_from_hf(c)
    if c.get("model_type", "llama") not in ARCHITECTURES:
        raise HfConversionError(f"model_type={c['model_type']!r} is not supported; only Llama "
                                "('llama'), Mixtral ('mixtral') and DeepSeek-V3 ('deepseek_v3') "
                                "checkpoints convert")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
        if key not in c:
            raise HfConversionError(f"HF config has no {key!r}; is this a Llama config.json?")
    if c.get("hidden_act", "silu") != "silu":
        raise HfConversionError(f"hidden_act={c['hidden_act']!r} is not supported; our MLP is "
                                "SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key, False):
            raise HfConversionError(f"{key}=true is not supported; our projections have no bias")

    # transformers 5 nests theta and scaling in `rope_parameters`; 4.x has `rope_theta` and
    # `rope_scaling` at the top (with `type` instead of `rope_type` in old files).
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HfConversionError(f"rope_type={rope_type!r} is not supported; supported: "
                                f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    rope_scaling = None
    if rope_type == "llama3":
        try:
            rope_scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        except KeyError as e:
            raise HfConversionError(
                f"rope_type='llama3' needs rope parameter {e.args[0]!r}") from None

    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    return ModelConfig(
        vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        num_layers=int(c["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=0 if head_dim * heads == hidden else head_dim,
        mlp_size=int(c["intermediate_size"]), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_seq_len=int(c.get("max_position_embeddings", ModelConfig.max_seq_len)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        moe=_moe_from_hf(c) if c.get("model_type") == "mixtral" else None)


def _moe_from_hf(c: dict) -> MoeConfig:
    for key in ("num_local_experts", "num_experts_per_tok"):
        if key not in c:
            raise HfConversionError(f"Mixtral config has no {key!r}")
    if float(c.get("router_jitter_noise") or 0.0):
        raise HfConversionError(f"router_jitter_noise={c['router_jitter_noise']} (noise on the "
                                "router's input in training) is not supported; set it to 0")
    for key, mixtral, other in _FOREIGN_ROUTER_KEYS:
        if c.get(key, mixtral) != mixtral:
            raise HfConversionError(f"{key}={c[key]!r} ({other}) is a router variant "
                                    "transformers' Mixtral does not run and jaxtrain does not "
                                    "import; only Mixtral's softmax top-k router converts")
    if c.get("sliding_window") and c["sliding_window"] < c.get("max_position_embeddings", 0):
        raise HfConversionError(f"sliding_window={c['sliding_window']} is not supported; our "
                                "attention is causal over the whole sequence")
    k, layers = int(c["num_experts_per_tok"]), int(c["num_hidden_layers"])
    return MoeConfig(num_experts=int(c["num_local_experts"]), top_k=k,
                     aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)) * k / layers)


def hf_config_from_model(model_cfg: ModelConfig, *, dtype: str = "float32") -> dict:
    """A HF `config.json` dict. Written in the 4.x layout (top-level rope_theta/rope_scaling),
    which transformers 5 also reads. A model with MLA is DeepSeek-V3's."""
    m = model_cfg
    if m.mla is not None:
        return hf_deepseek_config.hf_config_from_model(m, dtype=dtype)
    rope_scaling = None
    if m.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(m.rope_scaling)}
    model_type = "llama" if m.moe is None else "mixtral"
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
        "intermediate_size": m.expert_mlp_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.resolved_head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if m.moe is not None:
        e = m.moe
        out.update(num_local_experts=e.num_experts, num_experts_per_tok=e.top_k,
                   router_aux_loss_coef=e.aux_loss_coeff * m.num_layers / e.top_k,
                   router_jitter_noise=0.0, sliding_window=None)
    return out


def check_mixtral(m: ModelConfig) -> None:
    """What HF's Mixtral can express of our MoE model (export)."""
    e = m.moe
    for ok, what in ((all(m.moe_layers), "dense layers (moe.first_k_dense / layer_freq)"),
                     (not m.shared_mlp_size, "shared experts"),
                     (not e.pre_softmax, "moe.pre_softmax=true (top-k not renormalised)"),
                     (e.score_function == "softmax", f"moe.score_function={e.score_function}"),
                     (e.n_group == 1, "group-limited routing (moe.n_group > 1)"),
                     (e.routed_scaling_factor == 1.0, "moe.routed_scaling_factor != 1"),
                     (not e.expert_bias, "a balancing bias (moe.expert_bias)")):
        if not ok:
            raise HfConversionError(f"this MoE model has {what}, which HF's Mixtral cannot "
                                    "express; only all-MoE models with Mixtral's router export")


def check_exportable(m: ModelConfig) -> None:
    """Whether HF's model of this family (DeepSeek-V3 with MLA, Mixtral with MoE) expresses it."""
    if m.mla is not None:
        hf_deepseek_config.check_deepseek(m)
    elif m.moe is not None:
        check_mixtral(m)

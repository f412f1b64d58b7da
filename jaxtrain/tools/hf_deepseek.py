"""Hugging Face DeepseekV3ForCausalLM's layer tensors <-> our MLA + MoE params (hf.py runs
the conversion; hf_deepseek_config.py maps the config).

    self_attn.q_a_proj / q_a_layernorm / q_b_proj    attn/wq_a, attn/q_norm, attn/wq_b
      (or self_attn.q_proj with q_lora_rank null)    (attn/wq: model.mla.q_lora_rank=0)
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm    attn/wkv_a, attn/kv_norm
    self_attn.kv_b_proj / o_proj                     attn/wkv_b [C, H, N+F], attn/wo
    mlp.gate_proj / up_proj / down_proj              dense layers' mlp (dense_blocks)
    mlp.gate.weight [E, D]                           moe/router [D, E]
    mlp.gate.e_score_correction_bias [E]             moe/expert_bias (the balancing bias)
    mlp.experts.{j}.gate_proj / up_proj / down_proj  row j of moe/w_gate, w_up, w_down
    mlp.shared_experts.*                             moe/shared/* (n_shared_experts wide)

RoPE layout. DeepSeek's checkpoints lay each head's rope dims out in interleaved pairs
(x0, x1), (x2, x3), ...; HF's DeepseekV3 with rope_interleave=true (its default, and the
released checkpoints') rotates pair i by frequency i and writes the result rotate-half style,
[x_even·cos - x_odd·sin, x_odd·cos + x_even·sin]. Ours is rotate-half on halves, so with the
rope columns of q_b_proj (q_proj) and of kv_a_proj_with_mqa's rope part reordered to
[evens, odds] on import (the inverse on export) both compute the same q and k, and the same
logits. With rope_interleave=false HF rotates halves as we do: no reordering.

Multi-token prediction. A DeepSeek-V3 checkpoint carries num_nextn_predict_layers MTP modules
as model.layers.{L ...}; they are skipped on import (with a logged note: jaxtrain's model has
no MTP here) and export writes none (num_nextn_predict_layers=0).
"""
from __future__ import annotations

import logging
import re

import numpy as np

from jaxtrain.config import ModelConfig
from jaxtrain.tools.hf_spec import Spec, heads_in, heads_out, same, transpose

log = logging.getLogger("jaxtrain.hf")
BIAS = "expert_bias"   # model/moe_balance.BIAS: our balancing bias, an fp32 leaf (no jax here)


def rope_order(p: int) -> np.ndarray:
    """Our rope column j is DeepSeek's interleaved column rope_order(p)[j]: evens, then odds."""
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


def _reorder_rope(spec: tuple, start: int, p: int, interleave: bool) -> tuple:
    """A (hf_shape, our_shape, to_ours, to_hf) whose last our-axis has its rope columns
    [start, start+p) taken from the interleaved layout on import and put back on export."""
    if not interleave:
        return spec
    hf_shape, our_shape, to_ours, to_hf = spec
    order = rope_order(p)
    inverse = np.argsort(order)

    def take(w, cols):
        return np.concatenate([w[..., :start], w[..., start:start + p][..., cols],
                               w[..., start + p:]], axis=-1)
    return hf_shape, our_shape, lambda w: take(to_ours(w), order), lambda w: to_hf(take(w, inverse))


def layer_specs(m: ModelConfig, moe: bool, rope_interleave: bool = True) -> list[Spec]:
    """The HF tensors of one DeepseekV3 decoder layer (an MoE layer when `moe`)."""
    a, d, h = m.mla, m.hidden_size, m.num_heads
    n, p, f, c = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    attn = "self_attn."
    if a.q_lora_rank:
        r = a.q_lora_rank
        specs = [Spec(attn + "q_a_proj.weight", ("attn", "wq_a", "kernel"), *transpose((r, d))),
                 Spec(attn + "q_a_layernorm.weight", ("attn", "q_norm", "scale"), *same((r,))),
                 Spec(attn + "q_b_proj.weight", ("attn", "wq_b", "kernel"),
                      *_reorder_rope(heads_out(r, h, n + p), n, p, rope_interleave))]
    else:
        specs = [Spec(attn + "q_proj.weight", ("attn", "wq", "kernel"),
                      *_reorder_rope(heads_out(d, h, n + p), n, p, rope_interleave))]
    specs += [
        Spec(attn + "kv_a_proj_with_mqa.weight", ("attn", "wkv_a", "kernel"),
             *_reorder_rope(transpose((c + p, d)), c, p, rope_interleave)),
        Spec(attn + "kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), *same((c,))),
        Spec(attn + "kv_b_proj.weight", ("attn", "wkv_b", "kernel"), *heads_out(c, h, n + f)),
        Spec(attn + "o_proj.weight", ("attn", "wo", "kernel"), *heads_in(h, f, d)),
        Spec("input_layernorm.weight", ("attn_norm", "scale"), *same((d,))),
        Spec("post_attention_layernorm.weight", ("mlp_norm", "scale"), *same((d,))),
    ]
    if not moe:
        return specs + _mlp_specs("mlp", ("mlp",), m.mlp_size, d)
    e, fe = m.moe.num_experts, m.expert_mlp_size
    specs.append(Spec("mlp.gate.weight", ("moe", "router"), *transpose((e, d)), fp32=True))
    if m.moe.expert_bias:
        specs.append(Spec("mlp.gate.e_score_correction_bias", ("moe", BIAS),
                          *same((e,)), fp32=True))
    for j in range(e):
        for hf_w, ours, shape in (("gate_proj", "w_gate", (fe, d)), ("up_proj", "w_up", (fe, d)),
                                  ("down_proj", "w_down", (d, fe))):
            specs.append(Spec(f"mlp.experts.{j}.{hf_w}.weight", ("moe", ours), *transpose(shape),
                              expert=j))
    if m.shared_mlp_size:
        specs += _mlp_specs("mlp.shared_experts", ("moe", "shared"), m.shared_mlp_size, d)
    return specs


def _mlp_specs(hf_prefix: str, path: tuple, f: int, d: int) -> list[Spec]:
    return [Spec(f"{hf_prefix}.{hf_w}.weight", (*path, ours, "kernel"), *transpose(shape))
            for hf_w, ours, shape in (("gate_proj", "w_gate", (f, d)), ("up_proj", "w_up", (f, d)),
                                      ("down_proj", "w_down", (d, f)))]


def zero_bias(m: ModelConfig) -> dict[str, np.ndarray]:
    """HF's always-present e_score_correction_bias, zeros, for a model without moe.expert_bias."""
    if m.mla is None or m.moe is None or m.moe.expert_bias:
        return {}
    return {f"model.layers.{i}.mlp.gate.e_score_correction_bias":
            np.zeros((m.moe.num_experts,), np.float32)
            for i, moe in enumerate(m.moe_layers) if moe}


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mtp_tensors(state_dict: dict, m: ModelConfig, mtp_layers: int) -> set[str]:
    """The names of the checkpoint's MTP modules (layers L .. L+mtp_layers-1), noted in the log:
    skipped on import."""
    skipped = set()
    for name in state_dict:
        hit = _LAYER.match(name)
        if hit and m.num_layers <= int(hit.group(1)) < m.num_layers + mtp_layers:
            skipped.add(name)
    if skipped:
        log.warning("skipping %d tensors of %d multi-token-prediction layer(s) (model.layers.%d"
                    "+): jaxtrain imports the main model only", len(skipped), mtp_layers,
                    m.num_layers)
    return skipped

"""The attention's share of the ledger for both kinds of attention: grouped-query (q, k, v, o
over H·E and K·E) and multi-head latent attention (model.mla, model/mla.py). Jax-free.

MLA per layer (h hidden, H heads, R q_lora_rank, C kv_lora_rank, N/P the nope/rope parts of the
q/k head size E = N + P, F the value head size):

    q_a  h·R, q_norm R, q_b R·H·E     (R > 0; else q h·H·E)
    kv_a h·(C + P), kv_norm C, kv_b C·H·(N + F), o H·F·h

Tensor parallelism splits q_b (or q), kv_b and o by heads; q_a, kv_a and the latents' norms
are whole on every tensor rank (Megatron's split). QK^T runs over E, PV over F, so the
attention's FLOPs width is H·(E + F)/2 (H·E when F = E, the GQA formula).

Activations an MLA layer keeps for its backward (per token, elements): the latents c_q (R) and
c_kv (C) and their norm outputs (the norms' and the up-projections' backward), whole on every
tensor rank; the core's inputs q, k (H·E each) and v (H·F) and its output (H·F, also Wo's
input), split over tensor. RoPE and the rope key's broadcast are linear: their backward keeps
nothing. As for GQA (q, o, k, v), with E = F and K = H the same 2·H·E + 2·H·E.
"""
from __future__ import annotations

from jaxtrain.config import ModelConfig

# The parameters split by heads under tensor parallelism (the rest is whole per tensor rank).
HEAD_SPLIT = ("q", "q_b", "kv_b", "o")
KV = ("k", "v")   # GQA's K/V projections: split unless K does not divide over tensor


def attention_params(m: ModelConfig) -> dict[str, int]:
    """One layer's attention parameters by projection (the two block norms as `norms`)."""
    h, H = m.hidden_size, m.num_heads
    if m.mla is None:
        K, E = m.num_kv_heads, m.resolved_head_dim
        return {"q": h * H * E, "k": h * K * E, "v": h * K * E, "o": H * E * h, "norms": 2 * h}
    a = m.mla
    E, F = a.qk_head_dim, a.v_head_dim
    q = ({"q_a": h * a.q_lora_rank, "q_norm": a.q_lora_rank, "q_b": a.q_lora_rank * H * E}
         if a.q_lora_rank else {"q": h * H * E})
    return {**q, "kv_a": h * (a.kv_lora_rank + a.qk_rope_head_dim), "kv_norm": a.kv_lora_rank,
            "kv_b": a.kv_lora_rank * H * (a.qk_nope_head_dim + F), "o": H * F * h,
            "norms": 2 * h}


def attention_params_local(m: ModelConfig, tensor: int) -> float:
    """One layer's attention parameters per tensor rank (GQA's K/V replicated when the KV
    heads do not divide over `tensor`)."""
    per = attention_params(m)
    kv_shards = tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads
    return sum(n / tensor if k in HEAD_SPLIT else n / kv_shards if k in KV else n
               for k, n in per.items())


def attention_width(m: ModelConfig) -> float:
    """H·(E + F)/2: QK^T and PV FLOPs per token per key are 2·H·E + 2·H·F = 4·this."""
    return m.num_heads * (m.resolved_head_dim + m.v_head_dim) / 2


def kv_width(m: ModelConfig) -> float:
    """K's and V's elements per token, averaged: K·(E + F)/2 (what context parallelism moves:
    the up-projected K and V, not the latent)."""
    return m.num_kv_heads * (m.resolved_head_dim + m.v_head_dim) / 2


def projection_flops(m: ModelConfig) -> dict[str, float]:
    """Forward FLOPs per token of what each attention remat tag's recompute re-runs:
    `qkv_proj` (GQA: q, k, v; MLA: the down-projections) and `mla_up_proj` (the q and KV
    up-projections; 0 without MLA)."""
    per = attention_params(m)
    if m.mla is None:
        return {"qkv_proj": 2.0 * (per["q"] + per["k"] + per["v"]), "mla_up_proj": 0.0}
    down = per.get("q_a", per.get("q")) + per["kv_a"]
    up = per.get("q_b", 0) + per["kv_b"]
    return {"qkv_proj": 2.0 * down, "mla_up_proj": 2.0 * up}


def attention_activation_elements(m: ModelConfig, tensor: int) -> float:
    """Elements per token one layer's attention keeps for its backward (module docstring),
    per tensor rank: GQA's q and output (H·E each, split) and K/V (per KV shard)."""
    H, E, F = m.num_heads, m.resolved_head_dim, m.v_head_dim
    if m.mla is None:
        kv_shards = tensor if m.num_kv_heads % tensor == 0 else 1
        return 2 * H * E / tensor + 2 * m.num_kv_heads * E / kv_shards
    a = m.mla
    return 2 * (a.q_lora_rank + a.kv_lora_rank) + 2 * H * (E + F) / tensor

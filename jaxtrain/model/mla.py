"""Multi-head latent attention (DeepSeek-V2/V3's MLA; HF `DeepseekV3Attention`), mesh-free.

    q      = x·Wq                                   (q_lora_rank = 0)
           | RMSNorm(x·Wq_a)·Wq_b                   (the query's low-rank path)
    c, kr  = split(x·Wkv_a, [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(RMSNorm(c)·Wkv_b, [qk_nope_head_dim, v_head_dim])   per head
    k      = [k_nope, RoPE(kr) broadcast to every head];  q = [q_nope, RoPE(q_rope)]
    out    = attention(q, k, v)·Wo,  scale 1/sqrt(qk_nope + qk_rope) x YaRN's mscale²

Under YaRN (model.mla.yarn_factor > 1) the rope part's frequencies and cos/sin scale are
rope.py's (rope_tables hands them in); only the softmax-scale correction is applied here.

The down-projections (Wq_a, Wkv_a) and the latent are per position, not per head: their
`latent` axis is never split over `tensor` (it takes `fsdp` where `embed` is not there), while
the up-projections and Wo carry `heads`, which the rules table splits over `tensor` as Megatron
splits them. The latent outputs carry the remat tag `qkv_proj`, the up-projected q, k_nope and
v the tag `mla_up_proj` (Megatron's recompute module of that name drops them: the backward
re-runs the up-projections from the saved latents). The mscale correction multiplies q (the
scores are linear in it), so every attention core runs MLA with its default scale.

Shape letters as llama.py's, plus R the q latent (q_lora_rank), C the KV latent (kv_lora_rank),
N the nope part, P the rope part, E = N + P the q/k head size, F the value head size.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.config import ModelConfig
from jaxtrain.model.layers import (Dense, gather_sequence, param, project_gathered,
                                   project_scattered, rms_norm, split_sequence)
from jaxtrain.model.rope import apply_rope

REMAT_TAGS = ("mla_up_proj",)


class LatentNorm(nnx.Module):
    """RMSNorm over a latent of `size` (the q latent's or the KV latent's)."""

    def __init__(self, cfg: ModelConfig, size: int, rngs):
        self.scale = param(rngs, jax.nn.initializers.ones, (size,), ("norm",),
                           jnp.dtype(cfg.param_dtype))
        self.eps = cfg.norm_eps
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps, self.compute_dtype)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, ops, rngs):
        a = cfg.mla
        d, h = cfg.hidden_size, cfg.num_heads
        e, n, p, f = a.qk_head_dim, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        kw = dict(cfg=cfg, ops=ops, rngs=rngs)
        base = "blocks/attn"
        if a.q_lora_rank:
            r = a.q_lora_rank
            self.wq_a = Dense((d,), (r,), ("embed", "latent"), std=1.0 / math.sqrt(d),
                              name=f"{base}/wq_a", **kw)
            self.q_norm = LatentNorm(cfg, r, rngs)
            self.wq_b = Dense((r,), (h, e), ("latent", "heads", "head_dim"),
                              std=1.0 / math.sqrt(r), name=f"{base}/wq_b", **kw)
        else:
            self.wq = Dense((d,), (h, e), ("embed", "heads", "head_dim"), std=1.0 / math.sqrt(d),
                            name=f"{base}/wq", **kw)
        self.wkv_a = Dense((d,), (a.kv_lora_rank + p,), ("embed", "latent"),
                           std=1.0 / math.sqrt(d), name=f"{base}/wkv_a", **kw)
        self.kv_norm = LatentNorm(cfg, a.kv_lora_rank, rngs)
        self.wkv_b = Dense((a.kv_lora_rank,), (h, n + f), ("latent", "heads", "head_dim"),
                           std=1.0 / math.sqrt(a.kv_lora_rank), name=f"{base}/wkv_b", **kw)
        self.wo = Dense((h, f), (d,), ("heads", "head_dim", "embed"),
                        std=1.0 / math.sqrt(h * f * 2 * cfg.num_layers), name=f"{base}/wo", **kw)
        self.q_lora = bool(a.q_lora_rank)
        self.dims = (a.kv_lora_rank, n, p, f)
        self.mscale = a.softmax_mscale
        self.ops = ops

    def __call__(self, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
        """x_BSD: the norm output, split over the sequence under sequence parallelism; cos/sin:
        the rope part's tables (rope.rope_tables over qk_rope_head_dim)."""
        c = self.ops.constrain
        act = ("batch", "sequence", "heads", None)
        kv_rank, n, p, _ = self.dims
        first = self.wq_a if self.q_lora else self.wq
        q_lat, kv_BSc = project_gathered(gather_sequence(c), x_BSD, (first, self.wkv_a), fp8)
        kv_BSc = c(checkpoint_name(kv_BSc, "qkv_proj"), ("batch", "sequence", None))
        if self.q_lora:
            q_BSR = c(checkpoint_name(q_lat, "qkv_proj"), ("batch", "sequence", None))
            q_BSHE = self.wq_b(self.q_norm(q_BSR))
        else:
            q_BSHE = q_lat
        q_BSHE = c(checkpoint_name(q_BSHE, "mla_up_proj"), act)
        c_BSC, k_rope_BSP = kv_BSc[..., :kv_rank], kv_BSc[..., kv_rank:]
        kv_BSHG = self.wkv_b(self.kv_norm(c_BSC))   # G = N + F
        k_nope_BSHN = c(checkpoint_name(kv_BSHG[..., :n], "mla_up_proj"), act)
        v_BSHF = c(checkpoint_name(kv_BSHG[..., n:], "mla_up_proj"), act)

        h = q_BSHE.shape[2]
        q_rope_BSHP = apply_rope(q_BSHE[..., n:], cos, sin)
        k_rope_BS1P = apply_rope(k_rope_BSP[:, :, None, :], cos, sin)
        q_BSHE = jnp.concatenate([q_BSHE[..., :n], q_rope_BSHP], axis=-1)
        if self.mscale != 1.0:
            q_BSHE = q_BSHE * jnp.asarray(self.mscale, q_BSHE.dtype)
        k_BSHE = jnp.concatenate(
            [k_nope_BSHN, jnp.broadcast_to(k_rope_BS1P, (*k_rope_BS1P.shape[:2], h, p))],
            axis=-1)
        k_BSHE = c(k_BSHE, act)
        o_BSHF = self.ops.attention(q_BSHE, k_BSHE, v_BSHF, segment_ids_BS)
        o_BSHF = c(checkpoint_name(o_BSHF, "core_attn"), act)
        return checkpoint_name(project_scattered(gather_sequence(c), split_sequence(c), o_BSHF,
                                                 self.wo, fp8), "attn_out")

"""The attention core behind `model.attention`: causal, grouped-query, segment-masked.

Inputs are [B, S, H, E] queries and [B, S, K, E] keys/values with H a multiple of K; query head
h reads KV head h // (H/K). Implementations:

- `xla`: plain jnp, partitioned by GSPMD like the rest of the model (the reference, the CPU path).
- `pallas`: our flash kernel (jaxtrain.model.kernels); Pallas interpret mode off GPU.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs, bf16/fp16.

A kernel is an opaque custom call that GSPMD cannot split, so on a mesh `pallas` and `cudnn`
run per shard under `jax.shard_map` (parallel/sharded_kernels.py: batch and heads where the
rules table puts them, the sequence whole, or, under context parallelism, split over `context`
with every core run by context_attention.py's strategies). Which core `auto`
means, and whether the kernel is interpreted, follows the devices the program is compiled
for (`sharding.platform`), so a compile for GPU targets picks what a GPU would run.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.config import ConfigError, check_gqa
from jaxtrain.model.kernels import FlashAttentionError, flash_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")
# cuDNN's fused attention (jax/_src/cudnn/fused_attention_stablehlo.py): half precision only,
# head dim a multiple of 8 and at most 256 (Hopper; 128 on older GPUs).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256


class AttentionConfigError(ConfigError):
    """model.attention (or the model's heads) that cannot run on these devices."""


# ----------------------------------------------------------------------------- per-device cores

def xla_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, *, causal=True, sm_scale=None):
    b, s, h, e = q_BSHE.shape
    k_heads = k_BSKE.shape[2]
    if h % k_heads:
        raise AttentionConfigError(f"{h} query heads are not divisible by {k_heads} KV heads")
    g = h // k_heads
    scale = sm_scale if sm_scale is not None else e ** -0.5
    q_BSKGE = q_BSHE.reshape(b, s, k_heads, g, e)
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BSKE,
                              preferred_element_type=jnp.float32) * scale
    mask_BST = segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]
    if causal:
        mask_BST &= jnp.tril(jnp.ones((s, s), dtype=bool))[None]
    # An additive bias, not a select: the backward of a select keeps its [B, K, G, S, T]
    # predicate (0.5 GiB per layer at s=4096, 32 heads); an add keeps nothing, and the
    # masked probabilities are exactly 0 either way (exp(-1e30 - max) underflows).
    bias_BST = jnp.where(mask_BST, 0.0, -1e30).astype(jnp.float32)
    scores_BKGST = scores_BKGST + bias_BST[:, None, None]
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1)
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", probs_BKGST.astype(v_BSKE.dtype), v_BSKE,
                           preferred_element_type=jnp.float32)
    return out_BSKGE.reshape(b, s, h, e).astype(q_BSHE.dtype)


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    """The flash kernel, causal; `interpret` runs the Pallas interpreter (slow, for tests)
    where the program's devices are not GPUs. Hashable by value (it lives in the graphdef)."""
    interpret: bool = True

    def __call__(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
        return flash_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, causal=True,
                               interpret=self.interpret)


def cudnn_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
    """cuDNN flash attention. Packed documents go in as a [B, 1, S, S] boolean mask (jax adds it
    as a bias, so it costs B·S² memory); causality is fused and skips the masked blocks."""
    mask_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BSHE, k_BSKE, v_BSKE, mask=mask_B1ST, is_causal=True,
                                        implementation="cudnn")


# ----------------------------------------------------------------------------- per shard

def local_kv_heads(k_BSKE, v_BSKE, n_heads: int, shards: int, shard):
    """In the `shard`-th of `shards` head shards, holding query heads [i·H/t, (i+1)·H/t) and all
    K KV heads (K not divisible by t): the KV heads those query heads read, keeping
    h -> h // (H/K) exact."""
    k_heads = k_BSKE.shape[2]
    group, local_heads = n_heads // k_heads, n_heads // shards
    first_head = shard * local_heads
    if group % local_heads == 0:
        # The whole shard sits inside one group (t a multiple of K): one KV head, MQA locally.
        kv = first_head // group
        return (jax.lax.dynamic_slice_in_dim(k_BSKE, kv, 1, axis=2),
                jax.lax.dynamic_slice_in_dim(v_BSKE, kv, 1, axis=2))
    # Groups straddle shards unevenly: give every local query head its own KV head (MHA).
    kv_H = (first_head + jnp.arange(local_heads)) // group
    return jnp.take(k_BSKE, kv_H, axis=2), jnp.take(v_BSKE, kv_H, axis=2)


# ----------------------------------------------------------------------------- selection

def resolve(impl: str, platform: str) -> str:
    """`auto` made concrete for the devices the program is for: pallas on GPUs, xla elsewhere."""
    if impl not in IMPLEMENTATIONS:
        raise AttentionConfigError(f"model.attention={impl!r}; choose one of {IMPLEMENTATIONS}")
    if impl == "auto":
        return "pallas" if platform == "gpu" else "xla"
    return impl


def _check_pallas(model_cfg):
    # Trace the kernel on abstract inputs of the model's shapes: its own validation (head dim,
    # dtype, GQA groups) fails here, before the model is built, with the kernel's message.
    e, h, k = model_cfg.resolved_head_dim, model_cfg.num_heads, model_cfg.num_kv_heads
    dtype = jnp.dtype(model_cfg.compute_dtype)
    q = jax.ShapeDtypeStruct((1, 16, h, e), dtype)
    kv = jax.ShapeDtypeStruct((1, 16, k, e), dtype)
    seg = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    try:
        jax.eval_shape(PallasAttention(interpret=True), q, kv, kv, seg)
    except FlashAttentionError as err:
        raise AttentionConfigError(f"model.attention=pallas: {err}") from err


def _check_cudnn(model_cfg, platform: str):
    e = model_cfg.resolved_head_dim
    if model_cfg.compute_dtype not in CUDNN_DTYPES:
        raise AttentionConfigError(
            f"model.attention=cudnn needs model.compute_dtype in {CUDNN_DTYPES}, got "
            f"{model_cfg.compute_dtype}; use attention=pallas or xla for float32")
    if e % 8 or e > CUDNN_MAX_HEAD_DIM:
        raise AttentionConfigError(
            f"model.attention=cudnn needs a head dim that is a multiple of 8 and at most "
            f"{CUDNN_MAX_HEAD_DIM}, got {e}; use attention=pallas")
    if platform != "gpu":
        raise AttentionConfigError(
            f"model.attention=cudnn needs an NVIDIA GPU but the program is for {platform} "
            "devices; use attention=xla (or pallas, interpreted) here, or compile for a GPU "
            "target (--dry-run --target h100)")


def select(model_cfg, platform: str):
    """The per-device attention core for `model.attention` on `platform` devices ('gpu',
    'cpu': see sharding.platform), checked against the model config. On a mesh, kernels run
    per shard: sharded_kernels.shard_attention wraps them."""
    impl = resolve(model_cfg.attention, platform)
    check_gqa(model_cfg, AttentionConfigError)  # also for model configs built without validate()
    if impl == "xla":
        return xla_attention  # GSPMD partitions it like any other jnp code
    if impl == "pallas":
        _check_pallas(model_cfg)
        return PallasAttention(interpret=platform != "gpu")
    _check_cudnn(model_cfg, platform)
    return cudnn_attention


def is_kernel(core) -> bool:
    """True for an opaque kernel (pallas, cudnn), which GSPMD cannot split."""
    return core is not xla_attention

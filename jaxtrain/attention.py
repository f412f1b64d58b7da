"""The attention core behind `model.attention`: causal, grouped-query, segment-masked.

Inputs are [B, S, H, E] queries and [B, S, K, E] keys/values with H a multiple of K; query head
h reads KV head h // (H/K). Implementations:

- `xla`: plain jnp, partitioned by GSPMD like the rest of the model (the reference, the CPU path).
- `pallas`: our flash kernel (jaxtrain.pallas_kernels); Pallas interpret mode off GPU.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs, bf16/fp16.

A kernel is an opaque custom call that GSPMD cannot split, so on a mesh `pallas` and `cudnn`
run per shard under `jax.shard_map`: batch over (data, fsdp), heads over `tensor`, the sequence
whole (context parallelism is not supported).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain.pallas_kernels import FlashAttentionError, flash_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas", "cudnn")
# cuDNN's fused attention (jax/_src/cudnn/fused_attention_stablehlo.py): half precision only,
# head dim a multiple of 8 and at most 256 (Hopper; 128 on older GPUs).
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256


class AttentionConfigError(ValueError):
    pass


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
    scores_BKGST = jnp.where(mask_BST[:, None, None], scores_BKGST, -1e30)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1)
    out_BSKGE = jnp.einsum("bkgst,btke->bskge", probs_BKGST.astype(v_BSKE.dtype), v_BSKE,
                           preferred_element_type=jnp.float32)
    return out_BSKGE.reshape(b, s, h, e).astype(q_BSHE.dtype)


def pallas_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
    """The flash kernel, causal; interpreted (slow, for tests) where there is no GPU."""
    return flash_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, causal=True,
                           interpret=jax.default_backend() != "gpu")


def cudnn_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
    """cuDNN flash attention. Packed documents go in as a [B, 1, S, S] boolean mask (jax adds it
    as a bias, so it costs B·S² memory); causality is fused and skips the masked blocks."""
    mask_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BSHE, k_BSKE, v_BSKE, mask=mask_B1ST, is_causal=True,
                                        implementation="cudnn")


_KERNELS = {"pallas": pallas_attention, "cudnn": cudnn_attention}


# ----------------------------------------------------------------------------- on a mesh

def _axes_dividing(mesh: Mesh, axes, dim):
    """The axes of `axes` (size > 1) to split a dim of size `dim` over, or None if they don't
    divide it (then the dim is replicated and each device computes all of it)."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    if not axes or dim % size:
        return None
    return axes if len(axes) > 1 else axes[0]


def _local_kv(k_BSKE, v_BSKE, n_heads: int, tensor: int):
    """Inside a shard holding heads [i·H/t, (i+1)·H/t) and all K KV heads (K not divisible by
    t): the KV heads those query heads read, keeping h -> h // (H/K) exact."""
    k_heads = k_BSKE.shape[2]
    group, local_heads = n_heads // k_heads, n_heads // tensor
    first_head = jax.lax.axis_index("tensor") * local_heads
    if group % local_heads == 0:
        # The whole shard sits inside one group (t a multiple of K): one KV head, MQA locally.
        kv = first_head // group
        return (jax.lax.dynamic_slice_in_dim(k_BSKE, kv, 1, axis=2),
                jax.lax.dynamic_slice_in_dim(v_BSKE, kv, 1, axis=2))
    # Groups straddle shards unevenly: give every local query head its own KV head (MHA).
    kv_H = (first_head + jnp.arange(local_heads)) // group
    return jnp.take(k_BSKE, kv_H, axis=2), jnp.take(v_BSKE, kv_H, axis=2)


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """`kernel` applied per shard of `mesh` with jax.shard_map.

    `inside_data_vmap`: the call happens under the train step's vmap over `data`
    (spmd_axis_name="data"); shard_map's batching rule then adds `data` to the vmapped dim
    itself, so the specs here split the batch over `fsdp` only (naming `data` is an error).
    Hashable by value: nnx keeps it in the graph definition through `Ops`.
    """
    kernel: Callable
    mesh: Mesh
    inside_data_vmap: bool = False

    def __call__(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
        mesh = self.mesh
        b, _, n_heads, _ = q_BSHE.shape
        k_heads = k_BSKE.shape[2]
        if n_heads % k_heads:
            raise AttentionConfigError(
                f"{n_heads} query heads are not divisible by {k_heads} KV heads")
        batch = _axes_dividing(mesh, ("fsdp",) if self.inside_data_vmap else ("data", "fsdp"), b)
        heads = _axes_dividing(mesh, ("tensor",), n_heads)
        kv_heads = heads if heads and k_heads % mesh.shape["tensor"] == 0 else None
        q_spec = P(batch, None, heads, None)
        kv_spec = P(batch, None, kv_heads, None)

        def per_shard(q, k, v, seg):
            if heads and not kv_heads:
                k, v = _local_kv(k, v, n_heads, mesh.shape["tensor"])
            return self.kernel(q, k, v, seg)

        # check_vma=False: a pallas_call carries no varying-axes types for the checker. The
        # specs are exact, and autodiff still sums replicated K/V's cotangents over `tensor`.
        return jax.shard_map(per_shard, mesh=mesh,
                             in_specs=(q_spec, kv_spec, kv_spec, P(batch, None)),
                             out_specs=q_spec, check_vma=False)(
            q_BSHE, k_BSKE, v_BSKE, segment_ids_BS)


# ----------------------------------------------------------------------------- selection

def resolve(impl: str) -> str:
    """`auto` made concrete: pallas on GPU, xla elsewhere."""
    if impl not in IMPLEMENTATIONS:
        raise AttentionConfigError(f"model.attention={impl!r}; choose one of {IMPLEMENTATIONS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
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
        jax.eval_shape(pallas_attention, q, kv, kv, seg)
    except FlashAttentionError as err:
        raise AttentionConfigError(f"model.attention=pallas: {err}") from err


def _check_cudnn(model_cfg):
    e = model_cfg.resolved_head_dim
    if model_cfg.compute_dtype not in CUDNN_DTYPES:
        raise AttentionConfigError(
            f"model.attention=cudnn needs model.compute_dtype in {CUDNN_DTYPES}, got "
            f"{model_cfg.compute_dtype}; use attention=pallas or xla for float32")
    if e % 8 or e > CUDNN_MAX_HEAD_DIM:
        raise AttentionConfigError(
            f"model.attention=cudnn needs a head dim that is a multiple of 8 and at most "
            f"{CUDNN_MAX_HEAD_DIM}, got {e}; use attention=pallas")
    if jax.default_backend() != "gpu":
        raise AttentionConfigError(
            f"model.attention=cudnn needs an NVIDIA GPU but the backend is "
            f"{jax.default_backend()}; use attention=xla (or pallas, interpreted) here")


def select(model_cfg, mesh: Optional[Mesh] = None, *, inside_data_vmap: bool = False):
    """The `ops.attention` callable for `model.attention`, checked against the model config.

    With a `mesh` of more than one device, kernels run per shard (see ShardedAttention);
    `inside_data_vmap` says the model runs under the train step's vmap over `data`.
    """
    impl = resolve(model_cfg.attention)
    if model_cfg.num_heads % model_cfg.num_kv_heads:
        raise AttentionConfigError(
            f"model.num_heads={model_cfg.num_heads} is not divisible by "
            f"model.num_kv_heads={model_cfg.num_kv_heads}; pick a divisor of num_heads")
    if mesh is not None and mesh.shape.get("context", 1) > 1:
        raise AttentionConfigError(
            f"parallel.context={mesh.shape['context']}: attention does not support context "
            "parallelism (the sequence must be whole on every device); set parallel.context=1")
    if impl == "xla":
        return xla_attention  # GSPMD partitions it like any other jnp code
    if impl == "pallas":
        _check_pallas(model_cfg)
    else:
        _check_cudnn(model_cfg)
    kernel = _KERNELS[impl]
    if mesh is None or mesh.size == 1:
        return kernel
    return ShardedAttention(kernel, mesh, inside_data_vmap)

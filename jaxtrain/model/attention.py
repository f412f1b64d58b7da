"""The attention core behind `model.attention`: causal, grouped-query, segment-masked.

Inputs are [B, S, H, E] queries and [B, S, K, E] keys/values with H a multiple of K; query head
h reads KV head h // (H/K). Implementations:

- `xla`: plain jnp, partitioned by GSPMD like the rest of the model (the reference, the CPU path).
- `pallas`: our flash kernel (jaxtrain.model.kernels) on Pallas's Triton backend; Pallas
  interpret mode off GPU.
- `mosaic`: the same kernel's Hopper form on Mosaic GPU (TMA, wgmma, warp specialisation:
  H100/H200, bf16/fp16); jax's GPU interpreter off GPU.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, NVIDIA GPUs, bf16/fp16;
  packed documents go in as an explicit mask (cuDNN never sees segment ids it could drop).

`auto` picks mosaic on Hopper GPUs where this jax has Mosaic GPU and the model fits the kernel
(bf16/fp16, head dims <= 192), pallas on other GPUs, xla elsewhere (`choose` says why).

A value head size apart from the q/k one (model.mla's v_head_dim): xla, pallas and mosaic take
it natively (the kernels pad each to its tile); cudnn refuses it (jax's
dot_product_attention has one head size for K and V).

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

from jaxtrain import compat
from jaxtrain.config import ConfigError, check_gqa
from jaxtrain.model.kernels import FlashAttentionError, flash_attention
from jaxtrain.model.kernels.flash_config import MOSAIC_DTYPES, MOSAIC_MAX_HEAD_DIM

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic", "cudnn")
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
    out_BSKGF = jnp.einsum("bkgst,btkf->bskgf", probs_BKGST.astype(v_BSKE.dtype), v_BSKE,
                           preferred_element_type=jnp.float32)
    return out_BSKGF.reshape(b, s, h, v_BSKE.shape[-1]).astype(q_BSHE.dtype)  # v's head size


@dataclasses.dataclass(frozen=True)
class PallasAttention:
    """The flash kernel, causal, on Pallas's `backend` ("triton": model.attention=pallas;
    "mosaic": model.attention=mosaic); `interpret` runs the Pallas interpreter (slow, for
    tests) where the program's devices are not GPUs. Hashable by value (it lives in the
    graphdef)."""
    interpret: bool = True
    backend: str = "triton"

    @property
    def name(self) -> str:
        return "mosaic" if self.backend == "mosaic" else "pallas"

    def __call__(self, q_BSHE, k_BSKE, v_BSKE, segment_ids_BS):
        return flash_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, causal=True,
                               interpret=self.interpret, backend=self.backend)


def cudnn_attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS, *, implementation="cudnn"):
    """cuDNN flash attention. Packed documents go in as a [B, 1, S, S] boolean mask (jax adds it
    as a bias, so it costs B·S² memory; the compiled cuDNN call carries it, test_gpu_compile):
    never as segment ids, which a cuDNN path can drop (MaxText #4476 found one that did).
    Causality is fused and skips the masked blocks. `implementation="xla"`: the same call on
    jax's XLA path (what the CPU tests check the mask with)."""
    if v_BSKE.shape[-1] != k_BSKE.shape[-1]:
        raise AttentionConfigError(
            f"attention=cudnn: jax.nn.dot_product_attention takes one head size for K and V, got "
            f"{k_BSKE.shape[-1]} and {v_BSKE.shape[-1]}; use attention=mosaic, pallas or xla")
    mask_B1ST = (segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BSHE, k_BSKE, v_BSKE, mask=mask_B1ST, is_causal=True,
                                        implementation=implementation)


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

def _mosaic_unfit(model_cfg, compute_capability) -> str | None:
    """Why the Mosaic GPU kernel cannot be `auto`'s choice for this model on these GPUs
    (None: it can)."""
    if compat.mosaic_gpu() is None:
        return f"this jax ({jax.__version__}) has no Mosaic GPU backend"
    if compute_capability is None or not str(compute_capability).startswith("9."):
        return (f"the Mosaic kernels are Hopper's (sm_90: wgmma, TMA); these GPUs are "
                f"sm_{str(compute_capability or 'unknown').replace('.', '')}")
    if jnp.dtype(model_cfg.compute_dtype) not in MOSAIC_DTYPES:
        return f"the Mosaic kernel takes bf16/fp16, compute_dtype is {model_cfg.compute_dtype}"
    e, ev = model_cfg.resolved_head_dim, model_cfg.v_head_dim
    if max(e, ev) > MOSAIC_MAX_HEAD_DIM:
        sizes = f"head dim {e}" if e == ev else f"head dims q/k {e}, v {ev}"
        return f"{sizes} > the Mosaic kernel's {MOSAIC_MAX_HEAD_DIM}"
    return None


def choose(model_cfg, platform: str, compute_capability=None) -> tuple[str, str]:
    """(core, why): `model.attention` made concrete for the devices the program is for
    ('gpu' with its compute capability, 'cpu': see sharding.platform), and the reason, as
    the dry run reports it."""
    impl = model_cfg.attention
    if impl not in IMPLEMENTATIONS:
        raise AttentionConfigError(f"model.attention={impl!r}; choose one of {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl, "model.attention"
    if platform != "gpu":
        return "xla", f"auto: {platform} devices run the XLA core"
    unfit = _mosaic_unfit(model_cfg, compute_capability)
    if unfit is None:
        return "mosaic", (f"auto: jax {jax.__version__} has Mosaic GPU and these are sm_90 "
                          "GPUs (checked products; the Triton kernel is attention=pallas)")
    return "pallas", f"auto: Triton kernel, since {unfit}"


def _check_pallas(model_cfg, backend: str = "triton"):
    # Trace the kernel on abstract inputs of the model's shapes: its own validation (head dim,
    # dtype, GQA groups) fails here, before the model is built, with the kernel's message.
    e, h, k = model_cfg.resolved_head_dim, model_cfg.num_heads, model_cfg.num_kv_heads
    dtype = jnp.dtype(model_cfg.compute_dtype)
    q = jax.ShapeDtypeStruct((1, 16, h, e), dtype)
    kv = jax.ShapeDtypeStruct((1, 16, k, e), dtype)
    v = jax.ShapeDtypeStruct((1, 16, k, model_cfg.v_head_dim), dtype)   # MLA: its own size
    seg = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    name = "mosaic" if backend == "mosaic" else "pallas"
    try:
        jax.eval_shape(PallasAttention(interpret=True, backend=backend), q, kv, v, seg)
    except FlashAttentionError as err:
        raise AttentionConfigError(f"model.attention={name}: {err}") from err


def _check_cudnn(model_cfg, platform: str):
    e = model_cfg.resolved_head_dim
    if model_cfg.v_head_dim != e:
        raise AttentionConfigError(
            f"model.attention=cudnn: jax.nn.dot_product_attention takes one head size for K "
            f"and V, but model.mla has q/k {e} and v {model_cfg.v_head_dim}; use "
            "attention=mosaic, pallas or xla (auto picks one that fits)")
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


def select(model_cfg, platform: str, compute_capability=None):
    """The per-device attention core for `model.attention` on `platform` devices ('gpu' of
    `compute_capability`, 'cpu': see sharding.platform), checked against the model config.
    On a mesh, kernels run per shard: sharded_kernels.shard_attention wraps them."""
    impl, _ = choose(model_cfg, platform, compute_capability)
    check_gqa(model_cfg, AttentionConfigError)  # also for model configs built without validate()
    if impl == "xla":
        return xla_attention  # GSPMD partitions it like any other jnp code
    if impl == "mosaic" and platform == "gpu":
        unfit = _mosaic_unfit(model_cfg, compute_capability)
        if unfit is not None:
            raise AttentionConfigError(f"model.attention=mosaic cannot run here: {unfit}; use "
                                       "attention=pallas (the Triton kernel) or auto")
    if impl in ("pallas", "mosaic"):
        backend = "mosaic" if impl == "mosaic" else "triton"
        _check_pallas(model_cfg, backend)
        return PallasAttention(interpret=platform != "gpu", backend=backend)
    _check_cudnn(model_cfg, platform)
    return cudnn_attention


def check_interpretable(core, n_devices: int) -> None:
    """Refuse, rather than hang, an interpreted Mosaic kernel in a program of several devices:
    jax's GPU interpreter runs each program's warpgroups as XLA:CPU computations that block
    on each other's barriers, and with every device doing so they take all of XLA:CPU's
    worker threads and deadlock (seen at 2 devices x 3 warpgroups, tests with 8 fake
    devices; one device runs)."""
    if isinstance(core, PallasAttention) and core.backend == "mosaic" and core.interpret \
            and n_devices > 1:
        raise AttentionConfigError(
            f"model.attention=mosaic interpreted on CPU runs on one device only (jax's GPU "
            f"interpreter deadlocks XLA:CPU across {n_devices} devices); use attention=pallas "
            "or xla for multi-device CPU runs, or compile for a GPU target")


def is_kernel(core) -> bool:
    """True for an opaque kernel (pallas, cudnn), which GSPMD cannot split."""
    return core is not xla_attention

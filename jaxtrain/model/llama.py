"""Llama 3 decoder in Flax NNX: embed -> scan(Block) -> norm -> lm_head.

The maths only. Every parameter carries logical axis names (docs/design.md §3) and never a mesh
axis; activation sharding goes through the injected `constrain(x, logical_names)`, which is the
identity unless `sharding` provides one. Every projection matmul goes through one injectable
`dot_general`. Activations carry `checkpoint_name` tags that `remat` policies refer to.
Parameters are fp32 masters; each use casts them to `compute_dtype`.

FP8 (`Ops.fp8`): the projections (q/k/v/o, gate/up/down) of the middle layers run through
`fp8.fp8_dot_general`; each projection owns an `Fp8MetaState` variable (stacked with the
layers like the kernels, so the layer scan slices one meta per layer). Embedding, lm_head,
norms, attention and residuals never see FP8. `bf16_first`/`bf16_last` layers keep their
projections in the compute dtype: the stack runs as up to three scans over static layer
ranges (`layer_spans`), so every scan body is one fixed kind of layer.

Shape letters: B batch, S sequence, D hidden, H query heads, K kv heads, G = H/K, E head dim,
F mlp, V vocab, L layers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.model import attention as attention_lib
from jaxtrain.model import fp8 as fp8_lib
from jaxtrain.config import ModelConfig

Constrain = Callable[[jax.Array, tuple], jax.Array]
DotGeneral = Callable[..., jax.Array]

REMAT_TAGS = ("layer_input", "attn_norm", "qkv_proj", "core_attn", "attn_out", "mlp_norm",
              "mlp_in", "mlp_act", "mlp_out")



def identity_constrain(x, names):
    del names
    return x


@dataclasses.dataclass(frozen=True)
class Fp8Layers:
    """Which layers' projections run in FP8, and the recipe (hashable: lives in the graphdef)."""
    recipe: fp8_lib.Recipe
    bf16_first: int = 0
    bf16_last: int = 0


@dataclasses.dataclass(frozen=True)
class Ops:
    """What the model lets the outside world choose: how to matmul, how to shard, how to attend.

    `embed_lookup(table_VD, tokens_BS) -> x_BSD` looks tokens up in the (compute-dtype)
    table; on a mesh sharding supplies one that never gathers the table.
    `run_layers(block_fn, x_BSD, stacked_layer_state) -> x_BSD` runs the layer stack; the
    default is a plain scan, `remat` supplies checkpointed and grouped scans. When the stack
    runs as several layer ranges (FP8 with bf16 first/last layers), `span_runner(start, stop)`
    gives the runner of layers [start, stop) (default: `run_layers` for every range).
    """
    dot_general: DotGeneral = jax.lax.dot_general
    constrain: Constrain = identity_constrain
    attention: Callable = attention_lib.xla_attention
    embed_lookup: Callable = None   # (table_VD, tokens_BS) -> x_BSD; default jnp.take
    run_layers: Optional[Callable] = None
    fp8: Optional[Fp8Layers] = None
    span_runner: Optional[Callable[[int, int], Callable]] = None


class Fp8MetaState(nnx.Variable):
    """An `fp8.Fp8Meta` (scales, amax histories): train state outside `params`, never optimised."""


def layer_spans(num_layers: int, fp8: Optional[Fp8Layers]) -> list[tuple[int, int, bool]]:
    """[(start, stop, runs_fp8)]: the static layer ranges the stack runs as."""
    if fp8 is None:
        return [(0, num_layers, False)]
    first, last = fp8.bf16_first, num_layers - fp8.bf16_last
    spans = [(0, first, False), (first, last, True), (last, num_layers, False)]
    return [s for s in spans if s[1] > s[0]]


def _param(rngs: nnx.Rngs, init, shape, axes, dtype):
    value = init(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(std):
    return jax.nn.initializers.normal(stddev=std)


def _real_vocab_rows(init, real_vocab: int, axis: int):
    """`init` drawn at the real vocab size along `axis`, zero-padded to the requested size:
    the padding (a multiple of 128·tensor) then changes no drawn value, so the same seed gives
    the same model whatever the tensor degree. Padding rows stay zero in training (never
    looked up; their logits are masked, so they get no gradient)."""
    def draw(key, shape, dtype):
        real = init(key, (*shape[:axis], real_vocab, *shape[axis + 1:]), dtype)
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, shape[axis] - real_vocab)
        return jnp.pad(real, pad)
    return draw


class Dense(nnx.Module):
    """A projection: contracts x's last `len(in_shape)` dims with the kernel's leading dims.

    With `ops.fp8` it also owns an FP8 meta; `fp8=True` calls then run in FP8 (x is the E4M3
    activation operand, the kernel the E4M3 weight operand, gradients E5M2).
    """

    def __init__(self, in_shape, out_shape, axes, *, cfg: ModelConfig, ops: Ops, rngs, std,
                 name: str):
        self.kernel = _param(rngs, _normal(std), (*in_shape, *out_shape), axes,
                             jnp.dtype(cfg.param_dtype))
        self.n_in = len(in_shape)
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)
        self.ops = ops
        self.name = name
        if ops.fp8 is not None:
            self.fp8_meta = Fp8MetaState(fp8_lib.init_meta(ops.fp8.recipe))

    def __call__(self, x, fp8: bool = False):
        return self.apply(x, self.weights(), fp8)

    def weights(self):
        """(kernel, FP8 meta or None): what `apply` computes with, as arrays."""
        return self.kernel[...], (self.fp8_meta.get_value() if self.ops.fp8 is not None
                                  else None)

    def apply(self, x, weights, fp8: bool = False):
        """The projection of x with `weights` (from `weights()`), reading no variable itself:
        callable where only explicit arrays may enter (a custom VJP's function)."""
        kernel, meta = weights
        w = kernel.astype(self.compute_dtype)
        n = self.n_in
        dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
        x = x.astype(self.compute_dtype)
        if fp8:
            if self.ops.fp8 is None:
                raise fp8_lib.Fp8Error(f"{self.name}: fp8=True but the model was built without "
                                       "Ops.fp8 (no FP8 meta); set fp8.enabled=true")
            return fp8_lib.fp8_dot_general(x, w, dims, meta=meta, cfg=self.ops.fp8.recipe,
                                           name=self.name)
        return self.ops.dot_general(x, w, dims)


def project_gathered(gather, x, projections, fp8: bool):
    """The projections (Dense) of gather(x), the whole sequence, gathered once for all of them;
    the backward gathers x again for the weight gradients instead of keeping gather(x)
    (Megatron-SP: a layer keeps its sequence-parallel shard). Left to GSPMD, each projection
    gathers x itself and again in the backward (14 sequence-sized all-gathers per layer, 6
    here); a gather shared and kept holds the whole sequence per layer (+20 GiB at Llama 70B,
    tensor=8). Without sequence parallelism `gather` is the identity and nothing changes.

    The backward re-traces the projections for their VJP; their forward GEMMs, unused there,
    are dead code XLA removes (the compiled matmul FLOPs are unchanged)."""
    def run(xg, weights):
        return tuple(p.apply(xg, w, fp8) for p, w in zip(projections, weights))

    @jax.custom_vjp
    def projected(x, weights):
        return run(gather(x), weights)

    def fwd(x, weights):
        return run(gather(x), weights), (x, weights)

    def bwd(saved, cts):
        x, weights = saved
        xg, pull_gather = jax.vjp(gather, x)
        _, pull = jax.vjp(run, xg, weights)
        d_xg, d_weights = pull(cts)
        return pull_gather(d_xg)[0], d_weights

    projected.defvjp(fwd, bwd)
    return projected(x, tuple(p.weights() for p in projections))


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs):
        self.scale = _param(rngs, jax.nn.initializers.ones, (cfg.hidden_size,), ("norm",),
                            jnp.dtype(cfg.param_dtype))
        self.eps = cfg.norm_eps
        self.compute_dtype = jnp.dtype(cfg.compute_dtype)

    def __call__(self, x_BSD):
        return rms_norm(x_BSD, self.scale[...], self.eps, self.compute_dtype)


def _elementwise_recomputed(fn):
    """`fn` whose backward recomputes its (cheap, elementwise) insides from its inputs instead
    of keeping them: autodiff would otherwise hold every fp32 intermediate per layer (a 70B
    layer's norms kept 4 fp32 copies of the residual stream, its SwiGLU 5 MLP-sized tensors
    where Megatron keeps 3). The inputs are kept anyway (the residual stream, the in-projection
    outputs), so this costs no memory and a few elementwise passes."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _gather_sequence(constrain):
    """x -> x with every position of its context shard (the projections' input), from its
    SP shards."""
    return lambda x_BSD: constrain(x_BSD, ("batch", "sequence", "embed"))


def _split_sequence(constrain):
    """y -> y in the residual stream's layout (split over the sequence under SP)."""
    return lambda y_BSD: constrain(y_BSD, ("batch", "length", "embed"))


def project_scattered(gather, scatter, x, projection, fp8: bool):
    """scatter(projection(x)): a row-parallel projection whose output joins the residual
    stream (reduce-scattered over the sequence under sequence parallelism). Its backward
    gathers the output's cotangent once for both of the projection's gradients (GSPMD left to
    itself gathers it once per gradient GEMM: 2 of the 8 sequence-sized all-gathers a layer
    would run)."""
    weights = projection.weights()
    apply = lambda x_, w_: projection.apply(x_, w_, fp8)  # noqa: E731

    @jax.custom_vjp
    def projected(x, weights):
        return scatter(apply(x, weights))

    def fwd(x, weights):
        y, pull = jax.vjp(apply, x, weights)   # keeps what autodiff would keep
        return scatter(y), pull

    def bwd(pull, ct):
        return pull(gather(ct))

    projected.defvjp(fwd, bwd)
    return projected(x, weights)


def rms_norm(x_BSD, scale_D, eps: float, compute_dtype):
    """RMSNorm with its statistics in fp32 whatever the compute dtype."""
    @_elementwise_recomputed
    def norm(x_BSD, scale_D):
        x = x_BSD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return (x * scale_D.astype(jnp.float32)).astype(compute_dtype)
    return norm(x_BSD, scale_D)


@_elementwise_recomputed
def swiglu(gate_BSF, up_BSF):
    return jax.nn.silu(gate_BSF) * up_BSF


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [E/2], with Llama 3.1's frequency-dependent scaling when configured."""
    e = cfg.resolved_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv_freq / rs.factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def rope_tables(cfg: ModelConfig, positions_BS):
    inv_freq = jnp.asarray(rope_frequencies(cfg))
    angles_BSe = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles_BSe), jnp.sin(angles_BSe)


def apply_rope(x_BSNE, cos_BSe, sin_BSe):
    """Rotate-half RoPE (the Hugging Face Llama convention), computed in fp32."""
    x = x_BSNE.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BSe[:, :, None, :], sin_BSe[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSNE.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, rngs):
        d, h, k, e = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        std = 1.0 / math.sqrt(d)
        kw = dict(cfg=cfg, ops=ops, rngs=rngs)
        self.wq = Dense((d,), (h, e), ("embed", "heads", "head_dim"), std=std,
                        name="blocks/attn/wq", **kw)
        self.wk = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), std=std,
                        name="blocks/attn/wk", **kw)
        self.wv = Dense((d,), (k, e), ("embed", "kv_heads", "head_dim"), std=std,
                        name="blocks/attn/wv", **kw)
        self.wo = Dense((h, e), (d,), ("heads", "head_dim", "embed"),
                        std=1.0 / math.sqrt(h * e * 2 * cfg.num_layers), name="blocks/attn/wo",
                        **kw)
        self.ops = ops

    def __call__(self, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
        """x_BSD: the norm output, split over the sequence under sequence parallelism."""
        c = self.ops.constrain
        q_BSHE, k_BSKE, v_BSKE = project_gathered(_gather_sequence(c), x_BSD,
                                                  (self.wq, self.wk, self.wv), fp8)
        q_BSHE = c(checkpoint_name(q_BSHE, "qkv_proj"), ("batch", "sequence", "heads", None))
        k_BSKE = c(checkpoint_name(k_BSKE, "qkv_proj"), ("batch", "sequence", "kv_heads", None))
        v_BSKE = c(checkpoint_name(v_BSKE, "qkv_proj"), ("batch", "sequence", "kv_heads", None))
        q_BSHE, k_BSKE = apply_rope(q_BSHE, cos, sin), apply_rope(k_BSKE, cos, sin)
        o_BSHE = self.ops.attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS)
        o_BSHE = c(checkpoint_name(o_BSHE, "core_attn"), ("batch", "sequence", "heads", None))
        return checkpoint_name(project_scattered(_gather_sequence(c), _split_sequence(c), o_BSHE,
                                                 self.wo, fp8), "attn_out")


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, rngs):
        d, f = cfg.hidden_size, cfg.mlp_size
        kw = dict(cfg=cfg, ops=ops, rngs=rngs)
        self.w_gate = Dense((d,), (f,), ("embed", "mlp"), std=1.0 / math.sqrt(d),
                            name="blocks/mlp/w_gate", **kw)
        self.w_up = Dense((d,), (f,), ("embed", "mlp"), std=1.0 / math.sqrt(d),
                          name="blocks/mlp/w_up", **kw)
        self.w_down = Dense((f,), (d,), ("mlp", "embed"),
                            std=1.0 / math.sqrt(f * 2 * cfg.num_layers), name="blocks/mlp/w_down",
                            **kw)
        self.ops = ops

    def __call__(self, x_BSD, fp8: bool = False):
        """x_BSD: the norm output, split over the sequence under sequence parallelism."""
        c = self.ops.constrain
        gate_BSF, up_BSF = project_gathered(_gather_sequence(c), x_BSD,
                                            (self.w_gate, self.w_up), fp8)
        gate_BSF = c(checkpoint_name(gate_BSF, "mlp_in"), ("batch", "sequence", "mlp"))
        up_BSF = c(checkpoint_name(up_BSF, "mlp_in"), ("batch", "sequence", "mlp"))
        h_BSF = checkpoint_name(swiglu(gate_BSF, up_BSF), "mlp_act")
        return checkpoint_name(project_scattered(_gather_sequence(c), _split_sequence(c), h_BSF,
                                                 self.w_down, fp8), "mlp_out")


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, rngs):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, ops, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp = Mlp(cfg, ops, rngs)
        self.ops = ops

    def __call__(self, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
        c = self.ops.constrain
        residual = ("batch", "length", "embed")  # sequence-parallel region when SP is on
        x_BSD = c(checkpoint_name(x_BSD, "layer_input"), residual)
        h_BSD = c(checkpoint_name(self.attn_norm(x_BSD), "attn_norm"), residual)
        x_BSD = x_BSD + c(self.attn(h_BSD, cos, sin, segment_ids_BS, fp8), residual)
        h_BSD = c(checkpoint_name(self.mlp_norm(x_BSD), "mlp_norm"), residual)
        return x_BSD + c(self.mlp(h_BSD, fp8), residual)


def scan_layers(block_fn, x_BSD, stacked_state):
    """The default layer runner: one scan over the stacked layers, nothing rematerialised."""
    x_BSD, _ = jax.lax.scan(lambda x, s: (block_fn(s, x), None), x_BSD, stacked_state)
    return x_BSD


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, ops: Ops = Ops(),
                 real_vocab: int | None = None):
        """`cfg.vocab_size` may be padded (Megatron's make-vocab-size-divisible-by); logits of
        the padding ids beyond `real_vocab` are masked so the loss is that of the real vocab."""
        self.cfg = cfg
        self.ops = ops
        self.real_vocab = real_vocab or cfg.vocab_size
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, _real_vocab_rows(_normal(1.0), self.real_vocab, axis=0),
                            (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pdt)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, ops, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, _real_vocab_rows(_normal(1.0 / math.sqrt(cfg.hidden_size)),
                                       self.real_vocab, axis=1),
                (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pdt)

    # The three stages of the forward pass, separately callable so a pipeline can put the
    # embedding before and the head after its stages.
    def embed_tokens(self, tokens_BS):
        c = self.ops.constrain
        table_VD = self.embed[...].astype(jnp.dtype(self.cfg.compute_dtype))
        if self.ops.embed_lookup is None:
            x_BSD = jnp.take(table_VD, tokens_BS, axis=0)
        else:
            x_BSD = self.ops.embed_lookup(table_VD, tokens_BS)
        return c(x_BSD, ("batch", "length", "embed"))

    def block_fn(self):
        """(layer_state, x, cos, sin, segment_ids, fp8=False) -> x for one layer, and the
        stacked state (FP8 metas included). `fp8=True` runs the layer's projections in FP8."""
        graphdef, state = nnx.split(self.blocks)

        def apply(layer_state, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
            return nnx.merge(graphdef, layer_state)(x_BSD, cos, sin, segment_ids_BS, fp8)
        return apply, state

    def run_blocks(self, x_BSD, positions_BS, segment_ids_BS, use_fp8: bool = True):
        """The layer stack; `use_fp8=False` runs every layer in the compute dtype (e.g. an
        evaluation without FP8 scales)."""
        cos, sin = rope_tables(self.cfg, positions_BS)
        apply, state = self.block_fn()
        n = self.cfg.num_layers
        for start, stop, span_fp8 in layer_spans(n, self.ops.fp8):
            def block_fn(s, x, fp8=span_fp8 and use_fp8):
                return apply(s, x, cos, sin, segment_ids_BS, fp8)
            # Slicing copies the range's layer state; the common cases (one range) do not.
            part = state if (start, stop) == (0, n) else jax.tree.map(
                lambda a, start=start, stop=stop: a[start:stop], state)
            if self.ops.span_runner is not None:
                run = self.ops.span_runner(start, stop)
            else:
                run = self.ops.run_layers or scan_layers
            x_BSD = run(block_fn, x_BSD, part)
        return x_BSD

    def logits(self, x_BSD):
        h_BSD = self.final_norm(x_BSD)
        w_DV = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        w_DV = self.ops.constrain(w_DV, ("embed", "vocab"))  # gathered once, vocab-parallel
        # The GEMM writes the compute dtype (fp32 accumulation inside), as Megatron's and
        # MaxText's heads do: its weight gradient is then a compute-dtype GEMM, reduce-scattered
        # over fsdp in that dtype (an fp32 one was all-reduced: 3.7 GB per step on the wire at
        # Llama 3 8B, fsdp=8). Softmax and the loss run in fp32.
        logits_BSV = jnp.einsum("bsd,dv->bsv", h_BSD, w_DV.astype(h_BSD.dtype),
                                preferred_element_type=h_BSD.dtype).astype(jnp.float32)
        if self.real_vocab < self.cfg.vocab_size:
            is_real_V = jnp.arange(self.cfg.vocab_size) < self.real_vocab
            logits_BSV = jnp.where(is_real_V, logits_BSV, -1e30)
        return self.ops.constrain(logits_BSV, ("batch", "length", "vocab"))

    def __call__(self, tokens_BS, positions_BS=None, segment_ids_BS=None, use_fp8: bool = True):
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        if segment_ids_BS is None:
            segment_ids_BS = jnp.ones_like(tokens_BS)
        x_BSD = self.embed_tokens(tokens_BS)
        x_BSD = self.run_blocks(x_BSD, positions_BS, segment_ids_BS, use_fp8)
        return self.logits(x_BSD)


def cross_entropy_sum(logits_BSV, targets_BS, mask_BS):
    """Summed token cross entropy in fp32 and the number of counted tokens.

    Sums (not means) so microbatches and data shards combine exactly. The target logit is
    picked with a one-hot product so a vocab-sharded logits array is reduced where it lives
    instead of being gathered onto one device (Megatron's vocab-parallel cross entropy)."""
    logits_BSV = logits_BSV.astype(jnp.float32)
    lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
    onehot_BSV = jax.nn.one_hot(targets_BS, logits_BSV.shape[-1], dtype=jnp.float32)
    target_BS = jnp.sum(logits_BSV * onehot_BSV, axis=-1)
    mask_BS = mask_BS.astype(jnp.float32)
    return jnp.sum((lse_BS - target_BS) * mask_BS), jnp.sum(mask_BS)

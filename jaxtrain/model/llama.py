"""Llama 3 decoder in Flax NNX: embed -> scan(Block) -> norm -> lm_head.

The maths only. Every parameter carries logical axis names (docs/design.md §3) and never a mesh
axis; activation sharding goes through the injected `constrain(x, logical_names)`, which is the
identity unless `sharding` provides one. Every projection matmul goes through one injectable
`dot_general`. Activations carry `checkpoint_name` tags that `remat` policies refer to.
Parameters are fp32 masters; each use casts them to `compute_dtype`.

FP8 (`Ops.fp8`, the converter of model/fp8.py): the projections (q/k/v/o, gate/up/down) ask
it for their meta variable (stacked with the layers like the kernels, so the layer scan slices
one meta per layer) and their matmul; the stack runs as the static layer ranges it gives
(`layer_spans`: bf16 first/last layers apart), so every scan body is one fixed kind of layer.
Embedding, lm_head, norms, attention and residuals never see FP8. The loss is model/loss.py's.

Shape letters: B batch, S sequence, D hidden, H query heads, K kv heads, G = H/K, E head dim,
F mlp, V vocab, L layers.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.model import attention as attention_lib
from jaxtrain.model import mla as mla_lib
from jaxtrain.model import moe as moe_lib
from jaxtrain.model import mtp as mtp_lib
from jaxtrain.model import stack as stack_lib
from jaxtrain.model.fp8 import Fp8Converter
from jaxtrain.model.rope import apply_rope, rope_frequencies, rope_tables  # noqa: F401
from jaxtrain.model.layers import (Dense, RMSNorm, gather_sequence, normal, param,
                                   project_gathered, project_scattered, split_sequence, swiglu)
from jaxtrain.config import ModelConfig

Constrain = Callable[[jax.Array, tuple], jax.Array]
DotGeneral = Callable[..., jax.Array]

REMAT_TAGS = ("layer_input", "attn_norm", "qkv_proj", "core_attn", "attn_out", "mlp_norm",
              "mlp_in", "mlp_act", "mlp_out")



def identity_constrain(x, names):
    del names
    return x


@dataclasses.dataclass(frozen=True)
class Ops:
    """What the model lets the outside world choose: how to matmul, how to shard, how to attend.

    `embed_lookup(table_VD, tokens_BS) -> x_BSD` looks tokens up in the (compute-dtype)
    table; on a mesh sharding supplies one that never gathers the table.
    `run_layers(block_fn, x_BSD, stacked_layer_state) -> x_BSD` runs the layer stack; the
    default is a plain scan, `remat` supplies checkpointed and grouped scans. When the stack
    runs as several layer ranges (FP8 with bf16 first/last layers), `span_runner(start, stop)`
    gives the runner of layers [start, stop) (default: `run_layers` for every range).
    `grouped_dot(x_ND, w_EDF, group_sizes_E) -> y_NF` is the MoE experts' grouped GEMM
    (lax.ragged_dot's contract; on Hopper kernels.grouped_matmul); `dispatch` brings the
    tokens to the experts and back (moe.local_dispatch's contract; expert parallelism puts
    its all-to-alls there, and `local_experts(tree, num_experts)` slices per-expert FP8 metas
    to the rank's experts). `fp8` says which
    projections run in FP8 and owns their metas (default: FP8 off). `run_layer(block_fn,
    x_BSD, layer_state) -> x_BSD` runs one layer apart from the stack (the multi-token
    prediction modules' blocks; default: the layer as it is; remat supplies the stack's
    policy). `gather_weight(w, names) -> w` is a weight as its GEMM reads it (on a mesh with
    fsdp: gathered over fsdp); FP8 projections apply it to the FP8-cast kernel so FSDP's
    gathers move FP8 bytes (default: the weight as it is). `collective_matmul`
    (parallel/collective_matmul.py; default None: GSPMD's gathers and scatters) runs
    layers.project_gathered/project_scattered as ppermute rings.
    """
    dot_general: DotGeneral = jax.lax.dot_general
    constrain: Constrain = identity_constrain
    gather_weight: Constrain = identity_constrain
    attention: Callable = attention_lib.xla_attention
    embed_lookup: Callable = None   # (table_VD, tokens_BS) -> x_BSD; default jnp.take
    run_layers: Optional[Callable] = None
    fp8: Fp8Converter = Fp8Converter()
    span_runner: Optional[Callable[[int, int], Callable]] = None
    grouped_dot: Callable = moe_lib.ragged_dot
    dispatch: Callable = moe_lib.local_dispatch
    run_layer: Optional[Callable] = None
    collective_matmul: Any = None


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
        q_BSHE, k_BSKE, v_BSKE = project_gathered(gather_sequence(c), x_BSD,
                                                  (self.wq, self.wk, self.wv), fp8)
        q_BSHE = c(checkpoint_name(q_BSHE, "qkv_proj"), ("batch", "sequence", "heads", None))
        k_BSKE = c(checkpoint_name(k_BSKE, "qkv_proj"), ("batch", "sequence", "kv_heads", None))
        v_BSKE = c(checkpoint_name(v_BSKE, "qkv_proj"), ("batch", "sequence", "kv_heads", None))
        q_BSHE, k_BSKE = apply_rope(q_BSHE, cos, sin), apply_rope(k_BSKE, cos, sin)
        o_BSHE = self.ops.attention(q_BSHE, k_BSKE, v_BSKE, segment_ids_BS)
        o_BSHE = c(checkpoint_name(o_BSHE, "core_attn"), ("batch", "sequence", "heads", None))
        return checkpoint_name(project_scattered(gather_sequence(c), split_sequence(c), o_BSHE,
                                                 self.wo, fp8), "attn_out")


class Mlp(nnx.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, rngs, size: int = 0, name: str = "blocks/mlp",
                 tag: str = "mlp"):
        """A SwiGLU of `size` (default model.mlp_size); the MoE's shared experts are one (their
        remat tags `tag`_in, _act, _out: shared_*, apart from the dense MLP's)."""
        d, f = cfg.hidden_size, size or cfg.mlp_size
        kw = dict(cfg=cfg, ops=ops, rngs=rngs)
        self.w_gate = Dense((d,), (f,), ("embed", "mlp"), std=1.0 / math.sqrt(d),
                            name=f"{name}/w_gate", **kw)
        self.w_up = Dense((d,), (f,), ("embed", "mlp"), std=1.0 / math.sqrt(d),
                          name=f"{name}/w_up", **kw)
        self.w_down = Dense((f,), (d,), ("mlp", "embed"),
                            std=1.0 / math.sqrt(f * 2 * cfg.num_layers), name=f"{name}/w_down",
                            **kw)
        self.ops = ops
        self.tag = tag

    def __call__(self, x_BSD, fp8: bool = False):
        """x_BSD: the norm output, split over the sequence under sequence parallelism."""
        c, t = self.ops.constrain, self.tag
        gate_BSF, up_BSF = project_gathered(gather_sequence(c), x_BSD,
                                            (self.w_gate, self.w_up), fp8)
        gate_BSF = c(checkpoint_name(gate_BSF, f"{t}_in"), ("batch", "sequence", "mlp"))
        up_BSF = c(checkpoint_name(up_BSF, f"{t}_in"), ("batch", "sequence", "mlp"))
        h_BSF = checkpoint_name(swiglu(gate_BSF, up_BSF), f"{t}_act")
        return checkpoint_name(project_scattered(gather_sequence(c), split_sequence(c), h_BSF,
                                                 self.w_down, fp8), f"{t}_out")


class Block(nnx.Module):
    """Attention and an MLP; with `moe` the MLP is a mixture of experts, and the block returns
    (x, the layer's moe.MoeStats)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, rngs, moe: bool = False):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = (mla_lib.LatentAttention(cfg, ops, rngs) if cfg.mla is not None
                     else Attention(cfg, ops, rngs))
        self.mlp_norm = RMSNorm(cfg, rngs)
        if moe:
            shared = (Mlp(cfg, ops, rngs, size=cfg.shared_mlp_size, name="blocks/moe/shared",
                          tag="shared")
                      if cfg.shared_mlp_size else None)
            self.moe = moe_lib.MoeLayer(cfg, ops, rngs, shared=shared)
        else:
            self.mlp = Mlp(cfg, ops, rngs)
        self.is_moe = moe
        self.ops = ops

    def __call__(self, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
        c = self.ops.constrain
        residual = ("batch", "length", "embed")  # sequence-parallel region when SP is on
        x_BSD = c(checkpoint_name(x_BSD, "layer_input"), residual)
        h_BSD = c(checkpoint_name(self.attn_norm(x_BSD), "attn_norm"), residual)
        x_BSD = x_BSD + c(self.attn(h_BSD, cos, sin, segment_ids_BS, fp8), residual)
        h_BSD = c(checkpoint_name(self.mlp_norm(x_BSD), "mlp_norm"), residual)
        if self.is_moe:
            y_BSD, stats = self.moe(h_BSD, fp8)
            return x_BSD + c(y_BSD, residual), stats
        return x_BSD + c(self.mlp(h_BSD, fp8), residual)


def _stack(cfg: ModelConfig, ops: Ops, rngs, n: int, moe: bool):
    """n Blocks created stacked (logical axis `layers` first)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return Block(cfg, ops, rngs, moe=moe)
    return make(rngs)


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
        self.embed = param(rngs, _real_vocab_rows(normal(1.0), self.real_vocab, axis=0),
                            (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pdt)

        # `blocks` stacks the MoE layers when there are any, else all of them; a model mixing
        # kinds keeps its dense layers in `dense_blocks` (stack.py runs the two as groups).
        kinds = cfg.moe_layers
        self.has_moe = any(kinds)
        if self.has_moe and (ops.fp8.bf16_first or ops.fp8.bf16_last):
            ops.fp8.refuse("Ops.fp8 with model.moe runs every layer in FP8: set "
                           "fp8.bf16_first_layers=0 and fp8.bf16_last_layers=0")
        self.blocks = _stack(cfg, ops, rngs, sum(kinds) or cfg.num_layers, moe=self.has_moe)
        if self.has_moe and not all(kinds):
            self.dense_blocks = _stack(cfg, ops, rngs, kinds.count(False), moe=False)
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(
                rngs, _real_vocab_rows(normal(1.0 / math.sqrt(cfg.hidden_size)),
                                       self.real_vocab, axis=1),
                (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pdt)
        if cfg.mtp_depths:   # drawn last: the main model's weights are those without it
            self.mtp = mtp_lib.MultiTokenPrediction(
                cfg, ops, rngs, lambda: Block(cfg, ops, rngs, moe=False))

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

    def block_fn(self, dense: bool = False):
        """(layer_state, x, cos, sin, segment_ids, fp8=False) -> x for one layer of `blocks`
        (an MoE layer: -> (x, moe.MoeStats)), and the stacked state (FP8 metas included);
        `dense=True`: the same for `dense_blocks`. `fp8=True` runs the layer's projections in
        FP8."""
        graphdef, state = nnx.split(self.dense_blocks if dense else self.blocks)

        def apply(layer_state, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
            return nnx.merge(graphdef, layer_state)(x_BSD, cos, sin, segment_ids_BS, fp8)
        return apply, state

    def _runner(self, start: int, stop: int):
        if self.ops.span_runner is not None:
            return self.ops.span_runner(start, stop)
        return self.ops.run_layers or scan_layers

    def run_blocks(self, x_BSD, positions_BS, segment_ids_BS, use_fp8: bool = True):
        """The layer stack: x, or with MoE layers (x, moe.MoeStats summed over them);
        `use_fp8=False` runs every layer in the compute dtype (e.g. an evaluation without FP8
        scales)."""
        cos, sin = rope_tables(self.cfg, positions_BS)
        if self.has_moe:
            return self._run_moe_stack(x_BSD, cos, sin, segment_ids_BS,
                                       use_fp8 and self.ops.fp8.recipe is not None)
        apply, state = self.block_fn()
        n = self.cfg.num_layers
        for start, stop, span_fp8 in self.ops.fp8.layer_spans(n):
            def block_fn(s, x, fp8=span_fp8 and use_fp8):
                return apply(s, x, cos, sin, segment_ids_BS, fp8)
            # Slicing copies the range's layer state; the common cases (one range) do not.
            part = state if (start, stop) == (0, n) else jax.tree.map(
                lambda a, start=start, stop=stop: a[start:stop], state)
            x_BSD = self._runner(start, stop)(block_fn, x_BSD, part)
        return x_BSD

    def _run_moe_stack(self, x_BSD, cos, sin, segment_ids_BS, fp8: bool = False):
        """The stack as stack.py's groups. Groups holding MoE layers carry (x, MoeStats);
        groups of dense layers only carry x. `fp8`: every layer in FP8 (with MoE the FP8
        converter has one layer range, fp8.bf16_first/last_layers being 0)."""
        kinds = self.cfg.moe_layers
        moe_apply, moe_state = self.block_fn()
        states, rows = {stack_lib.MOE: moe_state}, {stack_lib.MOE: sum(kinds)}
        if not all(kinds):
            dense_apply, states[stack_lib.DENSE] = self.block_fn(dense=True)
            rows[stack_lib.DENSE] = kinds.count(False)

        def moe_layer(s, carry):
            x, stats = carry
            x, layer_stats = moe_apply(s, x, cos, sin, segment_ids_BS, fp8)
            return x, stats + layer_stats

        def dense_layer(s, x):
            return dense_apply(s, x, cos, sin, segment_ids_BS, fp8)

        apply = {stack_lib.MOE: moe_layer,
                 stack_lib.DENSE: lambda s, carry: (dense_layer(s, carry[0]), carry[1])}
        x, stats = x_BSD, moe_lib.MoeStats.zeros()
        for group in stack_lib.layer_groups(kinds, self.cfg.moe.layer_freq):
            part = stack_lib.group_state(group, states, rows)
            run = self._runner(group.start, group.stop)
            if stack_lib.MOE in group.unit:
                x, stats = run(stack_lib.unit_fn(group, apply), (x, stats), part)
            else:
                x = run(stack_lib.unit_fn(group, {stack_lib.DENSE: dense_layer}), x, part)
        return x, stats

    def logits(self, x_BSD):
        return self.head(self.final_norm(x_BSD))

    def head(self, h_BSD):
        """fp32 logits of the normed hidden state: the output head the MTP modules share."""
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
        """Logits [B, S, V] fp32; with MoE layers (logits, moe.MoeStats of the forward); with
        multi-token prediction an mtp.DepthLogits after those."""
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        if segment_ids_BS is None:
            segment_ids_BS = jnp.ones_like(tokens_BS)
        emb_BSD = self.embed_tokens(tokens_BS)
        x_BSD = self.run_blocks(emb_BSD, positions_BS, segment_ids_BS, use_fp8)
        out = []
        if self.has_moe:
            x_BSD, stats = x_BSD
            out.append(stats)
        if self.cfg.mtp_depths:
            cos, sin = rope_tables(self.cfg, positions_BS)
            out.append(self.mtp(x_BSD, emb_BSD, cos, sin, segment_ids_BS, self.head))
        logits = self.logits(x_BSD)
        return (logits, *out) if out else logits

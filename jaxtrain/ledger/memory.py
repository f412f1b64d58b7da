"""Theoretical memory per device: static state, in-flight activations, workspace reserve.

Conventions (docs/design.md §5):
- Static, by term (STATIC_TERMS): weights (bf16 copy) 2 + gradients (unpipelined: one layer's
  bf16 gradient, added into the accumulator as the backward makes it, or under context
  parallelism and MoE the stack's 2 when microbatches add up; pipelined: one layer's too,
  or the B's chunk gradient where the unpipelined step would not fuse) + fp32 accumulator 4
  + fp32 master 4
  + Adam moments 8 bytes per parameter held, the FP8 metas, other (FSDP's gathered layers,
  the pipeline's chunk slices); ZeRO-1 divides the 12 optimizer bytes by data (x context),
  FSDP divides all of them by the fsdp degree (plus two gathered layers in flight).
- Activations per layer per microbatch: what jaxtrain's layer keeps (layer_activation_bytes;
  for Llama 70B with flash attention and SP, 33·s·b·h/t bytes, next to Korthikanti et al.'s
  34·s·b·h/t for a GPT layer); XLA attention adds Korthikanti's 5·a·s/h score term.
  Full recompute keeps the layer input, 2·s·b·h/t, and re-materialises one recompute group at
  a time. Context parallelism divides s, and its attention keeps no scores whatever the core
  (context_attention.py: q, k, v of the shard, the output and the LSE); cuDNN's all-gather
  also keeps the gathered K/V. float32 compute doubles it.
- In flight. Without pipeline stages, gradient accumulation runs one microbatch at a time:
  L layer-microbatches. With stages, the executor (ledger.pipeline) stashes each F's chunk
  residuals for its microbatch, as the remat config stores them, until the B: the busiest
  rank's stash slots (2(p-1-r) + (v-1)p on rank r: lock-step's warm-up, Megatron's in-flight
  microbatches less one), the set the last virtual stage's B holds while it runs forward and
  backward at once and one set in transit between a switch and the stash (the GPU
  compiler's buffer assignment), what a B re-materialises at once under full recompute, and
  its chunk-input buffers (inbox, cotangent and two receive slots). Chunks padded or mixing
  bf16 and FP8 layers (a per-layer switch) copy the chunk's weights once while a B runs,
  without full recompute (jax's partial evaluation of a conditional re-emits its operands).
- Static with stages: every rank holds v chunks of the largest chunk's layers (uneven stages
  are padded to it) and one vocab table row (rank 0 the embedding, rank p-1 the head and the
  final norm: the pipeline executor's edge rows) for its compute copy and gradient
  accumulator; the fp32 masters and Adam moments of both tables and the norm are split over
  stage (1/p per rank, Megatron's N/(t·p) on average; device_params.state_params_local).
- Budget: static + activations + reserve must fit in 90% of device memory.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.config import Config, RematConfig, padded_vocab
from jaxtrain.ledger import experts, latent
from jaxtrain.ledger.device_params import layer_params_local
from jaxtrain.ledger.hardware import GiB
from jaxtrain.ledger.layout import Layout
from jaxtrain.ledger.pipeline import DTYPE_BYTES, Executor, chunk_input_bytes

BUDGET_FRACTION = 0.9
SCORE_MARGIN = 1.2
# cuBLAS/NCCL workspaces and XLA temporaries at h = 8192; with the fp32 logits term below this
# gives docs/design.md's 8 GB reserve at 70B scale, and it shrinks with the hidden size.
_WORKSPACE_AT_8K = 6 * GiB
_WORKSPACE_FLOOR = 0.25 * GiB

OPTIMIZER_BYTES = 12  # fp32 master + Adam m + v


def bytes_per_param(grad_bf16: bool = False) -> int:
    """18 (bf16 param, fp32 grad, fp32 master, Adam m, v) or 16 with bf16 grads / FSDP."""
    return 2 + (2 if grad_bf16 else 4) + OPTIMIZER_BYTES


# The static terms every report names, in this order (docs/design.md §5): the compute-dtype
# copy of the weights, compute-dtype gradient buffers beside the fp32 accumulator, the fp32
# gradient accumulator, the fp32 master copy, Adam's two moments, the FP8 metas, and what else
# the program holds between uses (FSDP's gathered layers, the pipeline's chunk slices).
STATIC_TERMS = ("weights", "gradients", "accumulator", "master", "moments", "fp8_meta", "other")


def held_bytes_per_param(layout: Layout) -> dict[str, float]:
    """Bytes per (TP/PP-local) parameter that one device holds, by static term, as jaxtrain's
    step holds them (the GPU compiler's buffer assignment, tests/gpu): the compute-dtype copy
    (weights 2), the fp32 gradient accumulator (4), the fp32 master (4) and Adam's moments (8),
    those two divided by the data-parallel group under ZeRO-1; FSDP shards all of them. No
    compute-dtype gradient of the whole stack: the unpipelined step adds each layer's into the
    accumulator as its backward makes it (parallel/grad_accumulation.py, Megatron's
    gradient_accumulation_fusion), leaving one layer's (`static_bytes`; not under context
    parallelism: parallel/grad_accumulation.fuses); so does the pipeline's B
    (`pipeline_static_bytes`)."""
    f = layout.fsdp
    # Megatron's distributed optimizer shards over the data-parallel group, which includes the
    # context ranks (parameters are replicated over both).
    zero = layout.data * layout.context if layout.zero1 else 1
    return {"weights": 2 / f, "gradients": 0.0, "accumulator": 4 / f,
            "master": 4 / (f * zero), "moments": 8 / (f * zero)}


def fp8_meta_bytes(cfg: Config) -> float:
    """The FP8 metas (replicated on every device): per projection of every layer row and per
    role (x, w, g) an fp32 scale, its inverse and the amax history."""
    if not cfg.fp8.enabled:
        return 0.0
    projections = 7   # q, k, v, o, gate, up, down (model/fp8.py)
    return cfg.model.num_layers * projections * 3 * (2 + cfg.fp8.amax_history_len) * 4


def static_bytes(cfg: Config, layout: Layout, n_local: float,
                 n_state: float | None = None, n_expert: float = 0.0) -> dict[str, float]:
    """Bytes by static term (STATIC_TERMS) for `n_local` parameters computed with and
    `n_state` (default the same) whose master and moments a device holds, `n_expert` of
    them routed experts."""
    per = held_bytes_per_param(layout)
    n_state = n_local if n_state is None else n_state
    out = {k: (n_state if k in ("master", "moments") else n_local) * v for k, v in per.items()}
    if layout.zero1 and layout.expert > 1 and n_expert:
        # ZeRO-1 shards the experts' state over their own data ranks, data·context/expert.
        extra = n_expert / layout.fsdp * (
            1 / experts.expert_data_ranks(layout) - 1 / (layout.data * layout.context))
        out["master"] += 4 * extra
        out["moments"] += 8 * extra
    if layout.stage == 1:
        # fused (parallel/grad_accumulation.fuses): one layer's compute-dtype gradient on its way into
        # the accumulator; else, with microbatches to add up, the stack's
        fused = layout.context == 1 and not any(cfg.model.moe_layers)
        grad_params = (layer_params_local(cfg, layout.tensor, layout.expert,
                                        layout.expert_tensor) if fused
                       else n_local if layout.microbatches > 1 else 0.0)
        out["gradients"] = grad_params * _compute_bytes(cfg) / layout.fsdp
    out["fp8_meta"] = fp8_meta_bytes(cfg)
    # FSDP all-gathers a layer's bf16 weights before use; two layers in flight for prefetch.
    out["other"] = (2 * 2 * layer_params_local(cfg, layout.tensor, layout.expert,
                                        layout.expert_tensor)
                    if layout.fsdp > 1 else 0.0)
    return out


def state_bytes(static: dict[str, float]) -> float:
    """What the step takes as arguments of the static terms: masters, moments, FP8 metas."""
    return static["master"] + static["moments"] + static["fp8_meta"]


def _act_scale(cfg: Config) -> float:
    return 2.0 if cfg.model.compute_dtype == "float32" else 1.0


def layer_activation_bytes(cfg: Config, layout: Layout, seq_len: int, *, flash: bool,
                           recompute_scores: bool = False, moe_dropped: frozenset = frozenset(),
                           checkpointed: bool = False) -> float:
    """Activations one layer keeps for its backward, per microbatch, as jaxtrain's layer
    stores them (calibrated on the GPU compiler's buffer assignment, tests/gpu):

    - the residual stream before attention and before the MLP, and the two norm outputs (the
      norms themselves are recomputed from their inputs): 4 x 2·s·b·h, split over `tensor`
      under sequence parallelism;
    - q and the attention output: 2 x 2·s·b·h/t (H·E = h); k and v: 2 x 2·s·b·K·E per KV
      shard (MLA: its latents and q, k, v, output of its own head sizes, ledger.latent); the flash kernel's fp32 log-sum-exp, 4·s·b·H/t;
    - the SwiGLU's gate, up and their product (the down projection's input): 3 x 2·s·b·F/t
      (silu is recomputed from gate);
    - without a flash kernel (XLA attention, the CPU path) the s×s scores, Korthikanti's 5
      bytes per score per head x1.2, calibrated on XLA:CPU, unless selective remat
      recomputes them (`recompute_scores`);
    - under context parallelism (c > 1) no scores but the LSE, whatever the core; with cuDNN
      (all_gather) the other c-1 shards' K and V too (jax's cuDNN backward keeps its inputs);
    - an MoE layer stores its experts' side instead of the SwiGLU (ledger.experts, by tag,
      less the `moe_dropped` tags; `checkpointed`: under a checkpoint policy), averaged over
      the layers with the dense ones.

    2 bytes per element in bf16/fp16, 4 in float32.
    """
    m, t, c = cfg.model, layout.tensor, layout.context
    s_local = seq_len / c
    sb = s_local * layout.micro_batch
    stream = 4 * 2 * sb * m.hidden_size / (t if layout.sequence_parallel else 1)
    attention = 2 * sb * latent.attention_activation_elements(m, t)   # ledger.latent
    if c > 1 and m.attention == "cudnn":
        kv_shards = t if m.num_kv_heads % t == 0 else 1
        attention += (c - 1) * 2 * 2 * sb * m.num_kv_heads * m.resolved_head_dim / kv_shards
    flash = flash or c > 1
    lse = 4 * sb * m.num_heads / t if flash else 0.0  # fp32 whatever the dtype
    mlp = 3 * 2 * sb * m.mlp_size / t
    if m.moe is not None:
        frac = experts.moe_fraction(cfg)
        mlp = (1 - frac) * mlp + frac * experts.stored_bytes(cfg, layout, seq_len, moe_dropped,
                                                             checkpointed) / _act_scale(cfg)
    scores = 0.0 if flash or recompute_scores else (
        5.0 * m.num_heads * s_local * seq_len * layout.micro_batch / t * SCORE_MARGIN)
    return (stream + attention + mlp + scores) * _act_scale(cfg) + lse


def remat_layer_bytes(cfg: Config, layout: Layout, remat: RematConfig, flash: bool,
                      seq_len: int) -> float:
    """layer_activation_bytes under a remat config's selective choice (full recompute's
    groups re-materialise the whole layer: the choice's none)."""
    selective = remat.granularity == "selective"
    dropped = frozenset(tag for mod in remat.modules for tag in experts.MODULE_TAGS.get(mod, ())
                        ) if selective else frozenset()
    return layer_activation_bytes(cfg, layout, seq_len, flash=flash,
                                  recompute_scores=selective and "core_attn" in remat.modules,
                                  moe_dropped=dropped, checkpointed=selective)


def selective_working_bytes(cfg: Config, layout: Layout, remat: RematConfig,
                            seq_len: int) -> float:
    """What a selective policy's backward re-materialises at once on top of the stored: one
    MoE layer's dropped tags (at most: XLA frees some before the next is recomputed; on the
    CPU compiler `moe` re-materialised 42% of a layer's at once, tests/test_remat_moe.py);
    when gate and up are among them (`moe`), with their cotangents (moe_in's size again), which
    the SwiGLU's backward holds next to the recomputed gate and up. On the H100 compiler
    (Mixtral, 4 layers, TP1 PP4 EP8; tests/test_gpu_compile_moe.py) the compiled peak was
    1.035x the ledger with `moe` this way, 1.34x without the cotangents; `moe_act` (gate and up
    stored) 0.97x without them."""
    if remat.granularity != "selective" or not any(cfg.model.moe_layers):
        return 0.0
    layer = experts.activation_bytes_by_tag(cfg, layout, seq_len)
    dropped = {tag for mod in remat.modules for tag in experts.MODULE_TAGS.get(mod, ())}
    cotangents = layer["moe_in"] if "moe_in" in dropped else 0.0
    return sum(layer[tag] for tag in dropped) + cotangents


def layer_checkpoint_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """What full recompute keeps per layer: its input, the size of a pipeline chunk input."""
    return chunk_input_bytes(cfg, layout, seq_len)


@dataclasses.dataclass(frozen=True)
class Activations:
    per_layer: float        # bytes stored per layer-microbatch (the checkpoint under full)
    inflight: float         # layer-microbatches held
    working_set: float      # bytes re-materialised at once under full recompute
    total: float
    buffers: float = 0.0    # the pipeline executor's chunk-input buffers (in total)


def stage_activations(cfg: Config, layout: Layout, remat: RematConfig, flash: bool,
                      seq_len: int, n_layers: int, inflight: float) -> Activations:
    """Activation bytes one device of a stage holds under a remat config: `inflight`
    layer-microbatches of a stage of `n_layers` layers (v chunks).

    Of the selective modules core_attn (its s×s scores) and the MoE ones are credited;
    recomputing the dense layers' other tagged activations is counted in HFU but not
    subtracted here, so memory is an upper bound.
    """
    full_layer = remat_layer_bytes(cfg, layout, remat, flash, seq_len)
    if remat.granularity != "full":
        working = selective_working_bytes(cfg, layout, remat, seq_len)
        return Activations(full_layer, inflight, working, inflight * full_layer + working)
    ckpt = layer_checkpoint_bytes(cfg, layout, seq_len)
    k = remat.num_layers or 1
    if remat.method == "uniform":
        # One checkpoint per group of k layers; recompute re-materialises a group at a time.
        group = min(k, n_layers)
        return Activations(ckpt, inflight, group * full_layer, inflight / group * ckpt
                           + group * full_layer)
    chunk = n_layers / layout.virtual_stages
    frac = 1.0 if remat.num_layers == 0 else min(k, chunk) / chunk
    stored = inflight * (frac * ckpt + (1 - frac) * full_layer)
    return Activations(ckpt, inflight, full_layer, stored + full_layer)


def chunk_residual_bytes(cfg: Config, layout: Layout, remat: RematConfig, flash: bool,
                         seq_len: int, chunk_layers: int) -> tuple[float, float]:
    """(stored, working): what one chunk's F keeps for its B for one microbatch under the
    remat config, and what its B re-materialises at once on top of that (full recompute: one
    group's activations; selective: one MoE layer's recomputed tags)."""
    full_layer = remat_layer_bytes(cfg, layout, remat, flash, seq_len)
    if remat.granularity != "full":
        return chunk_layers * full_layer, selective_working_bytes(cfg, layout, remat, seq_len)
    ckpt = layer_checkpoint_bytes(cfg, layout, seq_len)
    k = remat.num_layers or 1
    if remat.method == "uniform":
        group = min(k, chunk_layers)
        return chunk_layers / group * ckpt, group * full_layer
    n = chunk_layers if remat.num_layers == 0 else min(k, chunk_layers)
    return n * ckpt + (chunk_layers - n) * full_layer, full_layer


def chunk_weight_copy_bytes(cfg: Config, layout: Layout, remat: RematConfig,
                            stage_layers: tuple[int, ...], chunk_layers: int) -> float:
    """The copy of a chunk's weights (compute dtype) a B makes when the chunk runs a per-layer
    switch (padded chunks of uneven stages, bf16 and FP8 layers mixed) outside a checkpoint."""
    fp8 = cfg.fp8
    mixed = fp8.enabled and (fp8.bf16_first_layers or fp8.bf16_last_layers)
    if remat.granularity == "full" or not (len(set(stage_layers)) > 1 or mixed):
        return 0.0
    return (chunk_layers * layer_params_local(cfg, layout.tensor, layout.expert,
                                        layout.expert_tensor)
            * DTYPE_BYTES[cfg.model.compute_dtype])


def pipeline_static_bytes(cfg: Config, layout: Layout, remat: RematConfig,
                          stage_layers: tuple[int, ...], chunk_layers: int) -> dict[str, float]:
    """A chunk's weights-sized temporaries of an F or B (compute dtype, the GPU compiler's
    buffer assignment), by static term. gradients: where the B adds each layer's weight
    gradient into the fp32 accumulator as its backward makes it (dense stacks without
    context, tensor or fsdp sharding: executors/pipeline.fuses) one layer's in flight, else the B's gradient of its whole chunk before it joins the
    accumulator. other: with virtual stages the chunk's slice out of the rank's v, which XLA
    materialises as the operand of the chunk's layer loop (a static index too; one at a
    time on the fused path: the F's and the B's are not live together; priced as two
    unfused, as before), and the copy a per-layer switch makes (chunk_weight_copy_bytes)."""
    layer = (layer_params_local(cfg, layout.tensor, layout.expert, layout.expert_tensor)
             * DTYPE_BYTES[cfg.model.compute_dtype])
    weights = chunk_layers * layer
    fused = (layout.context == 1 and layout.tensor == 1 and layout.fsdp == 1
             and not any(cfg.model.moe_layers))
    slices = (1 if fused else 2) if layout.virtual_stages > 1 else 0
    return {"gradients": layer if fused else weights,
            "other": (weights * slices
                      + chunk_weight_copy_bytes(cfg, layout, remat, stage_layers,
                                                chunk_layers))}


def pipelined_activations(cfg: Config, layout: Layout, remat: RematConfig, flash: bool,
                          seq_len: int, ex: Executor) -> Activations:
    """What one device of the pipeline executor holds: the stash slots' chunk residuals, the
    last stage's B's own set and one set in transit (what an F hands to the stash, or a B
    reads out of it; each one microbatch of one chunk under the remat config), what a B
    re-materialises at once, and its chunk-input buffers (Megatron's accounting of a pipeline
    stage's in-flight activations)."""
    stored, working = chunk_residual_bytes(cfg, layout, remat, flash, seq_len, ex.chunk_layers)
    sets = ex.stash_buffer + 2
    buffers = ex.buffers * chunk_input_bytes(cfg, layout, seq_len)
    return Activations(per_layer=stored / ex.chunk_layers, inflight=sets * ex.chunk_layers,
                       working_set=working, total=sets * stored + working + buffers,
                       buffers=buffers)


def workspace_bytes(cfg: Config) -> float:
    """cuBLAS/NCCL workspaces and XLA temporaries: 6 GiB at h=8192, scaled, at least 0.25 GiB."""
    return max(_WORKSPACE_FLOOR, _WORKSPACE_AT_8K * min(1.0, cfg.model.hidden_size / 8192))


def reserve_bytes(cfg: Config, layout: Layout, seq_len: int) -> float:
    """Logits and workspace: one compute-dtype copy of the s·b·V/t logits (the head GEMM
    writes the compute dtype; the fp32 softmax and its gradient fuse into it) and an fp32
    s·b·h (the GPU compiler's buffer assignment of Llama 3 8B at 8K and 64K tokens, within
    1-8%: tests/test_gpu_compile.py), plus a workspace for cuBLAS/NCCL that scales with the
    hidden size (6 GiB at h=8192), which a compiled step's static buffers never contain, and
    with expert ranks one MoE layer's all-to-all buffers. Per context rank: s/c tokens."""
    m = cfg.model
    tokens = seq_len / layout.context * layout.micro_batch
    # each MTP module's logits as well (they are live with the main ones)
    logits = tokens * (1 + m.mtp_depths) * (
        _compute_bytes(cfg) * padded_vocab(m.vocab_size, layout.tensor) / layout.tensor
        + 4 * m.hidden_size)
    return logits + workspace_bytes(cfg) + experts.dispatch_buffer_bytes(cfg, layout, seq_len)


def _compute_bytes(cfg: Config) -> int:
    return 4 if cfg.model.compute_dtype == "float32" else 2

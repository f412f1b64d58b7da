"""The config's typed sections (ModelConfig, ParallelConfig, ...), the Config that holds
them and its freezing: a validated config is read-only."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Literal, Optional

from jaxtrain.config import rules
from jaxtrain.config.errors import FrozenConfigError


class _Section:
    """A config (section) that is frozen once validated: the run, its checkpoints and the
    dry run all read the same values. Derive another with dataclasses.replace (or `derive`)."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise FrozenConfigError(
                f"the config is frozen after loading; derive a new one instead of setting "
                f"{type(self).__name__}.{name}: config.derive(cfg, 'section.{name}=...') or "
                "dataclasses.replace")
        object.__setattr__(self, name, value)


def _freeze(node) -> None:
    if dataclasses.is_dataclass(node):
        object.__setattr__(node, "_frozen", True)
        for f in dataclasses.fields(node):
            _freeze(getattr(node, f.name))


@dataclasses.dataclass
class RopeScaling(_Section):
    """Llama 3.1 RoPE frequency scaling (HF `rope_type="llama3"`)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass
class MoeConfig(_Section):
    """Mixture of experts (docs/design.md §8), Megatron's names: which layers are MoE, the
    router, the experts and how tokens reach them. `model.moe` unset: every layer is dense."""
    num_experts: int = 8           # --num-experts
    top_k: int = 2                 # --moe-router-topk
    mlp_size: int = 0              # each expert's SwiGLU (--moe-ffn-hidden-size); 0: model.mlp_size
    # Always-on experts next to the routed ones (DeepSeek's n_shared_experts): one SwiGLU of
    # shared_experts x shared_mlp_size (Megatron's --moe-shared-expert-intermediate-size).
    shared_experts: int = 0
    shared_mlp_size: int = 0       # each shared expert's size; 0: the routed experts' size
    # Layer i is MoE when i >= first_k_dense and i % layer_freq == 0 (Megatron's
    # --moe-layer-freq N, DeepSeek's first_k_dense_replace; Mixtral: every layer).
    layer_freq: int = 1
    first_k_dense: int = 0
    # The router (model/router.py). score_function (--moe-router-score-function): softmax
    # (Mixtral) or sigmoid (DeepSeek-V3: the chosen experts' sigmoid scores as weights,
    # normalised to sum 1 when norm_topk_prob, HF's name).
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True
    # The weights' scale (HF routed_scaling_factor, --moe-router-topk-scaling-factor).
    routed_scaling_factor: float = 1.0
    # Group-limited routing (HF n_group / topk_group, --moe-router-num-groups /
    # --moe-router-group-topk): the experts in n_group groups, each scored by the sum of its
    # top-2 scores; a token picks its top_k among the topk_group best groups. 1/1: off.
    n_group: int = 1
    topk_group: int = 1
    # Auxiliary-loss-free balancing (--moe-router-enable-expert-bias, HF e_score_correction_bias):
    # a per-expert bias added to the scores for the choice only, moved after each step by
    # bias_update_rate x sign(mean load - load) (--moe-router-bias-update-rate). Sigmoid only.
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # --moe-router-pre-softmax: false (Mixtral): softmax over the top-k logits (the top-k
    # renormalised); true: softmax over all experts, the top-k kept as they are.
    pre_softmax: bool = False
    aux_loss_coeff: float = 1e-2   # --moe-aux-loss-coeff (Switch/GShard load balancing, per layer)
    z_loss_coeff: float = 0.0      # --moe-z-loss-coeff (ST-MoE router z-loss)
    # DeepSeek-V3's sequence-wise balance loss, alpha (--moe-aux-loss-coeff with
    # --moe-router-load-balancing-type seq_aux_loss; DeepSeek-V3: 1e-4), per layer
    seq_aux_loss_coeff: float = 0.0
    # dropless: every token reaches its experts (a grouped GEMM over the tokens sorted by
    # expert); capacity: each expert takes at most ceil(tokens x top_k / experts x
    # capacity_factor) (--moe-expert-capacity-factor), dropping by drop_policy
    # (--moe-token-drop-policy: the lowest router probabilities, or the latest positions).
    dispatch: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.0
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False  # --moe-pad-expert-input-to-capacity: [experts, capacity] buffers


@dataclasses.dataclass
class MlaConfig(_Section):
    """Multi-head latent attention (DeepSeek-V2/V3, docs/design.md §"Latent attention"), HF's
    DeepseekV3Config names. `model.mla` unset: grouped-query attention. Under MLA every head
    has its own key and value (model.num_kv_heads must equal model.num_heads)."""
    q_lora_rank: int = 0           # 0: a plain q projection; else down-proj -> RMSNorm -> up-proj
    kv_lora_rank: int = 64         # the compressed KV latent (RMSNorm'd, then up-projected)
    qk_nope_head_dim: int = 32     # the part of q/k without RoPE
    qk_rope_head_dim: int = 16     # the RoPE part; its key is one head shared by all heads
    v_head_dim: int = 32           # may differ from the q/k head size (nope + rope)
    # YaRN (arXiv 2309.00071, HF rope_type "yarn"; model/rope.py), on when yarn_factor > 1: the
    # rope part's frequencies blend interpolated (/ yarn_factor) and original ones over the
    # dims between yarn_beta_fast and yarn_beta_slow rotations in yarn_original_max_position
    # tokens, cos/sin are scaled by attention_factor, and the softmax scale by mscale² from
    # mscale_all_dim. HF's names: factor, original_max_position_embeddings, beta_fast,
    # beta_slow, mscale (0: absent), mscale_all_dim. DeepSeek-V3: 40, 4096, 32, 1, 1, 1.
    yarn_factor: float = 1.0
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        return self.yarn_factor > 1.0

    @property
    def softmax_mscale(self) -> float:
        """The factor on 1/sqrt(qk_head_dim): YaRN's mscale(factor, mscale_all_dim)², 1 without
        YaRN or with mscale_all_dim 0 (HF DeepseekV3's yarn_apply_mscale)."""
        if not self.yarn or self.mscale_all_dim <= 0:
            return 1.0
        return _yarn_mscale(self.yarn_factor, self.mscale_all_dim) ** 2

    @property
    def attention_factor(self) -> float:
        """YaRN's scale on the rope part's cos/sin (so on q_rope and k_rope each), HF's rule:
        mscale(factor, yarn_mscale) / mscale(factor, mscale_all_dim) when both are set, else
        mscale(factor, 1). DeepSeek-V3's 1/1 gives 1: its correction is the softmax scale."""
        if not self.yarn:
            return 1.0
        if self.yarn_mscale and self.mscale_all_dim:
            return (_yarn_mscale(self.yarn_factor, self.yarn_mscale)
                    / _yarn_mscale(self.yarn_factor, self.mscale_all_dim))
        return _yarn_mscale(self.yarn_factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (1 at factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass
class MtpConfig(_Section):
    """Multi-token prediction (DeepSeek-V3 §2.2, Megatron's --mtp-num-layers and
    --mtp-loss-scaling-factor; model/mtp.py): `num_layers` sequential modules after the stack,
    module k predicting the token k+1 past the next. Their cross entropies, averaged over the
    modules, join the objective times the factor. `model.mtp` unset or num_layers 0: off."""
    num_layers: int = 0               # D (DeepSeek-V3: 1, HF num_nextn_predict_layers)
    loss_scaling_factor: float = 0.3  # lambda from step 0 (DeepSeek-V3: 0.3)
    # Later factors, "STEP:FACTOR,..." with increasing steps: from STEP on lambda is FACTOR
    # (DeepSeek-V3: 0.1 after its first 10T tokens). "": the factor throughout.
    schedule: str = ""

    @property
    def boundaries(self) -> tuple[tuple[int, float], ...]:
        """The schedule's (step, factor) pairs, in order (rules.check_mtp checks them)."""
        return rules.mtp_schedule(self.schedule)


@dataclasses.dataclass
class ModelConfig(_Section):
    vocab_size: int = 384
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0  # 0: hidden_size // num_heads
    mlp_size: int = 768
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    attention: Literal["auto", "xla", "pallas", "mosaic", "cudnn"] = "auto"
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    moe: Optional[MoeConfig] = None
    mla: Optional[MlaConfig] = None
    mtp: Optional[MtpConfig] = None

    @property
    def mtp_depths(self) -> int:
        """The multi-token prediction modules (0: off)."""
        return self.mtp.num_layers if self.mtp is not None else 0

    @property
    def resolved_head_dim(self) -> int:
        """The query/key head size (MLA: qk_nope_head_dim + qk_rope_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def v_head_dim(self) -> int:
        """The value (and attention output) head size: the q/k one except under MLA."""
        return self.mla.v_head_dim if self.mla is not None else self.resolved_head_dim

    @property
    def rope_head_dim(self) -> int:
        """The dims RoPE rotates per head (MLA: qk_rope_head_dim only)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.resolved_head_dim

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it is a mixture-of-experts layer (all False without model.moe)."""
        e = self.moe
        return tuple(e is not None and i >= e.first_k_dense and i % e.layer_freq == 0
                     for i in range(self.num_layers))

    @property
    def expert_mlp_size(self) -> int:
        return (self.moe.mlp_size if self.moe is not None else 0) or self.mlp_size

    @property
    def shared_mlp_size(self) -> int:
        """The shared experts' SwiGLU size (all of them: count x each), 0 without any."""
        e = self.moe
        if e is None or not e.shared_experts:
            return 0
        return e.shared_experts * (e.shared_mlp_size or self.expert_mlp_size)


@dataclasses.dataclass
class ParallelConfig(_Section):
    """Mesh degrees (-1 fills the remaining devices) and how a step is split."""
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    # Under SP, the all-gather -> column-parallel GEMM and GEMM -> reduce-scatter pairs as
    # ppermute rings, each hop hidden behind a GEMM (parallel/collective_matmul.py).
    collective_matmul: bool = False
    context: int = 1
    # Context parallelism's attention: K/V all-gathered over `context` (any mask), or passed
    # around the ring, each hop hidden behind a block's attention (context_attention.py).
    context_strategy: Literal["all_gather", "ring"] = "all_gather"
    # Causal load balancing: the data pipeline gives context rank r chunks r and 2c-1-r of
    # each sequence (jaxtrain/data/context.py), so every rank does the same attention work.
    context_load_balance: bool = True
    stage: int = 1
    virtual_stages: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    microbatches: int = 1
    first_stage_layers: int = 0  # 0: an even split (Megatron decoder-first-pipeline-num-layers)
    last_stage_layers: int = 0
    zero1: bool = False
    # Expert parallelism (Megatron's --expert-model-parallel-size): carved out of the
    # data-parallel ranks (`data`), which it must divide; the experts are split over it, every
    # other weight stays data-parallel over all of `data` (docs/design.md §8).
    expert: int = 1
    # The experts' tensor parallelism (Megatron's --expert-tensor-parallel-size): 0 (its
    # default, "as parallel.tensor") splits each expert's mlp dim over `tensor`; 1 is MoE
    # parallel folding: each expert whole on one rank, the tensor ranks serving as more
    # expert ranks. parallel.expert then counts all of them, (ranks carved out of data) x
    # tensor, so it must be a multiple of parallel.tensor (DeepSeek-V3's TP2 EP64 on data 32).
    expert_tensor: int = 0


@dataclasses.dataclass
class RematConfig(_Section):
    """Megatron's recompute vocabulary on top of jax.checkpoint policies."""
    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = 0
    modules: tuple[str, ...] = ("core_attn",)
    offload: bool = False
    policy: str = ""  # escape hatch: a jax.checkpoint_policies name, "save:a,b", or "auto"
    memory_budget_gb: float = 0.0  # used by policy="auto"


@dataclasses.dataclass
class Fp8Config(_Section):
    enabled: bool = False
    recipe: Literal["delayed", "current"] = "delayed"
    format: Literal["hybrid", "e4m3"] = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    margin: int = 0
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0


@dataclasses.dataclass
class TrainConfig(_Section):
    steps: int = 200
    global_batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    # The steps the cosine decays over, to lr * min_lr_ratio, which holds after them (Megatron's
    # --lr-decay-iters); 0: train.steps. Set it to extend a finished run at the floor it reached.
    lr_decay_steps: int = 0
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 0
    workdir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 0  # 0: no periodic eval
    eval_batches: int = 4
    profile_start: int = 0
    profile_steps: int = 0  # 0: no profile
    exit_interval: int = 0  # Megatron's --exit-interval: save and exit when step % N == 0
    # Save and exit 0 once this much wall time has passed since the trainer started (Megatron's
    # --exit-duration-in-mins): seconds (3600), with units (90m, 23.5h, 1h30m) or SLURM's
    # [D-]HH:MM:SS. "" never. Leave room below the scheduler's limit for one step and one save.
    max_runtime: str = ""
    peak_tflops: float = 0.0  # 0: look up the device kind's peak
    xla_flags: str = ""  # "xla_NAME=VALUE ...": XLA options for GPU compiles (xla_flags.py)

    @property
    def max_runtime_s(self) -> float:
        return rules.parse_duration(self.max_runtime, "train.max_runtime")


@dataclasses.dataclass
class DataConfig(_Section):
    source: Literal["corpus", "text", "tokens", "prepared"] = "corpus"
    # text: a file or folder of .txt; tokens: a .npy/.bin token file; prepared: a directory
    # written by `python -m jaxtrain.data prepare`
    path: str = ""
    # prepared: Megatron's blend instead of data.path, "0.3 DIR_A 0.7 DIR_B" (weight, directory
    # pairs; the weights need not sum to 1)
    mixture: str = ""
    tokenizer: str = "byte"  # "byte" or the path of a Hugging Face tokenizer.json
    eval_fraction: float = 0.02
    corpus_max_bytes: int = 8_000_000  # embedded corpus: how much of the stdlib to read


@dataclasses.dataclass
class PrepareConfig(_Section):
    """`python -m jaxtrain.data prepare`: raw documents -> token shards (not part of Config)."""
    inputs: tuple[str, ...] = ()  # files, folders or globs of .jsonl, .parquet and .txt
    tokenizer: str = "byte"
    out: str = ""
    text_field: str = "text"  # the jsonl key / parquet column holding a document's text
    workers: int = 0  # tokenizing processes; 0: one per CPU
    shard_bytes: int = 1 << 27  # input text per shard (a shard is one unit of work and of resume)


@dataclasses.dataclass
class CheckpointConfig(_Section):
    every: int = 0  # 0: only at the end
    keep: int = 3
    async_save: bool = True
    resume: bool = True  # false: never restore (refused where checkpoints already exist)
    init_from: str = ""  # a `python -m jaxtrain.hf import` folder: start from those weights


@dataclasses.dataclass
class Config(_Section):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    remat: RematConfig = dataclasses.field(default_factory=RematConfig)
    fp8: Fp8Config = dataclasses.field(default_factory=Fp8Config)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def validate(self) -> "Config":
        """Check everything that needs no devices, then freeze: the validated config is the
        run's."""
        rules.validate(self)
        _freeze(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

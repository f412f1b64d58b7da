"""The config's typed sections (ModelConfig, ParallelConfig, ...), the Config that holds
them, its errors and its freezing: a validated config is read-only."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Literal, Optional


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key to change."""


class FrozenConfigError(ConfigError):
    """An assignment to a loaded (validated) config; derive a new one instead."""


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

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclasses.dataclass
class ParallelConfig(_Section):
    """Mesh degrees (-1 fills the remaining devices) and how a step is split."""
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
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
        return parse_duration(self.max_runtime, "train.max_runtime")


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
        from jaxtrain.config.rules import validate   # the rules read these classes
        validate(self)
        _freeze(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)





_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, key: str) -> float:
    """Seconds in `text`: "" (0: never), seconds ("3600"), units ("90m", "1h30m", "2d") or
    SLURM's --time forms with a colon or a dash (MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
    text = text.strip().lower()
    if not text:
        return 0.0
    bad = ConfigError(f"{key}={text!r} is not a duration; write seconds (3600), with units (90m, "
                      "23.5h, 1h30m) or as SLURM's [D-]HH:MM:SS")
    try:
        if re.fullmatch(r"\d+(\.\d*)?", text):
            return float(text)
        if re.fullmatch(r"(\d+(\.\d*)?[smhd])+", text):
            return sum(float(n) * _UNIT_S[u] for n, _, u in
                       re.findall(r"(\d+(\.\d*)?)([smhd])", text))
        days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
        parts = [int(x) for x in clock.split(":")]
        if "-" in text:  # D-HH[:MM[:SS]]
            if len(parts) > 3:
                raise bad
            parts += [0] * (3 - len(parts))
        elif len(parts) == 2:  # MM:SS
            parts = [0, *parts]
        elif len(parts) != 3:
            raise bad
        h, m, sec = parts
        return float(int(days) * 86400 + h * 3600 + m * 60 + sec)
    except ValueError:
        raise bad from None



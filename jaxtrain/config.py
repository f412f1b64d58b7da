"""Typed configuration: dataclasses, recipe loading, dotted overrides and validation.

A recipe is a Python file defining `get_config() -> Config`; recipes derive from each other by
calling one another's `get_config()` and changing fields. Overrides are `section.key=value`
strings, parsed according to the field's type. `Config.validate()` checks everything that can
be checked without devices; each error names the keys to change. The rules that need the
device count are jaxtrain.config_check's (`check(cfg, n_devices)` runs both).

This module imports nothing of ours (docs/design.md §1).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import json
import math
import pathlib
import re
import sys
import types
import typing
from typing import Any, Literal, Optional, get_args, get_origin


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
    attention: Literal["auto", "xla", "pallas", "cudnn"] = "auto"
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
        validate(self)
        _freeze(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


# ----------------------------------------------------------------------------- loading

def load_recipe(path: str | pathlib.Path) -> Config:
    """The Config of a recipe file. A recipe derives from its siblings with relative imports
    (`from . import llama3_base`): its folder is loaded as a package of its own, named after
    the folder's path, so two folders that both hold a `llama3_base.py` never share one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; recipes live in configs/*.py")
    folder = path.resolve().parent
    package = "jaxtrain_recipes_" + hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module  # no __init__.py needed: nothing runs for the package
    module = importlib.import_module(f"{package}.{path.stem}")
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(); a recipe must return a Config")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not Config")
    return cfg


def load_config(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Recipe file + `section.key=value` overrides, validated."""
    cfg = load_recipe(path)
    apply_overrides(cfg, overrides)
    return cfg.validate()


def derive(cfg: Config, *overrides: str) -> Config:
    """A validated copy of `cfg` with `section.key=value` overrides (the CLI's spelling)."""
    new = from_dict(cfg.to_dict())
    apply_overrides(new, overrides)
    return new.validate()


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict()` (reads a run's config.json)."""
    return _build(Config, d, "")


def _build(cls, d: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in hints:
            raise ConfigError(f"unknown key {prefix}{key}")
        tp = hints[key]
        inner = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            kwargs[key] = _build(inner, value, f"{prefix}{key}.")
        elif get_origin(inner) is tuple and isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


# ----------------------------------------------------------------------------- overrides

def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE, e.g. --train.steps=20")
        key, raw = item.split("=", 1)
        if key.startswith("config."):  # ml_collections habit: --config.train.steps=20
            key = key[len("config."):]
        set_value(cfg, key, raw)
    return cfg


def set_value(cfg: Config, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(type(node))
        where = ".".join(parts[:depth])
        if part not in hints:
            choices = sorted(hints)
            close = difflib.get_close_matches(part, choices, n=3)
            prefix = f"{where}." if where else ""
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(
                f"unknown config key {dotted!r}{hint} "
                f"(keys of {where or 'the config'}: {', '.join(choices)})")
        tp = hints[part]
        if depth == len(parts) - 1:
            setattr(node, part, parse_value(dotted, raw, tp))
            return
        child = getattr(node, part)
        if child is None:  # an optional section (e.g. model.rope_scaling): create it
            child = _unwrap_optional(tp)()
            setattr(node, part, child)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"config key {'.'.join(parts[:depth + 1])!r} is a value, not a section")
        node = child


def _unwrap_optional(tp):
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def parse_value(key: str, raw: str, tp) -> Any:
    """Parse `raw` as the field type `tp`; errors name the key and what is allowed."""
    is_optional = type(None) in get_args(tp)
    tp = _unwrap_optional(tp)
    if is_optional and raw.lower() in ("none", "null", ""):
        return None
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if raw not in allowed:
            close = difflib.get_close_matches(raw, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={raw!r} is not allowed{hint}; choose one of {', '.join(allowed)}")
        return raw
    if tp is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected a boolean (true/false)")
    if tp is int:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected a number") from None
    if tp is str:
        return raw
    if origin is tuple:
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
    raise ConfigError(f"{key}: cannot parse a value of type {tp}")


# ----------------------------------------------------------------------------- durations

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


# ----------------------------------------------------------------------------- validation
# The rules a config must pass before anything runs. `validate` (Config.validate) applies those
# that need no devices; jaxtrain.config_check.check(cfg, n_devices) applies them too, then the
# rest. A rule that also holds for the resolved layout (the -1 filled) or for a candidate
# layout of the planner is one function here, with the error class of its caller.

DEGREES = ("data", "fsdp", "tensor", "context", "stage")
# Which attention cores (model.attention) run each parallel.context_strategy.
CONTEXT_STRATEGIES = {"all_gather": ("auto", "xla", "pallas", "cudnn"),
                      "ring": ("auto", "xla", "pallas")}
FP8_ALIGN = 16  # FP8 GEMMs need K and N multiples of 16 (cuBLASLt, Transformer Engine)


def _check(ok: bool, msg: str, error: type[ConfigError] = ConfigError) -> None:
    if not ok:
        raise error(msg)


def parse_mixture(text: str) -> list[tuple[str, str]]:
    """`data.mixture` "0.3 A 0.7 B" (spaces or commas) -> [("0.3", "A"), ("0.7", "B")]: the
    weights as written (exact decimals), each checked to be a number >= 0, their sum > 0."""
    items = text.replace(",", " ").split()
    if not items or len(items) % 2:
        raise ConfigError(f"data.mixture={text!r}: expected weight/directory pairs, e.g. "
                          "'0.3 /data/web 0.7 /data/code'")
    pairs = list(zip(items[0::2], items[1::2]))
    total = 0.0
    for weight, path in pairs:
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"data.mixture: {weight!r} (before {path}) is not a number; "
                              "write weight/directory pairs, e.g. '0.3 /data/web 0.7 "
                              "/data/code'") from None
        _check(w >= 0 and w != float("inf"),
               f"data.mixture: the weight {weight} of {path} must be a finite number >= 0")
        total += w
    _check(total > 0, f"data.mixture={text!r}: the weights sum to {total:g}; give at least "
           "one directory a positive weight")
    return pairs


def validate_data(d: DataConfig) -> None:
    if d.mixture:
        _check(d.source == "prepared", f"data.mixture needs data.source=prepared (it is "
               f"{d.source}); mixtures blend prepared directories")
        _check(not d.path, "set data.path (one prepared directory) or data.mixture (several), "
               "not both")
        parse_mixture(d.mixture)
    elif d.source == "prepared":
        _check(bool(d.path), "data.source=prepared needs data.path (a directory written by "
               "`python -m jaxtrain.data prepare`) or data.mixture")
    else:
        _check(d.source == "corpus" or d.path,
               f"data.source={d.source} needs data.path (a file or folder)")


def check_gqa(m: ModelConfig, error: type[ConfigError] = ConfigError) -> None:
    """Grouped-query attention: every KV head serves the same number of query heads."""
    _check(m.num_heads % m.num_kv_heads == 0, f"model.num_heads={m.num_heads} is not divisible "
           f"by model.num_kv_heads={m.num_kv_heads}; grouped-query attention needs whole "
           "groups: pick a divisor of num_heads", error)


def check_fill(p: ParallelConfig, error: type[ConfigError] = ConfigError) -> None:
    """At most one mesh degree is -1: it fills the devices the others leave."""
    fill = [f"parallel.{a}" for a in DEGREES if getattr(p, a) == -1]
    _check(len(fill) <= 1, f"only one of parallel.{'/'.join(DEGREES)} may be -1 (it fills the "
           f"devices the others leave), but {' and '.join(fill)} are; give all but one a "
           "degree", error)


def check_batch_split(global_batch: int, data: int, fsdp: int, microbatches: int,
                      filled: str = "", error: type[ConfigError] = ConfigError) -> None:
    """train.global_batch = data x fsdp x micro-batch x microbatches (docs/design.md §4); a
    degree of -1 (not resolved yet) is left out, `filled` names the one resolved from -1."""
    factors = {a: v for a, v in (("data", data), ("fsdp", fsdp)) if v > 1}
    factors["microbatches"] = microbatches
    n = math.prod(factors.values())
    named = " x ".join(f"parallel.{a}={v}" + (" (the fill)" if a == filled else "")
                       for a, v in factors.items())
    _check(global_batch % n == 0, f"train.global_batch={global_batch} is not divisible by "
           f"{named}{f' = {n}' if len(factors) > 1 else ''}; change train.global_batch, "
           "parallel.microbatches or the layout", error)


def check_context_split(seq_len: int, context: int, load_balance: bool,
                        error: type[ConfigError] = ConfigError) -> None:
    """The sequence splits over `context` ranks: into 2·context chunks under causal load
    balancing (the data pipeline gives rank r chunks r and 2c-1-r, jaxtrain/data/context.py)."""
    s, c = seq_len, context
    if c == 1:
        return
    if not load_balance:
        _check(s % c == 0, f"train.seq_len={s} is not divisible by parallel.context={c}; use a "
               f"multiple of {c}", error)
        return
    _check(c % 2 == 0, f"parallel.context={c} is odd: causal load balancing (parallel."
           "context_load_balance=true) is supported for even degrees only (as in MaxText); use "
           "an even parallel.context or set parallel.context_load_balance=false", error)
    _check(s % (2 * c) == 0, f"train.seq_len={s} does not split into 2 x parallel.context={c} "
           f"= {2 * c} chunks (causal load balancing gives rank r chunks r and {2 * c - 1}-r); "
           f"use a seq_len divisible by {2 * c} or set parallel.context_load_balance=false",
           error)


def check_context_core(strategy: str, attention: str,
                       error: type[ConfigError] = ConfigError) -> None:
    """`strategy` (parallel.context_strategy) runs the `attention` core."""
    _check(strategy in CONTEXT_STRATEGIES, f"parallel.context_strategy={strategy!r} is "
           f"unknown; choose one of {', '.join(CONTEXT_STRATEGIES)}", error)
    _check(attention in CONTEXT_STRATEGIES[strategy],
           f"parallel.context_strategy={strategy} is not supported by model.attention="
           f"{attention}; " + "; ".join(f"{k} runs on {', '.join(a for a in v if a != 'auto')}"
                                        for k, v in CONTEXT_STRATEGIES.items())
           + ": change one of them", error)


def check_fp8(f: Fp8Config) -> None:
    """The fp8 section's own rules (fp8.recipe_of applies them to configs built without
    validate())."""
    for key, allowed, how in (("recipe", ("delayed", "current"), "delayed or current"),
                              ("format", ("hybrid", "e4m3"),
                               "hybrid (E4M3 forward, E5M2 gradients) or e4m3"),
                              ("amax_compute_algo", ("max", "most_recent"), "max or most_recent")):
        _check(getattr(f, key) in allowed,
               f"fp8.{key}={getattr(f, key)!r} is unknown; choose {how}")
    _check(f.amax_history_len >= 1, f"fp8.amax_history_len={f.amax_history_len} must be >= 1")
    _check(f.margin >= 0, f"fp8.margin={f.margin} must be >= 0")
    _check(f.recipe != "current" or f.margin == 0,
           f"fp8.margin={f.margin} with fp8.recipe=current: Transformer Engine's current "
           "scaling has no margin (each tensor is scaled to its own amax); set fp8.margin=0 or "
           "use fp8.recipe=delayed")


def validate(cfg: Config) -> None:
    """The rules that need no devices (config_check.check(cfg, n_devices) adds the rest)."""
    m, p, t, f = cfg.model, cfg.parallel, cfg.train, cfg.fp8
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "mlp_size",
                 "max_seq_len"):
        _check(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
    check_gqa(m)
    _check(m.head_dim > 0 or m.hidden_size % m.num_heads == 0,
           f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
           "set model.head_dim explicitly")
    _check(m.resolved_head_dim % 2 == 0, f"head dim {m.resolved_head_dim} must be even for RoPE")
    _check(t.seq_len <= m.max_seq_len,
           f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
           "lower train.seq_len or raise model.max_seq_len")
    _check(t.seq_len > 0 and t.global_batch > 0 and t.steps >= 0,
           "train.seq_len, train.global_batch must be positive and train.steps non-negative")
    for name in DEGREES:
        v = getattr(p, name)
        _check(v == -1 or v >= 1, f"parallel.{name}={v}: use a positive degree or -1 (fill)")
    check_fill(p)
    _check(p.microbatches >= 1, f"parallel.microbatches={p.microbatches} must be >= 1")
    _check(p.virtual_stages >= 1, f"parallel.virtual_stages={p.virtual_stages} must be >= 1")
    if p.context != 1:
        check_context_core(p.context_strategy, m.attention)
        _check(p.context != -1 or not p.context_load_balance, "parallel.context=-1 with "
               "parallel.context_load_balance=true: the data pipeline reorders each sequence "
               "for a fixed degree; give parallel.context a number or set "
               "parallel.context_load_balance=false")
        if p.context > 1:
            check_context_split(t.seq_len, p.context, p.context_load_balance)
    _check(not p.sequence_parallel or p.tensor != 1,
           "parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards the sequence "
           "over the tensor axis); set parallel.tensor or turn sequence_parallel off")
    check_batch_split(t.global_batch, p.data, p.fsdp, p.microbatches)  # a -1 is left out
    _check(0 <= cfg.data.eval_fraction < 1, "data.eval_fraction must be in [0, 1)")
    _check(t.log_every >= 1, "train.log_every must be >= 1")
    parse_duration(t.max_runtime, "train.max_runtime")  # a malformed one raises here
    _check(cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0: only at the end)")
    validate_data(cfg.data)
    check_fp8(f)
    _check(f.bf16_first_layers >= 0 and f.bf16_last_layers >= 0,
           "fp8.bf16_first_layers and fp8.bf16_last_layers must be >= 0")
    _check(f.bf16_first_layers + f.bf16_last_layers <= m.num_layers,
           f"fp8.bf16_first_layers={f.bf16_first_layers} + fp8.bf16_last_layers="
           f"{f.bf16_last_layers} exceeds model.num_layers={m.num_layers}; lower them")
    _check(cfg.remat.num_layers >= 0, "remat.num_layers must be >= 0")

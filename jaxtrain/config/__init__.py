"""Typed configuration: sections.py (the dataclasses, frozen once validated), loading.py
(recipes, dotted overrides, derived copies), rules.py (validation) and errors.py.

A recipe is a Python file defining `get_config() -> Config`; recipes derive from each other by
calling one another's `get_config()` and changing fields. Overrides are `section.key=value`
strings, parsed according to the field's type. `Config.validate()` checks everything that can
be checked without devices; each error names the keys to change. The rules that need the
device count are jaxtrain.config_check's (`check(cfg, n_devices)` runs both).

This package imports nothing of ours but itself (docs/design.md §1); `from jaxtrain.config
import X` reaches every name below.
"""
from jaxtrain.config.errors import ConfigError, FrozenConfigError
from jaxtrain.config.sections import (
    CheckpointConfig, Config, DataConfig, Fp8Config, MlaConfig, ModelConfig, MoeConfig, MtpConfig,
    ParallelConfig,
    PrepareConfig, RematConfig, RopeScaling, TrainConfig)
from jaxtrain.config.loading import (
    apply_overrides, derive, from_dict, load_config, load_recipe, parse_value, set_value)
from jaxtrain.config.rules import (
    CONTEXT_STRATEGIES, DEGREES, FP8_ALIGN, check_batch_split, check_context_core,
    check_context_split, check_expert, check_expert_split, check_fill, check_fp8, check_gqa,
    check_mla, check_moe, check_mtp, expert_from_data, folds, padded_vocab, parse_duration,
    parse_mixture, validate, validate_data)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "Fp8Config",
    "FrozenConfigError",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
    "MtpConfig",
    "ParallelConfig",
    "PrepareConfig",
    "RematConfig",
    "RopeScaling",
    "TrainConfig",
    "parse_duration",
    "apply_overrides",
    "derive",
    "from_dict",
    "load_config",
    "load_recipe",
    "parse_value",
    "set_value",
    "CONTEXT_STRATEGIES",
    "DEGREES",
    "FP8_ALIGN",
    "check_batch_split",
    "check_context_core",
    "check_context_split",
    "check_expert",
    "check_expert_split",
    "expert_from_data",
    "folds",
    "check_fill",
    "check_fp8",
    "check_gqa",
    "check_mla",
    "check_moe",
    "check_mtp",
    "padded_vocab",
    "parse_mixture",
    "validate",
    "validate_data",
]

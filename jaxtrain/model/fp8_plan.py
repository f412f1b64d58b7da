"""The model's FP8 plan from fp8.*: which layers run in FP8 (the rules it must meet are
jaxtrain.config_check's check_fp8_layout)."""
from __future__ import annotations

from jaxtrain.config import Config
from jaxtrain.model import fp8 as fp8_lib
from jaxtrain.model import llama as model_lib


def fp8_layers(cfg: Config) -> model_lib.Fp8Layers | None:
    """The model's FP8 plan from fp8.*; None when FP8 is off."""
    f = cfg.fp8
    if not f.enabled:
        return None
    return model_lib.Fp8Layers(fp8_lib.recipe_of(f), f.bf16_first_layers, f.bf16_last_layers)

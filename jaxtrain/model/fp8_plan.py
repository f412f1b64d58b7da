"""The model's FP8 plan from fp8.* (which layers run in FP8) and the checks, from the config
alone and before anything compiles, that it fits the model dims, the tensor-parallel split
and the remat grouping."""
from __future__ import annotations

from jaxtrain.config import Config, ConfigError
from jaxtrain.model import fp8 as fp8_lib
from jaxtrain.model import llama as model_lib


def fp8_layers(cfg: Config) -> model_lib.Fp8Layers | None:
    """The model's FP8 plan from fp8.*; None when FP8 is off."""
    f = cfg.fp8
    if not f.enabled:
        return None
    return model_lib.Fp8Layers(fp8_lib.recipe_of(f), f.bf16_first_layers, f.bf16_last_layers)


class Fp8LayoutError(ConfigError):
    """FP8 settings that do not fit the model or the layout; names the layer and the keys."""


def validate_fp8(cfg: Config, tensor: int) -> None:
    """FP8 checks from the config alone (before anything compiles): every FP8 projection's
    GEMM sizes, whole and per tensor-parallel shard, are multiples of 16, and the FP8/bf16
    layer ranges fit the remat grouping."""
    f, m = cfg.fp8, cfg.model
    if not f.enabled:
        return
    align = fp8_lib.FP8_ALIGN
    first, last = f.bf16_first_layers, m.num_layers - f.bf16_last_layers
    if first >= last:
        return  # every layer is kept in bf16: no FP8 GEMM runs
    where = f"layers {first}..{last - 1}"
    for name, (k, n, sharded) in model_lib.projection_sizes(m).items():
        for label, size in (("K (contracting)", k), ("N (output)", n)):
            if size % align:
                raise Fp8LayoutError(
                    f"fp8.enabled: {name} ({where}) has {label} size {size}, not a multiple of "
                    f"{align} (FP8 GEMM alignment); change the model dims or set "
                    "fp8.enabled=false")
        size = n if sharded == "N" else k
        kv = name in ("blocks/attn/wk", "blocks/attn/wv")
        if tensor > 1 and not (kv and m.num_kv_heads % tensor):  # kv heads replicate if indivisible
            local = size // tensor
            if local % align:
                raise Fp8LayoutError(
                    f"fp8.enabled: {name} ({where}) is split over parallel.tensor={tensor} into "
                    f"{sharded} = {size}/{tensor} = {local} per shard, not a multiple of {align} "
                    "(FP8 GEMM alignment); lower parallel.tensor or change the model dims")
    r = cfg.remat
    if not r.policy and r.granularity == "full" and r.method == "uniform":
        spans = model_lib.layer_spans(m.num_layers, fp8_layers(cfg))
        bad = [(a, b) for a, b, _ in spans if (b - a) % r.num_layers]
        if bad:
            raise Fp8LayoutError(
                f"remat.method=uniform remat.num_layers={r.num_layers} must divide the length "
                "of each layer range the stack runs as: layers "
                f"{', '.join(f'{a}..{b - 1}' for a, b, _ in spans)} (from fp8.bf16_first_layers="
                f"{f.bf16_first_layers}, fp8.bf16_last_layers={f.bf16_last_layers}); change "
                "remat.num_layers or those")

"""The ledger: pure arithmetic over a Config (no jax) for FLOPs, MFU/HFU, memory, communication
and the expected step time of a parallel layout (docs/design.md §5). With pipeline stages it models
jaxtrain's lock-step executor (`ledger.pipeline`). `jaxtrain.tools.plan` searches layouts with it;
the trainer uses `mfu`/`hfu` and `describe(estimate(...))`; the dry run compares it with XLA."""
from jaxtrain.ledger.comm import bubble_fraction
from jaxtrain.ledger.estimate import (MOE_REMAT_VARIANTS, REMAT_VARIANTS, Assumptions, Estimate,
                                      estimate, remat_label, uses_flash)
from jaxtrain.ledger.flops import (ParamCounts, hfu, hfu_flops_per_token, mfu,
                                   model_flops_per_token, param_counts,
                                   recompute_flops_per_token, tokens_per_step)
from jaxtrain.ledger.hardware import (GB, GPUS, GiB, Gpu, UnknownGpuError, get_gpu,
                                      gpu_for_device_kind)
from jaxtrain.ledger.layout import (Layout, LayoutError, layout_from_config, stage_layer_counts,
                                    validate_layout)
from jaxtrain.ledger.memory import BUDGET_FRACTION, bytes_per_param, held_bytes_per_param
from jaxtrain.ledger.pipeline import Executor, chunk_input_bytes, executor
from jaxtrain.ledger.summary import describe

__all__ = [
    "Assumptions", "BUDGET_FRACTION", "Estimate", "Executor", "GB", "GPUS", "GiB", "Gpu", "Layout",
    "LayoutError", "MOE_REMAT_VARIANTS", "ParamCounts", "REMAT_VARIANTS", "UnknownGpuError", "bubble_fraction",
    "bytes_per_param", "chunk_input_bytes", "describe", "estimate", "executor",
    "get_gpu", "gpu_for_device_kind",
    "held_bytes_per_param", "hfu", "hfu_flops_per_token", "layout_from_config", "mfu",
    "model_flops_per_token", "param_counts", "recompute_flops_per_token", "remat_label",
    "stage_layer_counts", "tokens_per_step", "uses_flash", "validate_layout",
]

"""Nominal accelerator figures (docs/design.md §5) and the lookups the trainer and planner use.

Peaks are dense (no sparsity) tensor-core rates. Device memory is binary (an H100 has 80 GiB),
so every memory figure in the ledger is in GiB; link bandwidths are decimal (450 GB/s), so
communication volumes are in GB = 1e9 bytes.
"""
from __future__ import annotations

import dataclasses

from jaxtrain.config import ConfigError

GiB = 2 ** 30
GB = 1e9


class UnknownGpuError(ConfigError):
    """A GPU name the hardware table does not know; the message lists the known ones."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float         # dense bf16/fp16 tensor-core peak, FLOP/s
    fp8_flops: float          # 0 when the chip has no FP8 tensor cores
    fp32_flops: float         # what an fp32 matmul gets (TF32 tensor cores on NVIDIA)
    hbm_bytes: float
    hbm_bandwidth: float      # bytes/s
    nvlink_bandwidth: float   # bytes/s per direction per GPU, inside the node
    nic_bandwidth: float      # bytes/s per GPU, between nodes
    gpus_per_node: int
    kernel_efficiency: tuple[float, float]  # fraction of peak the compute stream gets (low, high)
    estimate: bool = False    # True when the figures are a guess, not a datasheet

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Peak FLOP/s for matmuls in `dtype` (bfloat16, float16, float32, fp8)."""
        if dtype in ("bfloat16", "float16", "bf16", "fp16"):
            return self.bf16_flops
        if dtype in ("float32", "fp32", "tf32"):
            return self.fp32_flops
        if dtype in ("fp8", "float8", "e4m3", "hybrid"):
            if not self.fp8_flops:
                raise ConfigError(f"{self.name} has no FP8 tensor cores; set fp8.enabled=false")
            return self.fp8_flops
        raise ConfigError(f"no peak for dtype {dtype!r}; use bfloat16, float16, float32 or fp8")


# Datasheet numbers: H100 SXM5 and H200 SXM (same compute, 141 GB HBM3e: nvidia-smi reports
# 143771 MiB, i.e. 140 GiB), A100 SXM4 80GB (HDR 200 Gb/s NIC per GPU in a DGX A100).
# Kernel efficiency: end-to-end compute stream of a large Llama step (matmuls plus norms,
# RoPE, softmax, loss) relative to peak; Hopper reaches a lower fraction than Ampere.
_H100 = Gpu("h100", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=494.5e12,
            hbm_bytes=80 * GiB, hbm_bandwidth=3.35e12, nvlink_bandwidth=450e9,
            nic_bandwidth=50e9, gpus_per_node=8, kernel_efficiency=(0.50, 0.70))
GPUS: dict[str, Gpu] = {
    "h100": _H100,
    "h200": dataclasses.replace(_H100, name="h200", hbm_bytes=140 * GiB, hbm_bandwidth=4.8e12),
    "a100": Gpu("a100", bf16_flops=312e12, fp8_flops=0.0, fp32_flops=156e12,
                hbm_bytes=80 * GiB, hbm_bandwidth=2.04e12, nvlink_bandwidth=300e9,
                nic_bandwidth=25e9, gpus_per_node=8, kernel_efficiency=(0.55, 0.75)),
    # A rough guess for a many-core host running XLA:CPU (fake devices share its memory and
    # "links" are memory copies). Only good for orders of magnitude.
    "cpu": Gpu("cpu", bf16_flops=0.5e12, fp8_flops=0.0, fp32_flops=1e12, hbm_bytes=64 * GiB,
               hbm_bandwidth=100e9, nvlink_bandwidth=20e9, nic_bandwidth=10e9,
               gpus_per_node=8, kernel_efficiency=(0.2, 0.5), estimate=True),
}
_ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "h100-sxm5": "h100", "h200-sxm": "h200",
            "a100-80gb": "a100", "a100-sxm": "a100", "a100-sxm4-80gb": "a100"}


def get_gpu(name: str | Gpu) -> Gpu:
    """Look a GPU up by name (case-insensitive); an unknown name lists the known ones."""
    if isinstance(name, Gpu):
        return name
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join(list(GPUS) + sorted(_ALIASES))
        raise UnknownGpuError(f"unknown GPU {name!r}; known: {known} ('cpu' is an estimate)")
    return GPUS[key]


def gpu_for_device_kind(device_kind: str) -> Gpu:
    """Map a jax `device.device_kind` ("NVIDIA H100 80GB HBM3", "cpu", ...) to the table."""
    kind = device_kind.lower()
    for key in ("h200", "h100", "a100"):
        if key in kind:
            return GPUS[key]
    if "cpu" in kind:
        return GPUS["cpu"]
    raise UnknownGpuError(f"device kind {device_kind!r} is not in the hardware table (known: "
                          f"{', '.join(GPUS)}); set train.peak_tflops to the chip's peak")

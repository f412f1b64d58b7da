"""Compile-only GPU targets: the real XLA:GPU compiler on a machine without a GPU.

`devices("h100", 64)` returns 64 compile-only H100s (jax.experimental.topologies); a jitted
function lowered with shardings on a mesh of them compiles to the optimized HLO, memory
analysis, collectives and Triton/Pallas kernels an H100 would run. Nothing executes and
nothing is autotuned. Needs the `gpu-compile` extra (jax[cuda12] at the jax version in use)
and JAX_PLATFORMS=cpu (the CUDA backend would fail without a driver; the plugin still
registers its compile-only topologies). shared/notes/gpu-compile-without-gpu.md has the
background.

The target descriptions are the project's own, written from the devices' published
properties (NVIDIA's H100/H200 datasheets and CUDA's device query for the SXM5 parts):
132 SMs at up to 1.98 GHz, 228 KiB shared memory per SM of which 227 KiB a block may opt
into, 64 Ki 32-bit registers per SM and per block, 50 MiB L2; the rate tables give XLA's cost
model the per-SM throughputs behind the quoted peaks (dense bf16 989 TFLOP/s = 132 SMs x 4
tensor cores x 512 FMA/clock x 2 x 1.83 GHz; fp8 twice that; tf32 half; fp32 non-tensor
67 TFLOP/s = 132 x 128 FMA/clock x 2 x 1.98 GHz). The CUDA runtime version matters: without
it XLA's GEMM rewriter believes CUDA 0.0 and silently upcasts FP8 operands.
"""
from __future__ import annotations

import dataclasses
import os

from jaxtrain.config import ConfigError

INSTALL = "pip install -e '.[gpu-compile]'"
GPUS_PER_HOST = 8


class TargetError(ConfigError):
    """An unknown target, or a GPU compile this environment cannot do; says what to change."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str               # what the report prints
    ledger_gpu: str         # jaxtrain.ledger.hardware entry with the same nominal figures
    memory_bytes: int       # what the device reports (cudaDeviceProp.totalGlobalMem)
    bandwidth_bytes_s: int  # HBM bandwidth


TARGETS = {
    "h100": Target("H100 SXM5 80GB", "h100", 85_045_477_376, 3_352_320_000_000),
    "h200": Target("H200 SXM 141GB", "h200", 150_754_820_096, 4_800_000_000_000),
}

# Per-SM rates: XLA PrimitiveType id -> (clock GHz, units per SM, FMA per unit per clock).
_MATRIX_RATES = {16: (1.83, 4, 512), 10: (1.83, 4, 512), 11: (1.83, 4, 256),  # bf16 f16 tf32
                 20: (1.83, 4, 1024), 19: (1.83, 4, 1024), 2: (1.83, 4, 1024)}  # e4m3 e5m2 s8
_SCALAR_RATES = {11: (1.98, 128, 1), 12: (1.98, 64, 1), 16: (1.98, 128, 2), 10: (1.98, 128, 2)}


def get(name: str) -> Target:
    if name not in TARGETS:
        raise TargetError(f"--target {name!r} is unknown; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def _rates(table: dict) -> str:
    rows = (f"rate_infos {{ key: {k} value {{ clock_rate_ghz: {c} units_per_core: {u} "
            f"ops_per_clock: {o} }} }}" for k, (c, u, o) in sorted(table.items()))
    return " ".join(rows)


def spec_text(target: Target) -> str:
    """The GpuTargetConfigProto (text format) XLA:GPU compiles against."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {target.bandwidth_bytes_s}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {target.memory_bytes}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 feature_extension: ACCELERATED_FEATURES }}
  scalar_unit_description {{ {_rates(_SCALAR_RATES)} }}
  matrix_unit_description {{ {_rates(_MATRIX_RATES)} }}
  runtime_version: "12.8.0"
  name: "{target.name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
"""


def topology(n_devices: int) -> str:
    """'slices x hosts x GPUs per host' for n devices: whole 8-GPU hosts, or one smaller host."""
    if n_devices < 1:
        raise TargetError(f"--devices={n_devices}: need at least one device")
    if n_devices <= GPUS_PER_HOST:
        return f"1x1x{n_devices}"
    if n_devices % GPUS_PER_HOST:
        raise TargetError(f"--devices={n_devices}: a multi-host target has whole hosts of "
                          f"{GPUS_PER_HOST} GPUs; use a multiple of {GPUS_PER_HOST}")
    return f"1x{n_devices // GPUS_PER_HOST}x{GPUS_PER_HOST}"


def check_available() -> None:
    """Raise TargetError, naming the command that fixes it, when GPU compiles cannot run here."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401  (the jax[cuda12] plugin)
    except ImportError:
        raise TargetError(f"--target needs the GPU-compile extra (jax[cuda12] at the jax "
                          f"version in use); install it with: {INSTALL}") from None
    import jax
    if (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")) != "cpu":
        raise TargetError("--target compiles on compile-only devices with the CPU backend: set "
                          "JAX_PLATFORMS=cpu before jax starts (train.py and the remat sweep "
                          "do it for --target)")


def devices(name: str, n_devices: int) -> list:
    """n compile-only devices of target `name` (in topology order)."""
    target = get(name)
    check_available()
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=spec_text(target),
                                        topology=topology(n_devices))
    return list(topo.devices)

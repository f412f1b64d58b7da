"""XLA options a GPU training step compiles with: the defaults, and the config's overrides.

Applied only when the step is compiled for GPUs (the mesh's devices, compile-only ones
included); XLA:CPU gets none. Each default is kept because compiling bench/comm_gpu.py's
layouts for H100s shows it helps (BENCHMARKS.md, "Less communication than MaxText"), and
only where it does:

- with FSDP, pipelined all-gathers: a layer's weights gathered one loop iteration ahead
  (statically overlapped FSDP all-gather bytes 70% -> 82%); without FSDP they pipeline the
  activation gathers of sequence parallelism instead and cost memory (Llama 3 8B's recipe,
  TP 2 + SP: 59.8 -> 78.5 GiB per device);
- with FSDP, pipelined all-reduces: the same for the layer loop's all-reduces (-> 89%);
- while-loop double buffering, only when nothing but the layer loop loops (one microbatch,
  no pipeline): it unrolls every loop by two, so the next layer's collectives overlap this
  one's compute (-> 93%; temporaries +0.6 GiB at Llama 3 8B, 8 layers, fsdp=8: the
  prefetched weights), but a microbatch loop unrolled by two holds two microbatches'
  activations (Llama 3 8B's recipe, 128 microbatches: 60.7 -> 76.1 GiB per device).

- with ring context parallelism, two async collectives in flight instead of one: a
  backward ring step carries the next block's K/V and the last block's dK/dV while its
  attention runs, and with one the scheduler leaves one of them exposed
  (configs/llama3_8b_128k.py: 85.8% of the context bytes statically overlapped -> 99.1%).

- with parallel.collective_matmul, no dot merger: XLA:GPU merges the rings' GEMMs (they
  share the weight and none depends on another) into one that waits for every hop, leaving
  nothing between a permute's start and done (tiny TP2+SP model: 16 of 18 permutes
  overlapped without the merger, BENCHMARKS.md for the 8B figures).

Left out because the compile showed no difference: the latency-hiding scheduler flag (on by
default in this XLA), pipelined reduce-scatters, collective combine thresholds.
`train.xla_flags` ("name=value name=value") adds options or overrides these; the dry run
lists what a step compiled with.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxtrain.config import Config, ConfigError
from jaxtrain.parallel.mesh_axes import CONTEXT, STAGE
from jaxtrain.parallel.mesh_axes import FSDP as FSDP_AXIS

FSDP = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}
LAYER_LOOP_ONLY = {"xla_gpu_enable_while_loop_double_buffering": True}
RING = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
COLLECTIVE_MATMUL = {"xla_gpu_dot_merger_threshold_mb": 0}


def parse(text: str) -> dict:
    """"name=value name=value" (spaces or commas) -> {name: value}; true/false and integers
    parsed, anything else kept as a string."""
    return dict(parse_option(item) for item in text.replace(",", " ").split())


def parse_option(item: str, source: str = "train.xla_flags") -> tuple[str, Any]:
    """"xla_name=value" -> (name, value), as `parse`; `source` names the setting in errors."""
    name, sep, value = item.partition("=")
    if not sep or not name.startswith("xla_"):
        raise ConfigError(f"{source}: {item!r} is not xla_NAME=VALUE, e.g. "
                          "'xla_gpu_enable_pipelined_all_gather=false'")
    low = value.lower()
    return name, (True if low == "true" else False if low == "false"
                  else int(value) if value.lstrip("-").isdigit() else value)


def for_platform(cfg: Config, platform: str, degrees: Mapping[str, int]) -> dict:
    """The XLA options a step for `platform` devices compiles with; `degrees`: the mesh's
    resolved size per axis (mesh.shape: a -1 in the config is filled there)."""
    if platform != "gpu":
        return {}
    p = cfg.parallel
    defaults = {}
    if degrees[FSDP_AXIS] > 1:
        defaults.update(FSDP)
        if p.microbatches == 1 and degrees[STAGE] == 1:
            defaults.update(LAYER_LOOP_ONLY)
    if degrees[CONTEXT] > 1 and p.context_strategy == "ring":
        defaults.update(RING)
    if p.collective_matmul:
        defaults.update(COLLECTIVE_MATMUL)
    return {**defaults, **parse(cfg.train.xla_flags)}

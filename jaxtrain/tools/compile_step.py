"""Compile the real train step from abstract state: nothing is allocated, nothing runs.

Shared by the dry run and the remat sweep. The devices are the ones present, or compile-only
GPUs of a target (`jaxtrain.tools.targets`): then the compiler is XLA:GPU, and what it emits is
what a GPU would run (cuBLASLt/Triton GEMMs, async collectives, Pallas kernels for sm_90a).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain import step
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import sharding
from jaxtrain.config import Config

# The CPU backend's LLVM optimisation level changes code speed, not the HLO: buffer sizes,
# collectives and FLOPs are the same at level 0, and compiling is about twice as fast.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass
class CompiledStep:
    setup: setup_lib.Setup
    compiled: Any            # jax.stages.Compiled
    text: str                # its optimized HLO
    lower_s: float
    compile_s: float

    @property
    def mesh(self):
        return self.setup.mesh

    @property
    def platform(self) -> str:
        return sharding.platform(self.mesh)


def abstract_batch(cfg: Config, mesh) -> dict:
    """The global batch as ShapeDtypeStructs with the step's batch sharding."""
    sh = sharding.batch_sharding(mesh)
    shape = (cfg.train.global_batch, cfg.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=sh) for k in setup_lib.BATCH_KEYS}


def compiler_options(mesh, extra: dict | None = None) -> dict:
    """XLA options for compiling on `mesh`'s devices, plus `extra` (e.g. a dump folder)."""
    base = dict(CPU_COMPILER_OPTIONS) if sharding.platform(mesh) == "cpu" else {}
    return {**base, **(extra or {})}


def compile_step(cfg: Config, mesh, *, extra_options: dict | None = None,
                 setup: setup_lib.Setup | None = None) -> CompiledStep:
    """Lower and compile `cfg`'s train step (pipelined when stage > 1) on `mesh`."""
    setup = setup or setup_lib.build(cfg, mesh)
    t0 = time.perf_counter()
    lowered = step.make_train_step(setup).lower(setup.abstract_train_state,
                                                abstract_batch(cfg, mesh))
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=compiler_options(mesh, extra_options) or None)
    t2 = time.perf_counter()
    return CompiledStep(setup, compiled, compiled.as_text(), t1 - t0, t2 - t1)

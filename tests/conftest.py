"""Test setup: 8 fake CPU devices, set before jax is imported anywhere.

The suite is dominated by XLA compiles on 2 cores, so CPU codegen runs at -O0: the optimized
HLO (what the collective and memory checks read) is the same, only the LLVM backend does less.
"""
import os

os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

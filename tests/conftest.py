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


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def h100():
    """`h100(n)`: n compile-only H100s (jaxtrain.tools.targets). Tests that take it carry the
    gpu_compile marker; without the gpu-compile extra they fail saying how to install it."""
    from jaxtrain.tools import targets
    try:
        targets.check_available()
    except targets.TargetError as err:
        pytest.fail(str(err))
    cache = {}

    def devices(n: int = 8):
        if n not in cache:
            cache[n] = targets.devices("h100", n)
        return cache[n]
    return devices

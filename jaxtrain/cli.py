"""What `train.py` does with its arguments: load and validate the config, then inspect or train.

Errors a user can cause (ConfigError and its subclasses) print one clear line and exit 2
before anything expensive starts.
"""
from __future__ import annotations

import os
import sys

from jaxtrain.config import ConfigError, load_config


def maybe_initialize_distributed() -> None:
    """Join a multi-process job when a launcher set one up (SLURM, or JAX's env variables)."""
    import jax
    launched = ("JAX_COORDINATOR_ADDRESS" in os.environ
                or int(os.environ.get("SLURM_NTASKS", "1")) > 1)
    if launched and not getattr(maybe_initialize_distributed, "done", False):
        jax.distributed.initialize()
        maybe_initialize_distributed.done = True


def run(config_path: str, overrides, *, inspect_sharding: bool = False) -> int:
    try:
        cfg = load_config(config_path, overrides)
        maybe_initialize_distributed()
        if inspect_sharding:
            print(inspect(cfg))
            return 0
        from jaxtrain import trainer
        trainer.train(cfg)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def inspect(cfg) -> str:
    from flax import nnx

    from jaxtrain import sharding, step
    mesh = sharding.make_mesh(cfg.parallel)
    setup = step.build(cfg, mesh)
    return sharding.describe(setup.logical, nnx.to_pure_dict(setup.abstract_state), mesh)

"""What `train.py` does with its arguments: load and validate the config, check the devices,
then inspect, dry-run or train.

Errors a user can cause (ConfigError and its subclasses) print one clear line and exit 2
before anything expensive starts. Too few devices for the configured layout is one of them:
the ledger's plan for the layout is printed first (jaxtrain.tools.device_plan explains how the
device count of a layout with a -1 fill is chosen), and nothing is compiled or allocated.
"""
from __future__ import annotations

import os
import sys

from jaxtrain.config import ConfigError, load_config


def maybe_initialize_distributed() -> None:
    """Join a multi-process job when a launcher set one up: JAX's variables
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) or a cluster jax detects
    (SLURM, Open MPI, ...). Must run before anything touches a jax backend."""
    import jax
    if getattr(maybe_initialize_distributed, "done", False):
        return
    # JAX's preemption service would catch SIGTERM in C++ before the trainer's handler is
    # installed; jaxtrain.preemption handles SIGTERM (and SIGINT, max_runtime) itself.
    jax.config.update("jax_enable_preemption_service", False)
    env = os.environ
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    if any(n in env for n in names[1:]):
        missing = [n for n in names if n not in env]
        if missing:
            raise ConfigError(f"a multi-process launch sets {', '.join(names)}; "
                              f"{', '.join(missing)} is missing")
        # jax.distributed.initialize() reads only the address from the environment (jax 0.10).
        jax.distributed.initialize(num_processes=int(env["JAX_NUM_PROCESSES"]),
                                   process_id=int(env["JAX_PROCESS_ID"]))
    elif "JAX_COORDINATOR_ADDRESS" in env or int(env.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()  # the cluster environment supplies the rest
    else:
        return
    maybe_initialize_distributed.done = True


def run(config_path: str, overrides, *, inspect_sharding: bool = False, dry_run: bool = False,
        gpu: str | None = None, devices: int | None = None, target: str | None = None,
        as_json: bool = False) -> int:
    """`gpu`: what the ledger plans for (default h100); `devices`: the device count to plan
    the configured layout for (resolves a -1 fill), which training requires to be the devices
    present; `target`: compile the dry run for that many compile-only GPUs of this kind."""
    import json

    from jaxtrain.tools import dry_run as dry_run_lib
    from jaxtrain.tools import targets
    from jaxtrain.ledger import get_gpu
    try:
        cfg = load_config(config_path, overrides)
        plan_gpu = get_gpu(gpu or "h100")
        if devices is not None and devices < 1:
            raise ConfigError(f"--devices={devices}: need at least one device")
        if target is not None:
            targets.get(target)   # an unknown target lists the known ones
            if not dry_run:
                raise ConfigError(f"--target {target} compiles for GPUs that are not here: use "
                                  "it with --dry-run (training runs on the devices present)")
            targets.check_available()
        if as_json and not dry_run:
            raise ConfigError("--json is the dry run's report format: add --dry-run")
        maybe_initialize_distributed()
        if dry_run or inspect_sharding:  # only training stops cleanly on a signal
            from jaxtrain import preemption
            preemption.release_early()
        if dry_run:
            report = dry_run_lib.dry_run(cfg, gpu, devices=devices, config_name=config_path,
                                         echo=lambda s: print(s, file=sys.stderr, flush=True),
                                         target=target)
            print(json.dumps(report.to_json(), indent=1) if as_json else report.format())
            return 0
        check_devices(cfg, plan_gpu, devices, config_path)
        if inspect_sharding:
            print(inspect(cfg))
            return 0
        from jaxtrain import trainer
        from jaxtrain.tools.mfu_breakdown import after_profile
        trainer.train(resolve_auto_remat(cfg), on_profile=after_profile)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def resolve_auto_remat(cfg):
    """remat.policy=auto made concrete by compiling candidates on the present devices (the
    remat sweep's choose_policy); any other config as it is."""
    if cfg.remat.policy != "auto":
        return cfg
    import dataclasses

    from jaxtrain.parallel import sharding
    from jaxtrain.tools.remat_sweep import choose_policy
    remat = choose_policy(cfg, sharding.make_mesh(cfg.parallel))
    print(f"remat.policy=auto chose {remat}", flush=True)
    return dataclasses.replace(cfg, remat=remat).validate()   # validated and frozen again


def check_devices(cfg, gpu, devices: int | None, config_name: str) -> None:
    """Raise TooFewDevicesError (after printing the ledger's plan) when the present devices
    cannot hold the configured layout; runs before any compile or allocation."""
    import jax

    from jaxtrain.tools import device_plan
    present = jax.device_count()
    if present < device_plan.needed_devices(cfg, devices):
        planned = device_plan.plan_devices(cfg, gpu, devices)
        print(device_plan.format_planned(planned, config_name), flush=True)
        raise device_plan.TooFewDevicesError(device_plan.too_few_devices_message(
            cfg, present, jax.devices()[0].platform, planned, devices))
    if devices is not None and devices != present:
        raise ConfigError(f"--devices={devices} but {present} devices are present and training "
                          "uses all of them; drop --devices (it plans a layout for another "
                          "device count, with --dry-run or on too few devices)")


def inspect(cfg) -> str:
    import jax
    from flax import nnx

    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding, sharding_report
    mesh = sharding.make_mesh(cfg.parallel)
    setup = setup_lib.build(cfg, mesh)
    specs = jax.tree.map(lambda s: s.spec, setup.compute_shardings)   # the setup's, folded too
    return sharding_report.describe(setup.logical, nnx.to_pure_dict(setup.abstract_state), mesh,
                                    specs)

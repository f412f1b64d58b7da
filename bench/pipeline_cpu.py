"""Pipeline schedules on CPU: step time and compiled memory per schedule at p=4.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/pipeline_cpu.py [overrides]

The tiny config with 8 layers on stage=4 x data=2, for gpipe, 1f1b and interleaved_1f1b
(virtual_stages=2), each with 8 and 32 microbatches. CPU fake devices share two cores, so step
times compare schedules' lock-step overheads, not pipeline speed-up.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from jaxtrain import step  # noqa: E402
from jaxtrain.executors import setup as setup_lib  # noqa: E402
from jaxtrain.parallel import sharding  # noqa: E402
from jaxtrain.tools import hlo  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.ledger.pipeline_schedule import build_schedule  # noqa: E402
from jaxtrain.tools.remat_sweep import random_batch  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


def measure(schedule, v, m, extra):
    cfg = load_config("configs/tiny.py", [
        "--model.num_layers=8", "--parallel.stage=4", "--parallel.data=2",
        f"--parallel.schedule={schedule}", f"--parallel.virtual_stages={v}",
        f"--parallel.microbatches={m}", f"--train.global_batch={2 * m}", *extra])
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))
    train_step = step.make_train_step(setup, donate=False)
    batch = random_batch(cfg, setup.mesh)
    temp = hlo.memory(train_step.lower(setup.abstract_train_state, batch).compile())
    state = setup_lib.init_train_state(setup, 0)
    jax.block_until_ready(train_step(state, batch))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(train_step(state, batch))
        times.append(time.perf_counter() - start)
    sched = build_schedule(schedule, 4, m, v)
    return statistics.median(times), temp["temp_bytes"] / 2**20, sched


def main(argv):
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
    print("\n| schedule | v | m | steps | stash/rank | bubble (F=B=1) | step s | temp MiB/device |")
    print("|---|---|---|---|---|---|---|---|")
    for schedule, v in SCHEDULES:
        for m in (8, 32):
            t, mib, sched = measure(schedule, v, m, argv)
            print(f"| {schedule} | {v} | {m} | {sched.num_steps} | {tuple(sched.stash_slots)} | "
                  f"{sched.bubble():.3f} | {t:.2f} | {mib:.1f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

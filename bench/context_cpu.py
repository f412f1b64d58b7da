"""Context parallelism on CPU: step time and compiled memory per device at c = 1, 2, 4.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/context_cpu.py [overrides]

One long sequence per step (the case context parallelism is for): the tiny config with 2
layers at 4096 tokens, on c devices (data=1, context=c) for both strategies, XLA attention
(the CPU path; c=1 is GSPMD's plain attention with its s×s scores). Memory is the compiled
step's temporaries per device (`memory_analysis()`); the step time is the median of 5 steps.
CPU fake devices share the machine's cores, so times show what each layout costs in total,
not a speed-up.
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
from jaxtrain.tools.remat_sweep import random_batch  # noqa: E402

SEQ = 4096


def measure(c: int, strategy: str, extra):
    cfg = load_config("configs/tiny.py", [
        "--model.num_layers=2", f"--train.seq_len={SEQ}", f"--model.max_seq_len={SEQ}",
        "--train.global_batch=1", "--parallel.data=1", f"--parallel.context={c}",
        f"--parallel.context_strategy={strategy}", "--model.attention=xla", *extra])
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel, jax.devices()[:c]))
    train_step = step.make_train_step(setup, donate=False)
    batch = random_batch(cfg, setup.mesh)
    memory = hlo.memory(train_step.lower(setup.abstract_train_state, batch).compile())
    state = setup_lib.init_train_state(setup, 0)
    state, metrics = train_step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times), memory["temp_bytes"] / 2**20, float(metrics["loss"])


def main(argv):
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"seq {SEQ}, 1 sequence per step")
    print("\n| context | strategy | step s | temp MiB/device | loss after 6 steps |")
    print("|---|---|---|---|---|")
    for c, strategy in ((1, "all_gather"), (2, "all_gather"), (2, "ring"), (4, "all_gather"),
                        (4, "ring")):
        t, mib, loss = measure(c, strategy, argv)
        print(f"| {c} | {strategy if c > 1 else '-'} | {t:.2f} | {mib:.1f} | {loss:.4f} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

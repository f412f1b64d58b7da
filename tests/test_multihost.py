"""Two processes × 4 CPU devices train exactly like one process × 8 devices.

The real trainer (`python train.py`) runs as two localhost processes joined by
`jax.distributed` (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; jax 0.10's
`initialize()` reads only the address from the environment, so the CLI passes the other two).
Cross-process collectives on CPU go through gloo, jax's default
`jax_cpu_collectives_implementation`. Each process feeds only its half of every global batch
(`data.make_batches(process_index, process_count)` + `make_array_from_process_local_data`),
and process 0 writes metrics.jsonl. The data position in a checkpoint is global (sequences
consumed), so the two-process run's checkpoint resumes in one process with the same batches.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from util import logged_losses

pytestmark = pytest.mark.slow   # real processes: the slowest module of the suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
# Every mesh axis spans the two processes' devices differently: data across processes, fsdp
# and tensor inside each (device order: tensor fastest).
ARGS = ["--config", "configs/tiny.py", "--train.steps=6", "--train.log_every=1",
        "--train.eval_every=0", "--model.num_layers=2", "--train.seq_len=64",
        "--parallel.data=2", "--parallel.fsdp=2", "--parallel.tensor=2"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                        "JAX_PROCESS_ID")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", **extra)
    return env


def _launch(workdir: pathlib.Path, env: dict, log: pathlib.Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *ARGS, f"--train.workdir={workdir}",
                             *extra], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)


def _wait(procs, logs) -> None:
    """Wait for all; when one fails or time runs out, kill the rest (a process whose peer died
    would otherwise sit in jax.distributed's shutdown barrier for minutes)."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"{log.name} exited {p.returncode}:\n{log.read_text()[-4000:]}"


def test_two_processes_match_one_and_resume_in_one(tmp_path):
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
    logs = [tmp_path / "one.log"]
    _wait([_launch(one, _env(8), logs[0])], logs)

    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [_launch(two, _env(4, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2",
                               JAX_PROCESS_ID=str(i)), logs[i], "--train.exit_interval=3")
             for i in range(2)]
    _wait(procs, logs)

    run = json.loads((two / "run.json").read_text())
    assert run["process_count"] == 2 and run["n_devices"] == 8
    want, got = logged_losses(one), logged_losses(two)
    assert sorted(got) == [s for s in sorted(want) if s <= 3] and max(got) == 3
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                               rtol=1e-5)

    # The two processes' checkpoint at step 3, resumed by one process, feeds the same batches.
    logs = [tmp_path / "resumed.log"]
    _wait([_launch(two, _env(8), logs[0])], logs)
    got = logged_losses(two)
    assert {5, 6} <= set(got)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(got)],
                               rtol=1e-5)


def test_a_signal_to_one_process_stops_both_after_the_same_step(tmp_path):
    """SLURM may signal only some tasks: the other process learns it through the per-step
    agreement and both save the same step and exit 0 (no process waits in a collective)."""
    workdir = tmp_path / "run"
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, "train.py", *ARGS, "--train.steps=200", f"--train.workdir={workdir}"],
        cwd=ROOT, stdout=logs[i].open("w"), stderr=subprocess.STDOUT,
        env=_env(4, JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2",
                 JAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")) for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    while not ((workdir / "metrics.jsonl").exists() and len(logged_losses(workdir)) >= 2):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    _wait(procs, logs)
    stopped = max(logged_losses(workdir))
    assert stopped < 200
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(stopped)]
    assert (f"another process was asked to stop: stopping after step {stopped}"
            in logs[0].read_text())

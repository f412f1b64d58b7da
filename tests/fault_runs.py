"""Fault-test runs: the recipe every fault test trains (so any resumed run can equal the
uninterrupted one bit for bit) and real `python train.py` processes with their output.

Every run compiles the same train step; `compile_cache(folder)` lets the in-process runs and
the launched processes load it from one persistent cache (a fresh folder per test session;
jax keys an entry by the program, the compile options, the XLA flags and the jax version)."""
import os
import pathlib
import struct
import subprocess
import sys
import threading
import time

from jaxtrain.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 40
ARGS = [f"--train.steps={STEPS}", "--train.log_every=1", "--train.eval_every=0",
        "--model.num_layers=2", "--model.hidden_size=64", "--model.mlp_size=128",
        "--train.seq_len=32", "--train.global_batch=8", "--data.corpus_max_bytes=400000"]
TIMEOUT_S = 300
CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
_cache_dir: list[str] = []  # the folder compile_cache() set up, if any


def compile_cache(folder) -> None:
    """From now on, `launch`ed processes share the compile cache in `folder` (None: none); the
    tests enter compat.persistent_compile_cache(folder) for their own runs."""
    _cache_dir[:] = [str(folder)] if folder else []


def config(workdir, *extra):
    return load_config(ROOT / "configs/tiny.py", [*ARGS, *extra, f"--train.workdir={workdir}"])


def steps(workdir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (workdir / "checkpoints").iterdir())


def launch(workdir, *extra, faults=()) -> subprocess.Popen:
    """`python train.py` on the recipe (under tests/faulty_train.py's `faults`); its output
    goes through a pipe (not subject to the child's file-size limit) to <workdir>.log."""
    runner = [str(ROOT / "tests/faulty_train.py"), *faults, "--"] if faults else []
    command = [*(runner or [str(ROOT / "train.py")]), "--config", "configs/tiny.py", *ARGS,
               *extra, f"--train.workdir={workdir}"]
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    # A process whose file writes are made to fail does not write the cache either.
    if _cache_dir and "--file-size-limit" not in faults:
        env.update(zip(CACHE_ENV, (_cache_dir[0], "0", "0")))
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)

    def copy(log=workdir.parent / f"{workdir.name}.log"):
        with log.open("ab") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
    proc.copier = threading.Thread(target=copy, daemon=True)
    proc.copier.start()
    return proc


def output(workdir) -> str:
    return (workdir.parent / f"{workdir.name}.log").read_text()


def error_line(workdir) -> str:
    """train.py's one-line error (orbax's own logs may follow it)."""
    lines = [x.strip() for x in output(workdir).splitlines() if x.strip().startswith("error:")]
    assert len(lines) == 1, output(workdir)[-3000:]
    return lines[0]


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never saw {what}; exit {proc.poll()}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, workdir) -> int:
    try:
        return proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.copier.join(timeout=30)
        print(output(workdir)[-3000:])


def tensorboard_steps(workdir: pathlib.Path, tag: str) -> list[int]:
    """The steps of `tag`'s curve as TensorBoard shows it: events files in order, a session
    START at step T (tensorboardX's purge_step) hiding what earlier files logged at >= T."""
    from tensorboardX.proto.event_pb2 import Event
    curve: list[int] = []
    for path in sorted((workdir / "tensorboard").glob("events.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):  # TFRecord: length u64, crc u32, payload, crc u32
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 16 + length
            if event.session_log.status == event.session_log.START:
                curve = [s for s in curve if s < event.step]
            curve += [event.step for v in event.summary.value if v.tag == tag]
    return curve

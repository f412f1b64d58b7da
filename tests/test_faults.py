"""Preemption, kills, damaged checkpoints and full or read-only disks: nothing is lost or
silently restarted.

Signals and kills go to a real `python train.py` subprocess; the runs that only restart go
through `trainer.train` in-process. Every run uses the same recipe and step count, so any
resumed run must reproduce the uninterrupted reference bit for bit.
"""
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

import fault_runs
from fault_runs import (STEPS, config, error_line, finish, launch, output, steps,
                        tensorboard_steps, wait_for)
from jaxtrain import compat, trainer
from jaxtrain.checkpoint import CheckpointCorruptError
from util import logged_losses, metric_records

pytestmark = pytest.mark.slow   # real processes: the slowest module of the suite
# Runs whose step time is under test: a step compiled in the run itself, not loaded.
UNCACHED = {"test_max_runtime_stops_with_a_checkpoint"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One persistent compile cache for every run of this module, in-process or launched."""
    folder = tmp_path_factory.mktemp("compile-cache")
    fault_runs.compile_cache(folder)
    yield folder
    fault_runs.compile_cache(None)


@pytest.fixture(autouse=True)
def cached(request, cache_dir):
    if request.node.originalname in UNCACHED:
        yield
        return
    with compat.persistent_compile_cache(cache_dir):
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir) -> dict[int, float]:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    with compat.persistent_compile_cache(cache_dir):
        trainer.train(config(workdir, "--checkpoint.async_save=false"), log=lambda *_: None)
    losses = logged_losses(workdir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


# ----------------------------------------------------------------------------- signals

def test_sigterm_saves_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    workdir = tmp_path / "run"
    proc = launch(workdir)  # async saves: the exit waits for the save
    wait_for(lambda: len(metric_records(workdir)) >= 2, proc, "step 2 logged")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, workdir) == 0
    stopped = max(logged_losses(workdir))
    assert stopped < STEPS, "the run ended before the signal; make the test run longer"
    assert f"SIGTERM received: stopping after step {stopped}" in output(workdir)
    assert steps(workdir) == [str(stopped)]  # committed, nothing left half-written

    trainer.train(config(workdir))  # resume (the first step after it is logged too)
    assert logged_losses(workdir) == reference  # every step, bit-exact
    records = metric_records(workdir)
    assert [r["step"] for r in records if "first_step_time_s" in r] == [1, stopped + 1]
    assert tensorboard_steps(workdir, "loss") == list(range(1, STEPS + 1))  # no hole


def test_a_second_signal_exits_at_once(tmp_path):
    workdir, marker = tmp_path / "run", tmp_path / "committing"
    proc = launch(workdir, faults=["--slow-commit", str(marker), "1"])
    wait_for(lambda: len(metric_records(workdir)) >= 2, proc, "step 2 logged")
    proc.send_signal(signal.SIGTERM)
    wait_for(marker.exists, proc, "the stop checkpoint being committed")
    proc.send_signal(signal.SIGTERM)  # the commit now waits ten minutes; this must not
    assert finish(proc, workdir) == -signal.SIGTERM
    assert [p for p in steps(workdir) if p.isdigit()] == []  # never committed


def test_sigterm_while_restoring_exits_0_having_lost_nothing(tmp_path, stopped_at_6, reference):
    """The handlers are installed first (train.py, before jax is imported): a job preempted
    while it starts stops before its first step instead of dying with exit 143."""
    workdir, marker = tmp_path / "run", tmp_path / "restoring"
    shutil.copytree(stopped_at_6, workdir)
    before = metric_records(workdir)
    proc = launch(workdir, "--checkpoint.every=2", faults=["--slow-restore", str(marker)])
    wait_for(marker.exists, proc, "the restore")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, workdir) == 0
    assert "SIGTERM received while starting: stopping before step 7, nothing lost" in \
        output(workdir)
    assert steps(workdir) == ["2", "4", "6"] and metric_records(workdir) == before
    trainer.train(config(workdir, "--checkpoint.every=2"))
    assert logged_losses(workdir) == reference


def test_a_signal_while_starting_waits_for_the_trainer_or_ends_what_does_not_train():
    """train.py's first statement remembers SIGTERM (the trainer takes it, above); a dry run
    or an inspection gets the default action back, with a remembered signal delivered."""
    code = ("import os, signal, time\nfrom jaxtrain import preemption\npreemption.catch_early()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\nprint('alive', flush=True)\n"
            "preemption.release_early()\nprint('not reached')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == "alive\n", done


def test_max_runtime_stops_with_a_checkpoint(tmp_path, capsys):
    workdir = tmp_path / "run"
    trainer.train(config(workdir, "--train.max_runtime=0.5s"))  # passes during step 1
    stopped = max(logged_losses(workdir))
    assert stopped < STEPS and steps(workdir) == [str(stopped)]
    assert f"train.max_runtime reached: stopping after step {stopped}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- kill -9

def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, reference):
    workdir, marker = tmp_path / "run", tmp_path / "committing"
    proc = launch(workdir, "--checkpoint.every=2", faults=["--slow-commit", str(marker), "4"])
    wait_for(marker.exists, proc, "step 4's save being committed")
    proc.send_signal(signal.SIGKILL)
    assert finish(proc, workdir) == -signal.SIGKILL
    assert steps(workdir) == ["2", "4.orbax-checkpoint-tmp"]
    partial = workdir / "checkpoints" / "4.orbax-checkpoint-tmp"
    assert (partial / "commit_success.txt").exists()  # every byte written, only not committed

    logged = []
    trainer.train(config(workdir, "--checkpoint.every=2"), log=logged.append)
    assert any(f"ignored {partial}: a save interrupted" in line for line in logged), logged
    assert any(line.endswith("checkpoints/2") and "resumed from" in line for line in logged)
    assert logged_losses(workdir) == reference  # steps 3.. logged again by the resumed run
    # ... and once: the killed attempt's records of steps 3 and 4 were dropped at the restart
    assert [r["step"] for r in metric_records(workdir) if "loss" in r] == sorted(reference)


def test_tensorboard_keeps_every_step_through_a_kill_after_a_checkpoint(tmp_path, reference):
    """TensorBoard buffers events (tensorboardX flushes every 120 s) and a restart hides what
    was logged after its checkpoint: a kill -9 right after checkpoint 10 left the curve at 1-9
    and 11-40. Events are flushed when a checkpoint is saved; a torn last record (a kill
    mid-write) is cut off at the restart."""
    workdir = tmp_path / "run"
    proc = launch(workdir, "--checkpoint.every=10")
    wait_for(lambda: (workdir / "checkpoints" / "10").is_dir(), proc, "checkpoint 10")
    proc.send_signal(signal.SIGKILL)
    assert finish(proc, workdir) == -signal.SIGKILL
    (killed,) = (workdir / "tensorboard").glob("events.*")
    with killed.open("r+b") as f:  # a kill mid-write: the last record's tail never landed
        f.truncate(killed.stat().st_size - 5)
    trainer.train(config(workdir, "--checkpoint.every=10"))
    assert logged_losses(workdir) == reference
    assert tensorboard_steps(workdir, "loss") == list(range(1, STEPS + 1))


# ----------------------------------------------------------------------------- damage

def _truncate(step_dir: pathlib.Path) -> None:
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])


def _overwrite_values(step_dir: pathlib.Path) -> None:
    """Same size, other bytes in the array data. TensorStore notices when they break a
    compressed chunk; when they do not, it returns the other values (measured: NaN losses
    two steps later) and only the fingerprint sees it."""
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = bytes(range(64))
    largest.write_bytes(bytes(data))


def _garbage_metadata(step_dir: pathlib.Path) -> None:
    (step_dir / "state" / "_METADATA").write_bytes(b"\x00garbage" * 20)


def _other_fingerprint(step_dir: pathlib.Path) -> None:
    """The values as saved, a record of other ones: what the fingerprint check reports when
    the array files changed and still decode."""
    path = step_dir / "fingerprint" / "metadata"
    saved = json.loads(path.read_text())
    saved["params/embed"][1] ^= 1
    path.write_text(json.dumps(saved))


def _other_data_position(step_dir: pathlib.Path) -> None:
    """The iterator position edited (48 sequences -> 32): it would resume at other data."""
    path = step_dir / "data" / "metadata"
    position = json.loads(path.read_text())
    position["sequences"] -= 16
    path.write_text(json.dumps(position))


@pytest.fixture(scope="module")
def stopped_at_6(tmp_path_factory, cache_dir) -> pathlib.Path:
    """Checkpoints 2, 4, 6 of the reference recipe (exit_interval stops it after 6)."""
    workdir = tmp_path_factory.mktemp("stopped_at_6")
    with compat.persistent_compile_cache(cache_dir):
        trainer.train(config(workdir, "--checkpoint.every=2", "--train.exit_interval=6",
                              "--checkpoint.async_save=false"), log=lambda *_: None)
    assert steps(workdir) == ["2", "4", "6"]
    return workdir


@pytest.mark.parametrize("damage", [_truncate, _overwrite_values, _garbage_metadata,
                                    _other_fingerprint, _other_data_position])
def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, stopped_at_6, reference,
                                                             damage):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_6, workdir)
    damage(workdir / "checkpoints" / "6")
    logged = []
    trainer.train(config(workdir, "--checkpoint.every=2"), log=logged.append)
    warning = [line for line in logged if line.startswith("warning:")]
    assert len(warning) == 1 and "checkpoints/6 is unreadable" in warning[0], logged
    if damage is _other_fingerprint:
        assert "params/embed does not hold the values that were saved" in warning[0]
    if damage is _other_data_position:
        assert "its data position does not hold what was saved" in warning[0]
    assert "renamed it 6.unreadable and resumed from step 4" in warning[0]
    assert (workdir / "checkpoints" / "6.unreadable").is_dir()  # kept for inspection
    assert logged_losses(workdir) == reference


@pytest.mark.parametrize("source, resumed", [("6", "4"), ("2", "6")], ids=["renamed", "copied"])
def test_a_step_folder_named_after_another_step_is_damage(tmp_path, stopped_at_6, reference,
                                                          source, resumed):
    """6 renamed 8, or 2 copied as 8: restored silently, every later save collided with the
    folder (StepAlreadyExistsError) on every rerun. Now it is set aside like any damage."""
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_6, workdir)
    steps = workdir / "checkpoints"
    (shutil.move if source == "6" else shutil.copytree)(steps / source, steps / "8")
    logged = []
    trainer.train(config(workdir, "--checkpoint.every=2"), log=logged.append)
    warning = [line for line in logged if line.startswith("warning:")]
    assert len(warning) == 1 and f"checkpoints/8 is unreadable (it holds the train state of " \
        f"step {source}, not 8 (a renamed or copied folder))" in warning[0], logged
    assert f"renamed it 8.unreadable and resumed from step {resumed}" in warning[0]
    assert logged_losses(workdir) == reference


def test_no_readable_checkpoint_is_an_error_not_a_fresh_start(tmp_path, stopped_at_6):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_6, workdir)
    for step, damage in (("2", _garbage_metadata), ("4", _truncate), ("6", _other_fingerprint)):
        damage(workdir / "checkpoints" / step)
    before = metric_records(workdir)
    for _ in range(2):  # and again on the next attempt: nothing was renamed or overwritten
        with pytest.raises(CheckpointCorruptError, match=r"step 6: .*fingerprint.*; step 4: .*"
                           r"; step 2: .*JSONDecodeError"):
            trainer.train(config(workdir))
        assert steps(workdir) == ["2", "4", "6"] and metric_records(workdir) == before


# ----------------------------------------------------------------------------- full, read-only

def test_a_full_disk_at_save_time_is_an_error_that_keeps_the_previous_checkpoint(
        tmp_path, stopped_at_6, reference):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_6, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    shutil.rmtree(workdir / "checkpoints" / "6")
    # Files stop growing at 100 kB: checkpoint data files are larger, the logs smaller.
    proc = launch(workdir, "--checkpoint.every=4", "--checkpoint.keep=1",
                   faults=["--file-size-limit", "100000"])
    assert finish(proc, workdir) == 2
    error = error_line(workdir)
    assert "saving checkpoint" in error and "checkpoints/4 failed (File too large" in error
    assert "the latest complete checkpoint" in error and "checkpoints/2, is kept" in error
    assert "Traceback" not in output(workdir)  # orbax's threads printed ~330 lines of them
    assert steps(workdir) == ["2", "4.orbax-checkpoint-tmp"]
    trainer.train(config(workdir))  # room again: resumes from 2
    assert logged_losses(workdir) == reference


def test_a_read_only_workdir_is_refused_before_anything_runs(tmp_path, stopped_at_6):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_at_6, workdir)
    before = steps(workdir)
    (workdir / "checkpoints").chmod(0o555)
    try:
        proc = launch(workdir, faults=["--no-root-override"])
        assert finish(proc, workdir) == 2
    finally:
        (workdir / "checkpoints").chmod(0o755)
    assert error_line(workdir) == (
        f"error: train.workdir={workdir}: cannot write to {workdir}/checkpoints (Permission "
        "denied); make it writable or set train.workdir to a folder that is")
    assert steps(workdir) == before


def test_a_disk_that_cannot_take_config_json_is_a_one_line_error(tmp_path):
    workdir = tmp_path / "run"  # config.json is ~2 kB; the write probe writes 4 kB
    proc = launch(workdir, faults=["--file-size-limit", "1000"])
    assert finish(proc, workdir) == 2
    assert error_line(workdir) == (f"error: train.workdir={workdir}: cannot write to {workdir} "
                                   "(File too large); make it writable or set train.workdir to "
                                   "a folder that is")
    assert "Traceback" not in output(workdir)


def test_checkpoints_losing_write_permission_mid_run_exit_at_once(tmp_path):
    """The save's directory is made on the trainer's thread: made by orbax's threads, the
    failed mkdir left the others waiting out orbax's 300 s timeout before the process ended."""
    workdir = tmp_path / "run"
    proc = launch(workdir, "--checkpoint.every=20", faults=["--no-root-override"])
    try:
        wait_for(lambda: (workdir / "checkpoints" / "20").is_dir(), proc, "checkpoint 20")
        (workdir / "checkpoints").chmod(0o555)  # before step 40's save makes its folder
        revoked = time.monotonic()
        assert finish(proc, workdir) == 2
        assert time.monotonic() - revoked < 60
    finally:
        (workdir / "checkpoints").chmod(0o755)
    assert error_line(workdir).startswith(f"error: saving checkpoint {workdir}/checkpoints/40 "
                                          "failed (Permission denied")
    assert "checkpoints/20, is kept" in error_line(workdir)
    assert "Traceback" not in output(workdir)


# ----------------------------------------------------------------------------- fingerprint

def test_fingerprint_sees_one_changed_or_two_swapped_values_on_any_sharding():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxtrain.checkpoint import fingerprint
    x = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    changed = x.copy()
    changed[3, 5] = np.nextafter(changed[3, 5], np.float32(np.inf))  # one ulp
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    base = fingerprint({"x": x})["x"]
    assert fingerprint({"x": sharded})["x"] == base  # exact integers: sharding-independent
    assert fingerprint({"x": changed})["x"][0] != base[0]
    swapped_fp = fingerprint({"x": swapped})["x"]
    assert swapped_fp[0] == base[0] and swapped_fp[1] != base[1]  # the weighted sum sees it

"""The training loop: the one place that wires config, mesh, model, data, checkpoints and logs.

    setup (mesh, abstract state, shardings) -> restore or sharded init -> loop:
        dispatch step N, then read step N-1's metrics (the host never stalls the device)
        log / eval / profile / checkpoint on their schedules
    -> final checkpoint

A non-finite loss stops the run before anything is saved from that state, so the last good
checkpoint stays the latest. SIGTERM / SIGINT or `train.max_runtime` stop it after the step in
flight with a checkpoint (preemption.py); every process stops after the same step.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import time

import jax
import numpy as np

from jaxtrain import data as data_lib
from jaxtrain import step as step_lib, weights
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import sharding
from jaxtrain import run_report
from jaxtrain.checkpoint import Checkpointer, check_fresh_start, check_steps_left
from jaxtrain.config import Config, ConfigError
from jaxtrain.ledger.layout import layout_from_config
from jaxtrain.metrics import DATA_SPAN, MetricsWriter, Throughput, device_memory_gb
from jaxtrain.preemption import StopRequest
from jaxtrain.train_state import TrainState


class NonFiniteLossError(RuntimeError):
    pass


class WorkdirNotWritableError(ConfigError):
    pass


def check_writable(workdir: pathlib.Path) -> None:
    """Fail before any compile when the run could not save what it computes."""
    for folder in (workdir, workdir / "checkpoints"):
        probe = folder / f".write_probe_{jax.process_index()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_text(" " * 4096)  # some bytes: an empty file fits on a full disk
            probe.unlink()
        except OSError as e:
            raise WorkdirNotWritableError(
                f"train.workdir={workdir}: cannot write to {folder} ({e.strerror}); make it "
                "writable or set train.workdir to a folder that is") from None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write_run_info(workdir: pathlib.Path, cfg: Config) -> None:
    info = {"git_commit": git_commit(), "jax": jax.__version__,
            "devices": [d.device_kind for d in jax.devices()][:1], "n_devices": jax.device_count(),
            "process_count": jax.process_count()}
    for name, text in (("config.json", cfg.to_json()), ("run.json", json.dumps(info, indent=2))):
        try:
            (workdir / name).write_text(text)
        except OSError as e:  # a full disk or a file-size limit the write probe did not meet
            raise WorkdirNotWritableError(
                f"train.workdir={workdir}: cannot write {name} ({e.strerror}); free space there "
                "or set train.workdir to a folder that can take it") from None


def pipeline_summary(cfg: Config, stages: int) -> str:
    """The configured schedule's bubble (ledger) and static in-flight bound (simulator)."""
    from jaxtrain.ledger import bubble_fraction
    from jaxtrain.ledger.layout import stage_layer_counts
    from jaxtrain.ledger.pipeline_schedule import build_schedule
    p, v, m = stages, cfg.parallel.virtual_stages, cfg.parallel.microbatches
    schedule = build_schedule(cfg.parallel.schedule, p, m, v)
    return (f"pipeline: {cfg.parallel.schedule} stages={p} virtual={v} microbatches={m}; layers "
            f"per stage {stage_layer_counts(cfg, p, v)}; bubble (p-1)/(m·v) = "
            f"{bubble_fraction(p, m, v):.1%}; microbatches stashed per rank at most "
            f"{tuple(schedule.stash_slots)} ({schedule.num_steps} lock-step steps)")


def global_batch_array(setup, local_batch: dict) -> dict:
    """Assemble this process's rows into global arrays sharded over (data, fsdp)."""
    sh, keys = setup.batch_shardings, setup_lib.BATCH_KEYS
    if jax.process_count() == 1:
        return {k: jax.device_put(np.asarray(local_batch[k]), sh[k]) for k in keys}
    return {k: jax.make_array_from_process_local_data(sh[k], np.asarray(local_batch[k]))
            for k in keys}


def evaluate(setup, eval_step, state: TrainState, batches, n_batches: int) -> float:
    """Mean token loss over `n_batches` held-out batches (in FP8 when the run trains in FP8)."""
    sums = [eval_step(state.params, global_batch_array(setup, next(batches)), state.fp8_meta)
            for _ in range(n_batches)]   # dispatched, then read
    loss_sum = count = 0.0
    for s, c in jax.device_get(sums):
        loss_sum, count = loss_sum + float(s), count + float(c)
    return loss_sum / max(count, 1.0)


def restore_or_init(cfg: Config, setup, ckpt: Checkpointer, train_batches, log) -> TrainState:
    """The train state to start from: the latest readable checkpoint (and its data position),
    else imported weights (checkpoint.init_from), else a fresh init from train.seed."""
    for path in ckpt.interrupted_saves:
        log(f"ignored {path}: a save interrupted before it was committed (removed)")
    restored = (ckpt.restore_latest(setup.abstract_train_state, setup.layer_order,
                                    warn=log, model=cfg.model) if cfg.checkpoint.resume else None)
    if restored is not None:
        latest, state, data_state = restored
        train_batches.set_state(data_state)
        log(f"resumed from {ckpt.directory}/{latest}")
        return state
    if cfg.checkpoint.init_from:
        params, _ = weights.load_params(cfg.checkpoint.init_from)
        state = setup_lib.train_state_from_params(setup, params)
        log(f"initialised from {cfg.checkpoint.init_from}")
        return state
    return setup_lib.init_train_state(setup, cfg.train.seed)


def train(cfg: Config, *, log=print, on_profile=None) -> dict:
    """Run `cfg.train.steps` steps (resuming from the workdir's latest checkpoint); returns the
    last logged metrics. `on_profile(workdir, lowered_step, log)` runs after the profiled
    steps (train.py passes the MFU breakdown)."""
    started = time.monotonic()
    # The handlers first: a job preempted while it starts (data, mesh, init, the restore) stops
    # before its first step, exit 0, instead of dying with the default action.
    stop = StopRequest(cfg.train.max_runtime_s, started).install()
    try:
        return _train(cfg, stop, started, log, on_profile)
    finally:
        stop.uninstall()


def _train(cfg: Config, stop: StopRequest, started: float, log, on_profile) -> dict:
    workdir = pathlib.Path(cfg.train.workdir)
    is_main = jax.process_index() == 0
    check_writable(workdir)
    check_fresh_start(workdir / "checkpoints", cfg.checkpoint)
    check_steps_left(workdir / "checkpoints", cfg.checkpoint, cfg.train.steps)
    mesh = sharding.make_mesh(cfg.parallel)
    # Data first: a bad tokenizer, directory or mixture fails before anything compiles.
    train_batches = data_lib.make_batches(cfg, "train", jax.process_index(), jax.process_count())
    eval_batches = (data_lib.make_batches(cfg, "eval", jax.process_index(), jax.process_count())
                    if cfg.train.eval_every else None)
    setup = setup_lib.build(cfg, mesh)
    if mesh.shape["stage"] > 1 and is_main:
        log(pipeline_summary(cfg, mesh.shape["stage"]))
    previous = run_report.read_previous_config(workdir)
    if is_main:
        write_run_info(workdir, cfg)
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    state = restore_or_init(cfg, setup, ckpt, train_batches, log)
    start = int(state.step)
    if is_main:
        log(run_report.header(cfg, layout_from_config(cfg, mesh.size),
                              jax.devices()[0].device_kind, jax.process_count(), start))
        if note := run_report.schedule_change(previous, cfg, start):
            log(note)
    stopping = stop.before_start()  # a signal came while starting
    if stopping or start >= cfg.train.steps:
        ckpt.close()
        log(f"{stop.reason()} while starting: stopping before step {start + 1}, nothing lost "
            "(no step was taken); rerun to resume" if stopping else
            f"{workdir} is already at step {start} = train.steps: nothing to train. Raise "
            "train.steps to train on (train.lr_decay_steps keeps the decay where it was) or "
            "set train.workdir to a fresh folder")
        return {}
    loop = _Loop(cfg, setup, ckpt, train_batches, eval_batches, start,
                 on_profile if is_main else None)
    try:
        for step in range(loop.start, cfg.train.steps):
            state = loop.step(step, state)
            if loop.after(step + 1, state, stop):
                break
        loop.finish_pending()
        ckpt.wait()
        last = ckpt.latest_step()
    finally:
        ckpt.close()
        loop.writer.close()
    if is_main:
        log(run_report.closing(int(state.step), cfg, loop.last_logged,
                               last is not None and f"{ckpt.directory}/{last}",
                               time.monotonic() - started))
    return loop.last_logged


class _Loop:
    """One run's loop state: dispatch step N, then check and log step N-1 (the host never
    stalls the device); evaluate, profile and save on their schedules."""

    def __init__(self, cfg, setup, ckpt, train_batches, eval_batches, start, on_profile):
        self.cfg, self.setup, self.ckpt, self.start = cfg, setup, ckpt, start
        self.train_batches, self.eval_batches = train_batches, eval_batches
        self.on_profile = on_profile
        self.train_step = step_lib.make_train_step(setup)
        self.eval_step = step_lib.make_eval_step(setup) if eval_batches is not None else None
        self.throughput = Throughput(cfg, setup.mesh.size)
        self.writer = MetricsWriter(pathlib.Path(cfg.train.workdir), cfg.train.steps,
                                    enabled=jax.process_index() == 0, start_step=start,
                                    peak_is_estimate=self.throughput.peak_is_estimate)
        self.last_logged: dict = {}
        self.pending = None  # (step, metrics) of the step dispatched last
        t = cfg.train
        self.profiling = (range(t.profile_start, t.profile_start + t.profile_steps)
                          if t.profile_steps and jax.process_index() == 0 else range(0))
        if self.profiling and self.profiling.start < start:
            self.writer.console(
                f"note: train.profile_start={t.profile_start} lies before step {start}, where "
                "this run resumes: nothing is profiled. Profile in a fresh train.workdir or set "
                f"train.profile_start >= {start}")
            self.profiling = range(0)

    def step(self, step: int, state):
        if self.profiling and step == self.profiling.start:
            jax.profiler.start_trace(str(pathlib.Path(self.cfg.train.workdir) / "profile"))
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            with jax.profiler.TraceAnnotation(DATA_SPAN):  # the input pipeline (data wait)
                batch = global_batch_array(self.setup, next(self.train_batches))
            state, metrics = self.train_step(state, batch)
        self.finish_pending()
        self.pending = (step, metrics)
        self.writer.advance()
        if self.profiling and step + 1 == self.profiling.stop:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            if self.on_profile is not None:
                self.on_profile(self.cfg.train.workdir, self.train_step.lower(state, batch),
                                self.writer.console)
        return state

    def finish_pending(self) -> None:
        if self.pending is not None:
            self.last_logged = _finish(self.pending, self.cfg, self.throughput,
                                       self.writer) or self.last_logged
            self.pending = None

    def after(self, done: int, state, stop: StopRequest) -> bool:
        """Evaluate and save when due; True when the run stops here."""
        cfg, console = self.cfg, self.writer.console
        stopping = stop.poll()
        if stopping:
            console(f"{stop.reason()}: stopping after step {done} with a checkpoint (a "
                    "second signal exits at once)")
        exiting = stopping or (bool(cfg.train.exit_interval)
                               and done % cfg.train.exit_interval == 0)
        saving = ((cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
                  or done == cfg.train.steps or exiting)
        evaluating = self.eval_step is not None and done % cfg.train.eval_every == 0
        if saving or evaluating:  # these need this step's loss checked first
            self.finish_pending()
        if evaluating:
            loss = evaluate(self.setup, self.eval_step, state, self.eval_batches,
                            cfg.train.eval_batches)
            self.writer.write(done, {"eval_loss": loss})
            self.last_logged = {**self.last_logged, "eval_loss": loss}
        if saving:  # (a stop saves too) what a restart will not log again goes to disk first
            self.writer.flush()
            self.ckpt.save(done, state, self.train_batches.get_state(), self.setup.layer_order)
        if stopping:
            self.ckpt.wait()
            console(f"saved {self.ckpt.directory}/{done}; rerun to resume")
            return True
        if exiting and done < cfg.train.steps:
            console(f"exiting at step {done} (train.exit_interval); rerun to resume")
            return True
        return False


def _finish(pending, cfg: Config, throughput: Throughput, writer: MetricsWriter) -> dict | None:
    """Check a dispatched step's loss; log it when it is a logging step."""
    step, metrics = pending
    done = step + 1
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise NonFiniteLossError(
            f"loss became {loss} at step {done}; stopping without saving this state (the last "
            "good checkpoint is kept). Lower train.lr, raise train.warmup_steps or check the data")
    if throughput.started and done % cfg.train.log_every and done != cfg.train.steps:
        return None   # only the loss is read from the device on a step that is not logged
    record = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not throughput.started:
        # The first step after a start is always logged (no hole in the curves at a restart);
        # its time includes compilation, so it is reported apart and throughput starts after it.
        record["first_step_time_s"] = throughput.start(done)
    else:
        record.update(throughput.measure(done))
    record["memory_gb"] = device_memory_gb()
    writer.write(done, record)
    return record

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
from jaxtrain import mfu_breakdown
from jaxtrain import sharding, step as step_lib
from jaxtrain.checkpoint import Checkpointer
from jaxtrain.config import Config, ConfigError
from jaxtrain.metrics import MetricsWriter, Throughput, device_memory_gb
from jaxtrain.preemption import StopRequest


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
            probe.write_text("")
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
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(cfg.to_json())
    info = {"git_commit": git_commit(), "jax": jax.__version__,
            "devices": [d.device_kind for d in jax.devices()][:1], "n_devices": jax.device_count(),
            "process_count": jax.process_count()}
    (workdir / "run.json").write_text(json.dumps(info, indent=2))


def pipeline_summary(cfg: Config, stages: int) -> str:
    """The configured schedule's bubble (ledger) and static in-flight bound (simulator)."""
    from jaxtrain.ledger import bubble_fraction
    from jaxtrain.ledger.layout import stage_layer_counts
    from jaxtrain.pipeline_schedule import build_schedule
    p, v, m = stages, cfg.parallel.virtual_stages, cfg.parallel.microbatches
    schedule = build_schedule(cfg.parallel.schedule, p, m, v)
    return (f"pipeline: {cfg.parallel.schedule} stages={p} virtual={v} microbatches={m}; layers "
            f"per stage {stage_layer_counts(cfg, p, v)}; bubble (p-1)/(m·v) = "
            f"{bubble_fraction(p, m, v):.1%}; microbatches stashed per rank at most "
            f"{tuple(schedule.stash_slots)} ({schedule.num_steps} lock-step steps)")


def global_batch_array(setup, local_batch: dict) -> dict:
    """Assemble this process's rows into global arrays sharded over (data, fsdp)."""
    sh = sharding.batch_sharding(setup.mesh)
    if jax.process_count() == 1:
        return {k: jax.device_put(np.asarray(local_batch[k]), sh) for k in step_lib.BATCH_KEYS}
    return {k: jax.make_array_from_process_local_data(sh, np.asarray(local_batch[k]))
            for k in step_lib.BATCH_KEYS}


def evaluate(setup, eval_step, state, batches, n_batches: int) -> float:
    """Mean token loss over `n_batches` held-out batches (in FP8 when the run trains in FP8)."""
    loss_sum = count = 0.0
    for _ in range(n_batches):
        s, c = eval_step(state["params"], global_batch_array(setup, next(batches)),
                         state.get("fp8_meta"))
        loss_sum, count = loss_sum + float(s), count + float(c)
    return loss_sum / max(count, 1.0)


def train(cfg: Config, *, log=print) -> dict:
    """Run `cfg.train.steps` steps (resuming from the workdir's latest checkpoint); returns the
    last logged metrics."""
    started = time.monotonic()
    workdir = pathlib.Path(cfg.train.workdir)
    is_main = jax.process_index() == 0
    check_writable(workdir)
    mesh = sharding.make_mesh(cfg.parallel)
    # Data first: a bad tokenizer, directory or mixture fails before anything compiles.
    train_batches = data_lib.make_batches(cfg, "train", jax.process_index(), jax.process_count())
    eval_batches = (data_lib.make_batches(cfg, "eval", jax.process_index(), jax.process_count())
                    if cfg.train.eval_every else None)
    if cfg.remat.policy == "auto":  # decided by compiling candidates (remat_sweep)
        from jaxtrain.remat_sweep import choose_policy
        cfg.remat = choose_policy(cfg, mesh)
        log(f"remat.policy=auto chose {cfg.remat}")
    setup = step_lib.build(cfg, mesh)
    if mesh.shape["stage"] > 1 and is_main:
        log(pipeline_summary(cfg, mesh.shape["stage"]))
    if is_main:
        write_run_info(workdir, cfg)

    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
    for path in ckpt.interrupted_saves:
        log(f"ignored {path}: a save interrupted before it was committed (removed)")
    restored = (ckpt.restore_latest(step_lib.abstract_train_state(setup), setup.layer_order,
                                    warn=log) if cfg.checkpoint.resume else None)
    if restored is not None:
        latest, state, data_state = restored
        train_batches.set_state(data_state)
        log(f"resumed from {ckpt.directory}/{latest}")
    elif cfg.checkpoint.init_from:
        from jaxtrain import hf
        params, _ = hf.load_params(cfg.checkpoint.init_from)
        state = step_lib.train_state_from_params(setup, params)
        log(f"initialised from {cfg.checkpoint.init_from}")
    else:
        state = step_lib.init_train_state(setup, cfg.train.seed)
    start = int(state["step"])

    train_step = step_lib.make_train_step(setup)
    eval_step = step_lib.make_eval_step(setup) if eval_batches is not None else None
    throughput = Throughput(cfg, mesh.size)
    writer = MetricsWriter(workdir, cfg.train.steps, enabled=is_main,
                           peak_is_estimate=throughput.peak_is_estimate, start_step=start)
    profile_stop = cfg.train.profile_start + cfg.train.profile_steps
    last_logged: dict = {}
    pending = None  # (step, metrics) of the step dispatched last
    stop = StopRequest(cfg.train.max_runtime_s, started).install()
    try:
        for step in range(start, cfg.train.steps):
            if cfg.train.profile_steps and step == cfg.train.profile_start and is_main:
                jax.profiler.start_trace(str(workdir / "profile"))
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                with jax.profiler.TraceAnnotation(mfu_breakdown.DATA_SPAN):  # input pipeline (data wait)
                    batch = global_batch_array(setup, next(train_batches))
                state, metrics = train_step(state, batch)
            if pending is not None:
                last_logged = _finish(pending, cfg, throughput, writer) or last_logged
            pending = (step, metrics)
            writer.advance()
            if cfg.train.profile_steps and step + 1 == profile_stop and is_main:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                mfu_breakdown.after_profile(workdir, train_step.lower(state, batch),
                                            writer.console)
            done = step + 1
            stopping = stop.poll()
            if stopping:
                writer.console(f"{stop.reason()}: stopping after step {done} with a checkpoint "
                               "(a second signal exits at once)")
            exiting = stopping or (bool(cfg.train.exit_interval)
                                   and done % cfg.train.exit_interval == 0)
            saving = ((cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
                      or done == cfg.train.steps or exiting)
            evaluating = eval_step is not None and done % cfg.train.eval_every == 0
            if saving or evaluating:  # these need this step's loss checked first
                last_logged = _finish(pending, cfg, throughput, writer) or last_logged
                pending = None
            if evaluating:
                loss = evaluate(setup, eval_step, state, eval_batches,
                                cfg.train.eval_batches)
                writer.write(done, {"eval_loss": loss})
                last_logged = {**last_logged, "eval_loss": loss}
            if saving:
                ckpt.save(done, state, train_batches.get_state(), setup.layer_order)
            if stopping:
                ckpt.wait()
                writer.console(f"saved {ckpt.directory}/{done}; rerun to resume")
                break
            if exiting and done < cfg.train.steps:
                writer.console(f"exiting at step {done} (train.exit_interval); rerun to resume")
                break
        if pending is not None:
            last_logged = _finish(pending, cfg, throughput, writer) or last_logged
    finally:
        stop.uninstall()
        ckpt.close()
        writer.close()
    return last_logged


def _finish(pending, cfg: Config, throughput: Throughput, writer: MetricsWriter) -> dict | None:
    """Check a dispatched step's loss; log it when it is a logging step."""
    step, metrics = pending
    done = step + 1
    loss = float(metrics["loss"])
    if not np.isfinite(loss):
        raise NonFiniteLossError(
            f"loss became {loss} at step {done}; stopping without saving this state (the last "
            "good checkpoint is kept). Lower train.lr, raise train.warmup_steps or check the data")
    record = {k: float(v) for k, v in metrics.items()}
    if not throughput.started:
        # The first step after a start is always logged (no hole in the curves at a restart);
        # its time includes compilation, so it is reported apart and throughput starts after it.
        record["first_step_time_s"] = throughput.start(done)
    elif done % cfg.train.log_every and done != cfg.train.steps:
        return None
    else:
        record.update(throughput.measure(done))
    record["memory_gb"] = device_memory_gb()
    writer.write(done, record)
    return record

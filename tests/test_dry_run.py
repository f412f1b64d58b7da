"""train.py before launch: the ledger's plan on too few devices (exit 2, nothing compiled) and
--dry-run, which compiles llama70b's real train step on 8 fake CPU devices from abstract state."""
import importlib.util
import pathlib
import time

import jax
import pytest

from jaxtrain import dry_run, step, trainer
from jaxtrain.config import load_config
from jaxtrain.ledger import GiB

ROOT = pathlib.Path(__file__).resolve().parent.parent
LLAMA70B = str(ROOT / "configs" / "llama70b.py")
TINY = str(ROOT / "configs" / "tiny.py")


def train_main(argv):
    spec = importlib.util.spec_from_file_location("jaxtrain_train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture
def no_compile(monkeypatch):
    """Fail if anything builds a step or starts training."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled or allocated although the run was refused")
    monkeypatch.setattr(step, "build", refuse)
    monkeypatch.setattr(trainer, "train", refuse)


# ----------------------------------------------------------------------------- planning

def test_plan_picks_the_fewest_devices_that_fit():
    cfg = load_config(LLAMA70B)
    par, n_min = cfg.parallel, dry_run.min_devices(cfg)
    assert par.data == -1 and n_min == par.tensor * par.stage  # the fill counts as 1
    p = dry_run.plan_devices(cfg, "h100")
    # The recipe is laid out for 1024 H100s: the first data degree whose micro-batch fits.
    assert p.n_devices == 1024 == p.layout.n_devices and p.estimate.fits
    assert "fewest devices on which the layout fits h100" in p.how
    for d in range(1, p.layout.data):
        smaller = dry_run.plan_devices(cfg, "h100", devices=n_min * d)
        assert smaller.estimate is None or not smaller.estimate.fits, d
    at_min = dry_run.plan_devices(cfg, "h100", devices=n_min)
    assert at_min.layout.micro_batch == cfg.train.global_batch // par.microbatches
    bad = dry_run.plan_devices(cfg, "h100", devices=24)
    assert bad.estimate is None and "not divisible" in bad.error
    tiny = load_config(TINY)
    assert dry_run.plan_devices(tiny, "h100", present=8).n_devices == 8


def test_too_few_devices_prints_the_plan_and_exits_2_without_compiling(capsys, no_compile):
    t = time.perf_counter()
    rc = train_main(["--config", LLAMA70B])
    elapsed = time.perf_counter() - t
    out, err = capsys.readouterr()
    assert rc == 2
    planned = dry_run.plan_devices(load_config(LLAMA70B), "h100")
    assert "ledger plan for" in out and "on 1024 x h100" in out
    assert planned.layout.short() in out and "memory/device: fits" in out
    assert f"needs at least {planned.n_min} devices" in err and "8 cpu devices are present" in err
    assert "nothing was compiled or allocated" in err and "--dry-run" in err
    assert elapsed < 10, f"the refusal took {elapsed:.1f} s"

    rc = train_main(["--config", LLAMA70B, "--devices", "32", "--gpu", "h200"])
    out, err = capsys.readouterr()
    assert rc == 2 and "on 32 x h200 (--devices)" in out and "--devices=32 but 8" in err


def test_devices_flag_and_gpu_are_checked_before_training(capsys, no_compile):
    assert train_main(["--config", TINY, "--devices", "4"]) == 2
    assert "--devices=4 but 8 devices are present" in capsys.readouterr().err
    assert train_main(["--config", TINY, "--gpu", "tpu9"]) == 2
    assert "unknown GPU 'tpu9'" in capsys.readouterr().err


def test_scaling_keeps_the_model_and_the_planned_micro_batch():
    cfg = load_config(LLAMA70B, ["--parallel.tensor=16"])  # does not divide 8 devices
    planned = dry_run.plan_devices(cfg, "h100")
    scaled, changes = dry_run.scale_to_devices(cfg, planned, 8)
    p = scaled.parallel
    assert (p.tensor, p.stage, p.virtual_stages, p.data) == (8, 1, 1, 1)
    assert scaled.model == cfg.model
    assert scaled.train.global_batch == planned.layout.micro_batch * p.microbatches
    assert any(c.startswith(f"parallel.stage {cfg.parallel.stage} -> 1 (the dry run compiles "
                            "without pipeline stages") for c in changes)
    assert any(c.startswith("parallel.tensor 16 -> 8") for c in changes)
    tiny = load_config(TINY)
    assert dry_run.scale_to_devices(tiny, dry_run.plan_devices(tiny, "h100", present=8),
                                    8) == (tiny, [])


# ----------------------------------------------------------------------------- dry run

def test_llama70b_dry_run_on_8_cpu_devices(capsys, monkeypatch):
    """The real 70B step (80 scanned layers, abstract parameters) compiles on 8 fake devices
    in well under a minute of CPU time and is reported next to the ledger."""
    reports, real = [], dry_run.dry_run
    monkeypatch.setattr(dry_run, "dry_run",
                        lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    live_before = sum(a.nbytes for a in jax.live_arrays())
    t = time.perf_counter()
    rc = train_main(["--config", LLAMA70B, "--dry-run"])
    elapsed = time.perf_counter() - t
    out = capsys.readouterr().out
    assert rc == 0
    r = reports[0]
    # Nothing of the 70B model was materialised.
    assert sum(a.nbytes for a in jax.live_arrays()) - live_before < 2 ** 20

    # The scaled layout: the plan's tensor=8 and micro-batch 1, stage 1, data filling 8.
    L, m = r.estimate.layout, r.planned.layout.microbatches
    assert (L.tensor, L.stage, L.data, L.micro_batch, L.microbatches) == (8, 1, 1, 1, m)
    assert r.cfg.model.num_layers == 80 and r.planned.n_devices == 1024

    # Both columns, the collectives table and the stage note are printed.
    for text in ("dry run on 8 x cpu", "parallel.stage ", "ledger    compiled",
                 "state: fp32 master + Adam m, v", "temporaries", "all-gather  tensor",
                 "stage=1: pipeline stages are not wired into the dry run", "FLOPs per device per step"):
        assert text in out, text

    # Arguments are the fp32 master params and Adam's m and v: the ledger's 12 bytes/param.
    ledger = r.ledger_memory()
    assert r.memory["argument_bytes"] == pytest.approx(ledger["state"], rel=0.01)
    # Temporaries: activations with XLA attention (fp32 s×s scores), grads, the bf16 copy.
    # Measured 1.65x the ledger (its scores are bf16); see test_ledger_calibration.
    assert 1.0 < r.memory["temp_bytes"] / ledger["temp"] < 2.5
    # Trip-count-aware matmul FLOPs are the ledger's model FLOPs per device.
    assert r.matmul_flops == pytest.approx(r.estimate.model_flops_per_step / 8, rel=0.01)
    # Tensor-parallel traffic exists on the tensor axis only; the compiled volume is ~5x the
    # ledger's 4 AG + 4 RS of bf16 s·b·h per layer: XLA:CPU moves the residual stream in fp32
    # and emits more collectives per layer (recorded in the dry run's output).
    comm = r.comm_by_axes()
    assert set(comm) == {("tensor",)}
    ledger_tp, compiled_tp = comm[("tensor",)]
    assert 1.0 <= compiled_tp / ledger_tp <= 8.0
    print(f"llama70b dry run: {elapsed:.1f} s wall (compile {r.compile_s:.1f} s), temp "
          f"{r.memory['temp_bytes'] / GiB:.1f} GiB/device")

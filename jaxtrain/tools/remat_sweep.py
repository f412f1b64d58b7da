"""Compile one train step per remat policy and compare memory against recompute.

    python -m jaxtrain.remat_sweep --config configs/tiny.py [--policies none uniform:1 ...]
        [--run] [--steps 5] [--devices N] [--workdir DIR] [--train.seq_len=512 ...]

For each policy the step is lowered from abstract state (nothing is allocated) and compiled
on the current devices; the table reports, per device: compiled temporary memory, the step's
total footprint (arguments + outputs + temporaries − donated aliases), compiled matmul FLOPs,
the recompute overhead (FLOPs / FLOPs of `none` − 1), the ledger's activation and recompute
estimates and, with --run, the measured step time. The table is printed and written to
`remat_sweep.csv` and `remat_sweep.png` (memory vs recompute overhead) in the workdir.

Policy spellings (remat.parse): none, selective:core_attn,mlp, offload:core_attn, uniform:N,
block:N, or any remat.policy string (dots_saveable, save:qkv_proj,core_attn, ...).

`choose_policy(cfg, mesh)` serves remat.policy=auto: the least-recompute candidate whose
compiled footprint fits remat.memory_budget_gb.

FLOPs are counted from the optimized HLO: every dot (and cuBLAS GEMM custom call) at
2·M·N·K, times the trip counts of its enclosing loops. XLA's own cost_analysis() counts a
while-loop body once, which undercounts a scanned layer stack by the number of layers.
Matmuls inside opaque kernels (a Pallas or cuDNN attention custom call) are not visible.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import math
import pathlib
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxtrain import data, xla_flags
from jaxtrain.parallel import remat, sharding
from jaxtrain.tools import hlo
from jaxtrain.tools.compile_step import compile_step
from jaxtrain.config import Config, ConfigError, RematConfig, load_config
from jaxtrain.ledger import flops as ledger_flops
from jaxtrain.ledger.estimate import estimate
from jaxtrain.ledger.hardware import GiB, gpu_for_device_kind
from jaxtrain.ledger.layout import layers_per_chunk, layout_from_config, stage_layer_counts

log = logging.getLogger("jaxtrain.parallel.remat")

CSV_NAME, PNG_NAME = "remat_sweep.csv", "remat_sweep.png"


# ----------------------------------------------------------------------------- one policy

@dataclasses.dataclass
class Row:
    policy: str
    temp_bytes: int | None
    total_bytes: int | None
    flops: float
    recompute_overhead: float | None = None         # flops / flops(none) - 1
    ledger_activation_bytes: float | None = None
    ledger_recompute_overhead: float | None = None
    compile_s: float = 0.0
    step_time_s: float | None = None


def with_remat(cfg: Config, r: RematConfig) -> Config:
    return dataclasses.replace(cfg, remat=dataclasses.replace(
        r, memory_budget_gb=cfg.remat.memory_budget_gb))


def ledger_estimates(cfg: Config, mesh, gpu=None) -> tuple[float | None, float | None]:
    """(activation bytes per device, recompute FLOPs / model FLOPs) of cfg.remat, or Nones
    when the ledger does not model the policy (escape-hatch policies)."""
    r = cfg.remat
    if r.policy:
        return None, None
    try:
        layout = layout_from_config(cfg, mesh.size)
        gpu = gpu or gpu_for_device_kind(mesh.devices.flat[0].device_kind)
        est = estimate(cfg, layout, gpu, remat=r)
        # Full s×s attention on both sides: the compiled overhead it is shown next to runs
        # XLA's attention, which computes the masked half too.
        recompute = ledger_flops.recompute_flops_per_token(
            cfg, r, est.stage_layers, layout.virtual_stages, causal=False)
    except ConfigError as err:
        log.warning("ledger estimate unavailable for %s: %s", remat.label(r), err)
        return None, None
    return est.activation_bytes, recompute / ledger_flops.model_flops_per_token(cfg,
                                                                                causal=False)


def random_batch(cfg: Config, mesh, seed: int = 0) -> dict:
    """Random tokens, one document per row, placed with the step's batch sharding."""
    sh = sharding.batch_sharding(mesh)
    # Each process places only its own shards (works with several hosts too).
    return {k: jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])
            for k, a in data.synthetic_batch(cfg, seed, docs_per_row=1).items()}


def zero_train_state(setup):
    """A sharded all-zeros train state: a step costs the same whatever the values, and this
    compiles in a blink where the real initialiser (random normals) does not."""
    abstract = setup.abstract_train_state
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
                   out_shardings=setup.state_shardings)()


def time_steps(setup, compiled, steps: int) -> float:
    """Mean seconds per step over `steps` steps after one warm-up step."""
    state = zero_train_state(setup)
    batch = random_batch(setup.cfg, setup.mesh)
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t) / steps


def measure(cfg: Config, mesh, *, run: bool = False, steps: int = 5,
            compiler_options: dict | None = None, gpu=None) -> Row:
    """Compile (and optionally time) the train step of cfg.remat on `mesh`."""
    out = compile_step(cfg, mesh, extra_options=compiler_options)
    setup, compiled, seconds = out.setup, out.compiled, out.compile_s
    mem = hlo.memory(compiled)
    act, recompute = ledger_estimates(cfg, mesh, gpu)
    row = Row(policy=remat.label(cfg.remat), temp_bytes=mem["temp_bytes"],
              total_bytes=mem["total_bytes"], flops=hlo.matmul_flops_from_text(out.text),
              ledger_activation_bytes=act, ledger_recompute_overhead=recompute,
              compile_s=seconds)
    if run:
        row.step_time_s = time_steps(setup, compiled, steps)
    return row


# ----------------------------------------------------------------------------- sweeps

def default_policies(cfg: Config, n_stage: int = 1) -> list[str]:
    """none, selective, a few block depths, full uniform (1 and 2), offload off CPU."""
    chunk = min(layers_per_chunk(cfg, n_stage, cfg.parallel.virtual_stages))
    out = ["none", "selective:core_attn", "selective:core_attn,mlp"]
    out += [f"block:{k}" for k in sorted({max(1, chunk // 4), max(1, chunk // 2),
                                          max(1, 3 * chunk // 4)}) if k < chunk]
    out += ["uniform:1"] + (["uniform:2"] if chunk % 2 == 0 and chunk > 2 else [])
    if jax.default_backend() != "cpu":  # on CPU host and device memory are the same
        try:
            remat.check_offload_supported()
            out.append("offload:core_attn,mlp")
        except remat.RematConfigError:
            pass
    return out


def sweep(cfg: Config, mesh, policies: Sequence[str] | None = None, *, run: bool = False,
          steps: int = 5, compiler_options: dict | None = None, gpu=None,
          echo=print) -> list[Row]:
    """One Row per policy; `none` is always measured first as the FLOPs baseline."""
    names = list(policies or default_policies(cfg, mesh.shape["stage"]))
    configs = [remat.parse(p) for p in names]
    labels = [remat.label(r) for r in configs]
    if "none" not in labels:
        configs.insert(0, RematConfig())
    for r in configs:  # fail on a bad policy before compiling anything
        remat.validate(r, layers_per_chunk(cfg, mesh.shape["stage"], cfg.parallel.virtual_stages))
    rows = []
    for r in configs:
        row = measure(with_remat(cfg, r), mesh, run=run, steps=steps, gpu=gpu,
                      compiler_options=compiler_options)
        rows.append(row)
        if echo:
            echo(f"  compiled {row.policy} in {row.compile_s:.1f}s")
    base = next(row.flops for row in rows if row.policy == "none")
    for row in rows:
        row.recompute_overhead = row.flops / base - 1 if base else None
    return rows


def _auto_candidates(cfg: Config, n_stage: int) -> list[RematConfig]:
    chunk = min(layers_per_chunk(cfg, n_stage, cfg.parallel.virtual_stages))
    names = ["none", "selective:core_attn", "selective:core_attn,mlp",
             *[f"block:{k}" for k in range(1, chunk)], "uniform:1"]
    return [remat.parse(n) for n in names]


def choose_policy(cfg: Config, mesh, *, candidates: Sequence[RematConfig] | None = None,
                  compiler_options: dict | None = None) -> RematConfig:
    """remat.policy=auto: the candidate with the least recompute whose compiled per-device
    footprint (arguments + outputs + temporaries − aliases) fits remat.memory_budget_gb (GiB).

    Candidates are tried in the ledger's recompute order (least first), each compiled from
    abstract state, and the first that fits wins, so large models compile only as many steps
    as it takes. The choice and every tried footprint are logged.
    """
    budget_gb = cfg.remat.memory_budget_gb
    if budget_gb <= 0:
        raise remat.RematConfigError("remat.policy=auto needs remat.memory_budget_gb > 0 (GiB "
                                     "per device the step may use)")
    budget = budget_gb * GiB
    n_stage = mesh.shape["stage"]
    cands = list(candidates) if candidates is not None else _auto_candidates(cfg, n_stage)
    stage_layers = stage_layer_counts(cfg, n_stage, cfg.parallel.virtual_stages)

    def predicted(r: RematConfig) -> float:
        if r.policy:
            return math.inf  # unmodelled: try last
        c = with_remat(cfg, r)
        return ledger_flops.recompute_flops_per_token(c, c.remat, stage_layers,
                                                      cfg.parallel.virtual_stages)
    tried = []
    for r in sorted(cands, key=predicted):
        c = with_remat(cfg, r)
        mem = hlo.memory(compile_step(c, mesh, extra_options=compiler_options).compiled)
        footprint = mem["total_bytes"] if mem["total_bytes"] is not None else mem["temp_bytes"]
        if footprint is None:
            raise remat.RematConfigError("remat.policy=auto: this backend reports no memory "
                                         "analysis; name a remat policy instead")
        tried.append(f"{remat.label(r)}={footprint / GiB:.3f}GiB")
        if footprint <= budget:
            log.info("remat.policy=auto: chose %s (%.3f GiB per device, budget %.3f GiB; "
                     "tried %s)", remat.label(r), footprint / GiB, budget_gb, ", ".join(tried))
            return c.remat
    raise remat.RematConfigError(
        f"remat.policy=auto: no candidate fits remat.memory_budget_gb={budget_gb} per device "
        f"(compiled footprints: {', '.join(tried)}); raise the budget, shrink the micro-batch "
        "or add tensor/stage parallelism")


# ----------------------------------------------------------------------------- output

def _mib(x):
    return "" if x is None else f"{x / 2**20:.2f}"


def _pct(x):
    return "" if x is None else f"{100 * x:.1f}%"


def format_table(rows: Sequence[Row]) -> str:
    header = ("policy", "temp MiB", "total MiB", "GFLOPs", "recompute", "ledger act MiB",
              "ledger recompute", "compile s", "step s")
    lines = [header] + [(r.policy, _mib(r.temp_bytes), _mib(r.total_bytes), f"{r.flops / 1e9:.3f}",
                         _pct(r.recompute_overhead), _mib(r.ledger_activation_bytes),
                         _pct(r.ledger_recompute_overhead), f"{r.compile_s:.1f}",
                         "" if r.step_time_s is None else f"{r.step_time_s:.4f}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda line: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                 for i, (v, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, lines[1:])])


def write_csv(rows: Sequence[Row], path: pathlib.Path) -> None:
    fields = [f.name for f in dataclasses.fields(Row)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})


def write_plot(rows: Sequence[Row], path: pathlib.Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(100 * (r.recompute_overhead or 0.0), r.temp_bytes / 2**20, r.policy)
           for r in rows if r.temp_bytes is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, name in pts:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("recompute overhead (% of the no-remat step's matmul FLOPs)")
    ax.set_ylabel("compiled temporary memory per device (MiB)")
    ax.set_title(title or "remat policies: memory vs recompute")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI

def _parse_options(items: Sequence[str]) -> dict:
    return dict(xla_flags.parse_option(item, "--compiler-option") for item in items)


def sweep_devices(cfg: Config, n: int | None, target: str | None) -> list:
    """The devices the sweep compiles on: the first n present, or n compile-only GPUs of
    `target` (default: as many as the configured layout needs)."""
    if target is None:
        return jax.devices()[:n] if n else jax.devices()
    from jaxtrain.tools import targets
    from jaxtrain.tools.device_plan import plan_devices
    from jaxtrain.ledger import get_gpu
    planned = plan_devices(cfg, get_gpu(targets.get(target).ledger_gpu), n)
    if planned.n_devices is None:
        raise ConfigError(f"cannot compile for {target}: {planned.error}")
    return targets.devices(target, planned.n_devices)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtrain.remat_sweep",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="recipe file, e.g. configs/tiny.py")
    ap.add_argument("--policies", nargs="+", default=None,
                    help="policies to compare (default: a standard set); see the module doc")
    ap.add_argument("--run", action="store_true", help="also time a few real steps each")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per policy with --run")
    ap.add_argument("--devices", type=int, default=None, help="use the first N devices (with "
                    "--target: compile for N compile-only GPUs; default the layout's count)")
    ap.add_argument("--target", default=None, help="compile for compile-only GPUs of this kind "
                    "(h100, h200) with the real XLA:GPU compiler; needs the gpu-compile extra")
    ap.add_argument("--workdir", default=None, help="where the CSV and PNG go "
                    "(default: train.workdir)")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA compile option for every policy (repeatable)")
    args, overrides = ap.parse_known_args(argv)
    if args.target and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")  # compile-only GPUs: before jax starts
    try:
        cfg = load_config(args.config, overrides)
        devices = sweep_devices(cfg, args.devices, args.target)
        if args.target and args.run:
            raise ConfigError("--run times steps on real devices; --target only compiles")
        mesh = sharding.make_mesh(cfg.parallel, devices)
        gpu = None
        if args.target:
            from jaxtrain.tools import targets
            from jaxtrain.ledger import get_gpu
            gpu = get_gpu(targets.get(args.target).ledger_gpu)
        rows = sweep(cfg, mesh, args.policies, run=args.run, steps=args.steps, gpu=gpu,
                     compiler_options=_parse_options(args.compiler_option),
                     echo=lambda s: print(s, file=sys.stderr))
    except ConfigError as err:
        print(f"remat_sweep: error: {err}", file=sys.stderr)
        return 2
    workdir = pathlib.Path(args.workdir or cfg.train.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    shape = " ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "1 device"
    title = (f"{pathlib.Path(args.config).stem}: L={cfg.model.num_layers} "
             f"h={cfg.model.hidden_size} s={cfg.train.seq_len} b={cfg.train.global_batch} "
             f"({shape}, {devices[0].platform})")
    print(title)
    print(format_table(rows))
    write_csv(rows, workdir / CSV_NAME)
    write_plot(rows, workdir / PNG_NAME, title)
    print(f"wrote {workdir / CSV_NAME} and {workdir / PNG_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

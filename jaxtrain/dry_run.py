"""Before launch: the ledger's plan when there are too few devices, and `--dry-run`, which
compiles the real train step from abstract parameters and sets what XLA reports next to what
the ledger predicts for the same layout.

    python train.py --config configs/llama70b.py [--devices 1024] [--gpu h100]
        fewer devices than the layout needs: print the ledger's plan, exit 2, compile nothing
    python train.py --config configs/llama70b.py --dry-run [--parallel.tensor=4 ...]

Devices a layout needs. The mesh degrees multiply; a -1 degree fills whatever is left, so
without a device count it cannot be resolved. The layout *needs* the product of its fixed
degrees (the fill at 1): llama70b's tensor=8 x stage=2 x data=-1 needs 16. The plan that is
printed is for `--devices N` when given; else for the devices present when the layout resolves
on them; else for the fewest devices (the fill's smallest value) on which the ledger says the
layout fits the GPU's memory budget (llama70b on H100s: 1024), and when no count fits, for the
fewest it resolves on. The output says which.

Dry-run layout. The configured layout compiles unchanged when the present devices can run it
(their count resolves it, stage=1, context=1). Otherwise it is scaled to the present devices,
the model unchanged: stage and context go to 1 (neither is wired into the trainer yet;
`sharding.validate_layout` refuses them), tensor and fsdp keep the planned degree where it
divides the present devices (else the largest valid degree below it), data fills the rest, and
the global batch becomes data x fsdp x the planned micro-batch x microbatches, so each device
sees the planned per-microbatch shapes. Every change is printed. Dotted overrides apply first,
so an explicit layout that fits (e.g. --parallel.tensor=4 --parallel.stage=1) compiles as given.

What is compared, per device (fake CPU devices report memory_analysis() per device):
- memory: the compiled step's arguments (fp32 master params + Adam m, v, the batch) against the
  ledger's 12 optimizer bytes per parameter; its temporaries (activations, the compute-dtype
  parameter copy, fp32 gradients and accumulators, logits, workspace) against the ledger's
  bf16 copy + gradients + activations + reserve; the totals.
- communication: ring wire bytes per mesh axis per step of the compiled collectives (CPU's
  all-reduce-then-slice counted as the reduce-scatter a GPU emits) against the ledger's TP, DP
  and FSDP volumes, which use the same convention.
- FLOPs: the ledger's model FLOPs per device against the compiled matmuls (loops counted by
  trip count) and XLA's cost_analysis (which counts a scanned layer's body once).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

from jaxtrain.config import Config, ConfigError
from jaxtrain.ledger import Estimate, Gpu, Layout, LayoutError, describe, estimate, get_gpu
from jaxtrain.ledger.hardware import GB, GiB
from jaxtrain.ledger.layout import layout_from_config

DEGREES = ("tensor", "stage", "data", "fsdp", "context")
# The CPU backend's LLVM optimisation level changes code speed, not the HLO: buffer sizes,
# collectives and FLOPs are the same at level 0, and compiling is about twice as fast.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


class TooFewDevicesError(ConfigError):
    """The configured layout needs more devices than are present."""


# ----------------------------------------------------------------------------- planning

def fill_axis(cfg: Config) -> str | None:
    """The mesh degree set to -1 (it fills the devices the others leave), if any."""
    return next((a for a in DEGREES if getattr(cfg.parallel, a) == -1), None)


def min_devices(cfg: Config) -> int:
    """Devices the configured layout needs at least: its fixed degrees, the fill at 1."""
    return math.prod(max(getattr(cfg.parallel, a), 1) for a in DEGREES)


def _degrees_text(cfg: Config) -> str:
    parts = [f"{a}={getattr(cfg.parallel, a)}" for a in DEGREES if getattr(cfg.parallel, a) != 1]
    return " x ".join(parts) or "a single device"


@dataclasses.dataclass(frozen=True)
class Planned:
    """The configured layout resolved on the device count it is planned for."""
    n_min: int
    n_devices: int | None          # None when the layout resolves on no device count tried
    how: str                       # why this device count
    layout: Layout | None = None
    estimate: Estimate | None = None
    error: str = ""


def plan_devices(cfg: Config, gpu: str | Gpu, devices: int | None = None,
                 present: int | None = None) -> Planned:
    """Resolve the configured layout for `devices`, or pick the count (module docstring); a
    layout that resolves on the `present` device count is planned for those."""
    gpu = get_gpu(gpu)
    n_min, fill = min_devices(cfg), fill_axis(cfg)
    how = "--devices"
    if devices is None and present is not None and fill is not None:
        try:
            layout_from_config(cfg, present)
            devices, how = present, f"the {present} present devices"
        except LayoutError:
            pass
    if devices is not None or fill is None:
        n = devices if devices is not None else n_min
        if devices is None:
            how = "the product of the configured degrees"
        try:
            layout = layout_from_config(cfg, n)
            return Planned(n_min, n, how, layout, estimate(cfg, layout, gpu))
        except LayoutError as err:
            return Planned(n_min, None, how, error=str(err))
    # Every value the fill can take is bounded by what it has to divide.
    m, t = cfg.model, cfg.train
    bound = max(t.global_batch, m.num_layers, m.num_heads, t.seq_len, 1)
    first, first_err = None, ""
    for f in range(1, bound + 1):
        try:
            layout = layout_from_config(cfg, n_min * f)
            est = estimate(cfg, layout, gpu)
        except LayoutError as err:
            first_err = first_err or str(err)
            continue
        if est.fits:
            return Planned(n_min, n_min * f, (
                f"{fill}=-1 fills: the fewest devices on which the layout fits {gpu.name} "
                f"memory per the ledger ({fill}={f}); pass --devices N to plan another count"),
                layout, est)
        first = first or Planned(n_min, n_min * f, (
            f"{fill}=-1 fills: no device count fits {gpu.name} memory per the ledger; planned "
            f"for the fewest the layout resolves on ({fill}={f}); pass --devices N to plan "
            "another count"), layout, est)
    return first or Planned(n_min, None, f"{fill}=-1 fills", error=first_err)


def format_planned(p: Planned, config_name: str = "the config") -> str:
    if p.estimate is None:
        return f"no plan for {config_name}: {p.error}"
    return (f"ledger plan for {config_name} on {p.n_devices} x {p.estimate.gpu.name} "
            f"({p.how}):\n{describe(p.estimate)}")


def needed_devices(cfg: Config, devices: int | None = None) -> int:
    """What the present devices must number: --devices when given, else the layout's minimum."""
    return devices if devices is not None else min_devices(cfg)


def too_few_devices_message(cfg: Config, present: int, kind: str, planned: Planned,
                            devices: int | None = None) -> str:
    need = needed_devices(cfg, devices)
    what = (f"--devices={devices}" if devices is not None else
            f"the layout {_degrees_text(cfg)} needs at least {need} devices"
            + (f" ({fill_axis(cfg)}=-1 counts as 1)" if fill_axis(cfg) else ""))
    plan_at = f" (the plan above is for {planned.n_devices})" if planned.n_devices else ""
    return (f"{what} but {present} {kind} device{'s are' if present != 1 else ' is'} present; "
            f"nothing was compiled or allocated. Run on >= {need} devices{plan_at}, shrink the "
            "layout with --parallel.* overrides, or check the step with --dry-run (it compiles "
            f"on the {_devices(present)} present with a scaled layout)")


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


# ----------------------------------------------------------------------------- scaling

def _tensor_ok(cfg: Config, t: int, n: int) -> bool:
    m = cfg.model
    return (n % t == 0 and m.num_heads % t == 0 and m.mlp_size % t == 0
            and (m.num_kv_heads % t == 0 or t % m.num_kv_heads == 0)
            and (not cfg.parallel.sequence_parallel or cfg.train.seq_len % t == 0))


def runs_as_is(cfg: Config, n: int) -> bool:
    """True when the trainer accepts the configured layout on n devices."""
    from jaxtrain import sharding
    try:
        sharding.validate_layout(cfg, n)
        return True
    except ConfigError:
        return False


def scale_to_devices(cfg: Config, planned: Planned, n: int) -> tuple[Config, list[str]]:
    """The config the dry run compiles on n devices and the changes made (module docstring)."""
    if runs_as_is(cfg, n):
        return cfg, []
    if planned.layout is None:
        raise LayoutError(f"cannot scale the configured layout to {n} devices: {planned.error}")
    P = planned.layout
    out = copy.deepcopy(cfg)
    changes = []

    def change(key: str, new, why: str = "") -> None:
        section, name = key.split(".")
        old = getattr(getattr(out, section), name)
        if old != new:
            setattr(getattr(out, section), name, new)
            changes.append(f"{key} {old} -> {new}" + (f" ({why})" if why else ""))

    layers, per_stage = cfg.model.num_layers, max(planned.estimate.stage_layers)
    if P.stage > 1:
        change("parallel.stage", 1, "the dry run compiles without pipeline stages (not wired "
               f"into the dry run yet), so every device holds all {layers} layers where the plan holds {per_stage}: "
               f"static memory and the layer collectives grow {layers / per_stage:.3g}x")
        change("parallel.virtual_stages", 1)
        change("parallel.schedule", "1f1b")
        change("parallel.first_stage_layers", 0)
        change("parallel.last_stage_layers", 0)
    else:
        change("parallel.stage", 1)
    change("parallel.context", 1, "context parallelism is not implemented yet")
    t = max(d for d in range(1, P.tensor + 1) if _tensor_ok(cfg, d, n))
    change("parallel.tensor", t, "" if t == P.tensor else f"the largest degree <= {P.tensor} "
           f"that divides {n} devices and the heads")
    if t == 1:
        change("parallel.sequence_parallel", False)
    f = max(d for d in range(1, P.fsdp + 1) if (n // t) % d == 0)
    change("parallel.fsdp", f)
    change("parallel.data", n // (t * f), f"fills the {n} present devices")
    change("parallel.microbatches", P.microbatches)
    change("train.global_batch", (n // (t * f)) * f * P.micro_batch * P.microbatches,
           f"keeps the planned micro_batch={P.micro_batch} x {P.microbatches} microbatches per "
           "data rank, so per-device activations match the plan")
    out.validate()
    from jaxtrain import sharding
    sharding.validate_layout(out, n)
    return out, changes


# ----------------------------------------------------------------------------- compiling

@dataclasses.dataclass
class DryRun:
    """A compiled step next to the ledger's prediction for its layout."""
    config_name: str
    cfg: Config                  # what was compiled (scaled)
    planned: Planned
    changes: list
    estimate: Estimate           # the ledger on the compiled layout
    memory: dict                 # hlo.memory of the compiled step (per device)
    collectives: list            # hlo.Collective, CPU all-reduce-then-slice relabelled
    matmul_flops: float          # per device, loops counted by trip count
    xla_flops: float | None      # cost_analysis(): a loop body counts once
    lower_s: float
    compile_s: float
    device_kind: str

    @property
    def n_devices(self) -> int:
        return self.estimate.n_devices

    def ledger_memory(self) -> dict[str, float]:
        e = self.estimate
        s = e.static_breakdown
        temps = s["param"] + s["grad"] + s.get("fsdp_buffers", 0.0) + e.activation_bytes \
            + e.reserve_bytes
        return {"state": s["optimizer"], "temp": temps, "total": e.total_bytes}

    def comm_by_axes(self) -> dict[tuple, tuple[float | None, float | None]]:
        """axes -> (ledger bytes, compiled wire bytes) per device per step."""
        from jaxtrain import hlo
        compiled: dict = {}
        for (_, axes), b in hlo.summary(self.collectives, wire=True).items():
            compiled[axes] = compiled.get(axes, 0.0) + b
        c = self.estimate.comm_bytes
        ledger = {("tensor",): c["tp"], ("data",): c["dp"], ("fsdp",): c["fsdp"]}
        keys = [k for k in ledger if ledger[k] or k in compiled]
        keys += sorted((k for k in compiled if k not in ledger), key=str)
        return {k: (ledger.get(k), compiled.get(k)) for k in keys}

    def format(self) -> str:
        from jaxtrain import hlo
        e, L, mem = self.estimate, self.estimate.layout, self.memory
        out = [format_planned(self.planned, self.config_name), ""]
        head = (f"dry run on {self.n_devices} x {self.device_kind}: {L.short()}, global_batch "
                f"{self.cfg.train.global_batch}, seq {self.cfg.train.seq_len}")
        out.append(head)
        if self.changes:
            out.append("  scaled from the planned layout to the present devices (model unchanged):")
            out += [f"    {c}" for c in self.changes]
        else:
            out.append("  the configured layout, unchanged")
        out.append("  stage=1: pipeline stages are not wired into the dry run yet, so it always "
                   "compiles stage=1")
        out.append(f"  lowered in {self.lower_s:.1f} s, compiled in {self.compile_s:.1f} s from "
                   "abstract parameters: nothing allocated")
        lm = self.ledger_memory()
        big = max([v for v in (*lm.values(), *mem.values()) if v] or [0])
        unit, scale = ("GiB", GiB) if big >= GiB else ("MiB", 2 ** 20)
        out += ["", f"memory per device, {unit}   ledger ({e.gpu.name} formulas, remat {e.remat}, "
                f"{'flash' if e.flash else 'XLA attention: s x s scores'})   vs   compiled "
                "(memory_analysis)"]
        gib = lambda x: "n/a" if x is None else f"{x / scale:10.2f}"  # noqa: E731
        rows = [
            ("state: fp32 master + Adam m, v", lm["state"], mem["argument_bytes"],
             "arguments (state + batch)"),
            ("bf16 params + grads + activations + reserve", lm["temp"], mem["temp_bytes"],
             "temporaries"),
            ("total", lm["total"], mem["total_bytes"], "arguments + outputs + temp - donated"),
        ]
        w = max(len(r[0]) for r in rows)
        out.append(f"  {'':{w}}  {'ledger':>10}  {'compiled':>10}")
        out += [f"  {a:{w}}  {gib(b)}  {gib(c)}   {d}" for a, b, c, d in rows]
        out.append(f"  ledger terms ({unit}): static {e.static_bytes / scale:.2f} (" + ", ".join(
            f"{k} {v / scale:.2f}" for k, v in e.static_breakdown.items() if v)
            + f"; {e.bytes_per_param:.1f} B/param), activations "
            f"{e.activation_bytes / scale:.2f}, reserve {e.reserve_bytes / scale:.2f} (logits + "
            f"workspace); {e.reason}")
        out += ["", "communication per device per step, GB (ring wire bytes)"]
        comm = self.comm_by_axes()
        label = lambda a: "?" if a is None else (",".join(a) or "-")  # noqa: E731
        gb = lambda x: "-" if x is None else f"{x / GB:10.3f}"  # noqa: E731
        kinds = {("tensor",): "TP", ("data",): "DP", ("fsdp",): "FSDP"}
        out.append(f"  {'axes':14}  {'ledger':>10}  {'compiled':>10}")
        out += [f"  {label(a):14}  {gb(lg):>10}  {gb(cp):>10}   {kinds.get(a, '')}"
                for a, (lg, cp) in comm.items()]
        if not comm:
            out.append("  none (a single device, or nothing sharded)")
        out += ["", "compiled collectives (CPU all-reduce-then-slice counted as reduce-scatter):",
                hlo.format_summary(self.collectives) if self.collectives else "  none", ""]
        per_dev = e.model_flops_per_step / self.n_devices
        xla = "n/a" if self.xla_flops is None else f"{self.xla_flops:.4g}"
        out.append(f"FLOPs per device per step: ledger model {per_dev:.4g} (with recompute "
                   f"{e.hfu_flops_per_step / self.n_devices:.4g}); compiled matmuls "
                   f"{self.matmul_flops:.4g}; XLA cost_analysis {xla} (counts each scanned "
                   "loop body once)")
        return "\n".join(out)


def dry_run(cfg: Config, gpu: str | Gpu = "h100", *, devices: int | None = None,
            config_name: str = "the config", echo=None) -> DryRun:
    """Scale the layout to the present devices, compile the train step from abstract state and
    read what XLA reports; `echo` (e.g. print) hears progress before the long compile."""
    import jax

    from jaxtrain import attention, hlo, remat_sweep, sharding, step
    gpu = get_gpu(gpu)
    present = jax.devices()
    planned = plan_devices(cfg, gpu, devices, present=len(present))
    scaled, changes = scale_to_devices(cfg, planned, len(present))
    mesh = sharding.make_mesh(scaled.parallel, present)
    setup = step.build(scaled, mesh)
    if echo:
        echo(f"dry run: compiling the train step of {config_name} on {len(present)} x "
             f"{present[0].device_kind} ...")
    t0 = time.perf_counter()
    lowered = step.make_train_step(setup).lower(step.abstract_train_state(setup),
                                                remat_sweep.abstract_batch(scaled, mesh))
    t1 = time.perf_counter()
    options = CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    compiled = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    text = compiled.as_text()
    colls = hlo.reclassify_sliced_all_reduce(hlo.collectives_from_text(text, mesh))
    try:
        xla_flops = hlo.compiled_flops(compiled)
    except hlo.HloAnalysisUnavailable:
        xla_flops = None
    flash = attention.select(scaled.model) is not attention.xla_attention
    est = estimate(scaled, layout_from_config(scaled, len(present)), gpu, flash=flash)
    return DryRun(config_name=config_name, cfg=scaled, planned=planned, changes=changes,
                  estimate=est, memory=hlo.memory(compiled), collectives=colls,
                  matmul_flops=hlo.matmul_flops_from_text(text), xla_flops=xla_flops,
                  lower_s=t1 - t0, compile_s=t2 - t1, device_kind=present[0].device_kind)

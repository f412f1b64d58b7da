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
(their count resolves it and the trainer accepts it). Otherwise it is scaled to the present
devices, the model unchanged, and every change is printed with its reason:
- stage keeps the planned degree when it divides the present devices and splits the layers
  into chunks the config needs (its uneven first/last stages, virtual stages, remat groups);
  else the largest such divisor below it. virtual_stages, schedule, microbatches and
  first/last_stage_layers are kept when valid for that stage count: virtual_stages drops to
  the largest that still splits the layers (schedule 1f1b at 1), microbatches rounds up to a
  multiple of stage for interleaving, the uneven split is dropped when stage changed;
- context keeps the planned degree where it divides the n/stage devices of a stage and splits
  the sequence (into 2·context chunks under causal load balancing), else the largest valid
  degree below it;
- tensor and fsdp keep the planned degree where it divides the n/stage devices of a stage
  (else the largest valid degree below it), data fills the rest;
- the global batch becomes data x fsdp x the planned micro-batch x microbatches, so each
  device sees the planned per-microbatch shapes.
Dotted overrides apply first, so an explicit layout that fits (e.g. --parallel.tensor=4
--parallel.stage=1) compiles as given. With stage > 1 the compiled step is the real pipelined
one (step.loss_and_grads dispatches to pipeline_model: the lock-step shard_map executor).

What is compared, per device (fake CPU devices report memory_analysis() per device), against
the ledger's estimate on the compiled layout (every pipeline rank holds the same; with stages
the ledger models the lock-step executor itself, see jaxtrain.ledger.pipeline):
- memory: the compiled step's arguments (fp32 master params + Adam m, v, the batch) against the
  ledger's 12 optimizer bytes per parameter; its temporaries (activations, the compute-dtype
  parameter copy, fp32 gradients and accumulators, logits, workspace) against the ledger's
  bf16 copy + gradients + activations + reserve; the totals.
- communication: ring wire bytes per mesh axis per step of the compiled collectives (CPU's
  all-reduce-then-slice counted as the reduce-scatter a GPU emits) against the ledger's
  volumes, which use the same convention. The stage axis is split by kind: the executor's
  collective-permutes against the ledger's PP sends; the rest (the all-reduce of the
  replicated embedding and head gradients, parameter resharding) listed with what it is.
  The HLO reader counts a conditional's collectives in every table step, where the ledger
  counts the chunk passes the executor runs; the output gives the factor.
- FLOPs: the ledger's model and hardware FLOPs per device against the compiled matmuls (loops
  counted by trip count) and XLA's cost_analysis (which counts a scanned layer's body once).
  Pipelined, every table step's F and B branches (a B recomputes its chunk) and the head are
  counted, as the HLO reader does, which predicts the compiled count.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from jaxtrain import config
from jaxtrain.config import Config, ConfigError
from jaxtrain.config_check import check
from jaxtrain.ledger import (Estimate, Executor, Gpu, Layout, LayoutError, describe, estimate,
                             get_gpu)
from jaxtrain.ledger.memory import layer_params_local, padded_vocab, workspace_bytes
from jaxtrain.ledger.hardware import GB, GiB
from jaxtrain.ledger.layout import layers_per_chunk, layout_from_config, tensor_splits_model
from jaxtrain.ledger.pipeline import RECEIVE_BUFFERS

if TYPE_CHECKING:
    from jaxtrain.tools import gpu_program, pipeline_flops

DEGREES = ("tensor", "stage", "data", "fsdp", "context")


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
    return (n % t == 0 and tensor_splits_model(cfg.model, t)
            and (not cfg.parallel.sequence_parallel or cfg.train.seq_len % t == 0))


def _context_ok(cfg: Config, c: int) -> bool:
    try:
        config.check_context_split(cfg.train.seq_len, c, cfg.parallel.context_load_balance)
        return True
    except ConfigError:
        return False


def runs_as_is(cfg: Config, n: int) -> bool:
    """True when the trainer accepts the configured layout on n devices."""
    from jaxtrain.parallel import sharding
    try:
        sharding.validate_layout(cfg, n)
        return True
    except ConfigError:
        return False


def _uneven_configured(cfg: Config, P: Layout) -> bool:
    """The config asks for uneven first/last stages (which apply at its own stage degree)."""
    p = cfg.parallel
    return bool(p.first_stage_layers or p.last_stage_layers) and p.stage == P.stage


def _split_problem(cfg: Config, stage: int, virtual: int, uneven: bool) -> str:
    """'' when `stage` x `virtual` chunks split the layers as the config needs (its uneven
    first/last stages when `uneven`, else evenly) into chunks its remat groups fit; else why not."""
    from jaxtrain.parallel import remat
    edits = dict(stage=stage, virtual_stages=virtual)
    if not uneven:
        edits.update(first_stage_layers=0, last_stage_layers=0)
    trial = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **edits))
    try:
        remat.validate(cfg.remat, layers_per_chunk(trial, stage, virtual))
    except ConfigError as err:
        return str(err)
    return ""


def _pick_stage(cfg: Config, P: Layout, n: int) -> tuple[int, int, bool]:
    """(stage, virtual_stages, uneven split kept) on n devices: the planned stage when it divides
    n and splits the layers, else the largest such divisor of n below it; with the largest
    virtual_stages <= the planned one that still splits them."""
    for s in range(min(P.stage, n), 1, -1):
        if n % s:
            continue
        uneven = s == P.stage and _uneven_configured(cfg, P)
        for v in range(P.virtual_stages, 0, -1):
            if not _split_problem(cfg, s, v, uneven):
                return s, v, uneven
    return 1, 1, False


def scale_to_devices(cfg: Config, planned: Planned, n: int) -> tuple[Config, list[str]]:
    """The config the dry run compiles on n devices and the changes made (module docstring)."""
    if runs_as_is(cfg, n):
        return cfg, []
    if planned.layout is None:
        raise LayoutError(f"cannot scale the configured layout to {n} devices: {planned.error}")
    out, changes = _scaled(cfg, planned, n)
    check(out.validate(), n)
    return out, changes


def _scaled(cfg: Config, planned: Planned, n: int) -> tuple[Config, list[str]]:
    P = planned.layout
    out = config.from_dict(cfg.to_dict())  # an unfrozen copy; validated (frozen) by the caller
    changes = []

    def change(key: str, new, why: str = "") -> None:
        section, name = key.split(".")
        old = getattr(getattr(out, section), name)
        if old != new:
            setattr(getattr(out, section), name, new)
            changes.append(f"{key} {old} -> {new}" + (f" ({why})" if why else ""))

    layers, per_stage = cfg.model.num_layers, max(planned.estimate.stage_layers)
    uneven_cfg = _uneven_configured(cfg, P)
    s, v, uneven = _pick_stage(cfg, P, n)
    if s == P.stage:
        change("parallel.stage", s)
    else:
        if n % P.stage:
            why = f"stage={P.stage} does not divide the {n} present devices"
        else:
            why = f"stage={P.stage} does not split the layers: " + _split_problem(
                cfg, P.stage, 1, uneven_cfg)
        if s > 1:
            why += f"; {s} is the largest degree below it that divides {n} and splits them"
        held = layers // s  # a reduced stage splits evenly
        change("parallel.stage", s, f"{why}; each device holds {held} of the {layers} layers "
               f"where the plan holds {per_stage}: static memory and the layer collectives grow "
               f"{held / per_stage:.3g}x")
    if v != P.virtual_stages:
        change("parallel.virtual_stages", v, "no pipeline" if s == 1 else (
            f"{P.virtual_stages} do not split the layers over stage={s}: "
            + _split_problem(cfg, s, P.virtual_stages, uneven)))
    if v == 1 < P.virtual_stages and out.parallel.schedule == "interleaved_1f1b":
        change("parallel.schedule", "1f1b", "one chunk per rank")
    m = P.microbatches
    if v > 1 and m % s:
        m = -(-m // s) * s
        change("parallel.microbatches", m, f"interleaved 1F1B needs a multiple of stage={s}")
    else:
        change("parallel.microbatches", m)
    if (cfg.parallel.first_stage_layers or cfg.parallel.last_stage_layers) and not uneven:
        why = "no pipeline" if s == 1 else f"the uneven split is for stage={P.stage}"
        change("parallel.first_stage_layers", 0, why)
        change("parallel.last_stage_layers", 0)
    per = n // s  # the devices of one pipeline stage
    c = max(d for d in range(1, P.context + 1) if per % d == 0 and _context_ok(cfg, d))
    change("parallel.context", c, "" if c == P.context else f"the largest degree <= "
           f"{P.context} that divides the {_devices(per)}{' of a stage' if s > 1 else ''} "
           "and splits the sequence")
    per //= c
    t = max(d for d in range(1, P.tensor + 1) if _tensor_ok(cfg, d, per))
    change("parallel.tensor", t, "" if t == P.tensor else f"the largest degree <= {P.tensor} "
           f"that divides the {_devices(per)}{' of a stage' if s > 1 else ''} and the heads")
    if t == 1:
        change("parallel.sequence_parallel", False)
    f = max(d for d in range(1, P.fsdp + 1) if (per // t) % d == 0)
    change("parallel.fsdp", f)
    data = per // (t * f)
    change("parallel.data", data, f"fills the {n} present devices")
    change("train.global_batch", data * f * P.micro_batch * m,
           f"keeps the planned micro_batch={P.micro_batch} x {m} microbatches per data rank, "
           "so per-device activations match the plan")
    return out, changes


def _human_bytes(x: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.0f} B"


def branch_matmul_flops(cfg: Config, layout: Layout, ex: Executor) -> float:
    """Matmul FLOPs per device per step as the HLO reader counts the executor: every branch of
    every table step (remat none), i.e. the F switch's two chunk forwards (from the inbox, from
    the embedding) and the B switch's stashed backwards (twice a forward; a middle stage's and
    virtual stage 0's) and the last stage's forward + backward + head forward and backward."""
    m, t, seq = cfg.model, layout.tensor, cfg.train.seq_len
    tokens = layout.micro_batch * seq / layout.context
    layer = (2 * layer_params_local(cfg, t)
             + 4 * m.num_heads * m.resolved_head_dim * seq / t)
    chunk = tokens * ex.chunk_layers * layer
    head = tokens * 2 * m.hidden_size * padded_vocab(m.vocab_size, t) / t
    middle = 2 if ex.stages * ex.virtual_stages > 2 else 0
    return ex.steps * ((2 + middle + 2 + 3) * chunk + 3 * head)


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
    gpu_report: "gpu_program.GpuReport | None" = None   # with a GPU target
    executed: "pipeline_flops.ExecutedFlops | None" = None  # pipelined: per rank, as run

    @property
    def n_devices(self) -> int:
        return self.estimate.n_devices

    @property
    def executor(self) -> Executor | None:
        """The ledger's pipeline executor (its lock-step table); None without stages."""
        return self.estimate.executor

    def ledger_memory(self) -> dict[str, float]:
        e = self.estimate
        s = e.static_breakdown
        temps = sum(v for k, v in s.items() if k != "optimizer") + e.activation_bytes \
            + e.reserve_bytes
        return {"state": s["optimizer"], "temp": temps, "total": e.total_bytes,
                "temp_no_workspace": temps - workspace_bytes(self.cfg)}

    def hlo_pass_factor(self) -> float:
        """Compiled over ledger layer traffic (TP, FSDP) from counting alone: the HLO reader
        counts a chunk's collectives in every branch of every table step (3 forward passes:
        two F branches and the last stage's B; 2 or 3 backward ones), the ledger the passes a
        rank runs. 1 without stages."""
        ex = self.executor
        if ex is None:
            return 1.0
        backward = 3 if ex.stages * ex.virtual_stages > 2 else 2
        return (3 + backward) * ex.steps / (ex.forward_passes + ex.backward_passes)

    def comm_by_axes(self) -> dict[tuple, tuple[float | None, float | None]]:
        """axes -> (ledger bytes, compiled wire bytes) per device per step."""
        from jaxtrain.tools import hlo
        compiled: dict = {}
        for (_, axes), b in hlo.summary(self.collectives, wire=True).items():
            compiled[axes] = compiled.get(axes, 0.0) + b
        c, L = self.estimate.comm_bytes, self.estimate.layout
        # Gradients are reduced once over the data-parallel group: data and context.
        dp_axes = tuple(a for a in ("data", "context") if L.degree(a) > 1) or ("data",)
        # The vocab tables' gradients reach every stage rank in an all-reduce over stage.
        ledger = {("tensor",): c["tp"], dp_axes: c["dp"], ("fsdp",): c["fsdp"],
                  ("stage",): c["pp"] + c["vocab"]}
        if L.context > 1:  # the attention's K/V (and dK/dV) over context
            ledger[("context",)] = ledger.get(("context",), 0.0) + c["cp"]
        keys = [k for k in ledger if ledger[k] or k in compiled]
        keys += sorted((k for k in compiled if k not in ledger), key=str)
        return {k: (ledger.get(k), compiled.get(k)) for k in keys}

    def stage_comm(self) -> dict[tuple[str, bool], list]:
        """(kind, in the schedule loop) -> [wire bytes per step, runs per step, payload of one
        run, its HLO shape, payload per step] of the compiled collectives over `stage` alone."""
        out: dict = {}
        for c in self.collectives:
            if c.axes == ("stage",):
                row = out.setdefault((c.kind, c.in_loop), [0.0, 0, c.bytes, c.shape, 0])
                row[0] += c.wire_bytes_per_step
                row[1] += c.count
                row[4] += c.bytes_per_step
        return out

    def _format_stage_comm(self, gb) -> list[str]:
        e, ex, mib = self.estimate, self.executor, _human_bytes
        out = []
        for (kind, in_loop), (wire, runs, payload, shape, payload_total) in sorted(
                self.stage_comm().items()):
            if kind == "collective-permute" and in_loop:
                what = (f"{runs} x {mib(payload)}: activations right, cotangents left (ledger "
                        f"PP: {ex.steps} steps x 2 sends x {mib(e.chunk_input_bytes)})")
                if shape.startswith("f32") and self.cfg.model.compute_dtype != "float32":
                    what += f"; XLA:CPU carries {self.cfg.model.compute_dtype} as f32 (2x)"
            elif in_loop:
                what = f"{runs} runs inside the schedule loop"
            elif kind == "all-reduce":
                what = (f"after the loop, {mib(payload_total)}: the loss and the embedding/head "
                        f"gradients to every stage rank (ledger vocab "
                        f"{gb(e.comm_bytes['vocab']).strip()})")
            else:
                what = (f"outside the loop, {mib(payload_total)}: layers moved between their "
                        "stored order and the chunks'")
            out.append(f"    {kind:20}  {'':>10}  {gb(wire):>10}   {what}")
        return out

    def format(self) -> str:
        from jaxtrain.tools import hlo
        e, L, mem, ex = self.estimate, self.estimate.layout, self.memory, self.executor
        out = [format_planned(self.planned, self.config_name), ""]
        out.append(f"dry run on {self.n_devices} x {self.device_kind}: {L.short()}, global_batch "
                   f"{self.cfg.train.global_batch}, seq {self.cfg.train.seq_len}")
        if self.changes:
            out.append("  scaled from the planned layout to the present devices (model unchanged):")
            out += [f"    {c}" for c in self.changes]
        else:
            out.append("  the configured layout, unchanged")
        if ex is not None:
            out.append(
                f"  pipelined: {ex.schedule}, {ex.stages} stages x {ex.virtual_stages} virtual "
                f"stages of {ex.chunk_layers} layers, {ex.microbatches} microbatches; lock-step "
                f"table of {ex.steps} steps (F in {ex.f_steps}, B in {ex.b_steps}); bubble "
                f"{e.bubble:.1%} (Megatron), {e.lockstep_bubble:.1%} (the table)")
        out.append(f"  lowered in {self.lower_s:.1f} s, compiled in {self.compile_s:.1f} s from "
                   "abstract parameters: nothing allocated")

        lm = self.ledger_memory()
        big = max([v for v in (*lm.values(), *mem.values()) if v] or [0])
        unit, scale = ("GiB", GiB) if big >= GiB else ("MiB", 2 ** 20)
        out += ["", f"memory per device, {unit}   ledger ({e.gpu.name} formulas, remat {e.remat}, "
                f"{'flash' if e.flash else 'XLA attention: s x s scores'})   vs   compiled "
                "(memory_analysis)"]
        rows = [("state: fp32 master + Adam m, v", lm["state"], mem["argument_bytes"],
                 "arguments (state + batch)"),
                ("bf16 params + grads + activations + reserve", lm["temp"], mem["temp_bytes"],
                 "temporaries"),
                ("  the same without the GPU workspace", lm["temp_no_workspace"], None,
                 "(static buffers hold no NCCL/cuBLAS workspace)"),
                ("total", lm["total"], mem["total_bytes"], "arguments + outputs + temp - donated")]
        w = max(len(r[0]) for r in rows)
        out.append(f"  {'':{w}}  {'ledger':>10}  {'compiled':>10}")
        num = lambda x: "" if x is None else f"{x / scale:.2f}"  # noqa: E731
        out += [f"  {a:{w}}  {num(b):>10}  {num(c):>10}   {d}" for a, b, c, d in rows]
        acts = f"activations {e.activation_bytes / scale:.2f}"
        if ex is not None:
            sets = e.activation_bytes - e.pipeline_buffer_bytes
            acts += (f" (the executor's {ex.stash_buffer} + 2 stashed {ex.chunk_layers}-layer "
                     f"chunk residual sets {sets / scale:.2f}; {ex.buffers} chunk inputs of "
                     f"{_human_bytes(e.chunk_input_bytes)}: {ex.inbox_buffer} inbox, "
                     f"{ex.grad_buffer} cotangent, {RECEIVE_BUFFERS} receive)")
        out.append(f"  ledger terms ({unit}): static {e.static_bytes / scale:.2f} (" + ", ".join(
            f"{k} {v / scale:.2f}" for k, v in e.static_breakdown.items() if v)
            + f"; {e.bytes_per_param:.1f} B/param), {acts}, reserve {e.reserve_bytes / scale:.2f}"
            f" (logits + workspace); {e.reason}")

        comm = self.comm_by_axes()
        big = max([v for pair in comm.values() for v in pair if v] or [0])
        unit, scale = next((u, f) for u, f in (("GB", GB), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                           if big >= 0.1 * f or f == 1)
        out += ["", f"communication per device per step, {unit} (ring wire bytes)"]
        label = lambda a: "?" if a is None else (",".join(a) or "-")  # noqa: E731
        gb = lambda x: "-" if x is None else f"{x / scale:10.3f}"  # noqa: E731
        kinds = {("tensor",): "TP", ("data",): "DP", ("fsdp",): "FSDP",
                 ("stage",): "PP + vocab", (): "1-device groups: no traffic"}
        out.append(f"  {'axes':22}  {'ledger':>10}  {'compiled':>10}")
        for a, (lg, cp) in comm.items():
            out.append(f"  {label(a):22}  {gb(lg):>10}  {gb(cp):>10}   {kinds.get(a, '')}")
            if a == ("stage",) and ex is not None:
                out += self._format_stage_comm(gb)
        if not comm:
            out.append("  none (a single device, or nothing sharded)")
        if ex is not None:
            out.append(
                f"  pipelined: the HLO counts a chunk's layer collectives in every branch of the "
                f"{ex.steps} steps, the ledger the {ex.forward_passes} forward + "
                f"{ex.backward_passes} backward passes a rank runs: "
                f"x{self.hlo_pass_factor():.3g}")
        out += ["", "compiled collectives (CPU all-reduce-then-slice counted as reduce-scatter):",
                hlo.format_summary(self.collectives) if self.collectives else "  none", ""]

        D = self.n_devices
        xla = "n/a" if self.xla_flops is None else f"{self.xla_flops:.4g}"
        # full causal square, as the compiled matmuls compute it (mfu counts it half)
        out.append(f"FLOPs per device per step: ledger model "
                   f"{e.model_flops_per_step_full_attn / D:.4g}, with recompute "
                   f"{e.hfu_flops_per_step_full_attn / D:.4g}; compiled matmuls "
                   f"{self.matmul_flops:.4g}; XLA cost_analysis {xla} (counts each scanned "
                   "loop body once)")
        if ex is not None:
            out.append(
                f"  pipelined: every branch of the {ex.steps} steps, as the HLO reader counts "
                f"them: {branch_matmul_flops(self.cfg, L, ex):.4g}")
        if self.executed is not None:
            out.append("  executed (each rank's F and B branches as its table takes them): "
                       + ", ".join(f"{f:.4g}" for f in self.executed.per_rank)
                       + f" per rank; mean {self.executed.mean:.4g}")
        if self.gpu_report is not None:
            out.append(self.gpu_report.format())
        return "\n".join(out)

    def to_json(self) -> dict:
        """The report for scripts: memory terms, collective bytes per kind and mesh axis,
        matmul FLOPs, and what only a GPU program has (kernels, overlap)."""
        from jaxtrain.tools import hlo
        axes = lambda a: None if a is None else list(a)  # noqa: E731
        lm = self.ledger_memory()
        out = {
            "config": self.config_name, "devices": self.n_devices, "device": self.device_kind,
            "layout": self.estimate.layout.short(), "changes": list(self.changes),
            "compiled": {"memory": self.memory, "matmul_flops": self.matmul_flops,
                         "executed_matmul_flops": None if self.executed is None else {
                             "per_rank": list(self.executed.per_rank),
                             "mean": self.executed.mean, "max": self.executed.max,
                             "every_branch": self.executed.every_branch},
                         "xla_flops": self.xla_flops,
                         "collectives": [{"kind": k, "axes": axes(a), "payload_bytes": v,
                                          "wire_bytes": w} for (k, a), v, w in (
                             (key, val, hlo.summary(self.collectives, wire=True)[key])
                             for key, val in sorted(hlo.summary(self.collectives).items(),
                                                    key=lambda kv: str(kv[0])))]},
            "ledger": {"memory": lm, "static_bytes": self.estimate.static_bytes,
                       "activation_bytes": self.estimate.activation_bytes,
                       "model_flops_per_device": self.estimate.model_flops_per_step_full_attn
                       / self.n_devices,
                       "hfu_flops_per_device": self.estimate.hfu_flops_per_step_full_attn
                       / self.n_devices},
            "comm_by_axes": [{"axes": axes(a), "ledger_bytes": lg, "compiled_wire_bytes": cp}
                             for a, (lg, cp) in self.comm_by_axes().items()],
            "lower_s": self.lower_s, "compile_s": self.compile_s,
        }
        if self.gpu_report is not None:
            out["gpu"] = self.gpu_report.to_json()
        return out


def dry_run(cfg: Config, gpu: str | Gpu | None = None, *, devices: int | None = None,
            config_name: str = "the config", echo=None, target: str | None = None) -> DryRun:
    """Compile the train step (pipelined when stage > 1) from abstract state and read what
    XLA reports. On the devices present, the layout scaled to them; for a GPU `target`, on
    `devices` compile-only GPUs (default: the configured layout's device count), with the
    ledger planning for the same GPU. `echo` (e.g. print) hears progress before the long
    compile."""
    import tempfile

    import jax

    from jaxtrain import xla_flags
    from jaxtrain.model import attention
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import gpu_program, hlo, targets
    from jaxtrain.tools.compile_step import compile_step
    if target is not None:
        tgt = targets.get(target)
        if gpu is not None and get_gpu(gpu).name != get_gpu(tgt.ledger_gpu).name:
            raise ConfigError(f"--gpu {get_gpu(gpu).name} and --target {target} disagree; "
                              "--target alone sets the GPU the ledger plans for")
        gpu = get_gpu(tgt.ledger_gpu)
        planned = plan_devices(cfg, gpu, devices)
        if planned.n_devices is None:
            raise LayoutError(f"cannot compile {config_name} for {target}: {planned.error}")
        present, kind = targets.devices(target, planned.n_devices), tgt.name
    else:
        gpu = get_gpu(gpu or "h100")
        present = jax.devices()
        planned = plan_devices(cfg, gpu, devices, present=len(present))
        kind = present[0].device_kind
    scaled, changes = scale_to_devices(cfg, planned, len(present))
    mesh = sharding.make_mesh(scaled.parallel, present)
    if echo:
        echo(f"dry run: compiling the train step of {config_name} on {len(present)} x {kind} ...")
    is_gpu = sharding.platform(mesh) == "gpu"
    flash = attention.is_kernel(attention.select(scaled.model, sharding.platform(mesh)))
    with tempfile.TemporaryDirectory(prefix="jaxtrain-dump-") as dump:
        # the dump holds each Pallas kernel's launch and PTX (registers, spills)
        extra = {"xla_dump_to": dump} if is_gpu and flash else None
        out = compile_step(scaled, mesh, extra_options=extra)
        report = None
        mem = hlo.memory(out.compiled)
        if is_gpu:
            device_memory = (targets.get(target).memory_bytes if target else
                             (present[0].memory_stats() or {}).get("bytes_limit", 0))
            report = gpu_program.GpuReport.read(
                out.text, mesh, dump if extra else None, device_memory, mem["total_bytes"],
                xla_flags.for_platform(scaled, "gpu"))
    colls = hlo.reclassify_sliced_all_reduce(hlo.collectives_from_text(out.text, mesh))
    try:
        xla_flops = hlo.compiled_flops(out.compiled)
    except hlo.HloAnalysisUnavailable:
        xla_flops = None
    layout = layout_from_config(scaled, len(present))
    est = estimate(scaled, layout, gpu, flash=flash)
    executed = None
    if est.executor is not None:
        from jaxtrain.tools import pipeline_flops
        executed = pipeline_flops.for_step(out.text, est.executor)
    return DryRun(config_name=config_name, cfg=scaled, planned=planned, changes=changes,
                  estimate=est, memory=mem, collectives=colls,
                  matmul_flops=hlo.matmul_flops_from_text(out.text), xla_flops=xla_flops,
                  lower_s=out.lower_s, compile_s=out.compile_s, device_kind=kind,
                  gpu_report=report, executed=executed)

"""Device planning: the devices a configured layout needs, the ledger's plan for the device
count it is planned for, and the layout scaled to the devices present (what `--dry-run`
compiles, jaxtrain.tools.dry_run). The planner (jaxtrain.tools.plan) searches for a layout;
this module maps the configured one onto N devices.

    python train.py --config configs/llama70b.py [--devices 1024] [--gpu h100]
        fewer devices than the layout needs: print the ledger's plan, exit 2, compile nothing

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
--parallel.stage=1) compiles as given.
"""
from __future__ import annotations

import dataclasses
import math

from jaxtrain import config
from jaxtrain.config import Config, ConfigError
from jaxtrain.config_check import check
from jaxtrain.ledger import Estimate, Gpu, Layout, LayoutError, describe, estimate, get_gpu
from jaxtrain.ledger.layout import layers_per_chunk, layout_from_config, tensor_splits_model

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
    fake = (f"; a model that fits in host memory runs on {need} fake CPU devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} (as the tests do)"
            if kind == "cpu" else "")
    return (f"{what} but {present} {kind} device{'s are' if present != 1 else ' is'} present; "
            f"nothing was compiled or allocated. Run on >= {need} devices{plan_at}, shrink the "
            "layout with --parallel.* overrides, or check the step with --dry-run (it compiles "
            f"on the {_devices(present)} present with a scaled layout){fake}")


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

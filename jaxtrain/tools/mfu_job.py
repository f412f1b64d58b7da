"""The job a profile belongs to: its files, config, how many devices it ran on, and its mesh.

The device count is the whole job's, not the trace's: one rank's file of a two-rank run is
half the job, and T_ideal divides the model's FLOPs by every device. It comes from, in order,
`--devices`, the run's run.json, the trace's distributedInfo (world size x devices per rank),
the config's layout when it fixes every degree (no -1), and only then the devices the trace
shows (with a note). Every source that speaks must agree with the others, the trace may not
show more devices (or higher ranks) than the job has, and the config's layout must fit the
count: a disagreement is one line naming both sides, before anything is measured.
"""
from __future__ import annotations

import json
import math
import pathlib

from jaxtrain.config import Config, ConfigError, from_dict, load_config
from jaxtrain.ledger.layout import resolve_degrees
from jaxtrain.tools import mfu_axes
from jaxtrain.tools import profile_trace as pt


class BreakdownError(ConfigError):
    """Input the breakdown cannot use; one line that says what to do."""


def device_count(cfg: Config, devs, *, given: int | None, run_info: dict, notes: list) -> int:
    """The job's device count, cross-checked (module docstring); devs: the trace's devices
    (jaxtrain.tools.mfu_timeline.Devices)."""
    p = cfg.parallel
    sizes = {a: getattr(p, a) for a in mfu_axes.MESH_ORDER}
    said = []   # (where, count)
    if given:
        said.append(("--devices", int(given)))
    if run_info.get("n_devices"):
        said.append(("run.json", int(run_info["n_devices"])))
    if devs.world_size:
        said.append((f"the trace's distributedInfo (world_size {devs.world_size} x "
                     f"{devs.per_file} device{'s' if devs.per_file > 1 else ''} per rank)",
                     devs.world_size * devs.per_file))
    if -1 not in sizes.values():
        said.append(("the config's layout (" + " x ".join(f"{a}={v}" for a, v in sizes.items())
                     + ")", math.prod(sizes.values())))
    traced = len(devs.index)
    if not said:
        notes.append(f"{traced} devices, those in the trace (--devices: the whole job's)")
        said.append(("the trace", traced))
    where, n = said[0]
    for other, m in said[1:]:
        if m != n:
            raise BreakdownError(f"{where} says {n} devices but {other} says {m}: pass the "
                                 "config the trace ran (--config) and its --devices")
    top = max(devs.index.values(), default=-1)
    if traced > n or top >= n:
        raise BreakdownError(f"the trace shows {traced} devices (up to index {top}) but "
                             f"{where} says the job has {n}; pass the job's config and "
                             "--devices")
    return n


def mesh_degrees(cfg: Config, n_devices: int) -> dict[str, int]:
    """The config's mesh degrees on n devices (axis -> size, stage first), or a one-line
    error when the layout does not fit."""
    try:
        degrees = resolve_degrees(cfg, n_devices)
    except ConfigError as err:
        raise BreakdownError(f"the config's layout does not fit the job's {n_devices} "
                             f"devices: {err}") from None
    return {a: degrees[a] for a in mfu_axes.MESH_ORDER}


def inputs(run_dir, trace, cfg, hlo_text):
    """(title, files, config, run.json, logged step times, HLO text) of a run or of traces."""
    if run_dir is None:
        files = [pathlib.Path(f) for f in trace or ()]
        if cfg is None:
            raise BreakdownError("--trace needs --config: the recipe (configs/X.py) or a run's "
                                 "config.json that the trace ran (model FLOPs for T_ideal, the "
                                 "layout for the ledger's budget)")
        return ", ".join(f.name for f in files), files, cfg, {}, {}, hlo_text
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise BreakdownError(f"{run_dir}: no such run directory (train.workdir)")
    files = pt.session_files(run_dir)
    if not files:
        raise BreakdownError(
            f"{run_dir} has no profile (no profile/**/*.xplane.pb or *.trace.json.gz); "
            "train with --train.profile_steps=N --train.profile_start=S")
    hlo_file = files[0].parent / pt.HLO_FILE
    if hlo_text is None and hlo_file.is_file():
        hlo_text = hlo_file.read_text()
    return (str(run_dir), files, cfg or _run_config(run_dir),
            _read_json(run_dir / "run.json") or {},
            _logged_step_times(run_dir / "metrics.jsonl"), hlo_text)


def config_arg(path: str) -> Config:
    if path.endswith(".json"):
        d = _read_json(pathlib.Path(path))
        if d is None:
            raise BreakdownError(f"--config {path}: not a readable config.json")
        return from_dict(d)
    return load_config(path)


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _run_config(run_dir: pathlib.Path) -> Config:
    d = _read_json(run_dir / "config.json")
    if d is None:
        raise BreakdownError(f"{run_dir}/config.json is missing or unreadable; pass --trace "
                             "with --config RECIPE instead")
    return from_dict(d)


def _logged_step_times(path: pathlib.Path) -> dict:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step_time_s" in r:
                out[int(r["step"])] = float(r["step_time_s"])
    return out

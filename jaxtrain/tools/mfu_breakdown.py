"""Where did the MFU go: a profiled step = T_ideal + seven terms, next to the ledger's budget.

    python -m jaxtrain.mfu_breakdown RUN_DIR             # the profile train.profile_steps wrote
    python -m jaxtrain.mfu_breakdown --trace FILE [FILE ...] --config RECIPE [--hlo FILE]

T_ideal = model FLOPs per device / peak (ledger.flops: causal attention counted as half). The
rest of each device's step window (jaxtrain.tools.mfu_timeline) is cut by the shape each loss has on
its timeline:

- kernel efficiency: compute time above T_ideal, less recompute (split into GEMMs below peak
  and non-GEMM kernels where GEMMs are known: the compiled HLO, or kernel names);
- recompute: backward GEMM time above twice the forward GEMM time (needs the HLO's op_name:
  JAX puts backward ops under transpose(...));
- pipeline bubble: compute idle while only send/recv (collective-permute) runs;
- exposed communication: compute idle while a collective runs, shared among the collectives
  running, by mesh axis (the HLO's replica groups) or else by kind;
- data wait: compute idle, no communication, the host inside the input pipeline (jaxtrain's
  `next_batch` annotation, torch's DataLoader);
- host launch overhead: compute idle otherwise;
- stragglers: exposed collective time spent waiting for a peer: the slowest peer's compute
  time minus this device's (peers: devices of the same pipeline stage), or, when a collective
  ran more than STRAGGLER_FACTOR x the ledger's time for it (latency + bytes / link
  bandwidth; not with CPU's guessed figures), its exposed time beyond that; taken out of
  exposed communication.

Each device's terms and T_ideal add up to its T_step exactly; a step reports their mean over
devices. Kernel efficiency is negative when a chip beats its table peak (CPU's is a guess).
The budget is the planner's estimate (ledger.estimate) of the run's layout: its compute above
T_ideal, recompute, bubble, exposed communication and launch overhead (midpoint of its
optimistic and pessimistic values); the ledger assumes no data wait and no stragglers. MFU
points of a term = excess x T_ideal / (T_step x budget step): they add up to the planned MFU
minus the measured one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections import defaultdict

from jaxtrain.tools import mfu_timeline as mt
from jaxtrain.tools import profile_trace as pt
from jaxtrain.config import Config, ConfigError, from_dict, load_config
from jaxtrain.ledger import (Assumptions, comm, estimate, get_gpu, gpu_for_device_kind,
                             layout_from_config)
from jaxtrain.ledger.flops import model_flops_per_token, tokens_per_step
from jaxtrain.ledger.layout import AXES_FAST_TO_SLOW, resolve_degrees
from jaxtrain.tools.mfu_report import TERMS, Breakdown, Budget, StepTerms

STRAGGLER_FACTOR = 3.0
MESH_ORDER = tuple(reversed(AXES_FAST_TO_SLOW))   # stage, data, fsdp, context, tensor
DATA_SPAN = mt.DATA_SPAN


class BreakdownError(ConfigError):
    """Input the breakdown cannot use; one line that says what to do."""


def step_terms(step, windows: dict, tl: mt.Timeline, ideal: float, stage: int = 1,
               expected_s=None) -> StepTerms:
    """The seven terms of one step, averaged over its devices (each device's sum is exact)."""
    measured = {d: mt.measure(ops, tl.data.get(tl.source[d], []), s, e)
                for d, (s, e, ops) in windows.items()}
    n_total = max(len(tl.devices), 1)
    per_stage = max(n_total // max(stage, 1), 1)
    peers = defaultdict(list)
    for d in measured:
        peers[tl.index[d] // per_stage].append(d)
    slowest = {d: max(measured[p].busy for p in g) for g in peers.values() for d in g}
    per_device, by_axis, split = {}, defaultdict(float), defaultdict(float)
    any_gemm = any(o.gemm for _, _, ops in windows.values() for o in ops)
    directed = any(o.gemm and o.backward is not None for _, _, ops in windows.values()
                   for o in ops)
    for d, m in measured.items():
        exposed = sum(m.exposed.values())
        by_bytes = 0.0
        if expected_s is not None:
            for op, x in m.exposed.items():
                want = expected_s(op)
                dur = (op.end - op.start) * 1e-6
                if want and dur > STRAGGLER_FACTOR * want:
                    by_bytes += min(x, dur - want)
        straggler = min(exposed, max(slowest[d] - m.busy, by_bytes))
        recompute = max(0.0, m.backward - 2 * m.forward) if directed else 0.0
        terms = {"kernel_efficiency": m.busy - ideal - recompute, "recompute": recompute,
                 "bubble": m.bubble, "exposed_comm": exposed - straggler,
                 "data_wait": m.data_wait, "launch_overhead": m.launch_overhead,
                 "stragglers": straggler}
        keep = (exposed - straggler) / exposed if exposed else 0.0
        for op, x in m.exposed.items():
            by_axis[op.label or "?"] += x * keep / len(measured)
        split["gemm_below_peak"] += (m.gemm - ideal - recompute) / len(measured)
        split["non_gemm"] += (m.busy - m.gemm) / len(measured)
        per_device[d] = {"t_step": m.t_step, "busy": m.busy, **terms}
    mean = {k: sum(v[k] for v in per_device.values()) / len(per_device) for k in TERMS}
    return StepTerms(step=step, devices=len(per_device),
                     t_step=sum(v["t_step"] for v in per_device.values()) / len(per_device),
                     terms=mean, exposed_by_axis=dict(by_axis),
                     kernel_split=dict(split) if any_gemm else None, per_device=per_device)


def gemm_shapes(windows_by_step: dict, peak: float) -> list[dict]:
    """GEMM efficiency by shape over the complete steps: executions, time, achieved TFLOP/s.

    An op may run as several kernels (a split-K GEMM and its reduction), so a window's FLOPs
    of an op are its FLOPs x min(kernels seen, its executions per step in the HLO)."""
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for windows in windows_by_step.values():
        for s, e, ops in windows.values():
            seen = defaultdict(list)
            for o in ops:
                if o.gemm and o.gemm_flops and s <= o.start < e:
                    seen[o.name].append(o)
            for same in seen.values():
                runs = min(len(same), same[0].executions)
                r = rows[same[0].gemm_shape or same[0].name]
                r[0] += runs
                r[1] += sum(o.end - o.start for o in same) * 1e-6
                r[2] += same[0].gemm_flops * runs
    out = [{"shape": k, "count": c, "time_s": t, "tflops": f / t / 1e12 if t else 0.0,
            "of_peak": f / t / peak if t else 0.0} for k, (c, t, f) in rows.items()]
    return sorted(out, key=lambda r: -r["time_s"])


# ----------------------------------------------------------------------------- the budget

_AXIS_OF = {"dp_comm": "data", "fsdp_comm": "fsdp", "tp_comm": "tensor", "pp_comm": "stage",
            "cp_comm": "context"}


def ledger_budget(cfg: Config, n_devices: int, gpu) -> Budget:
    """Each term's budget from the planner's own estimate (ledger.estimate) of this layout."""
    layout = layout_from_config(cfg, n_devices)
    est = estimate(cfg, layout, gpu)
    loss = est.losses
    pair = lambda f: tuple(f(i) for i in (0, 1))  # noqa: E731
    comm_keys = [k for k in loss if k.endswith("_comm")]
    terms = {"kernel_efficiency": pair(lambda i: loss["compute"][i] - est.ideal_step_s),
             "recompute": loss["recompute"], "bubble": loss["bubble"],
             "exposed_comm": pair(lambda i: sum(loss[k][i] for k in comm_keys)),
             "data_wait": (0.0, 0.0), "launch_overhead": loss["overhead"],
             "stragglers": (0.0, 0.0)}
    by_axis = {_AXIS_OF[k]: loss[k] for k in comm_keys if any(loss[k])}
    return Budget(gpu=est.gpu.name + (" (figures an estimate)" if est.gpu.estimate else ""),
                  layout=layout.short(), ideal=est.ideal_step_s, terms=terms, by_axis=by_axis,
                  expected_mfu=est.expected_mfu)


# ----------------------------------------------------------------------------- the breakdown

# ----------------------------------------------------------------------------- entry points

def breakdown(run_dir=None, *, trace=None, cfg: Config | None = None, hlo_text: str | None = None,
              gpu: str | None = None, n_devices: int | None = None) -> Breakdown:
    """The breakdown of a run directory's newest profile, or of trace files (several: several
    hosts) with the config they ran. The GPU suite calls `breakdown(run_dir).format()`."""
    title, files, cfg, run_info, logged, hlo_text = _inputs(run_dir, trace, cfg, hlo_text)
    data = pt.load(files)
    notes = []
    n_devices = n_devices or run_info.get("n_devices")
    if not n_devices:
        n_devices = len(mt.timeline(data).devices)
        notes.append(f"{n_devices} devices, those in the trace (--devices: the whole job's)")
    mesh, ops, module = None, {}, ""
    if hlo_text:
        module = pt.hlo_module_name(hlo_text)
        try:
            degrees = resolve_degrees(cfg, n_devices)
            mesh = {a: degrees[a] for a in MESH_ORDER}
        except ConfigError:
            notes.append(f"the config's layout does not fit {n_devices} devices: collectives "
                         "by kind, not mesh axis")
        ops = pt.hlo_ops(hlo_text, mesh)
    else:
        notes.append("no compiled HLO (the trainer saves profile/.../train_step.hlo.txt; "
                     "--hlo FILE): GEMMs found by kernel name, recompute and mesh axes unknown")
    tl = mt.timeline(data, ops, module)
    if not tl.devices:
        raise BreakdownError(f"{title}: no device activity in the trace (no /device:GPU "
                             "process, torch kernel or XLA op)")
    windows, how = mt.step_windows(tl)
    if not windows:
        n_marks = sum(len(v) for v in tl.markers.values())
        raise BreakdownError(
            f"{title}: no complete step in the trace ({n_marks} step markers); a step needs "
            "its device work and the end of the step before it (or its StepTraceAnnotation) "
            "in the trace: profile at least 2 steps (--train.profile_steps=2)")
    gpu_ = _gpu(gpu, run_info, tl, cfg, notes)
    peak = gpu_.peak_flops(cfg.model.compute_dtype)
    ideal = model_flops_per_token(cfg) * tokens_per_step(cfg) / (n_devices * peak)
    try:
        budget = ledger_budget(cfg, n_devices, gpu_)
    except ConfigError as err:
        budget = None
        notes.append(f"no ledger budget: {err}")
    expected = _expected_seconds(cfg, n_devices, gpu_) if not gpu_.estimate else None
    steps = [step_terms(k, windows[k], tl, ideal, mesh["stage"] if mesh else 1, expected)
             for k in sorted(windows, key=lambda k: (str(type(k)), k))]
    if ops and not any(o.gemm and o.backward is not None for v in tl.devices.values()
                       for o in v):
        notes.append("no GEMM carries forward/backward in its HLO op_name: recompute not "
                     "measured (it stays in kernel efficiency)")
    if any(s.terms["kernel_efficiency"] < 0 for s in steps):
        notes.append(f"kernel efficiency < 0: the device ran faster than {gpu_.name}'s table "
                     "peak" + (" (an estimate)" if gpu_.estimate else "") + "; set "
                     "train.peak_tflops or --gpu")
    return Breakdown(title=title, files=files, assignment=how, gpu=gpu_.name, peak=peak,
                     ideal=ideal, steps=steps, budget=budget,
                     gemms=gemm_shapes(windows, peak), notes=notes, logged=logged)


def _inputs(run_dir, trace, cfg, hlo_text):
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


def after_profile(workdir, lowered, log=print) -> Breakdown | None:
    """The trainer's hook after its profiled steps: save the compiled step's HLO beside the
    profile (GEMM shapes, forward/backward, mesh axes), print the breakdown and write
    mfu_breakdown.json and .png into the profile folder. Problems print one line."""
    workdir = pathlib.Path(workdir)
    files = pt.session_files(workdir)
    if files:
        (files[0].parent / pt.HLO_FILE).write_text(lowered.compile().as_text())
    try:
        result = breakdown(workdir)
    except ConfigError as err:
        log(f"mfu breakdown: {err}")
        return None
    log(result.format())
    result.save(workdir / "profile")
    return result


def _gpu(name, run_info, tl, cfg, notes):
    if name:
        gpu = get_gpu(name)
    elif run_info.get("devices"):
        gpu = gpu_for_device_kind(run_info["devices"][0])
    elif all("/cpu:" in d for d in tl.devices):
        gpu = get_gpu("cpu")
    else:
        gpu = get_gpu("h100")
        notes.append("GPU not given: h100 assumed (--gpu)")
    if cfg.train.peak_tflops > 0:  # the trainer's own peak (metrics.peak_flops_per_device)
        p = cfg.train.peak_tflops * 1e12
        gpu = dataclasses.replace(gpu, bf16_flops=p, fp32_flops=p, estimate=False)
    return gpu


def _expected_seconds(cfg, n_devices, gpu):
    """op -> the ledger's time for it: the pessimistic latency plus its wire bytes over the
    link of its mesh axes (None when unknown). Small collectives are latency-bound."""
    latency = Assumptions().p2p_latency_s[1]
    try:
        layout = layout_from_config(cfg, n_devices)
    except ConfigError:
        return None

    def expected(op):
        axes = tuple(op.label.split("+"))
        if not op.wire_bytes or not set(axes) <= set(MESH_ORDER):
            return None
        return latency + op.wire_bytes / comm.link(layout, axes, gpu)[1]
    return expected


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


def _config_arg(path: str) -> Config:
    if path.endswith(".json"):
        d = _read_json(pathlib.Path(path))
        if d is None:
            raise BreakdownError(f"--config {path}: not a readable config.json")
        return from_dict(d)
    return load_config(path)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtrain.mfu_breakdown",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", help="a run directory (train.workdir) with a profile")
    ap.add_argument("--trace", nargs="+", metavar="FILE",
                    help="trace files instead: .xplane.pb, .trace.json.gz, Chrome/Perfetto JSON "
                         "(jax, torch.profiler); one per host")
    ap.add_argument("--config", help="with --trace: the recipe or config.json the trace ran")
    ap.add_argument("--hlo", help="with --trace: the compiled step's HLO text")
    ap.add_argument("--gpu", help="h100, h200, a100, cpu (default: the run's device)")
    ap.add_argument("--devices", type=int, help="devices of the run (default: the run's)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--out", help="folder for mfu_breakdown.json and .png (default: "
                                  "RUN_DIR/profile; none with --trace)")
    args = ap.parse_args(argv)
    try:
        if bool(args.run_dir) == bool(args.trace):
            raise BreakdownError("give a RUN_DIR or --trace FILE [FILE ...] (one of them)")
        hlo_text = None
        if args.hlo:
            try:
                hlo_text = pathlib.Path(args.hlo).read_text()
            except OSError as err:
                raise BreakdownError(f"--hlo {args.hlo}: {err.strerror}") from None
        result = breakdown(args.run_dir, trace=args.trace,
                           cfg=_config_arg(args.config) if args.config else None,
                           hlo_text=hlo_text, gpu=args.gpu, n_devices=args.devices)
    except ConfigError as err:
        print(f"mfu_breakdown: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=1) if args.json else result.format())
    out = args.out or (pathlib.Path(args.run_dir) / "profile" if args.run_dir else None)
    if out:
        result.save(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

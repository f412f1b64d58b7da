"""Where did the MFU go: a profiled step = T_ideal + seven terms, next to the ledger's budget.

    python -m jaxtrain.mfu_breakdown RUN_DIR             # the profile train.profile_steps wrote
    python -m jaxtrain.mfu_breakdown --trace FILE [FILE ...] --config RECIPE [--hlo FILE]

T_ideal = model FLOPs per device / peak (ledger.flops: causal attention counted as half), over
the whole job's devices (jaxtrain.tools.mfu_job), however many of them the trace shows. The
rest of each device's step window (jaxtrain.tools.mfu_timeline) is cut by the shape each loss
has on its timeline (jaxtrain.tools.mfu_sweep):

- kernel efficiency: compute time above T_ideal, less recompute, split into GEMMs below peak
  (GEMM time - T_ideal's GEMM part), attention below peak (fused attention kernels - T_ideal's
  attention part, where such kernels ran), non-GEMM kernels and memory copies;
- recompute: the time of forward work replayed in the backward: ops jax.checkpoint puts under
  `rematted_computation` (the compiled HLO's op_name), or kernels torch.utils.checkpoint's
  replay launched (jaxtrain.tools.torch_ops). Work is told by what it is, never by how long it
  ran, so a slow backward GEMM is kernel efficiency. Where the trace cannot tell (no HLO, no
  autograd markers) recompute is "n/a", its time stays in kernel efficiency and its budget is
  folded into kernel efficiency's;
- pipeline bubble: compute idle while only send/recv (collective-permute, NCCL SendRecv of a
  pipeline) runs;
- exposed communication: compute idle while a collective runs after its last peer arrived,
  shared among the collectives running, by mesh axis (the HLO's replica groups, or torch's
  process groups' ranks on the config's mesh; an all-to-all of expert parallelism on `expert`);
- data wait: compute idle, the batch's host-to-device copy running or the host inside the input
  pipeline (jaxtrain's `next_batch`, torch's DataLoader);
- host launch overhead: compute idle otherwise;
- stragglers: compute idle while a collective waits for its last peer to arrive
  (jaxtrain.tools.mfu_peers), whatever made the peer late; attributed to that peer and to the
  term in which it spent more than the waiting device. A collective none of whose peers is in
  the trace that ran more than STRAGGLER_FACTOR x the ledger's time for it (latency + bytes /
  link bandwidth; not with CPU's guessed figures) counts its exposed time beyond that.

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

from jaxtrain.config import Config, ConfigError
from jaxtrain.ledger import (Assumptions, comm, estimate, get_gpu, gpu_for_device_kind,
                             layout_from_config)
from jaxtrain.ledger.flops import (attention_flops_per_token, model_flops_per_token,
                                   tokens_per_step)
from jaxtrain.tools import kernel_classes as kc
from jaxtrain.tools import mfu_axes, mfu_job, mfu_peers
from jaxtrain.tools import mfu_timeline as mt
from jaxtrain.tools import profile_trace as pt
from jaxtrain.tools.mfu_job import BreakdownError
from jaxtrain.tools.mfu_report import TERMS, Breakdown, Budget, StepTerms
from jaxtrain.tools.mfu_sweep import measure

STRAGGLER_FACTOR = 3.0
MESH_ORDER = mfu_axes.MESH_ORDER
DATA_SPAN = mt.DATA_SPAN
# where a late peer's time went, as compared with the device that waited for it
_CAUSES = ("kernel_efficiency", "recompute", "data_wait", "launch_overhead", "bubble",
           "exposed_comm")

__all__ = ["BreakdownError", "TERMS", "breakdown", "after_profile", "main", "step_terms"]


@dataclasses.dataclass(frozen=True)
class Ideal:
    total: float        # T_ideal, seconds
    attention: float    # its causal-attention part (QK^T and PV)


def step_terms(step, windows: dict, tl: mt.Timeline, ideal: Ideal, degrees: dict | None,
               expected_s=None) -> StepTerms:
    """The seven terms of one step, averaged over its devices (each device's sum is exact)."""
    peers = mfu_peers.match(windows, tl, degrees)
    measured = {d: measure(ops, tl.data.get(tl.source[d], []), s, e, peers.arrivals[d])
                for d, (s, e, ops) in windows.items()}
    n = len(measured)
    seen = {o.cls for _, _, ops in windows.values() for o in ops}
    classes = ("gemm", "attention", "non_gemm") if "attention" in seen else ("gemm", "non_gemm")
    copies = any(m.by_class["memcpy"] for m in measured.values())
    measured_rc = not tl.recompute_seen
    per_device, by_axis, waits = {}, defaultdict(float), []
    split, rc_split = defaultdict(float), defaultdict(float)
    for d, m in measured.items():
        beyond = _beyond_bytes(m, peers.alone[d], expected_s)
        rc = m.recompute_by_class if measured_rc else dict.fromkeys(m.recompute_by_class, 0.0)
        per_device[d] = {"t_step": m.t_step, "busy": m.busy,
                         "kernel_efficiency": m.busy - ideal.total - sum(rc.values()),
                         "recompute": m.recompute if measured_rc else None,
                         "bubble": m.bubble,
                         "exposed_comm": sum(m.exposed.values()) - sum(beyond.values()),
                         "data_wait": m.data_wait, "launch_overhead": m.launch_overhead,
                         "stragglers": sum(m.waiting.values()) + sum(beyond.values())}
        for op, x in m.exposed.items():
            by_axis[op.label or "?"] += (x - beyond.get(op, 0.0)) / n
        for k, v in _kernel_split(m, ideal, rc, classes, copies).items():
            split[k] += v / n
        for c in classes:
            rc_split[c] += rc[c] / n
        waits += [(d, peers.late[d][op], x) for op, x in m.waiting.items()]
    mean = {t: None if t == "recompute" and not measured_rc else
            sum(v[t] for v in per_device.values()) / n for t in TERMS}
    return StepTerms(step=step, devices=n,
                     t_step=sum(v["t_step"] for v in per_device.values()) / n,
                     terms=mean, exposed_by_axis=dict(by_axis),
                     kernel_split=dict(split) if "gemm" in seen else None,
                     per_device=per_device, stragglers_on=_late_peers(waits, per_device, tl, n),
                     recompute_split=dict(rc_split) if measured_rc else None)


def _kernel_split(m, ideal: Ideal, rc: dict, classes: tuple, copies: bool) -> dict:
    """Kernel efficiency's parts on one device: each class's time less its share of T_ideal
    (attention's own where fused attention kernels ran) and its recompute; memory copies."""
    attn = ideal.attention if "attention" in classes else 0.0
    out = {"gemm_below_peak": m.by_class["gemm"] - (ideal.total - attn) - rc["gemm"]}
    if "attention" in classes:
        out["attention_below_peak"] = m.by_class["attention"] - attn - rc["attention"]
    out["non_gemm"] = m.by_class["non_gemm"] - rc["non_gemm"]
    if copies:
        out["memcpy"] = m.by_class["memcpy"]
    return out


def _beyond_bytes(m, alone: list, expected_s) -> dict:
    """Op -> exposed seconds beyond STRAGGLER_FACTOR x its ledger time, for collectives none
    of whose peers is in the trace."""
    out = {}
    for op in alone if expected_s is not None else ():
        want, x = expected_s(op), m.exposed.get(op, 0.0)
        dur = (op.end - op.start) * 1e-6
        if want and x and dur > STRAGGLER_FACTOR * want:
            out[op] = min(x, dur - want)
    return out


def _late_peers(waits, per_device: dict, tl: mt.Timeline, n: int) -> dict:
    """{peer: {"seconds": the mean wait on it, "cause": the term it spent more time in}}."""
    out = {}
    for d, peer, x in waits:
        name = _device_name(peer, tl)
        row = out.setdefault(name, {"seconds": 0.0, "cause": "", "_by": defaultdict(float)})
        row["seconds"] += x / n
        diff = {t: (per_device[peer][t] or 0.0) - (per_device[d][t] or 0.0) for t in _CAUSES
                if peer in per_device}
        best = max(diff, key=diff.get, default=None)
        row["_by"][best if best and diff[best] > 0 else "not visible"] += x
    for row in out.values():
        by = row.pop("_by")
        row["cause"] = max(by, key=by.get)
    return out


def _device_name(dev: str, tl: mt.Timeline) -> str:
    local = dev.split("/", 1)[-1].lstrip("/")
    if len(tl.ids.ranks) > 1 or tl.ids.world_size:
        return f"device {tl.index[dev]} (rank {tl.ids.ranks[tl.source[dev]]}, {local})"
    return f"device {tl.index[dev]} ({local})"


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


def kernel_families(windows_by_step: dict) -> dict:
    """What each kernel family matched in the complete steps' windows (kernel_classes)."""
    fam = kc.Families()
    for windows in windows_by_step.values():
        for s, e, ops in windows.values():
            for o in ops:
                if s <= o.start < e:
                    fam.add(kc.Kind(o.cls, o.family or "other kernels"), o.name,
                            (o.end - o.start) * 1e-6)
    return fam.table()


# ----------------------------------------------------------------------------- the budget

_AXIS_OF = {"dp_comm": "data", "fsdp_comm": "fsdp", "tp_comm": "tensor", "pp_comm": "stage",
            "cp_comm": "context", "ep_comm": "expert"}


def ledger_budget(cfg: Config, n_devices: int, gpu, fold_recompute: bool = False) -> Budget:
    """Each term's budget from the planner's own estimate (ledger.estimate) of this layout;
    fold_recompute: recompute is not measured, its budget joins kernel efficiency's."""
    layout = layout_from_config(cfg, n_devices)
    est = estimate(cfg, layout, gpu)
    loss = est.losses
    pair = lambda f: tuple(f(i) for i in (0, 1))  # noqa: E731
    comm_keys = [k for k in loss if k.endswith("_comm")]
    fold = loss["recompute"] if fold_recompute else (0.0, 0.0)
    terms = {"kernel_efficiency": pair(lambda i: loss["compute"][i] - est.ideal_step_s
                                       + fold[i]),
             "recompute": None if fold_recompute else loss["recompute"],
             "bubble": loss["bubble"],
             "exposed_comm": pair(lambda i: sum(loss[k][i] for k in comm_keys)),
             "data_wait": (0.0, 0.0), "launch_overhead": loss["overhead"],
             "stragglers": (0.0, 0.0)}
    by_axis = {_AXIS_OF[k]: loss[k] for k in comm_keys if any(loss[k])}
    return Budget(gpu=est.gpu.name + (" (figures an estimate)" if est.gpu.estimate else ""),
                  layout=layout.short(), ideal=est.ideal_step_s, terms=terms, by_axis=by_axis,
                  expected_mfu=est.expected_mfu, folded=sum(loss["recompute"]) / 2
                  if fold_recompute else None)


# ----------------------------------------------------------------------------- entry points

def breakdown(run_dir=None, *, trace=None, cfg: Config | None = None, hlo_text: str | None = None,
              gpu: str | None = None, n_devices: int | None = None) -> Breakdown:
    """The breakdown of a run directory's newest profile, or of trace files (one per rank or
    host) with the config they ran. The GPU suite calls `breakdown(run_dir).format()`."""
    title, files, cfg, run_info, logged, hlo_text = mfu_job.inputs(run_dir, trace, cfg, hlo_text)
    data = pt.load(files)
    notes = []
    ids = mt.devices(data)
    if not ids.index:
        raise BreakdownError(f"{title}: no device activity in the trace (no /device:GPU "
                             "process, torch kernel or XLA op)")
    n_devices = mfu_job.device_count(cfg, ids, given=n_devices, run_info=run_info, notes=notes)
    degrees = mfu_job.mesh_degrees(cfg, n_devices)
    ops, module = {}, ""
    if hlo_text:
        module = pt.hlo_module_name(hlo_text)
        ops = pt.hlo_ops(hlo_text, degrees)
    tl = mt.timeline(data, ids, ops, module, degrees, mfu_axes.expert_degree(cfg))
    if not hlo_text and not tl.torch:
        notes.append("no compiled HLO (the trainer saves profile/.../train_step.hlo.txt; "
                     "--hlo FILE): GEMMs found by kernel name, collectives by kind")
    windows, how = mt.step_windows(tl)
    if not windows:
        n_marks = sum(len(v) for v in tl.markers.values())
        raise BreakdownError(
            f"{title}: no complete step in the trace ({n_marks} step markers); a step needs "
            "its device work and the end of the step before it (or its StepTraceAnnotation) "
            "in the trace: profile at least 2 steps (--train.profile_steps=2)")
    gpu_ = _gpu(gpu, run_info, tl, cfg, notes)
    peak = gpu_.peak_flops(cfg.model.compute_dtype)
    per_device = tokens_per_step(cfg) / (n_devices * peak)
    ideal = Ideal(model_flops_per_token(cfg) * per_device,
                  attention_flops_per_token(cfg.model, cfg.train.seq_len) * per_device)
    try:
        budget = ledger_budget(cfg, n_devices, gpu_, fold_recompute=bool(tl.recompute_seen))
    except ConfigError as err:
        budget = None
        notes.append(f"no ledger budget: {err}")
    if tl.recompute_seen:
        notes.append(f"recompute n/a: {tl.recompute_seen}; its time stays in kernel "
                     "efficiency" + (f", its budget ({budget.folded * 1e3:.2f} ms) is folded "
                                     "into kernel efficiency's" if budget else ""))
    expected = _expected_seconds(cfg, n_devices, gpu_) if not gpu_.estimate else None
    steps = [step_terms(k, windows[k], tl, ideal, degrees, expected)
             for k in sorted(windows, key=lambda k: (str(type(k)), k))]
    if len(ids.index) < n_devices:
        notes.append(f"the trace shows {len(ids.index)} of the job's {n_devices} devices: "
                     "terms are their mean, stragglers among the peers present")
    if any(s.terms["kernel_efficiency"] < 0 for s in steps):
        notes.append(f"kernel efficiency < 0: the device ran faster than {gpu_.name}'s table "
                     "peak" + (" (an estimate)" if gpu_.estimate else "") + "; set "
                     "train.peak_tflops or --gpu")
    return Breakdown(title=title, files=files, assignment=how, gpu=gpu_.name, peak=peak,
                     ideal=ideal.total, steps=steps, budget=budget,
                     gemms=gemm_shapes(windows, peak), notes=notes, logged=logged,
                     kernels=kernel_families(windows))


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtrain.mfu_breakdown",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", nargs="?", help="a run directory (train.workdir) with a profile")
    ap.add_argument("--trace", nargs="+", metavar="FILE",
                    help="trace files instead: .xplane.pb, .trace.json.gz, Chrome/Perfetto JSON "
                         "(jax, torch.profiler); one per rank or host")
    ap.add_argument("--config", help="with --trace: the recipe or config.json the trace ran")
    ap.add_argument("--hlo", help="with --trace: the compiled step's HLO text")
    ap.add_argument("--gpu", help="h100, h200, a100, cpu (default: the run's device)")
    ap.add_argument("--devices", type=int, help="devices of the job (default: the run's, the "
                                                "trace's world size or the config's layout)")
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
                           cfg=mfu_job.config_arg(args.config) if args.config else None,
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

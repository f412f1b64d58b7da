"""A profile as device timelines, the steps on them, and one sweep that charges each instant.

What is a device: a /device:GPU:N process of a JAX trace (derived xprof lines skipped), the GPU
of torch kernels ("cat": "kernel"), or, on XLA:CPU, which has no device timeline, the XLA ops
run for each device_ordinal on whatever host threads ran them. A step (JAX) is one execution
(run_id) of the busiest module, matched to the StepTraceAnnotation markers from the last one
back (the profiler stops after the last profiled step finishes; executions before the first
marker were dispatched before the trace began). Its window runs from the end of the previous
execution to the end of its own, so the device's wait before a step is charged to that step.
Without run ids, device work belongs to the marker of its launch (correlation ids, torch) or
of its start time. `measure` is the sweep (rules in jaxtrain.tools.mfu_breakdown).
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict

from jaxtrain.tools import profile_trace as pt
from jaxtrain.metrics import DATA_SPAN  # the trainer's span around fetching a batch

_DERIVED_LINES = {"Steps", "XLA Modules", "XLA Ops", "Async XLA Ops", "Framework Name Scope",
                  "Framework Ops", "Source code", "Launch Stats", "Host Offload Ops",
                  "_counters_", "TensorFlow Name Scope", "TensorFlow Ops", "XLA TraceMe"}
_DEVICE_PROC_RE = re.compile(r"^/device:(GPU|TPU):(\d+)")
_COLL_RE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                      r"collective-broadcast|collective-permute|send|recv)(-start|-done)?\b")
_NCCL_RE = re.compile(r"nccl\w*?(AllReduce|AllGather|ReduceScatter|AllToAll|Broadcast|"
                      r"SendRecv|Send|Recv)", re.I)
_GEMM_RE = re.compile(r"gemm|matmul|nvjet|xmma|cutlass|cublas|wgmma|(^|[_.])dot([_.\d]|$)",
                      re.I)
_TRANSFER_RE = re.compile(r"memcpy|memset", re.I)
_TORCH_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


@dataclasses.dataclass(eq=False, slots=True)
class Op:
    """One op on a device's timeline (µs)."""
    start: float
    end: float
    name: str
    kind: str               # compute | comm | p2p | transfer
    gemm_flops: float = 0.0
    gemm: bool = False
    gemm_shape: str = ""
    backward: bool | None = None
    label: str = ""         # comm: mesh axes ("data", "data+fsdp") or the collective's kind
    wire_bytes: float = 0.0
    executions: int = 1     # of its HLO op per step
    key: tuple | None = None   # ("run", module, run_id) or ("corr", id)


@dataclasses.dataclass
class Timeline:
    devices: dict[str, list[Op]]
    source: dict[str, int]                   # device -> file index
    index: dict[str, int]                    # device -> global device index
    markers: dict[int, list[tuple]]          # file -> [(step, start, end)] sorted
    data: dict[int, list[tuple]]             # file -> [(start, end)] input-pipeline spans
    launches: dict[tuple, float]             # (file, correlation id) -> host launch time


def _device_of(s: pt.Span) -> tuple[str | None, int]:
    m = _DEVICE_PROC_RE.match(s.process)
    if m:
        return (None, 0) if s.thread in _DERIVED_LINES else (f"{s.source}{s.process}",
                                                              int(m.group(2)))
    if s.cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        dev = int(s.args.get("device", 0))
        return f"{s.source}/gpu:{dev}", dev
    return None, 0


def _op(s: pt.Span, ops: dict, module: str) -> Op | None:
    hlo_name = str(s.args.get("hlo_op", ""))
    info = ops.get(hlo_name) if s.args.get("hlo_module", module) == module else None
    if info is not None and info.opcode in pt.CONTAINERS:
        return None   # a while/conditional spans the ops it runs
    if info is None and re.match(r"^(while|conditional|call)(\.\d+)?$", hlo_name or s.name):
        return None
    names = f"{hlo_name} {s.name}"
    coll = _COLL_RE.match(hlo_name) or _COLL_RE.match(s.name)
    nccl = _NCCL_RE.search(s.name)
    comm_kind = info.comm if info is not None and info.comm else (
        coll.group(1) if coll else nccl.group(1).lower() if nccl else "")
    if comm_kind in ("collective-permute", "send", "recv", "sendrecv", "p2p"):
        kind = "p2p"
    elif comm_kind:
        kind = "comm"
    elif s.cat in ("gpu_memcpy", "gpu_memset") or _TRANSFER_RE.search(s.name):
        kind = "transfer"
    else:
        kind = "compute"
    if info is not None and info.axes is not None:
        label = "+".join(info.axes) or "none"
    else:
        group = s.args.get("Process Group Description") or s.args.get("Process Group Name")
        label = str(group) if group else comm_kind
    gemm = bool(info.gemm_flops) if info is not None else bool(_GEMM_RE.search(names))
    run = s.args.get("run_id")
    corr = s.args.get("correlation", s.args.get("correlation_id"))
    key = (("run", str(s.args.get("hlo_module", "")), str(run)) if run is not None
           else ("corr", str(corr)) if corr is not None else None)
    return Op(start=s.start, end=s.end, name=hlo_name or s.name, kind=kind,
              gemm_flops=info.gemm_flops if info is not None else 0.0,
              gemm=kind == "compute" and gemm, gemm_shape=info.gemm_shape if info else "",
              backward=info.backward if info is not None else None, label=label,
              wire_bytes=info.wire_bytes if info is not None else 0.0,
              executions=info.executions if info is not None else 1, key=key)


def timeline(trace: pt.Trace, ops: dict | None = None, module: str = "") -> Timeline:
    """Sort the trace's spans into device ops, step markers, input-pipeline spans, launches."""
    ops = ops or {}
    devices, source, index = defaultdict(list), {}, {}
    markers, data, launches = defaultdict(dict), defaultdict(list), {}
    host_ops = []
    for s in trace.spans:
        dev, local = _device_of(s)
        if dev is not None:
            op = _op(s, ops, module)
            if op is not None:
                devices[dev].append(op)
                source[dev], index[dev] = s.source, local
            continue
        if _DEVICE_PROC_RE.match(s.process) or s.cat.startswith("gpu_"):
            continue   # a derived line of a device, torch's annotations on a GPU stream
        step = s.args.get("step_num")
        m = _TORCH_STEP_RE.match(s.name)
        if step is not None or m:
            n = int(step) if step is not None else int(m.group(1))
            markers[s.source].setdefault(n, (n, s.start, s.end))
        elif s.name == DATA_SPAN or s.name.startswith("enumerate(DataLoader)"):
            data[s.source].append((s.start, s.end))
        elif "correlation" in s.args or "correlation_id" in s.args:
            launches[(s.source, str(s.args.get("correlation", s.args.get("correlation_id"))))] \
                = s.start
        if "hlo_op" in s.args and "device_ordinal" in s.args:
            host_ops.append(s)
    if not devices:  # XLA:CPU: the ops of each device ordinal, on the host threads
        for s in host_ops:
            op = _op(s, ops, module)
            if op is not None:
                dev = f"{s.source}/cpu:{s.args['device_ordinal']}"
                devices[dev].append(op)
                source[dev], index[dev] = s.source, int(s.args["device_ordinal"])
    per_source = max((sum(1 for d in source if source[d] == i) for i in set(source.values())),
                     default=1)
    index = {d: source[d] * per_source + i for d, i in index.items()}
    for v in devices.values():
        v.sort(key=lambda o: o.start)
    return Timeline(dict(devices), source, index,
                    {k: sorted(v.values(), key=lambda m: m[1]) for k, v in markers.items()},
                    dict(data), launches)


# ----------------------------------------------------------------------------- steps

def step_windows(tl: Timeline) -> tuple[dict, str]:
    """{step: {device: (start, end, ops)}} of complete steps, and how steps were found."""
    has_runs = any(o.key and o.key[0] == "run" for ops in tl.devices.values() for o in ops)
    has_corr = any(o.key and o.key[0] == "corr" for ops in tl.devices.values() for o in ops)
    how = "run_id" if has_runs else "correlation" if has_corr and tl.launches else "time"
    main = _main_module(tl) if has_runs else None
    out = defaultdict(dict)
    for dev, ops in tl.devices.items():
        marks = tl.markers.get(tl.source[dev], [])
        groups = (_run_groups(ops, main, marks) if how == "run_id"
                  else _marker_groups(ops, marks, tl, tl.source[dev], how))
        prev_end = None
        for label, members, mark in groups:
            first, end = min(o.start for o in members), max(o.end for o in members)
            start = prev_end
            if start is None and mark is not None and mark[1] <= first:
                start = mark[1]
            prev_end = end
            if label is not None and start is not None and end > start:
                out[label][dev] = (start, end, ops)
    return dict(out), how


def _main_module(tl: Timeline) -> str:
    busy = defaultdict(float)
    for ops in tl.devices.values():
        for o in ops:
            if o.key and o.key[0] == "run":
                busy[o.key[1]] += o.end - o.start
    return max(busy, key=busy.get)


def _run_groups(ops, main, marks):
    runs = defaultdict(list)
    for o in ops:
        if o.key and o.key[0] == "run" and o.key[1] == main:
            runs[o.key[2]].append(o)
    ordered = sorted(runs.values(), key=lambda r: min(o.start for o in r))
    # The profiler stops after the last step finishes, so the last run is the last marker's;
    # runs before the first marker were dispatched before the trace began.
    labels = [None] * len(ordered)
    mark_of = [None] * len(ordered)
    if marks:
        for i in range(1, min(len(ordered), len(marks)) + 1):
            labels[-i], mark_of[-i] = marks[-i][0], marks[-i]
    else:
        labels = list(range(len(ordered)))
    return list(zip(labels, ordered, mark_of))


def _marker_groups(ops, marks, tl, source, how):
    if not marks:
        return []
    starts = [m[1] for m in marks]
    groups = defaultdict(list)
    for o in ops:
        t = o.start
        if how == "correlation":
            t = tl.launches.get((source, o.key[1])) if o.key else None
            if t is None:
                continue
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0:
            groups[i].append(o)
    return [(marks[i][0], groups[i], marks[i]) for i in sorted(groups)]


# ----------------------------------------------------------------------------- measuring

@dataclasses.dataclass
class Measured:
    """One device in one step window, seconds."""
    t_step: float
    busy: float = 0.0
    gemm: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    bubble: float = 0.0
    data_wait: float = 0.0
    launch_overhead: float = 0.0
    exposed: dict = dataclasses.field(default_factory=dict)   # Op -> seconds


def measure(ops: list[Op], data: list[tuple], start: float, end: float) -> Measured:
    """Sweep the window once, charging every instant by the rules (module docstring)."""
    points = [(start, 0, None, ""), (end, 0, None, "")]
    for o in ops:
        s, e = max(o.start, start), min(o.end, end)
        if e > s and o.kind != "transfer":
            points += [(s, 1, o, ""), (e, -1, o, "")]
    for s0, e0 in data:
        s, e = max(s0, start), min(e0, end)
        if e > s:
            points += [(s, 1, None, "data"), (e, -1, None, "data")]
    points.sort(key=lambda p: p[0])
    m = Measured(t_step=(end - start) * 1e-6)
    n = defaultdict(int)
    active: dict[Op, int] = {}
    prev = start
    for t, delta, op, what in points:
        seg = (t - prev) * 1e-6
        if seg > 0:
            if n["compute"]:
                m.busy += seg
                m.gemm += seg if n["gemm"] else 0.0
                m.forward += seg if n["fwd"] else 0.0
                m.backward += seg if n["bwd"] else 0.0
            elif active:
                for a in active:
                    m.exposed[a] = m.exposed.get(a, 0.0) + seg / len(active)
            elif n["p2p"]:
                m.bubble += seg
            elif n["data"]:
                m.data_wait += seg
            else:
                m.launch_overhead += seg
        prev = max(prev, t)
        if not delta:
            continue
        if op is None:
            n[what] += delta
        elif op.kind == "comm":
            active[op] = active.get(op, 0) + delta
            if not active[op]:
                del active[op]
        elif op.kind == "p2p":
            n["p2p"] += delta
        else:
            n["compute"] += delta
            if op.gemm:
                n["gemm"] += delta
                n["fwd" if op.backward is False else "bwd" if op.backward else "-"] += delta
    return m

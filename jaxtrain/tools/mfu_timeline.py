"""A profile as device timelines and the steps on them (the sweep is jaxtrain.tools.mfu_sweep).

What is a device: a /device:GPU:N process of a JAX trace (derived xprof lines skipped), the GPU
of torch kernels ("cat": "kernel"), or, on XLA:CPU, which has no device timeline, the XLA ops
run for each device_ordinal on whatever host threads ran them. Which device it is in the job:
its file's rank (torch's `distributedInfo`, else a `rank<N>` in the file name, else the file's
place in the list) times the devices per file, plus its order among its file's devices, so
rank 1 on GPU 1 is device 1. What an op is: the compiled HLO's view where there is one (GEMM
FLOPs, forward replayed in the backward, collectives' mesh axes), the kernel's name otherwise
(jaxtrain.tools.kernel_classes), and for torch what launched it (jaxtrain.tools.torch_ops:
recompute, the collective's process group, whose ranks give its mesh axes,
jaxtrain.tools.mfu_axes).

A step (JAX) is one execution (run_id) of the busiest module, matched to the
StepTraceAnnotation markers from the last one back (the profiler stops after the last profiled
step finishes; executions before the first marker were dispatched before the trace began). Its
window runs from the end of the previous execution to the end of its own, so the device's wait
before a step is charged to that step. Without run ids, device work belongs to the marker of
its launch (correlation ids, torch) or of its start time.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from collections import defaultdict

from jaxtrain.config import ConfigError
from jaxtrain.tools import kernel_classes as kc
from jaxtrain.tools import mfu_axes
from jaxtrain.tools import profile_trace as pt
from jaxtrain.tools import torch_ops
from jaxtrain.metrics import DATA_SPAN  # the trainer's span around fetching a batch

_DERIVED_LINES = {"Steps", "XLA Modules", "XLA Ops", "Async XLA Ops", "Framework Name Scope",
                  "Framework Ops", "Source code", "Launch Stats", "Host Offload Ops",
                  "_counters_", "TensorFlow Name Scope", "TensorFlow Ops", "XLA TraceMe"}
_DEVICE_PROC_RE = re.compile(r"^/device:(GPU|TPU):(\d+)")
_COLL_RE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                      r"collective-broadcast|collective-permute|send|recv)(-start|-done)?\b")
_TORCH_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_IN_NAME_RE = re.compile(r"rank[_\-.]?(\d+)", re.I)
_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class TimelineError(ConfigError):
    """Trace files that do not describe one job; the message says which and what to pass."""


@dataclasses.dataclass(eq=False, slots=True)
class Op:
    """One op on a device's timeline (µs)."""
    start: float
    end: float
    name: str
    kind: str               # compute | comm | p2p | transfer
    cls: str = "non_gemm"   # compute: gemm | attention | non_gemm; transfer: h2d | memcpy
    family: str = ""        # jaxtrain.tools.kernel_classes' family of its kernel
    gemm_flops: float = 0.0
    gemm_shape: str = ""
    backward: bool | None = None
    recompute: bool = False  # forward work replayed in the backward
    label: str = ""         # comm: mesh axes ("data", "data+fsdp") or the collective's kind
    group: str = ""         # comm: what the peers' same collective is called (pg or HLO op)
    ranks: tuple | None = None   # comm: the group's global ranks (torch), None unknown
    axes: tuple | None = None    # comm: the HLO's mesh axes, None unknown
    wire_bytes: float = 0.0
    executions: int = 1     # of its HLO op per step
    key: tuple | None = None   # ("run", module, run_id) or ("corr", id)

    @property
    def gemm(self) -> bool:
        return self.cls == "gemm"


@dataclasses.dataclass
class Devices:
    """The trace's devices and where each sits in the job."""
    index: dict[str, int]      # device -> its index in the job
    source: dict[str, int]     # device -> file index
    ranks: list[int]           # file -> its rank
    per_file: int              # devices per file (rank)
    world_size: int | None     # torch's distributedInfo world_size
    hosts: list[str]           # file -> the host it ran on


@dataclasses.dataclass
class Timeline:
    devices: dict[str, list[Op]]
    ids: Devices
    markers: dict[int, list[tuple]]          # file -> [(step, start, end)] sorted
    data: dict[int, list[tuple]]             # file -> [(start, end)] input-pipeline spans
    launches: dict[tuple, float]             # (file, correlation id) -> host launch time
    recompute_seen: str                      # "" measurable, else why not

    @property
    def source(self) -> dict[str, int]:
        return self.ids.source

    @property
    def index(self) -> dict[str, int]:
        return self.ids.index

    @property
    def torch(self) -> bool:
        """Kernels linked to host launches by correlation ids (torch.profiler's traces)."""
        return any(o.key and o.key[0] == "corr" for v in self.devices.values() for o in v)


def devices(trace: pt.Trace) -> Devices:
    """Each device of the trace and its index: its file's rank (distributedInfo, a rank<N> in
    the file name, the file's place) x devices per file + its order within the file. Two files
    of one rank, or files of different jobs, are an error."""
    ranks, worlds = [], set()
    infos = trace.info or [{}] * len(trace.files)
    for i, (f, info) in enumerate(zip(trace.files, infos)):
        dist = info.get("distributedInfo") or {}
        named = _RANK_IN_NAME_RE.search(f.name)
        ranks.append(int(dist["rank"]) if "rank" in dist else
                     int(named.group(1)) if named else i)
        if "world_size" in dist:
            worlds.add(int(dist["world_size"]))
    if len(set(ranks)) < len(ranks):
        dup = next(r for r in ranks if ranks.count(r) > 1)
        raise TimelineError(f"two trace files are rank {dup} "
                            f"({', '.join(f.name for f, r in zip(trace.files, ranks) if r == dup)}"
                            "); pass one file per rank")
    if len(worlds) > 1:
        raise TimelineError(f"the trace files come from jobs of different sizes (world_size "
                            f"{sorted(worlds)} in their distributedInfo); pass one job's files")
    local, source = {}, {}
    for s in trace.spans:
        dev, number = _device_of(s)
        if dev is not None:
            local.setdefault(dev, number)
            source[dev] = s.source
    if not local:   # XLA:CPU: each device ordinal's ops, on the host threads
        for s in trace.spans:
            if "hlo_op" in s.args and "device_ordinal" in s.args:
                dev = f"{s.source}/cpu:{s.args['device_ordinal']}"
                local.setdefault(dev, int(s.args["device_ordinal"]))
                source[dev] = s.source
    files = set(source.values())
    per_file = max((sum(1 for d in source if source[d] == i) for i in files), default=1)
    index = {}
    for i in files:
        mine = sorted((d for d in source if source[d] == i), key=local.get)
        index.update({d: ranks[i] * per_file + k for k, d in enumerate(mine)})
    hosts = [str(info.get("host_name") or f.name.split(".")[0])
             for f, info in zip(trace.files, infos)]
    return Devices(index, source, ranks, per_file, worlds.pop() if worlds else None, hosts)


def timeline(trace: pt.Trace, ids: Devices, ops: dict | None = None, module: str = "",
             degrees: dict | None = None, expert: int = 1) -> Timeline:
    """Sort the trace's spans into device ops, step markers, input-pipeline spans, launches.

    degrees (the config's mesh, axis -> size) name torch process groups by their mesh axes."""
    ops = ops or {}
    by_source = defaultdict(list)
    for s in trace.spans:
        by_source[s.source].append(s)
    host = {i: torch_ops.host_side(spans) for i, spans in by_source.items()}
    devs = defaultdict(list)
    markers, data = defaultdict(dict), defaultdict(list)
    cpu = bool(ids.index) and all("/cpu:" in d for d in ids.index)   # XLA:CPU's host ops
    for s in trace.spans:
        dev = (f"{s.source}/cpu:{s.args['device_ordinal']}" if cpu and "hlo_op" in s.args
               and "device_ordinal" in s.args else _device_of(s)[0])
        if dev is not None:
            op = _op(s, ops, module, host[s.source], degrees, expert)
            if op is not None:
                devs[dev].append(op)
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
    for v in devs.values():
        v.sort(key=lambda o: o.start)
    launches = {(i, c): la.time for i, h in host.items() for c, la in h.launches.items()}
    return Timeline(dict(devs), ids,
                    {k: sorted(v.values(), key=lambda m: m[1]) for k, v in markers.items()},
                    dict(data), launches, _recompute_seen(ops, host, devs))


def _recompute_seen(ops: dict, host: dict, devices: dict) -> str:
    """"" when the trace shows which work is forward replayed in the backward, else why not."""
    if ops:
        return "" if any(o.backward is not None for o in ops.values()) else (
            "the compiled HLO carries no op_name metadata")
    if any(o.key and o.key[0] == "corr" for v in devices.values() for o in v):   # torch
        return "" if any(h.markers for h in host.values()) else (
            "the trace has no autograd backward nodes (profile with CPU activity)")
    return "no compiled HLO (--hlo FILE; the trainer saves profile/.../train_step.hlo.txt)"


def _device_of(s: pt.Span) -> tuple[str | None, int]:
    m = _DEVICE_PROC_RE.match(s.process)
    if m:
        return (None, 0) if s.thread in _DERIVED_LINES else (f"{s.source}{s.process}",
                                                              int(m.group(2)))
    if s.cat in _KERNEL_CATS:
        dev = int(s.args.get("device", 0))
        return f"{s.source}/gpu:{dev}", dev
    return None, 0


def _op(s: pt.Span, ops: dict, module: str, host: torch_ops.HostSide, degrees, expert
        ) -> Op | None:
    hlo_name = str(s.args.get("hlo_op", ""))
    info = ops.get(hlo_name) if s.args.get("hlo_module", module) == module else None
    if info is not None and info.opcode in pt.CONTAINERS:
        return None   # a while/conditional spans the ops it runs
    if info is None and re.match(r"^(while|conditional|call)(\.\d+)?$", hlo_name or s.name):
        return None
    corr = s.args.get("correlation", s.args.get("correlation_id"))
    launch = host.launches.get(str(corr)) if corr is not None else None
    kind = kc.classify(info.kernel if info is not None and info.kernel else s.name)
    comms = {}
    if kind.cls in ("comm", "p2p"):   # an NCCL kernel: its collective from record_param_comms
        comms = {**((launch.comms or {}) if launch else {}),
                 **{k: v for k, v in s.args.items()
                    if k.startswith(("Collective", "Process Group"))}}
        kind = kc.classify(s.name, str(comms.get("Collective name", "")))
    op = Op(start=s.start, end=s.end, name=hlo_name or s.name, kind="compute", cls=kind.cls,
            family=kind.family, recompute=bool(launch and launch.recompute))
    if info is not None:
        _from_hlo(op, info, kind)
    elif s.cat in ("gpu_memcpy", "gpu_memset") and kind.cls not in ("h2d", "memcpy"):
        op.cls = "h2d" if re.search(r"htod|h2d", s.name, re.I) else "memcpy"
    elif (coll := _COLL_RE.match(s.name)) and kind.cls not in ("comm", "p2p"):
        base = coll.group(1)   # an XLA collective's name on a trace without its HLO
        op.cls = "p2p" if base in ("collective-permute", "send", "recv") else "comm"
        op.label = base
    if op.cls in ("comm", "p2p"):
        op.kind = op.cls
        if info is None:
            _torch_comm(op, comms, kind, degrees, expert)
    elif op.cls in ("h2d", "memcpy", "memset"):
        op.kind, op.cls = "transfer", "memcpy" if op.cls == "memset" else op.cls
    run = s.args.get("run_id")
    op.key = (("run", str(s.args.get("hlo_module", "")), str(run)) if run is not None
              else ("corr", str(corr)) if corr is not None else None)
    return op


def _from_hlo(op: Op, info: pt.HloOp, kind: kc.Kind) -> None:
    """The compiled program's view of an op: GEMM FLOPs, remat, collectives' mesh axes."""
    op.gemm_flops, op.gemm_shape = info.gemm_flops, info.gemm_shape
    op.backward, op.recompute = info.backward, info.recompute
    op.wire_bytes, op.executions = info.wire_bytes, info.executions
    if info.comm:
        op.cls = "p2p" if info.comm == "p2p" else "comm"
        op.axes = info.axes
        op.label = ("+".join(info.axes) or "none") if info.axes is not None else info.comm
        op.group = op.name
    elif info.gemm_flops:
        op.cls = "gemm"
        op.family = (kind.family if kind.cls == "gemm" and kind.family != "other GEMM"
                     else "XLA dot (HLO)")
    elif kind.cls in ("gemm", "comm", "p2p") or kind.family == "other kernels":
        op.cls = "non_gemm" if kind.cls in ("gemm", "comm", "p2p") else op.cls
        op.family = "XLA ops (HLO)"   # the HLO says: no matmul


def _torch_comm(op: Op, comms: dict, kind: kc.Kind, degrees, expert) -> None:
    """A torch collective's peers and label: its process group's ranks on the config's mesh."""
    ranks = mfu_axes.parse_ranks(comms.get("Process Group Ranks"))
    desc = str(comms.get("Process Group Description", ""))
    name = str(comms.get("Process Group Name", ""))
    op.ranks = tuple(ranks) if ranks else None
    op.group = f"pg {name}" if name else kind.collective
    label = (mfu_axes.group_label(ranks, degrees, expert=expert, kind=kind.collective,
                                  desc=desc) if ranks and degrees else None)
    op.label = (label or mfu_axes.desc_axis(desc) or desc or (f"pg {name}" if name else
                                                              kind.collective))


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

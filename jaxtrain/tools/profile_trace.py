"""Read profiler traces into one list of spans, and the HLO ops their names refer to.

Formats (one file per profiled process; several files are several hosts):
- JAX profiles: `HOST.xplane.pb`, read with xprof (the maintained XProf / TensorBoard profile
  plugin), which converts it to trace events, or the `HOST.trace.json.gz` jax writes beside it
  from the same session (no extra dependency).
- Chrome / Perfetto trace JSON, plain or gzipped: `{"traceEvents": [...]}` or a bare list, as
  jax.profiler's perfetto_trace.json.gz and torch.profiler's export_chrome_trace write it.
Complete events ("ph": "X") and begin/end pairs ("B"/"E") become spans; process and thread
names come from the metadata events ("M"); timestamps are microseconds, the format's unit.

Each file's top-level fields other than the events (torch's `distributedInfo` with the rank and
its process groups, `host_name`, `record_shapes`) are kept per file in `Trace.info`.

`hlo_ops` reads the compiled step's HLO text (what the trainer saves next to its profile):
which trace op names are GEMMs (their FLOPs and shapes), forward or backward (a JAX op_name
under `transpose(...)` is backward), forward work replayed in the backward (jax.checkpoint's
`rematted_computation` in the op_name), collectives and the mesh axes they span. A fusion
without metadata of its own takes its fused computation's root's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import pathlib
import re
import tempfile
import types

from jaxtrain.tools import hlo, hlo_module
from jaxtrain.config import ConfigError

PROFILE_SUFFIXES = (".xplane.pb", ".trace.json.gz", ".trace.json", ".json.gz", ".json")
HLO_FILE = "train_step.hlo.txt"   # the trainer's compiled step, in the profile session folder
XPROF_INSTALL = "pip install 'jaxtrain[profile]' (or: pip install xprof)"


class TraceError(ConfigError):
    """A trace this module cannot read; the message names the file and what to do."""


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Span:
    start: float          # µs
    dur: float            # µs
    name: str
    source: int           # index of the file it came from (one profiled process each)
    pid: str
    tid: str
    process: str          # process name: "/device:GPU:0", "/host:CPU", "python3", ...
    thread: str
    cat: str
    args: dict

    @property
    def end(self) -> float:
        return self.start + self.dur


@dataclasses.dataclass
class Trace:
    files: list[pathlib.Path]
    spans: list[Span]
    info: list[dict] = dataclasses.field(default_factory=list)   # per file: top-level fields


def session_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The newest profile session under `path` (a run directory, its profile/ folder or one
    session folder): one file per host, the xplane when xprof is installed, else jax's JSON."""
    path = pathlib.Path(path)
    if (path / "profile").is_dir():
        path = path / "profile"
    sessions = sorted({f.parent for suffix in (".xplane.pb", ".trace.json.gz")
                       for f in path.rglob(f"*{suffix}")}, key=lambda d: d.stat().st_mtime)
    if not sessions:
        return []
    session = sessions[-1]
    prefer = ".xplane.pb" if _have_xprof() else ".trace.json.gz"
    hosts: dict[str, pathlib.Path] = {}
    for f in sorted(session.iterdir()):
        for suffix in (".xplane.pb", ".trace.json.gz"):
            if f.name.endswith(suffix):
                host = f.name[: -len(suffix)]
                if host not in hosts or suffix == prefer:
                    hosts[host] = f
    return list(hosts.values())


def load(files) -> Trace:
    files = [pathlib.Path(f) for f in files]
    spans: list[Span] = []
    info: list[dict] = []
    for i, f in enumerate(files):
        if not f.is_file():
            raise TraceError(f"{f}: no such trace file")
        if f.name.endswith(".xplane.pb"):
            data = _xplane_json(f)
        elif f.name.endswith((".json", ".json.gz")):
            data = _json_data(f)
        else:
            raise TraceError(f"{f}: unknown trace format; pass a JAX .xplane.pb, its "
                             ".trace.json.gz, or a Chrome/Perfetto trace JSON (.json[.gz]); a "
                             "binary Perfetto protobuf must be exported to JSON first")
        events = data.get("traceEvents") if isinstance(data, dict) else data
        spans += chrome_spans(events, i, f)
        info.append({k: v for k, v in data.items() if k != "traceEvents"}
                    if isinstance(data, dict) else {})
    return Trace(files, spans, info)


def chrome_spans(events, source: int, origin="trace") -> list[Span]:
    """Spans of Chrome trace events (the `traceEvents` list)."""
    if not isinstance(events, list):
        raise TraceError(f"{origin}: no traceEvents list; not a Chrome/Perfetto trace JSON")
    procs, threads, out, open_ = {}, {}, [], {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M":
            name = (e.get("args") or {}).get("name")
            if e.get("name") == "process_name":
                procs[str(e.get("pid"))] = str(name)
            elif e.get("name") == "thread_name":
                threads[(str(e.get("pid")), str(e.get("tid")))] = str(name)
    for e in events:
        if not isinstance(e, dict) or e.get("ph") not in ("X", "B", "E") or "ts" not in e:
            continue
        pid, tid = str(e.get("pid")), str(e.get("tid"))
        if e["ph"] == "B":
            open_.setdefault((pid, tid), []).append(e)
            continue
        if e["ph"] == "E":
            stack = open_.get((pid, tid))
            if not stack:
                continue
            b = stack.pop()
            e = {**b, "dur": float(e["ts"]) - float(b["ts"]),
                 "args": {**(b.get("args") or {}), **(e.get("args") or {})}}
        out.append(Span(start=float(e["ts"]), dur=float(e.get("dur", 0.0)),
                        name=str(e.get("name", "")), source=source, pid=f"{source}:{pid}",
                        tid=tid, process=procs.get(pid, pid),
                        thread=threads.get((pid, tid), tid), cat=str(e.get("cat", "")),
                        args=dict(e.get("args") or {})))
    return out


def _json_data(path: pathlib.Path):
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not a Chrome/Perfetto trace JSON ({err})") from None


def _have_xprof() -> bool:
    try:
        import xprof.convert.raw_to_tool_data  # noqa: F401
    except ImportError:
        return False
    return True


def _xplane_json(path: pathlib.Path):
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        raise TraceError(f"reading {path.name} needs xprof: {XPROF_INSTALL}; or pass the "
                         f"{path.name.removesuffix('.xplane.pb')}.trace.json.gz jax wrote "
                         "beside it") from None
    with _quiet_stderr() as log:
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(path)], "trace_viewer", {})
    if not data:
        raise TraceError(f"{path}: xprof could not convert it ({log.read().strip()[-300:]})")
    return json.loads(data)


@contextlib.contextmanager
def _quiet_stderr():
    """xprof's C++ logs every conversion step to fd 2; keep it for the error message only."""
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)


# ----------------------------------------------------------------------------- HLO ops

@dataclasses.dataclass(frozen=True)
class HloOp:
    opcode: str
    gemm_flops: float = 0.0        # matmul FLOPs of one execution (fusions: their dots)
    gemm_shape: str = ""           # "f32[2048,128] x f32[128,384]" of its largest dot
    backward: bool | None = None   # under transpose(...) in op_name; None: no op_name
    recompute: bool = False        # forward work jax.checkpoint replays in the backward
    kernel: str = ""               # a custom call's kernel: its Pallas name or its target
    comm: str = ""                 # "" or a collective kind ("all-reduce", ..., "p2p")
    axes: tuple | None = None      # mesh axes of a collective; None unknown
    wire_bytes: float = 0.0        # what one device sends per execution (hlo.py convention)
    executions: int = 1            # per step (loop trip counts; every branch of a conditional)


_OP_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^{}]*op_name="([^"]*)"',
                         re.M)
_LAYOUT_RE = re.compile(r"\{[\d,]*\}")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KERNEL_NAME_RE = re.compile(r'\bname\s*=\s*\\?"([\w.\-]+)\\?"|"name":\s*"([\w.\-]+)"')
_P2P = ("collective-permute", "send", "recv")
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")
REMAT_SCOPE = "rematted_computation"   # jax.checkpoint's name scope for the replayed forward


def hlo_module_name(text: str) -> str:
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", text)
    return m.group(1) if m else ""


def hlo_ops(text: str, mesh_shape: dict | None = None) -> dict[str, HloOp]:
    """Every instruction of a compiled module's text by name (the trace's `hlo_op`).

    mesh_shape (axis -> size, mesh order) maps collectives' device groups to mesh axes."""
    comps, reach = hlo_module.parsed(text)
    op_names = dict(_OP_NAME_RE.findall(text))
    by_op = {}
    if mesh_shape:
        mesh = types.SimpleNamespace(axis_names=tuple(mesh_shape), shape=dict(mesh_shape))
        try:
            by_op = {c.op: c for c in hlo.collectives_from_text(text, mesh)}
        except hlo.HloError:
            by_op = {}  # groups that fit no mesh of this size: kinds without axes
    out = {}
    for comp in comps.values():
        for instr in comp.instrs:
            base = instr.opcode.removesuffix("-start").removesuffix("-done")
            comm = ("p2p" if base in _P2P else base if base in hlo.KINDS else "")
            coll = by_op.get(instr.name)
            if coll is None and comm and instr.opcode.endswith("-done") and instr.operands:
                coll = by_op.get(instr.operands[0])
            flops, shape = _gemm(instr, comp, comps)
            op_name = op_names.get(instr.name) or _root_op_name(instr, comps, op_names)
            out[instr.name] = HloOp(
                opcode=instr.opcode, gemm_flops=flops, gemm_shape=shape,
                backward=None if not op_name else "transpose(" in op_name,
                recompute=bool(op_name) and REMAT_SCOPE in op_name, kernel=_kernel(instr),
                comm=comm, axes=coll.axes if coll is not None else None,
                wire_bytes=coll.wire_bytes if coll is not None else 0.0,
                executions=reach[comp.name].count)
    return out


def _root_op_name(instr, comps, op_names) -> str:
    """A fusion's op_name when its own line has none: its fused computation's root's."""
    if instr.opcode != "fusion":
        return ""
    for name, _, _ in hlo_module.callees(instr):
        if name in comps and comps[name].instrs:
            return op_names.get(comps[name].instrs[-1].name, "")
    return ""


def _kernel(instr) -> str:
    if instr.opcode != "custom-call":
        return ""
    named = _KERNEL_NAME_RE.search(instr.attrs)
    target = _TARGET_RE.search(instr.attrs)
    return (named.group(1) or named.group(2)) if named else target.group(1) if target else ""


def _gemm(instr, comp, comps, depth: int = 0) -> tuple[float, str]:
    """(matmul FLOPs, largest dot's shape) of an instruction, looking into fusions."""
    try:
        flops = float(hlo.matmul_flops_of(instr, comp))
    except hlo.HloParseError:
        return 0.0, ""   # a matmul whose operands the text does not size: not timed as one
    if flops:
        operands = [s or (comp.by_name[o].shape if o in comp.by_name else "?")
                    for o, s in zip(instr.operands[:2], instr.operand_shapes[:2])]
        return flops, " x ".join(_LAYOUT_RE.sub("", s) for s in operands)
    if instr.opcode != "fusion" or depth > 3:
        return 0.0, ""
    total, best = 0.0, (0.0, "")
    for name, _, _ in hlo_module.callees(instr):
        for inner in comps[name].instrs if name in comps else ():
            f, shape = _gemm(inner, comps[name], comps, depth + 1)
            total += f
            best = max(best, (f, shape))
    return total, best[1]

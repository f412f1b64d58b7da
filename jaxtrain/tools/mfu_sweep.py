"""One sweep over a device's step window that charges each instant to exactly one place.

In order of precedence, an instant is:
- busy, when a compute kernel runs: by class (GEMM before attention before non-GEMM when
  kernels overlap on several streams), and recompute when a kernel of forward work replayed in
  the backward runs;
- a collective's, when compute is idle and collectives run: shared evenly among them, each
  share waiting on a peer (before the collective's last peer arrived, jaxtrain.tools.mfu_peers)
  or exposed communication (after);
- pipeline bubble, when only send/recv runs;
- data wait, when a host-to-device copy that feeds the step's input runs (one before the
  step's first compute kernel);
- busy in a memory copy, when another memcpy or memset runs;
- data wait, when the host is in the input pipeline (jaxtrain's `next_batch`, torch's
  DataLoader);
- host launch overhead otherwise.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

CLASSES = ("gemm", "attention", "non_gemm")


@dataclasses.dataclass
class Measured:
    """One device in one step window, seconds."""
    t_step: float
    busy: float = 0.0
    by_class: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        (*CLASSES, "memcpy"), 0.0))
    recompute: float = 0.0
    recompute_by_class: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(
        CLASSES, 0.0))
    bubble: float = 0.0
    data_wait: float = 0.0
    launch_overhead: float = 0.0
    exposed: dict = dataclasses.field(default_factory=dict)   # Op -> seconds
    waiting: dict = dataclasses.field(default_factory=dict)   # Op -> seconds on a late peer


def measure(ops, data: list[tuple], start: float, end: float,
            arrivals: dict | None = None) -> Measured:
    """Sweep the window [start, end) µs once (module docstring). arrivals: collective Op ->
    when its last peer arrived (µs, this device's clock)."""
    arrivals = arrivals or {}
    inside = [o for o in ops if min(o.end, end) > max(o.start, start)]
    first_compute = min((o.start for o in inside if o.kind == "compute"), default=end)
    points = [(start, 0, None), (end, 0, None)]
    for o in inside:
        s, e = max(o.start, start), min(o.end, end)
        points += [(s, 1, o), (e, -1, o)]
        if o in arrivals and s < arrivals[o] < e:
            points.append((arrivals[o], 0, o))   # from here on it is transferring
    for s0, e0 in data:
        s, e = max(s0, start), min(e0, end)
        if e > s:
            points += [(s, 1, "data"), (e, -1, "data")]
    points.sort(key=lambda p: p[0])
    m = Measured(t_step=(end - start) * 1e-6)
    n = defaultdict(int)
    active: dict = {}
    prev = start
    for t, delta, what in points:
        seg = (t - prev) * 1e-6
        if seg > 0:
            _charge(m, n, active, arrivals, prev, seg)
        prev = max(prev, t)
        if not delta:
            continue
        if what == "data":
            n["data"] += delta
        elif what.kind == "comm":
            active[what] = active.get(what, 0) + delta
            if not active[what]:
                del active[what]
        elif what.kind == "p2p":
            n["p2p"] += delta
        elif what.kind == "transfer":
            n["input" if what.cls == "h2d" and what.start < first_compute else "memcpy"] += delta
        else:
            n[what.cls] += delta
            if what.recompute:
                n["rc:" + what.cls] += delta
    return m


def _charge(m: Measured, n: dict, active: dict, arrivals: dict, t: float, seg: float) -> None:
    cls = next((c for c in CLASSES if n[c]), None)
    if cls is not None:
        m.busy += seg
        m.by_class[cls] += seg
        rc = next((c for c in CLASSES if n["rc:" + c]), None)
        if rc is not None:
            m.recompute += seg
            m.recompute_by_class[rc] += seg
    elif active:
        for a in active:
            into = m.waiting if t < arrivals.get(a, t) else m.exposed
            into[a] = into.get(a, 0.0) + seg / len(active)
    elif n["p2p"]:
        m.bubble += seg
    elif n["input"]:
        m.data_wait += seg
    elif n["memcpy"]:
        m.busy += seg
        m.by_class["memcpy"] += seg
    elif n["data"]:
        m.data_wait += seg
    else:
        m.launch_overhead += seg

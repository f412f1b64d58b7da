"""One collective seen from all its peers: when each arrived, and who was last.

A collective cannot finish before its last peer starts it, so a device that starts it earlier
waits: that wait, where compute is idle, is the straggler term, whatever made the peer late (a
slower kernel, its DataLoader, its host). The same collective on two devices is the k-th of its
kind in the step: of its process group for torch (NCCL runs a communicator's collectives in
issue order on every rank), of its HLO instruction for JAX (every device runs the same
program). Its peers are the devices of its group: torch's process-group ranks, or the devices
that share every mesh coordinate but the collective's axes (the HLO's replica groups), or,
with neither, every device that ran it.

Files from different hosts have different clocks; a collective ends at about the same moment
on all its peers, so each host's offset is the median difference of the collectives' ends
against the first file's. Files from one host share its clock.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict

from jaxtrain.tools import mfu_axes
from jaxtrain.tools.mfu_timeline import Op, Timeline


@dataclasses.dataclass
class Peers:
    arrivals: dict     # device -> {Op: when its last peer arrived, µs on the device's clock}
    late: dict         # device -> {Op: the device that arrived last}
    alone: dict        # device -> [Op]: collectives none of whose peers is in the trace
    offsets: dict      # file -> clock offset against the first file, µs


def match(windows: dict, tl: Timeline, degrees: dict | None) -> Peers:
    """The collectives of one step's windows ({device: (start, end, ops)}) across devices."""
    instances = defaultdict(dict)   # (group, k) -> {device: Op}
    for dev, (s, e, ops) in windows.items():
        seen = defaultdict(int)
        for o in ops:
            if o.kind == "comm" and s <= o.start < e:
                key = o.group or o.name
                instances[(key, seen[key])][dev] = o
                seen[key] += 1
    offsets = _offsets(instances, tl)
    out = Peers({d: {} for d in windows}, {d: {} for d in windows},
                {d: [] for d in windows}, offsets)
    for by_dev in instances.values():
        for dev, op in by_dev.items():
            members = [p for p in by_dev if _same_group(dev, p, op, tl, degrees)]
            if len(members) < 2:
                out.alone[dev].append(op)
                continue
            arrive = {p: by_dev[p].start - offsets[tl.source[p]] for p in members}
            last = max(members, key=arrive.get)
            at = arrive[last] + offsets[tl.source[dev]]
            if at > op.start:
                out.arrivals[dev][op] = at
                out.late[dev][op] = last
    return out


def _same_group(dev: str, peer: str, op: Op, tl: Timeline, degrees: dict | None) -> bool:
    if dev == peer:
        return True
    if op.ranks is not None:
        return tl.ids.ranks[tl.source[peer]] in op.ranks
    if op.axes is not None and degrees:
        axes = mfu_axes.rank_axes(degrees)
        a, b = (mfu_axes.coords(tl.index[x], axes) for x in (dev, peer))
        return all(x == y for (name, _), x, y in zip(axes, a, b) if name not in op.axes)
    return True


def _offsets(instances: dict, tl: Timeline) -> dict:
    files = sorted(set(tl.source.values()))
    offsets = dict.fromkeys(files, 0.0)
    if not files:
        return offsets
    ref = files[0]
    diffs = defaultdict(list)
    for by_dev in instances.values():
        ends = defaultdict(list)
        for d, o in by_dev.items():
            ends[tl.source[d]].append(o.end)
        if ref in ends:
            for f, e in ends.items():
                diffs[f].append(statistics.median(e) - statistics.median(ends[ref]))
    for f in files:
        if tl.ids.hosts[f] != tl.ids.hosts[ref] and diffs[f]:
            offsets[f] = statistics.median(diffs[f])
    return offsets

"""The discrete-event model behind bench/torch_traces.py: how its SPMD program runs on two
ranks, the truth of each step window, and the torch.profiler export of each rank.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

from torch_traces import DEFAULT_DATA_MS, Op, Scenario, program


# ----------------------------------------------------------------------------- the model

@dataclasses.dataclass
class Ran:
    """An op as it ran on one rank (µs on the node's clock)."""
    op: Op
    step: int
    launch: float
    start: float
    end: float
    last: float = 0.0     # collectives: when the last rank arrived


def simulate(sc: Scenario, seed: int = 0):
    """({rank: [Ran]}, {rank: [(name, start, end)] host spans}, {rank: [(step, host start)]})."""
    rng = random.Random(seed)
    ranks = (0, 1)
    host = dict.fromkeys(ranks, 1_000_000.0)
    compute, nccl = dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0.0)
    tags = {r: {} for r in ranks}
    runs, spans, marks = {r: [] for r in ranks}, {r: [] for r in ranks}, {r: [] for r in ranks}
    for step in range(sc.steps):
        for r in ranks:
            marks[r].append((step, host[r]))
        for op in program(sc, step):
            if op.host == "data":
                for r in ranks:
                    d = sc.data_ms.get((r, step), DEFAULT_DATA_MS) * 1e3 * rng.uniform(0.95, 1.05)
                    spans[r].append(("enumerate(DataLoader)#_MultiProcessingDataLoaderIter"
                                     ".__next__", host[r], host[r] + d))
                    host[r] += d
                continue
            if op.host == "sync":
                for r in ranks:
                    host[r] = max(host[r], tags[r][op.wait]) + rng.uniform(8, 15)
                continue
            launches = {}
            for r in ranks:
                launches[r] = host[r]
                host[r] += op.host_us * rng.uniform(0.7, 1.3)
            if op.role == "comm":
                arrive = {r: max(launches[r] + 6, nccl[r], tags[r].get(op.wait, 0.0))
                          for r in ranks}
                last = max(arrive.values())
                end = last + op.comm["transfer_us"] * rng.uniform(0.97, 1.03)
                for r in ranks:   # NCCL completes on the ranks a few µs apart
                    nccl[r] = end + rng.uniform(0.0, 12.0)
                    if op.tag:
                        tags[r][op.tag] = nccl[r]
                    runs[r].append(Ran(op, step, launches[r], arrive[r], nccl[r], last))
                continue
            for r in ranks:
                slow = sc.slow.get((r, step), 1.0) if op.role in ("gemm", "attention",
                                                                   "non_gemm") else 1.0
                start = max(launches[r] + 5, compute[r], tags[r].get(op.wait, 0.0))
                end = start + op.us * slow * rng.uniform(0.97, 1.03)
                compute[r] = end
                if op.tag:
                    tags[r][op.tag] = end
                runs[r].append(Ran(op, step, launches[r], start, end))
    return runs, spans, marks


def truth(sc: Scenario, runs: list, spans: list, ideal_s: float, ideal_attention_s: float):
    """{step: terms} of one rank (steps >= 1), by what the model knows each instant was."""
    out = {}
    ends = {}
    for x in runs:
        ends[x.step] = max(ends.get(x.step, 0.0), x.end)
    for step in range(1, sc.steps):
        w0, w1 = ends[step - 1], ends[step]
        cuts = {w0, w1}
        for x in runs:
            cuts |= {min(max(t, w0), w1) for t in (x.start, x.end, x.last) if t}
        for _, s, e in spans:
            cuts |= {min(max(s, w0), w1), min(max(e, w0), w1)}
        cuts = sorted(cuts)
        t = {"busy": dict.fromkeys(("gemm", "attention", "non_gemm", "memcpy"), 0.0),
             "recompute": dict.fromkeys(("gemm", "attention", "non_gemm"), 0.0),
             "stragglers": 0.0, "exposed": {}, "data_wait": 0.0, "launch_overhead": 0.0}
        for a, b in zip(cuts, cuts[1:]):
            mid, seg = (a + b) / 2, (b - a) * 1e-6
            now = [x for x in runs if x.start <= mid < x.end]
            kernel = next((x for x in now if x.op.role in ("gemm", "attention", "non_gemm")),
                          None)
            coll = next((x for x in now if x.op.role == "comm"), None)
            if kernel:
                t["busy"][kernel.op.role] += seg
                if kernel.op.recompute:
                    t["recompute"][kernel.op.role] += seg
            elif coll and mid < coll.last:
                t["stragglers"] += seg
            elif coll:
                axis = coll.op.comm["axis"]
                t["exposed"][axis] = t["exposed"].get(axis, 0.0) + seg
            elif any(x.op.role == "h2d" for x in now):
                t["data_wait"] += seg
            elif any(x.op.role == "memcpy" for x in now):
                t["busy"]["memcpy"] += seg
            elif any(s <= mid < e for _, s, e in spans):
                t["data_wait"] += seg
            else:
                t["launch_overhead"] += seg
        busy, rc = sum(t["busy"].values()), sum(t["recompute"].values())
        attn = ideal_attention_s if t["busy"]["attention"] else 0.0
        out[step] = {"t_step": (w1 - w0) * 1e-6,
                     "terms": {"kernel_efficiency": busy - ideal_s - rc, "recompute": rc,
                               "bubble": 0.0, "exposed_comm": sum(t["exposed"].values()),
                               "data_wait": t["data_wait"],
                               "launch_overhead": t["launch_overhead"],
                               "stragglers": t["stragglers"]},
                     "exposed_by_axis": t["exposed"],
                     "kernel_split": {
                         "gemm_below_peak": t["busy"]["gemm"] - (ideal_s - attn)
                         - t["recompute"]["gemm"],
                         "attention_below_peak": t["busy"]["attention"] - attn
                         - t["recompute"]["attention"],
                         "non_gemm": t["busy"]["non_gemm"] - t["recompute"]["non_gemm"],
                         "memcpy": t["busy"]["memcpy"]},
                     "cause": sc.causes.get(step, "")}
    return out


# ----------------------------------------------------------------------------- the export

STREAM = {"main": 7, "comm": 24}


def export(sc: Scenario, rank: int, runs: list, spans: list, marks: list) -> dict:
    """torch.profiler's Chrome trace of one rank."""
    pid, gpu = 4000 + rank, rank
    tids = {"main": pid, "autograd": pid + 37}
    ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
          {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": "CPU"}},
          {"ph": "M", "name": "process_name", "pid": gpu, "tid": 0, "args": {"name": "python"}},
          {"ph": "M", "name": "process_labels", "pid": gpu, "tid": 0,
           "args": {"labels": f"GPU {gpu}"}}]
    ev += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t,
            "args": {"name": f"thread {t} ({'python' if k == 'main' else 'pt_autograd_0'})"}}
           for k, t in tids.items()]
    ev += [{"ph": "M", "name": "thread_name", "pid": gpu, "tid": s, "args": {"name": f"stream {s}"}}
           for s in STREAM.values()]
    ext = itertools.count(1)
    next_mark = [m[1] for m in marks[1:]] + [max(x.end for x in runs) + 50]
    for (step, start), end in zip(marks, next_mark):
        ev.append(_x("user_annotation", f"ProfilerStep#{step}", pid, tids["main"], start,
                     end - start, {"External id": next(ext)}))
        mine = [x for x in runs if x.step == step]
        first, last = min(x.start for x in mine), max(x.end for x in mine)
        ev.append(_x("gpu_user_annotation", f"ProfilerStep#{step}", gpu, STREAM["main"], first,
                     last - first, {"External id": next(ext)}))
    ev += [_x("user_annotation", name, pid, tids["main"], s, e - s, {"External id": next(ext)})
           for name, s, e in spans]
    by_thread = {k: [] for k in tids}
    for corr, x in enumerate(runs, start=1):
        by_thread[x.op.thread].append((x, corr))
        comm = x.op.role == "comm"
        args = {"External id": next(ext), "queued": 0, "device": gpu, "context": 1,
                "stream": STREAM["comm" if comm else "main"], "correlation": corr}
        if x.op.role in ("h2d", "memcpy"):
            cat = "gpu_memcpy"
            args |= {"bytes": 33554432 if x.op.role == "h2d" else 4,
                     "memory bandwidth (GB/s)": 24.6}
        else:
            cat = "kernel"
            args |= {"registers per thread": 168, "shared memory": 98304, "blocks per SM": 1.2,
                     "warps per SM": 9.6, "grid": [132, 1, 1], "block": [384, 1, 1],
                     "est. achieved occupancy %": 19}
            if comm and x.op.pg_on_kernel:
                args |= next(a for n, a, _ in x.op.stack if n == "record_param_comms")
        ev.append(_x(cat, x.op.name, gpu, args["stream"], x.start, x.end - x.start, args))
        tid = tids[x.op.thread]
        ev.append(_x("cuda_driver" if x.op.api == "cuLaunchKernel" else "cuda_runtime",
                     x.op.api, pid, tid, x.launch, 3.5,
                     {"External id": args["External id"], "cbid": 211, "correlation": corr}))
        ev += [{"ph": "s", "id": corr, "pid": pid, "tid": tid, "ts": round(x.launch, 3),
                "cat": "ac2g", "name": "ac2g"},
               {"ph": "f", "id": corr, "pid": gpu, "tid": args["stream"],
                "ts": round(x.start, 3), "cat": "ac2g", "name": "ac2g", "bp": "e"}]
    for thread, launched in by_thread.items():
        ev += _host_ops(launched, pid, tids[thread], ext)
    return {"schemaVersion": 1,
            "deviceProperties": [{"id": gpu, "name": "NVIDIA H100 80GB HBM3",
                                  "totalGlobalMem": 85045231616, "computeMajor": 9,
                                  "computeMinor": 0, "numSms": 132}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2,
                                "pg_count": 2, "nccl_version": "2.21.5", "pg_config": [
                                    {"pg_name": "0", "pg_desc": "default_pg",
                                     "backend_config": "cuda:nccl", "pg_size": 2,
                                     "ranks": [0, 1]},
                                    {"pg_name": "1", "pg_desc": "mesh_ep",
                                     "backend_config": "cuda:nccl", "pg_size": 2,
                                     "ranks": [0, 1]}]},
            "record_shapes": 1, "trace_id": f"{sc.name}-{rank}", "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000, "host_name": "node0",
            "traceName": f"rank{rank}.json", "traceEvents": ev}


def _x(cat, name, pid, tid, ts, dur, args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": round(ts, 3),
            "dur": round(dur, 3), "args": args}


def shift(trace: dict, us: float) -> dict:
    """The same trace on a host whose clock reads `us` later."""
    for e in trace["traceEvents"]:
        if "ts" in e:
            e["ts"] = round(e["ts"] + us, 3)
    return trace


def _host_ops(launched, pid, tid, ext) -> list:
    """CPU op spans around the launches of one thread: consecutive launches under the same op
    instance share its span, nested 0.2 µs inside their parent."""
    out, open_ = [], []   # open_: [(instance id, name, args, start)]
    prev_end = None

    def close(depth):
        while len(open_) > depth:
            _, name, args, start = open_.pop()
            end = prev_end + 0.2 * (len(open_) + 1)
            out.append(_x("cpu_op", name, pid, tid, start, end - start,
                          {"External id": next(ext), **args}))
    for x, _ in sorted(launched, key=lambda xc: xc[0].launch):
        stack = x.op.stack
        keep = 0
        while keep < min(len(open_), len(stack)) and open_[keep][0] == stack[keep][2]:
            keep += 1
        if prev_end is not None:
            close(keep)
        for depth in range(keep, len(stack)):
            name, args, ident = stack[depth]
            open_.append((ident, name, args, x.launch - 0.2 * (len(stack) - depth)))
        prev_end = x.launch + 3.5
    if prev_end is not None:
        close(0)
    return out



"""How close the MFU breakdown comes to the truth on two-rank torch traces with known terms.

    python bench/mfu_torch_check.py [OUT_DIR]    # default: a temporary folder

Writes bench/torch_traces.py's scenarios, runs `jaxtrain.tools.mfu_breakdown.breakdown` on
both ranks' files of each (and on rank 1's file alone), and prints, per scenario, each term's
largest error over the steps and the two devices as a share of that device's T_step (the
kernel-efficiency split and the axes: of the step's mean over the devices, as the breakdown
reports them), the straggler's cause against the one the scenario planted, and how far any
device's T_ideal + seven terms is from its T_step.
"""
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import json  # noqa: E402

from jaxtrain.tools import mfu_breakdown as mb  # noqa: E402
from jaxtrain.tools.mfu_job import config_arg  # noqa: E402
import torch_traces  # noqa: E402

SPLIT = ("gemm_below_peak", "attention_below_peak", "non_gemm", "memcpy")


def check(folder: pathlib.Path) -> list[str]:
    truth = json.loads((folder / "truth.json").read_text())
    cfg = config_arg(str(folder / "config.json"))
    bd = mb.breakdown(trace=[folder / "rank0.json", folder / "rank1.json"], cfg=cfg,
                      gpu="h100")
    worst, axes, causes, sums = {}, {}, [], 0.0
    for s in bd.steps:
        if str(s.step) not in truth["ranks"]["0"]:
            continue
        known = [truth["ranks"][r][str(s.step)] for r in ("0", "1")]
        t_step = sum(k["t_step"] for k in known) / 2
        for dev, got in s.per_device.items():   # rank r runs on GPU r
            mine = known[int(dev.rsplit(":", 1)[1])]
            for t, v in mine["terms"].items():
                _worst(worst, t, got[t], v, mine["t_step"])
        for k in SPLIT:
            _worst(worst, f"  {k}", (s.kernel_split or {}).get(k, 0.0),
                   sum(x["kernel_split"][k] for x in known) / 2, t_step)
        for axis in {a for k in known for a in k["exposed_by_axis"]} | set(s.exposed_by_axis):
            v = sum(k["exposed_by_axis"].get(axis, 0.0) for k in known) / 2
            err = abs(s.exposed_by_axis.get(axis, 0.0) - v) / t_step
            axes[axis] = max(axes.get(axis, 0.0), err)
        planted = known[0]["cause"]
        if planted:
            peer, row = max(s.stragglers_on.items(), key=lambda kv: kv[1]["seconds"])
            causes.append(f"step {s.step}: planted {planted}, found {row['cause']} (waiting "
                          f"{row['seconds'] * 1e3:.2f} ms on {peer})")
        for v in s.per_device.values():
            sums = max(sums, abs(bd.ideal + sum(v[t] or 0.0 for t in mb.TERMS) - v["t_step"]))
    lines = [f"{folder.name}: steps {', '.join(str(s.step) for s in bd.steps if s.step)}, "
             f"T_ideal {bd.ideal * 1e3:.2f} ms (truth {truth['ideal_s'] * 1e3:.2f}), "
             f"MFU {bd.mfu:.1%}"]
    lines += [f"  {t:<24} {'n/a' if g is None else f'{g * 1e3:8.3f}'} ms  truth {v * 1e3:8.3f}"
              f" ms  largest error {e:.4%} of T_step" for t, (e, g, v) in worst.items()]
    lines += [f"  exposed on {a:<13} largest error {e:.4%} of T_step"
              for a, e in sorted(axes.items())]
    lines += [f"  stragglers' cause, {c}" for c in causes]
    lines.append(f"  sum: |T_ideal + terms - T_step| <= {sums:.2e} s on every device")
    alone = mb.breakdown(trace=[folder / "rank1.json"], cfg=cfg, gpu="h100")
    lines.append(f"  rank 1's file alone: T_ideal {alone.ideal * 1e3:.2f} ms, "
                 f"{alone.steps[-1].devices} device; " + "; ".join(
                     f"{t} {e:.4%}" for t, e in _alone_errors(alone, truth).items()))
    return lines


def _worst(worst: dict, term: str, got, want: float, t_step: float) -> None:
    """Keep the largest error of a term: (error / T_step, measured, truth)."""
    err = abs((got or 0.0) - want) / t_step
    if err >= worst.get(term, (-1.0,))[0]:
        worst[term] = (err, got, want)


def _alone_errors(bd, truth) -> dict:
    """Rank 1's terms from its file alone against its own truth (largest over the steps);
    without rank 0's file a wait for rank 0 is exposed communication, so those two are
    reported summed."""
    worst = {}
    for s in bd.steps:
        known = truth["ranks"]["1"].get(str(s.step))
        if not known:
            continue
        got, want = dict(s.terms), dict(known["terms"])
        got["comm + stragglers"] = got.pop("exposed_comm") + got.pop("stragglers")
        want["comm + stragglers"] = want.pop("exposed_comm") + want.pop("stragglers")
        for t, v in want.items():
            worst[t] = max(worst.get(t, 0.0), abs((got[t] or 0.0) - v) / known["t_step"])
    return worst


def main(argv):
    out = pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(tempfile.mkdtemp())
    for folder in torch_traces.write(out):
        print("\n".join(check(folder)))


if __name__ == "__main__":
    main(sys.argv)

"""The MFU breakdown's result: per-step terms, the ledger's budget, and their table and JSON
(jaxtrain.tools.mfu_breakdown computes them; jaxtrain.tools.mfu_plot draws the PNG). A term the
trace cannot measure (recompute without HLO or autograd markers) is None: "n/a" in the table,
its budget folded into kernel efficiency's, so the MFU points still add up."""
from __future__ import annotations

import dataclasses
import json
import pathlib

TERMS = ("kernel_efficiency", "recompute", "bubble", "exposed_comm", "data_wait",
         "launch_overhead", "stragglers")


@dataclasses.dataclass
class StepTerms:
    step: object
    devices: int
    t_step: float
    terms: dict                      # TERMS -> seconds (mean over devices)
    exposed_by_axis: dict
    kernel_split: dict | None        # {"gemm_below_peak", ["attention_below_peak"],
                                     #  "non_gemm", ["memcpy"]}; None: no GEMM known
    per_device: dict                 # device -> {"t_step", "busy", TERMS...}
    stragglers_on: dict = dataclasses.field(default_factory=dict)  # peer -> {seconds, cause}
    recompute_split: dict | None = None   # {"gemm", ["attention"], "non_gemm"}; None: n/a


@dataclasses.dataclass
class Budget:
    """The ledger's expected step for the run's layout: (optimistic, pessimistic) seconds."""
    gpu: str
    layout: str
    ideal: float
    terms: dict                      # TERMS -> (optimistic, pessimistic); None: folded
    by_axis: dict
    expected_mfu: tuple
    folded: float | None = None      # recompute's budget inside kernel efficiency's

    def mid(self, term: str) -> float | None:
        v = self.terms[term]
        return None if v is None else sum(v) / 2

    @property
    def step(self) -> float:
        return self.ideal + sum(self.mid(t) or 0.0 for t in TERMS)



_LABELS = {"kernel_efficiency": ("kernel efficiency", "compute - T_ideal - recompute"),
           "recompute": ("recompute", "forward replayed in the backward"),
           "bubble": ("pipeline bubble", "idle, only send/recv running"),
           "exposed_comm": ("exposed communication", "idle, a collective running"),
           "data_wait": ("data wait", "idle, host in the input pipeline"),
           "launch_overhead": ("host launch overhead", "idle otherwise"),
           "stragglers": ("stragglers", "collective waiting on a slower peer")}
_RC_LABELS = {"gemm": "GEMMs", "attention": "attention", "non_gemm": "non-GEMM kernels"}
SPLIT_LABELS = {"gemm_below_peak": "GEMMs below peak", "attention_below_peak":
                "attention below peak", "non_gemm": "non-GEMM kernels",
                "memcpy": "memory copies"}


@dataclasses.dataclass
class Breakdown:
    title: str
    files: list
    assignment: str            # how device work was matched to steps
    gpu: str
    peak: float                # FLOP/s per device
    ideal: float               # T_ideal, seconds
    steps: list                # StepTerms, complete steps in order
    budget: Budget | None
    gemms: list
    notes: list
    logged: dict               # step -> step_time_s in metrics.jsonl
    kernels: dict = dataclasses.field(default_factory=dict)   # family -> what it matched

    @property
    def mean(self) -> StepTerms:
        n = len(self.steps)
        splits = [s.kernel_split for s in self.steps if s.kernel_split is not None]
        rc = [s.recompute_split for s in self.steps if s.recompute_split is not None]
        late, by_cause = {}, {}
        for s in self.steps:
            for peer, row in s.stragglers_on.items():
                late.setdefault(peer, {"seconds": 0.0, "cause": ""})["seconds"] += \
                    row["seconds"] / n
                causes = by_cause.setdefault(peer, {})
                causes[row["cause"]] = causes.get(row["cause"], 0.0) + row["seconds"]
        for peer, causes in by_cause.items():   # the cause of most of the waiting on it
            late[peer]["cause"] = max(causes, key=causes.get)
        return StepTerms(step="mean", devices=self.steps[0].devices,
                         t_step=sum(s.t_step for s in self.steps) / n,
                         terms=_mean([s.terms for s in self.steps], n),
                         exposed_by_axis=_mean([s.exposed_by_axis for s in self.steps], n),
                         kernel_split=_mean(splits, n) if splits else None, per_device={},
                         stragglers_on=late, recompute_split=_mean(rc, n) if rc else None)

    @property
    def mfu(self) -> float:
        return self.ideal / self.mean.t_step

    def points(self) -> dict:
        """MFU points each term's excess over budget costs; they sum to planned - measured."""
        if self.budget is None:
            return {}
        scale = 100 * self.ideal / (self.mean.t_step * self.budget.step)
        m = self.mean.terms
        return {t: (m[t] - self.budget.mid(t)) * scale for t in TERMS
                if m[t] is not None and self.budget.mid(t) is not None}

    def format(self) -> str:
        m, b, pts = self.mean, self.budget, self.points()
        steps = [s.step for s in self.steps]
        head = [f"MFU breakdown of {self.title}: step{'s' if len(steps) > 1 else ''} "
                f"{', '.join(map(str, steps))} ({m.devices} device{'s' if m.devices > 1 else ''}"
                f" of {self.gpu}; steps by {self.assignment})",
                f"T_step {m.t_step * 1e3:.2f} ms = T_ideal {self.ideal * 1e3:.2f} ms + seven "
                f"terms; MFU {self.mfu:.1%} measured" + (
                    f", {self.ideal / b.step:.1%} planned (ledger, {b.layout})" if b else "")]
        logged = [f"{self.logged[s + 1] * 1e3:.2f} ms (step {s + 1})" for s in steps
                  if isinstance(s, int) and s + 1 in self.logged]
        if logged:  # the trainer logs the step with step_num=N as step N+1
            head.append("host-timed in metrics.jsonl: " + ", ".join(logged))
        rows = [("term", "budget ms", "measured ms", "excess ms", "MFU pts", "shape on the "
                 "timeline"), ("T_ideal", _ms(b.ideal if b else None), _ms(self.ideal), "", "",
                               "model FLOPs / peak")]
        for t in TERMS:
            name, rule = _LABELS[t]
            bud, got = (b.mid(t) if b else None), m.terms[t]
            rows.append((name, "n/a" if b and bud is None else _ms(bud),
                         "n/a" if got is None else _ms(got),
                         _ms(got - bud if None not in (bud, got) else None),
                         f"{pts[t]:+.2f}" if t in pts else "", rule))
            if t == "kernel_efficiency" and m.kernel_split:
                rows += [(f"  {label}", "", _ms(m.kernel_split[k]), "", "", "")
                         for k, label in SPLIT_LABELS.items() if k in m.kernel_split]
            if t == "recompute" and m.recompute_split and got:
                rows += [(f"  {label}", "", _ms(m.recompute_split[k]), "", "", "")
                         for k, label in _RC_LABELS.items() if k in m.recompute_split]
            if t == "exposed_comm":
                axes = sorted(set(m.exposed_by_axis) | set(b.by_axis if b else {}))
                rows += [(f"  {a}", _ms(sum(b.by_axis[a]) / 2 if b and a in b.by_axis else
                                        None), _ms(m.exposed_by_axis.get(a, 0.0)), "", "", "")
                         for a in axes]
            if t == "stragglers":
                rows += [(f"  waiting on {peer}", "", _ms(r["seconds"]), "", "",
                          f"late by {_cause(r['cause'])}")
                         for peer, r in sorted(m.stragglers_on.items(),
                                               key=lambda kv: -kv[1]["seconds"])]
        rows.append(("T_step", _ms(b.step if b else None), _ms(m.t_step),
                     _ms(m.t_step - b.step if b else None),
                     f"{sum(pts.values()):+.2f}" if pts else "", "planned - measured MFU"))
        out = head + [""] + _table(rows)
        if self.gemms:
            out += ["", "GEMM efficiency by shape (summed over the steps and devices above):"]
            out += _table([("shape", "count", "ms", "TFLOP/s", "of peak")] + [
                (g["shape"], str(g["count"]), _ms(g["time_s"]), f"{g['tflops']:.3g}",
                 f"{g['of_peak']:.0%}") for g in self.gemms[:8]])
        if self.kernels:
            out += ["", "Kernels by family (summed over the steps and devices above):"]
            out += _table([("family", "class", "kernels", "ms", "e.g.")] + [
                (f, r["class"], str(r["kernels"]), _ms(r["time_s"]), r["examples"][0][:60])
                for f, r in list(self.kernels.items())[:10]])
        if len(self.steps) > 1:
            out += [""] + [f"step {s.step}: T_step {s.t_step * 1e3:.2f} ms, " + ", ".join(
                f"{_LABELS[t][0]} " + ("n/a" if s.terms[t] is None else f"{s.terms[t] * 1e3:.2f}")
                for t in TERMS) for s in self.steps]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_json(self) -> dict:
        def step(s):
            return {"step": s.step, "devices": s.devices, "t_step_s": s.t_step,
                    "terms_s": s.terms, "exposed_by_axis_s": s.exposed_by_axis,
                    "kernel_split_s": s.kernel_split, "recompute_split_s": s.recompute_split,
                    "stragglers_on": s.stragglers_on,
                    "per_device": s.per_device}
        b = self.budget
        return {"title": self.title, "files": [str(f) for f in self.files],
                "steps_by": self.assignment, "gpu": self.gpu, "peak_flops": self.peak,
                "ideal_s": self.ideal, "mfu": self.mfu, "mean": step(self.mean),
                "steps": [step(s) for s in self.steps],
                "budget": None if b is None else {
                    "gpu": b.gpu, "layout": b.layout, "ideal_s": b.ideal, "step_s": b.step,
                    "terms_s": b.terms, "exposed_by_axis_s": b.by_axis,
                    "recompute_folded_s": b.folded,
                    "mfu": self.ideal / b.step, "expected_mfu": b.expected_mfu},
                "mfu_points": self.points(), "gemm_shapes": self.gemms,
                "kernel_classes": self.kernels, "notes": self.notes,
                "logged_step_time_s": self.logged}

    def plot(self, path) -> None:
        from jaxtrain.tools import mfu_plot
        mfu_plot.plot(self, path)

    def save(self, folder) -> None:
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mfu_breakdown.json").write_text(json.dumps(self.to_json(), indent=1))
        self.plot(folder / "mfu_breakdown.png")


def _mean(dicts: list, n: int) -> dict:
    """Key-wise mean over steps; a term None in any step (not measured) stays None."""
    keys = sorted({k for d in dicts for k in d})
    return {k: None if any(d.get(k, 0.0) is None for d in dicts) else
            sum(d.get(k, 0.0) for d in dicts) / n for k in keys}


def _cause(term: str) -> str:
    return _LABELS[term][0] if term in _LABELS else term


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.2f}"


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]

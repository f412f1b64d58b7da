"""The MFU breakdown's result: per-step terms, the ledger's budget, and their table, JSON and
stacked-bar PNG (jaxtrain.tools.mfu_breakdown computes them)."""
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
    kernel_split: dict | None        # {"gemm_below_peak", "non_gemm"}; None: no GEMM known
    per_device: dict                 # device -> {"t_step", "busy", TERMS...}



@dataclasses.dataclass
class Budget:
    """The ledger's expected step for the run's layout: (optimistic, pessimistic) seconds."""
    gpu: str
    layout: str
    ideal: float
    terms: dict
    by_axis: dict
    expected_mfu: tuple

    def mid(self, term: str) -> float:
        return sum(self.terms[term]) / 2

    @property
    def step(self) -> float:
        return self.ideal + sum(self.mid(t) for t in TERMS)



_LABELS = {"kernel_efficiency": ("kernel efficiency", "compute - T_ideal - recompute"),
           "recompute": ("recompute", "bwd GEMMs - 2 x fwd GEMMs"),
           "bubble": ("pipeline bubble", "idle, only send/recv running"),
           "exposed_comm": ("exposed communication", "idle, a collective running"),
           "data_wait": ("data wait", "idle, host in the input pipeline"),
           "launch_overhead": ("host launch overhead", "idle otherwise"),
           "stragglers": ("stragglers", "collective waiting on a slower peer")}


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

    @property
    def mean(self) -> StepTerms:
        n = len(self.steps)
        avg = lambda dicts: {k: sum(d.get(k, 0.0) for d in dicts) / n  # noqa: E731
                             for k in sorted({k for d in dicts for k in d})}
        splits = [s.kernel_split for s in self.steps if s.kernel_split is not None]
        return StepTerms(step="mean", devices=self.steps[0].devices,
                         t_step=sum(s.t_step for s in self.steps) / n,
                         terms=avg([s.terms for s in self.steps]),
                         exposed_by_axis=avg([s.exposed_by_axis for s in self.steps]),
                         kernel_split=avg(splits) if splits else None, per_device={})

    @property
    def mfu(self) -> float:
        return self.ideal / self.mean.t_step

    def points(self) -> dict:
        """MFU points each term's excess over budget costs; they sum to planned - measured."""
        if self.budget is None:
            return {}
        scale = 100 * self.ideal / (self.mean.t_step * self.budget.step)
        return {t: (self.mean.terms[t] - self.budget.mid(t)) * scale for t in TERMS}

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
            bud = b.mid(t) if b else None
            rows.append((name, _ms(bud), _ms(m.terms[t]),
                         _ms(m.terms[t] - bud if bud is not None else None),
                         f"{pts[t]:+.2f}" if pts else "", rule))
            if t == "kernel_efficiency" and m.kernel_split:
                rows += [("  GEMMs below peak", "", _ms(m.kernel_split["gemm_below_peak"]), "",
                          "", ""), ("  non-GEMM kernels", "", _ms(m.kernel_split["non_gemm"]),
                                    "", "", "")]
            if t == "exposed_comm":
                axes = sorted(set(m.exposed_by_axis) | set(b.by_axis if b else {}))
                rows += [(f"  {a}", _ms(sum(b.by_axis[a]) / 2 if b and a in b.by_axis else
                                        None), _ms(m.exposed_by_axis.get(a, 0.0)), "", "", "")
                         for a in axes]
        rows.append(("T_step", _ms(b.step if b else None), _ms(m.t_step),
                     _ms(m.t_step - b.step if b else None),
                     f"{sum(pts.values()):+.2f}" if pts else "", "planned - measured MFU"))
        out = head + [""] + _table(rows)
        if self.gemms:
            out += ["", "GEMM efficiency by shape (summed over the steps and devices above):"]
            out += _table([("shape", "count", "ms", "TFLOP/s", "of peak")] + [
                (g["shape"], str(g["count"]), _ms(g["time_s"]), f"{g['tflops']:.3g}",
                 f"{g['of_peak']:.0%}") for g in self.gemms[:8]])
        if len(self.steps) > 1:
            out += [""] + [f"step {s.step}: T_step {s.t_step * 1e3:.2f} ms, " + ", ".join(
                f"{_LABELS[t][0]} {s.terms[t] * 1e3:.2f}" for t in TERMS) for s in self.steps]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_json(self) -> dict:
        def step(s):
            return {"step": s.step, "devices": s.devices, "t_step_s": s.t_step,
                    "terms_s": s.terms, "exposed_by_axis_s": s.exposed_by_axis,
                    "kernel_split_s": s.kernel_split, "per_device": s.per_device}
        b = self.budget
        return {"title": self.title, "files": [str(f) for f in self.files],
                "steps_by": self.assignment, "gpu": self.gpu, "peak_flops": self.peak,
                "ideal_s": self.ideal, "mfu": self.mfu, "mean": step(self.mean),
                "steps": [step(s) for s in self.steps],
                "budget": None if b is None else {
                    "gpu": b.gpu, "layout": b.layout, "ideal_s": b.ideal, "step_s": b.step,
                    "terms_s": b.terms, "exposed_by_axis_s": b.by_axis,
                    "mfu": self.ideal / b.step, "expected_mfu": b.expected_mfu},
                "mfu_points": self.points(), "gemm_shapes": self.gemms, "notes": self.notes,
                "logged_step_time_s": self.logged}

    def plot(self, path) -> None:
        """Stacked bars: the ledger's budget next to the measured step (a negative term, kernel
        efficiency on a chip faster than its table peak, is drawn as zero)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        bars = [("measured", self.ideal, self.mean.terms)]
        if self.budget is not None:
            bars.insert(0, ("ledger budget", self.budget.ideal,
                            {t: self.budget.mid(t) for t in TERMS}))
        fig, ax = plt.subplots(figsize=(6, 5))
        colors = plt.get_cmap("tab10").colors
        for x, (name, ideal, terms) in enumerate(bars):
            bottom = 0.0
            for i, (t, v) in enumerate([("T_ideal", ideal)] + [(t, terms[t]) for t in TERMS]):
                v = max(v, 0.0) * 1e3
                ax.bar(x, v, bottom=bottom, color=colors[i % 10],
                       label=(_LABELS.get(t, (t,))[0] if x == len(bars) - 1 else None))
                bottom += v
        ax.set_xticks(range(len(bars)), [b[0] for b in bars])
        ax.set_ylabel("ms per step")
        ax.set_title(f"MFU {self.mfu:.1%} measured" + (
            f", {self.ideal / self.budget.step:.1%} planned" if self.budget else ""))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def save(self, folder) -> None:
        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mfu_breakdown.json").write_text(json.dumps(self.to_json(), indent=1))
        self.plot(folder / "mfu_breakdown.png")


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.2f}"


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]

"""The breakdown's PNG: what each step is made of, readable however far it is from the budget.

Left, one stacked bar per step (the ledger's budget, the measured mean), each drawn as shares
of its own T_step and labelled with its milliseconds, so a measured step many times the budget
does not flatten the budget into a sliver; the measured kernel efficiency is drawn as its
parts (GEMMs below peak, attention below peak, non-GEMM kernels, memory copies). Right, each
term's budget and measured milliseconds side by side on one axis, logarithmic when they span
more than a factor of 30. A negative part (a chip faster than its table peak) is drawn as zero;
a term not measured (n/a) is left out.
"""
from __future__ import annotations

from jaxtrain.tools.mfu_report import _LABELS, SPLIT_LABELS, TERMS

_LOG_ABOVE = 30.0


def bars(bd) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """[(bar name, its T_step, [(segment label, seconds drawn: negative parts as 0)])]."""
    m = bd.mean
    rows = []
    if bd.budget is not None:
        b = bd.budget
        rows.append(("ledger budget", [("T_ideal", b.ideal)] + [
            (_LABELS[t][0], b.mid(t)) for t in TERMS if b.mid(t) is not None]))
    measured = [("T_ideal", bd.ideal)]
    for t in TERMS:
        if m.terms[t] is None:
            continue
        if t == "kernel_efficiency" and m.kernel_split:
            measured += [(f"kernel eff.: {SPLIT_LABELS[k]}", m.kernel_split[k])
                         for k in SPLIT_LABELS if k in m.kernel_split]
        else:
            measured.append((_LABELS[t][0], m.terms[t]))
    rows.append(("measured", measured))
    steps = ([bd.budget.step] if bd.budget is not None else []) + [m.t_step]
    return [(name, t_step, [(label, max(v, 0.0)) for label, v in segs])
            for (name, segs), t_step in zip(rows, steps)]


def plot(bd, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.5),
                                      gridspec_kw={"width_ratios": [1, 1.3]})
    drawn = bars(bd)
    terms = ["T_ideal"] + [_LABELS[t][0] for t in TERMS]
    colors = dict(zip(terms, plt.get_cmap("tab10").colors))
    hatches = dict(zip(SPLIT_LABELS.values(), ("", "//", "..", "xx")))
    for x, (name, _, segs) in enumerate(drawn):
        total = sum(v for _, v in segs) or 1.0
        bottom = 0.0
        for label, seconds in segs:
            share = seconds / total
            part = label.removeprefix("kernel eff.: ")
            color = colors[_LABELS["kernel_efficiency"][0] if part != label else label]
            left.bar(x, share * 100, bottom=bottom, color=color, width=0.6,
                     hatch=hatches.get(part, ""), edgecolor="white", linewidth=0.5,
                     label=label if label not in left.get_legend_handles_labels()[1] else None)
            if share >= 0.04:
                left.text(x, bottom + share * 50, f"{seconds * 1e3:.3g} ms",
                          ha="center", va="center", fontsize=7)
            bottom += share * 100
    left.set_xticks(range(len(drawn)), [f"{n}\nT_step {t * 1e3:.3g} ms" for n, t, _ in drawn])
    left.set_ylabel("% of its own step")
    left.set_ylim(0, 100)
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    _terms_panel(right, bd)
    fig.suptitle(f"MFU {bd.mfu:.1%} measured" + (
        f", {bd.ideal / bd.budget.step:.1%} planned" if bd.budget else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _terms_panel(ax, bd) -> None:
    m, b = bd.mean, bd.budget
    names = ["T_ideal"] + [_LABELS[t][0] for t in TERMS]
    got = [bd.ideal] + [m.terms[t] for t in TERMS]
    want = [b.ideal if b else None] + [b.mid(t) if b else None for t in TERMS]
    ys = range(len(names))
    positive = [v * 1e3 for v in got + want if v is not None and v > 0]
    if positive and max(positive) / min(positive) > _LOG_ABOVE:
        ax.set_xscale("log")
    floor = min(positive, default=1.0) / 2
    for y, g, w in zip(ys, got, want):   # zero (or negative) bars are left out, labelled
        if w is not None and w > 0:
            ax.barh(y + 0.2, w * 1e3, height=0.38, color="tab:gray",
                    label="budget" if y == 0 else None)
        if g is None:
            ax.text(floor, y - 0.2, "n/a (in kernel efficiency)", va="center", fontsize=7)
            continue
        if g > 0:
            ax.barh(y - 0.2, g * 1e3, height=0.38, color="tab:blue",
                    label="measured" if y == 0 else None)
        ax.text(max(g * 1e3, floor), y - 0.2, f" {g * 1e3:.3g}", va="center", fontsize=7)
    ax.set_xlim(left=floor if ax.get_xscale() == "log" else 0)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step" + (" (log)" if ax.get_xscale() == "log" else ""))
    ax.legend(fontsize=8, loc="lower right")

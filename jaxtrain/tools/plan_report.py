"""The planner's table and text (`python -m jaxtrain.plan`'s output); the search is plan.py's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxtrain.ledger import GB, GiB
from jaxtrain.ledger.summary import describe

if TYPE_CHECKING:  # plan.py imports this module
    from jaxtrain.tools.plan import Candidate, Plan


_COLUMNS = ("#", "", "tensor", "stage", "data", "ctx", "ep", "v", "mb", "m", "bubble",
            "static", "act none/sel/full", "remat", "total", "fits", "DP GB/s", "TP GB/s",
            "PP GB/s", "FSDP GB/s", "CP GB/s", "EP GB/s", "ideal s", "MFU")


def _remat_short(label: str) -> str:
    """none, selective, full, or the MoE modules a selective choice adds to core_attn."""
    head, _, rest = label.partition("(")
    extra = [m for m in rest.rstrip(")").split(",") if m and m != "core_attn"]
    return "+".join(extra) if head == "selective" and extra else head


def _row(i: int, c: Candidate) -> list[str]:
    e, L = c.estimate, c.estimate.layout
    a = e.activation_bytes_by_remat
    mark = {"recommended": "*", "configured": "c", "recommended+configured": "*c"}.get(c.role, "")

    def cm(k):
        return f"{e.comm_bytes[k] / GB:.1f}/{e.comm_seconds[k]:.2f}" if e.comm_bytes[k] else "-"
    return [str(i), mark, str(L.tensor), str(L.stage), str(L.data), str(L.context),
            f"{L.expert}{'f' if L.folded else ''}", str(L.virtual_stages), str(L.micro_batch),
            str(L.microbatches), f"{e.bubble:.1%}",
            f"{e.static_bytes / GiB:.1f}",
            "/".join(f"{a[k] / GiB:.1f}" for k in ("none", "selective", "full")),
            _remat_short(e.remat), f"{e.total_bytes / GiB:.1f}", "yes" if e.fits else "NO",
            cm("dp"), cm("tp"), cm("pp"), cm("fsdp"), cm("cp"), cm("ep"), f"{e.ideal_step_s:.2f}",
            f"{e.expected_mfu[0]:.0%}-{e.expected_mfu[1]:.0%}"]


def format_table(candidates: list) -> str:
    rows = [list(_COLUMNS)] + [_row(i, c) for i, c in enumerate(candidates)]
    widths = [max(len(r[j]) for r in rows) for j in range(len(_COLUMNS))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows)


def format_plan(p: Plan) -> str:
    e0 = p.candidates[0].estimate
    head = (f"{p.n_devices} x {p.gpu.name}: {e0.params_total / 1e9:.2f} B params, seq "
            f"{e0.seq_len}, global batch {e0.global_batch}; memory in GiB (budget "
            f"{e0.budget_bytes / GiB:.1f} = 90% of {p.gpu.hbm_bytes / GiB:.0f}), comm in GB per "
            "device per step / seconds on nominal links; ep 8f: folded over the tensor ranks")
    out = [head, "", "derivation:"] + [f"  {w}" for w in p.walk] + ["", format_table(p.candidates),
                                                                     ""]
    rec = p.recommended
    if rec is None:
        out.append("nothing fits: " + "; ".join(f"#{i} {c.why}"
                                                for i, c in enumerate(p.candidates)))
        return "\n".join(out)
    i = p.candidates.index(rec)
    out += [f"recommended (#{i}): {rec.why}", describe(rec.estimate), "", "why the others lose:"]
    out += [f"  #{j} {c.estimate.layout.short()} [{c.estimate.remat}]"
            f"{' (configured)' if c.role == 'configured' else ''}: {c.why}"
            for j, c in enumerate(p.candidates) if c is not rec]
    return "\n".join(out)

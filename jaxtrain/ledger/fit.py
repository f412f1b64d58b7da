"""Whether a layout fits its GPU, said in one line: the terms against the budget and, when one
overflows, what to try for it (estimate.Estimate.reason)."""
from __future__ import annotations

from jaxtrain.config import Config, RematConfig
from jaxtrain.ledger import experts
from jaxtrain.ledger.hardware import GiB
from jaxtrain.ledger.layout import Layout

_HINTS = {"static": "more tensor/stage parallelism, ZeRO-1 or FSDP",
          "activations": "more recompute, a smaller micro-batch, more tensor/stage or context "
                         "parallelism",
          "reserve": "a smaller micro-batch or more tensor parallelism (vocab-parallel logits)"}


def hint(cfg: Config, layout: Layout, remat: RematConfig, overflow: str) -> str:
    """What to try for the overflowing term: recompute only where some is left; with expert
    ranks and dropless buffers (top_k x expert rows per token) the buffers first."""
    hint = _HINTS.get(overflow, "")
    if overflow == "activations" and remat.granularity == "full":
        hint = hint.replace("more recompute, ", "")
    if (overflow in ("activations", "reserve") and layout.expert > 1
            and experts.buffer_rows_per_token(cfg, layout) > experts.rows_per_token(cfg)):
        hint = (f"capacity-sized expert buffers (model.moe.dispatch=capacity, "
                f"pad_to_capacity=true: the dropless ones hold top_k x expert = "
                f"{experts.buffer_rows_per_token(cfg, layout):.0f} rows per token) or a "
                f"smaller parallel.expert; or {hint}")
    return hint


def reason(terms, total, budget, gpu, overflow, hint: str = "") -> str:
    line = (f"static {terms['static'] / GiB:.1f} + activations {terms['activations'] / GiB:.1f} "
            f"+ reserve {terms['reserve'] / GiB:.1f} = {total / GiB:.1f} GiB")
    cap = (f"{budget / GiB:.1f} GiB budget (90% of {gpu.hbm_bytes / GiB:.0f} GiB "
           f"{gpu.name})")
    if not overflow:
        return f"fits: {line} <= {cap}"
    alone = terms[overflow] > budget
    head = f"{overflow} alone exceed" if alone else f"{overflow} overflow"
    return f"{head}: {line} > {cap}; try {hint}"

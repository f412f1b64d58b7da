"""An estimate in a few lines: what train.py, the dry run and the planner print."""
from __future__ import annotations

from jaxtrain.ledger import pipeline
from jaxtrain.ledger.estimate import COMM_KINDS, Estimate
from jaxtrain.ledger.hardware import GB, GiB


def describe(est: Estimate) -> str:
    """A few lines for train.py: the layout, memory against budget, comm, FLOPs and MFU range."""
    L = est.layout
    sched = (f", {L.schedule} v={L.virtual_stages}" if L.stage > 1 else "")
    lines = [
        f"layout: {L.short()} on {L.n_devices} x {est.gpu.name}{sched}; bubble {est.bubble:.1%}",
        f"params: {est.params_total / 1e9:.3f} B ({est.params_non_embedding / 1e9:.3f} B without "
        f"input embedding); {est.params_local / 1e9:.3f} B per device, "
        f"{est.bytes_per_param:.2f} bytes each",
        f"memory/device: {est.reason} [remat {est.remat}{', flash' if est.flash else ''}]",
        "comm/device/step: " + (", ".join(
            f"{k.upper()} {est.comm_bytes[k] / GB:.2f} GB ({est.comm_seconds[k]:.3f} s "
            f"{est.comm_links[k]})" for k in COMM_KINDS if est.comm_bytes[k]) or "none"),
        f"flops/token: model {est.model_flops_per_token:.4g}, with recompute "
        f"{est.hfu_flops_per_token:.4g}; ideal step {est.ideal_step_s:.3f} s, expected "
        f"{est.expected_step_s[0]:.3f}-{est.expected_step_s[1]:.3f} s, MFU "
        f"{est.expected_mfu[0]:.0%}-{est.expected_mfu[1]:.0%}",
    ]
    ex = est.executor
    if ex is not None:
        mib = est.chunk_input_bytes / 2 ** 20
        sets = est.activation_bytes - est.pipeline_buffer_bytes
        lines.insert(1, (
            f"pipeline executor: {ex.steps} lock-step steps (idle {est.lockstep_bubble:.1%}), "
            f"{ex.sends} sends of {mib:.4g} MiB; {ex.stash_buffer} + 2 stashed "
            f"{ex.chunk_layers}-layer chunk residual sets {sets / GiB:.2f} GiB; buffers "
            f"{ex.inbox_buffer} inbox + {ex.grad_buffer} cotangent + "
            f"{pipeline.RECEIVE_BUFFERS} receive x {mib:.4g} MiB"))
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)

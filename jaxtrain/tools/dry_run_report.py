"""The dry run's report (jaxtrain.tools.dry_run says what is compared): as text, the ledger's
plan, the compiled layout and its changes, then memory, communication and FLOPs per device,
the ledger next to the compiled step, and what only a GPU program has; as JSON for scripts.
"""
from __future__ import annotations

from jaxtrain.ledger.hardware import GB, GiB
from jaxtrain.ledger.pipeline import RECEIVE_BUFFERS
from jaxtrain.tools import hlo
from jaxtrain.tools.device_plan import format_planned
from jaxtrain.tools.dry_run import DryRun, branch_matmul_flops


def format_report(r: DryRun) -> str:
    """The report as text: the plan, what was compiled, memory, communication, FLOPs, and a
    GPU program's report when there is one."""
    out = [format_planned(r.planned, r.config_name), ""]
    out += _layout_lines(r) + _memory_lines(r) + _comm_lines(r) + _flops_lines(r)
    if r.gpu_report is not None:
        out.append(r.gpu_report.format())
    return "\n".join(out)


def _human_bytes(x: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.0f} B"


def _layout_lines(r: DryRun) -> list[str]:
    """What was compiled: the layout, its changes from the plan, the pipeline, the timings."""
    e, L, ex = r.estimate, r.estimate.layout, r.executor
    out = [f"dry run on {r.n_devices} x {r.device_kind}: {L.short()}, global_batch "
           f"{r.cfg.train.global_batch}, seq {r.cfg.train.seq_len}"]
    if r.changes:
        out.append("  scaled from the planned layout to the present devices (model unchanged):")
        out += [f"    {c}" for c in r.changes]
    else:
        out.append("  the configured layout, unchanged")
    if ex is not None:
        out.append(
            f"  pipelined: {ex.schedule}, {ex.stages} stages x {ex.virtual_stages} virtual "
            f"stages of {ex.chunk_layers} layers, {ex.microbatches} microbatches; lock-step "
            f"table of {ex.steps} steps (F in {ex.f_steps}, B in {ex.b_steps}); bubble "
            f"{e.bubble:.1%} (Megatron), {e.lockstep_bubble:.1%} (the table)")
    if r.attention:
        out.append(f"  attention core: {r.attention[0]} ({r.attention[1]})")
    if r.grouped_gemm:
        out.append(f"  experts' grouped GEMM: {r.grouped_gemm[0]} ({r.grouped_gemm[1]})")
    out.append(f"  lowered in {r.lower_s:.1f} s, compiled in {r.compile_s:.1f} s from "
               "abstract parameters: nothing allocated")
    return out


def _memory_lines(r: DryRun) -> list[str]:
    """Memory per device: the ledger's terms next to memory_analysis()."""
    e, mem, ex = r.estimate, r.memory, r.executor
    lm = r.ledger_memory()
    big = max([v for v in (*lm.values(), *mem.values()) if v] or [0])
    unit, scale = ("GiB", GiB) if big >= GiB else ("MiB", 2 ** 20)
    out = ["", f"memory per device, {unit}   ledger ({e.gpu.name} formulas, remat {e.remat}, "
           f"{'flash' if e.flash else 'XLA attention: s x s scores'})   vs   compiled "
           "(memory_analysis)"]
    rows = [("state: fp32 master + Adam m, v", lm["state"], mem["argument_bytes"],
             "arguments (state + batch)"),
            ("bf16 params + grads + activations + reserve", lm["temp"], mem["temp_bytes"],
             "temporaries"),
            ("  the same without the GPU workspace", lm["temp_no_workspace"], None,
             "(static buffers hold no NCCL/cuBLAS workspace)"),
            ("total", lm["total"], mem["total_bytes"], "arguments + outputs + temp - donated")]
    w = max(len(row[0]) for row in rows)
    out.append(f"  {'':{w}}  {'ledger':>10}  {'compiled':>10}")
    num = lambda x: "" if x is None else f"{x / scale:.2f}"  # noqa: E731
    out += [f"  {a:{w}}  {num(b):>10}  {num(c):>10}   {d}" for a, b, c, d in rows]
    acts = f"activations {e.activation_bytes / scale:.2f}"
    if ex is not None:
        sets = e.activation_bytes - e.pipeline_buffer_bytes
        acts += (f" (the executor's {ex.stash_buffer} + 2 stashed {ex.chunk_layers}-layer "
                 f"chunk residual sets {sets / scale:.2f}; {ex.buffers} chunk inputs of "
                 f"{_human_bytes(e.chunk_input_bytes)}: {ex.inbox_buffer} inbox, "
                 f"{ex.grad_buffer} cotangent, {RECEIVE_BUFFERS} receive)")
    out.append(f"  ledger terms ({unit}): static {e.static_bytes / scale:.2f} "
               f"({e.bytes_per_param:.1f} B/param), {acts}, reserve "
               f"{e.reserve_bytes / scale:.2f} (logits + workspace); {e.reason}")
    out.append(f"  static state per term ({unit})  ledger  compiled")
    for term, ledger in e.static_breakdown.items():
        compiled = r.state_terms.get(term) if term != "other" else None
        where = "argument" if term in r.state_terms and term != "other" else "in temporaries"
        out.append(f"    {term:<22}  {num(ledger):>6}  {num(compiled) or where:>8}")
    return out


def axis_causes(r: DryRun) -> dict[tuple, str]:
    """axes -> why the compiled bytes are more than 10% off the ledger's, for each axes that
    are: what is known to differ, else that nothing explains it (a defect to find)."""
    out = {}
    for a, row in r.comm_by_axes().items():
        if row.ledger is None:
            out[a] = "no ledger term for these axes"
            continue
        if abs(row.off) <= 0.10:
            continue
        f32 = [c for c in r.collectives if c.axes == a and c.shape.lstrip("(").startswith("f32")]
        if (r.device_kind == "cpu" and r.cfg.model.compute_dtype != "float32" and
                sum(c.wire_bytes_per_step for c in f32) > 0.5 * (row.every_branch or 0)):
            out[a] = f"XLA:CPU carries {r.cfg.model.compute_dtype} as f32 (2x)"
        else:
            out[a] = "not explained: the collectives table below lists the ops"
    return out


def _comm_lines(r: DryRun) -> list[str]:
    """Communication per device per step by mesh axes, the ledger next to the wire bytes the
    compiled step executes, then the compiled collectives' table."""
    ex, comm, causes = r.executor, r.comm_by_axes(), axis_causes(r)
    big = max([v for row in comm.values() for v in row if v] or [0])
    unit, scale = next((u, f) for u, f in (("GB", GB), ("MB", 1e6), ("kB", 1e3), ("B", 1))
                       if big >= 0.1 * f or f == 1)
    out = ["", f"communication per device per step, {unit} (ring wire bytes; compiled: what a "
           "device executes" + (", the pipeline ranks' mean" if ex is not None else "") + ")"]
    label = lambda a: "?" if a is None else (",".join(a) or "-")  # noqa: E731
    gb = lambda x: "-" if x is None else f"{x / scale:10.3f}"  # noqa: E731
    kinds = {("tensor",): "TP", ("data",): "DP", ("fsdp",): "FSDP", ("context",): "CP",
             ("data", "context"): "DP", ("stage",): "PP + vocab",
             ("data", "expert"): "DP (dense params)",
             ("data", "expert", "context"): "DP (dense params)"}
    out.append(f"  {'axes':22}  {'ledger':>10}  {'compiled':>10}  {'off':>6}")
    for a, row in comm.items():
        off = "" if row.off is None else f"{row.off:+6.1%}"
        note = kinds.get(a, "") + (f"; {causes[a]}" if a in causes else "")
        out.append(f"  {label(a):22}  {gb(row.ledger):>10}  {gb(row.executed):>10}  "
                   f"{off:>6}   {note}")
        if a == ("stage",) and ex is not None:
            out += _stage_comm_lines(r, gb)
    if not comm:
        out.append("  none (a single device, or nothing sharded)")
    if ex is not None:
        out.append(f"  pipelined, the HLO counts every branch of the {ex.steps} steps "
                   f"({ex.forward_passes} forward + {ex.backward_passes} backward chunk passes "
                   "a rank runs): " + ", ".join(
                       f"{label(a)} {gb(row.every_branch).strip()}" for a, row in comm.items()
                       if row.every_branch))
    return out + ["", "compiled collectives, every branch (CPU all-reduce-then-slice counted as "
                  "reduce-scatter):",
                  hlo.format_summary(r.collectives) if r.collectives else "  none", ""]


def _stage_comm_lines(r: DryRun, gb) -> list[str]:
    """The stage axis by kind: the executor's permutes and what else crosses stages."""
    e, ex, mib = r.estimate, r.executor, _human_bytes
    out = []
    for (kind, in_loop), (wire, runs, payload, shape, payload_total) in sorted(
            r.stage_comm().items()):
        if kind == "collective-permute" and in_loop:
            what = (f"{runs} x {mib(payload)}: activations right, cotangents left (ledger "
                    f"PP: {ex.steps} steps x 2 sends x {mib(e.chunk_input_bytes)})")
            if shape.startswith("f32") and r.cfg.model.compute_dtype != "float32":
                what += f"; XLA:CPU carries {r.cfg.model.compute_dtype} as f32 (2x)"
        elif in_loop:
            what = f"{runs} runs inside the schedule loop"
        elif kind in ("all-reduce", "reduce-scatter", "all-gather"):
            what = (f"after the loop, {mib(payload_total)}: the loss, the embedding/head "
                    f"gradients to their masters' stage shards and the compute copy gathered "
                    f"(ledger vocab {gb(e.comm_bytes['vocab']).strip()})")
        else:
            what = (f"outside the loop, {mib(payload_total)}: layers moved between their "
                    "stored order and the chunks'")
        out.append(f"    {kind:20}  {'':>10}  {gb(wire):>10}   {what}")
    return out


def _flops_lines(r: DryRun) -> list[str]:
    """Matmul FLOPs per device per step: the ledger's against what the compiled step executes;
    the every-branch and XLA counts as detail."""
    e, ex, D = r.estimate, r.executor, r.n_devices
    ledger = e.hfu_flops_per_step_full_attn / D   # the full causal square, as counted below
    executed = r.executed.mean
    out = [f"FLOPs per device per step: ledger {ledger:.4g} (model "
           f"{e.model_flops_per_step_full_attn / D:.4g} + recompute), compiled {executed:.4g} "
           f"executed ({executed / ledger - 1:+.1%}; GEMMs, dots and attention kernels as their "
           "dense matmuls, the full square)"]
    if ex is not None:
        out.append("  executed per pipeline rank (its F and B branches as its table takes "
                   "them): " + ", ".join(f"{f:.4g}" for f in r.executed.per_rank))
        out.append(f"  every branch of the {ex.steps} steps, as the HLO counts them: "
                   f"{r.executed.every_branch:.4g} (the table predicts "
                   f"{branch_matmul_flops(r.cfg, e.layout, ex):.4g})")
    xla = "n/a" if r.xla_flops is None else f"{r.xla_flops:.4g}"
    out.append(f"  GEMMs and dots alone, every branch: {r.matmul_flops:.4g}; XLA cost_analysis "
               f"{xla} (counts each scanned loop body once)")
    return out


def report_json(r: DryRun) -> dict:
    """The report for scripts: memory terms, collective bytes per kind and mesh axis, matmul
    FLOPs, and what only a GPU program has (kernels, overlap)."""
    axes = lambda a: None if a is None else list(a)  # noqa: E731
    e, lm, causes = r.estimate, r.ledger_memory(), axis_causes(r)
    wire = hlo.summary(r.collectives, wire=True)
    out = {
        "config": r.config_name, "devices": r.n_devices, "device": r.device_kind,
        "layout": e.layout.short(), "changes": list(r.changes),
        "attention": dict(zip(("core", "why"), r.attention)),
        "grouped_gemm": dict(zip(("impl", "why"), r.grouped_gemm)),
        "compiled": {"memory": r.memory, "state_terms": dict(r.state_terms),
                     "matmul_flops": r.matmul_flops,
                     "executed_matmul_flops": {
                         "per_rank": list(r.executed.per_rank),
                         "mean": r.executed.mean, "max": r.executed.max,
                         "every_branch": r.executed.every_branch},
                     "xla_flops": r.xla_flops,
                     "collectives": [{"kind": k, "axes": axes(a), "payload_bytes": v,
                                      "wire_bytes": wire[(k, a)]}
                                     for (k, a), v in sorted(hlo.summary(r.collectives).items(),
                                                             key=lambda kv: str(kv[0]))]},
        "ledger": {"memory": lm, "static_bytes": e.static_bytes,
                   "static_terms": dict(e.static_breakdown),
                   "activation_bytes": e.activation_bytes,
                   "model_flops_per_device": e.model_flops_per_step_full_attn / r.n_devices,
                   "hfu_flops_per_device": e.hfu_flops_per_step_full_attn / r.n_devices},
        "flops_off": r.executed.mean / (e.hfu_flops_per_step_full_attn / r.n_devices) - 1,
        "comm_by_axes": [{"axes": axes(a), "ledger_bytes": row.ledger,
                          "compiled_wire_bytes": row.executed,
                          "every_branch_wire_bytes": row.every_branch, "off": row.off,
                          "cause": causes.get(a)}
                         for a, row in r.comm_by_axes().items()],
        "lower_s": r.lower_s, "compile_s": r.compile_s,
    }
    if r.gpu_report is not None:
        out["gpu"] = r.gpu_report.to_json()
    return out

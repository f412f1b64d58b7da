"""`--dry-run`: compile the real train step from abstract parameters and set what XLA reports
next to what the ledger predicts for the same layout.

    python train.py --config configs/llama70b.py --dry-run [--parallel.tensor=4 ...]

The layout compiled is the configured one when the present devices can run it, else scaled to
them, every change reported with its reason (jaxtrain.tools.device_plan: how, and for which
device count the ledger's plan printed first is made). With stage > 1 the compiled step is the
real pipelined one (the step dispatches to executors/pipeline.py: the lock-step shard_map
executor). The report's text and JSON are written by jaxtrain.tools.dry_run_report.

What is compared, per device (fake CPU devices report memory_analysis() per device), against
the ledger's estimate on the compiled layout (every pipeline rank holds the same; with stages
the ledger models the lock-step executor itself, see jaxtrain.ledger.pipeline):
- memory: the compiled step's arguments (fp32 master params + Adam m, v, the batch) against the
  ledger's 12 optimizer bytes per parameter; its temporaries (activations, the compute-dtype
  parameter copy, fp32 gradients and accumulators, logits, workspace) against the ledger's
  bf16 copy + gradients + activations + reserve; the totals.
- communication: ring wire bytes per mesh axis per step of the compiled collectives (CPU's
  all-reduce-then-slice counted as the reduce-scatter a GPU emits) against the ledger's
  volumes, which use the same convention. The stage axis is split by kind: the executor's
  collective-permutes against the ledger's PP sends; the rest (the all-reduce of the
  replicated embedding and head gradients, parameter resharding) listed with what it is.
  The HLO reader counts a conditional's collectives in every table step, where the ledger
  counts the chunk passes the executor runs; the output gives the factor.
- FLOPs: the ledger's model and hardware FLOPs per device against the compiled matmuls (loops
  counted by trip count) and XLA's cost_analysis (which counts a scanned layer's body once).
  Pipelined, every table step's F and B branches (a B recomputes its chunk) and the head are
  counted, as the HLO reader does, which predicts the compiled count.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxtrain.config import Config, ConfigError, padded_vocab
from jaxtrain.ledger import Estimate, Executor, Gpu, Layout, LayoutError, estimate, get_gpu
from jaxtrain.ledger.layout import layout_from_config
from jaxtrain.ledger.memory import layer_params_local, workspace_bytes
from jaxtrain.tools.device_plan import Planned, plan_devices, scale_to_devices

if TYPE_CHECKING:
    from jaxtrain.tools import gpu_program, pipeline_flops


def branch_matmul_flops(cfg: Config, layout: Layout, ex: Executor) -> float:
    """Matmul FLOPs per device per step as the HLO reader counts the executor: every branch of
    every table step (remat none), i.e. the F switch's two chunk forwards (from the inbox, from
    the embedding) and the B switch's stashed backwards (twice a forward; a middle stage's and
    virtual stage 0's) and the last stage's forward + backward + head forward and backward."""
    m, t, seq = cfg.model, layout.tensor, cfg.train.seq_len
    tokens = layout.micro_batch * seq / layout.context
    layer = (2 * layer_params_local(cfg, t)
             + 4 * m.num_heads * m.resolved_head_dim * seq / t)
    chunk = tokens * ex.chunk_layers * layer
    head = tokens * 2 * m.hidden_size * padded_vocab(m.vocab_size, t) / t
    middle = 2 if ex.stages * ex.virtual_stages > 2 else 0
    return ex.steps * ((2 + middle + 2 + 3) * chunk + 3 * head)


# ----------------------------------------------------------------------------- compiling

@dataclasses.dataclass
class DryRun:
    """A compiled step next to the ledger's prediction for its layout."""
    config_name: str
    cfg: Config                  # what was compiled (scaled)
    planned: Planned
    changes: list
    estimate: Estimate           # the ledger on the compiled layout
    memory: dict                 # hlo.memory of the compiled step (per device)
    collectives: list            # hlo.Collective, CPU all-reduce-then-slice relabelled
    matmul_flops: float          # per device, loops counted by trip count
    xla_flops: float | None      # cost_analysis(): a loop body counts once
    lower_s: float
    compile_s: float
    device_kind: str
    gpu_report: "gpu_program.GpuReport | None" = None   # with a GPU target
    executed: "pipeline_flops.ExecutedFlops | None" = None  # pipelined: per rank, as run
    attention: tuple = ()        # (the attention core compiled, why: attention.choose)

    @property
    def n_devices(self) -> int:
        return self.estimate.n_devices

    @property
    def executor(self) -> Executor | None:
        """The ledger's pipeline executor (its lock-step table); None without stages."""
        return self.estimate.executor

    def ledger_memory(self) -> dict[str, float]:
        e = self.estimate
        s = e.static_breakdown
        temps = sum(v for k, v in s.items() if k != "optimizer") + e.activation_bytes \
            + e.reserve_bytes
        return {"state": s["optimizer"], "temp": temps, "total": e.total_bytes,
                "temp_no_workspace": temps - workspace_bytes(self.cfg)}

    def hlo_pass_factor(self) -> float:
        """Compiled over ledger layer traffic (TP, FSDP) from counting alone: the HLO reader
        counts a chunk's collectives in every branch of every table step (3 forward passes:
        two F branches and the last stage's B; 2 or 3 backward ones), the ledger the passes a
        rank runs. 1 without stages."""
        ex = self.executor
        if ex is None:
            return 1.0
        backward = 3 if ex.stages * ex.virtual_stages > 2 else 2
        return (3 + backward) * ex.steps / (ex.forward_passes + ex.backward_passes)

    def comm_by_axes(self) -> dict[tuple, tuple[float | None, float | None]]:
        """axes -> (ledger bytes, compiled wire bytes) per device per step."""
        from jaxtrain.tools import hlo
        compiled: dict = {}
        for (_, axes), b in hlo.summary(self.collectives, wire=True).items():
            compiled[axes] = compiled.get(axes, 0.0) + b
        c, L = self.estimate.comm_bytes, self.estimate.layout
        # Gradients are reduced once over the data-parallel group: data and context.
        dp_axes = tuple(a for a in ("data", "context") if L.degree(a) > 1) or ("data",)
        # The vocab tables' gradients reach every stage rank in an all-reduce over stage.
        ledger = {("tensor",): c["tp"], dp_axes: c["dp"], ("fsdp",): c["fsdp"],
                  ("stage",): c["pp"] + c["vocab"]}
        if L.context > 1:  # the attention's K/V (and dK/dV) over context
            ledger[("context",)] = ledger.get(("context",), 0.0) + c["cp"]
        keys = [k for k in ledger if ledger[k] or k in compiled]
        keys += sorted((k for k in compiled if k not in ledger), key=str)
        return {k: (ledger.get(k), compiled.get(k)) for k in keys}

    def stage_comm(self) -> dict[tuple[str, bool], list]:
        """(kind, in the schedule loop) -> [wire bytes per step, runs per step, payload of one
        run, its HLO shape, payload per step] of the compiled collectives over `stage` alone."""
        out: dict = {}
        for c in self.collectives:
            if c.axes == ("stage",):
                row = out.setdefault((c.kind, c.in_loop), [0.0, 0, c.bytes, c.shape, 0])
                row[0] += c.wire_bytes_per_step
                row[1] += c.count
                row[4] += c.bytes_per_step
        return out

    def format(self) -> str:
        """The report as text (jaxtrain.tools.dry_run_report)."""
        from jaxtrain.tools import dry_run_report
        return dry_run_report.format_report(self)

    def to_json(self) -> dict:
        """The report for scripts: memory terms, collective bytes per kind and mesh axis,
        matmul FLOPs, and what only a GPU program has (kernels, overlap)."""
        from jaxtrain.tools import dry_run_report
        return dry_run_report.report_json(self)


def dry_run(cfg: Config, gpu: str | Gpu | None = None, *, devices: int | None = None,
            config_name: str = "the config", echo=None, target: str | None = None) -> DryRun:
    """Compile the train step (pipelined when stage > 1) from abstract state and read what
    XLA reports. On the devices present, the layout scaled to them; for a GPU `target`, on
    `devices` compile-only GPUs (default: the configured layout's device count), with the
    ledger planning for the same GPU. `echo` (e.g. print) hears progress before the long
    compile."""
    import tempfile

    import jax

    from jaxtrain import xla_flags
    from jaxtrain.model import attention
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import gpu_kernels, gpu_program, hlo, targets
    from jaxtrain.tools.compile_step import compile_step
    if target is not None:
        tgt = targets.get(target)
        if gpu is not None and get_gpu(gpu).name != get_gpu(tgt.ledger_gpu).name:
            raise ConfigError(f"--gpu {get_gpu(gpu).name} and --target {target} disagree; "
                              "--target alone sets the GPU the ledger plans for")
        gpu = get_gpu(tgt.ledger_gpu)
        planned = plan_devices(cfg, gpu, devices)
        if planned.n_devices is None:
            raise LayoutError(f"cannot compile {config_name} for {target}: {planned.error}")
        present, kind = targets.devices(target, planned.n_devices), tgt.name
    else:
        gpu = get_gpu(gpu or "h100")
        present = jax.devices()
        planned = plan_devices(cfg, gpu, devices, present=len(present))
        kind = present[0].device_kind
    scaled, changes = scale_to_devices(cfg, planned, len(present))
    mesh = sharding.make_mesh(scaled.parallel, present)
    if echo:
        echo(f"dry run: compiling the train step of {config_name} on {len(present)} x {kind} ...")
    is_gpu = sharding.platform(mesh) == "gpu"
    chosen = attention.choose(scaled.model, sharding.platform(mesh),
                              sharding.compute_capability(mesh))
    flash = chosen[0] in ("pallas", "mosaic", "cudnn")
    with tempfile.TemporaryDirectory(prefix="jaxtrain-dump-") as dump:
        # the dumps hold each Pallas kernel's launch and PTX (registers, spills)
        extra = {"xla_dump_to": dump} if is_gpu and flash else None
        mosaic_dir = f"{dump}/mosaic" if is_gpu and chosen[0] == "mosaic" else None
        with gpu_kernels.mosaic_dump(mosaic_dir):
            out = compile_step(scaled, mesh, extra_options=extra)
        report = None
        mem = hlo.memory(out.compiled)
        raw_colls = hlo.collectives_from_text(out.text, mesh)
        if is_gpu:
            device_memory = (targets.get(target).memory_bytes if target else
                             (present[0].memory_stats() or {}).get("bytes_limit", 0))
            report = gpu_program.GpuReport.read(
                out.text, mesh, dump if extra else None, device_memory, mem["total_bytes"],
                xla_flags.for_platform(scaled, "gpu", mesh.shape), raw_colls, mosaic_dir)
    colls = hlo.reclassify_sliced_all_reduce(raw_colls)
    try:
        xla_flops = hlo.compiled_flops(out.compiled)
    except hlo.HloAnalysisUnavailable:
        xla_flops = None
    layout = layout_from_config(scaled, len(present))
    est = estimate(scaled, layout, gpu, flash=flash)
    executed = None
    if est.executor is not None:
        from jaxtrain.tools import pipeline_flops
        executed = pipeline_flops.for_step(out.text, est.executor)
    return DryRun(config_name=config_name, cfg=scaled, planned=planned, changes=changes,
                  estimate=est, memory=mem, collectives=colls,
                  matmul_flops=hlo.matmul_flops_from_text(out.text), xla_flops=xla_flops,
                  lower_s=out.lower_s, compile_s=out.compile_s, device_kind=kind,
                  gpu_report=report, executed=executed, attention=chosen)

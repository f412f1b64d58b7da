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
- communication: ring wire bytes per mesh axis per step of the collectives a device executes
  (pipelined: each rank's F and B switch branches as its table takes them, the ranks'
  mean; CPU's all-reduce-then-slice counted as the reduce-scatter a GPU emits) against the
  ledger's volumes (its DP and FSDP payloads as the (g-1)/g a ring moves); an axis more
  than 10% off carries its cause, and what the HLO counts in every branch of every table
  step is a detail line. The
  stage axis is split by kind: the executor's collective-permutes against the ledger's PP
  sends; the rest (the all-reduce of the replicated embedding and head gradients, parameter
  resharding) listed with what it is.
- FLOPs: the ledger's model and hardware FLOPs per device against the matmuls the compiled
  step executes (loops by trip count, attention kernels as their dense matmuls, pipelined
  each rank's branches as above); as detail lines, what the HLO counts in every branch and
  XLA's cost_analysis (which counts a scanned layer's body once).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxtrain.config import Config, ConfigError, padded_vocab
from jaxtrain.ledger import Estimate, Executor, Gpu, Layout, LayoutError, estimate, get_gpu
from jaxtrain.ledger import comm, device_params, experts, latent
from jaxtrain.ledger.layout import layout_from_config, stage_layer_counts
from jaxtrain.ledger.device_params import layer_params_local
from jaxtrain.ledger.memory import state_bytes, workspace_bytes
from jaxtrain.tools.device_plan import Planned, plan_devices, scale_to_devices

if TYPE_CHECKING:
    from jaxtrain.tools import gpu_program, pipeline_flops


# Axes the ledger has no term for that move less than this share of the step's wire bytes
# (the loss's and the gradient norm's scalars, the norm scales' gradients) are left out of
# the report's rows; the collectives table still lists them.
NEGLIGIBLE_SHARE = 1e-3


class AxisComm(NamedTuple):
    """One mesh axes' communication per device per step, bytes."""
    ledger: float | None     # the ledger's volume (None: it has no term for these axes)
    executed: float          # wire bytes of the collectives a device runs (ranks' mean)
    every_branch: float | None   # the HLO's count: every branch of every conditional

    @property
    def off(self) -> float | None:
        """executed / ledger - 1, None without a ledger term."""
        return self.executed / self.ledger - 1 if self.ledger else None


def branch_matmul_flops(cfg: Config, layout: Layout, ex: Executor) -> float:
    """Matmul FLOPs per device per step as the HLO reader counts the executor: every branch of
    every table step (remat none), i.e. the F switch's two chunk forwards (from the inbox, from
    the embedding) and the B switch's stashed backwards (twice a forward; a middle stage's and
    virtual stage 0's) and the last stage's forward + backward + head forward and backward.
    An MoE layer's experts count by the rows their grouped GEMMs run (the routed rows: top_k
    a token dropless, capacity's kept rows or every [E, C] slot), never every expert."""
    m, t, seq = cfg.model, layout.tensor, cfg.train.seq_len
    tokens = layout.micro_batch * seq / layout.context
    layer = (2 * layer_matmul_params(cfg, layout)
             + 4 * latent.attention_width(m) * seq / t)
    chunk = tokens * ex.chunk_layers * layer
    head = tokens * 2 * m.hidden_size * padded_vocab(m.vocab_size, t) / t
    middle = 2 if ex.stages * ex.virtual_stages > 2 else 0
    return ex.steps * ((2 + middle + 2 + 3) * chunk + 3 * head)


def layer_matmul_params(cfg: Config, layout: Layout) -> float:
    """One layer's parameters a token multiplies per device (the layers' mean): the held ones,
    with an MoE layer's E/ep held experts replaced by the rows per token its experts run."""
    m, t = cfg.model, layout.tensor
    held = layer_params_local(cfg, t, layout.expert, layout.expert_tensor)
    if m.moe is None:
        return held
    frac = experts.moe_fraction(cfg)
    routed = experts.rows_per_token(cfg) * 3 * m.hidden_size * m.expert_mlp_size / t
    return held + frac * (routed - experts.expert_params_local(cfg, layout))


def grouped_rows_share(cfg: Config, layout: Layout) -> float:
    """The share of a grouped GEMM buffer's rows that are routed (load balanced): what the
    executed FLOPs count of each grouped GEMM kernel (kernel_flops.grouped_gemm_flops_of)."""
    if cfg.model.moe is None:
        return 1.0
    return experts.rows_per_token(cfg) / experts.buffer_rows_per_token(cfg, layout)


def dp_terms(cfg: Config, L: Layout, dp_payload: float) -> list[tuple[tuple, float, int]]:
    """[(mesh axes, the ledger's DP payload over them, their ranks)]: gradients are reduced
    once over the data-parallel group (data and context); with expert ranks carved out of
    data the dense params' over data, expert and context, the experts' over data and context
    alone (the ranks holding the same experts: comm.dp_split)."""
    group = tuple(a for a in ("data", "context") if L.degree(a) > 1) or ("data",)
    if L.expert == 1:
        return [(group, dp_payload, L.data * L.context)]
    stage_layers = stage_layer_counts(cfg, L.stage, L.virtual_stages)
    dense, routed = comm.dp_split(L, device_params.params_local(cfg, L, stage_layers),
                                  device_params.expert_params_held(cfg, L, stage_layers),
                                  device_params.edge_row_local(cfg, L))
    carved = L.data * L.context // experts.expert_data_ranks(L)   # the mesh's expert axis
    dense_axes = tuple(a for a in ("data", "expert", "context")
                       if (a == "expert" and carved > 1) or (a == "data" and L.data > carved)
                       or (a == "context" and L.context > 1))
    out = [(dense_axes, dense, L.data * L.context)]
    if routed:
        out.append((group, routed, experts.expert_data_ranks(L)))
    return out


# ----------------------------------------------------------------------------- compiling

def compiled_state_terms(compiled, abstract_state) -> dict[str, float]:
    """Per-device bytes of the compiled step's train-state arguments by the ledger's static
    terms (master: params; moments: Adam's mu and nu; fp8_meta; other: step counts), from
    the shardings the compiled program takes them in."""
    import jax
    import numpy as np
    shardings = compiled.input_shardings[0][0]
    out = dict.fromkeys(("master", "moments", "fp8_meta", "other"), 0.0)

    def add(path, leaf, sh):
        names = [str(getattr(k, "name", getattr(k, "key", k))) for k in path]
        term = ("master" if names[0] == "params" else "fp8_meta" if names[0] == "fp8_meta"
                else "moments" if {"mu", "nu"} & set(names) else "other")
        out[term] += float(np.prod(sh.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    jax.tree_util.tree_map_with_path(add, abstract_state, shardings)
    return out


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
    executed: "pipeline_flops.ExecutedFlops"   # matmul FLOPs per device (rank) as run
    executed_wire: dict          # axes -> wire bytes per step per device (rank) as run
    state_terms: dict = dataclasses.field(default_factory=dict)  # compiled_state_terms
    gpu_report: "gpu_program.GpuReport | None" = None   # with a GPU target
    attention: tuple = ()        # (the attention core compiled, why: attention.choose)
    grouped_gemm: tuple = ()     # MoE: (the experts' grouped GEMM, why: setup.grouped_dot_for)

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
        state = state_bytes(s)
        temps = sum(s.values()) - state + e.activation_bytes + e.reserve_bytes
        return {"state": state, "temp": temps, "total": e.total_bytes,
                "temp_no_workspace": temps - workspace_bytes(self.cfg)}

    def comm_by_axes(self) -> dict[tuple, "AxisComm"]:
        """axes -> the ledger's bytes and the compiled step's wire bytes per device per step,
        executed and in every branch; negligible axes the ledger has no term for left out
        (NEGLIGIBLE_SHARE)."""
        from jaxtrain.tools import hlo
        every: dict = {}
        for (_, axes), b in hlo.summary(self.collectives, wire=True).items():
            every[axes] = every.get(axes, 0.0) + b
        c, L = self.estimate.comm_bytes, self.estimate.layout
        # The ledger's DP and FSDP volumes are payloads (§5: Megatron's 2·N for DP), of which
        # a ring moves (g-1)/g over g devices; its other terms are wire bytes already.
        ring = lambda g: (g - 1) / g  # noqa: E731
        # The vocab tables' gradients reduce-scattered over stage, their copy gathered (under
        # ZeRO-1 from the stage x data-parallel shards at once: comm.vocab_terms).
        over_stage, joint = comm.vocab_terms(self.cfg, L)
        ledger = {("tensor",): c["tp"], ("fsdp",): c["fsdp"] * ring(L.fsdp),
                  ("stage",): c["pp"] + over_stage}
        terms = dp_terms(self.cfg, L, c["dp"])
        for axes, payload, ranks in terms:
            ledger[axes] = ledger.get(axes, 0.0) + payload * ring(ranks)
        if joint:   # over stage and the dense params' data-parallel axes
            ledger[("stage",) + terms[0][0]] = joint
        if L.context > 1:  # the attention's K/V (and dK/dV) over context
            ledger[("context",)] = ledger.get(("context",), 0.0) + c["cp"]
        keys = [k for k in ledger if ledger[k] or every.get(k)]
        floor = NEGLIGIBLE_SHARE * sum(every.values())
        keys += sorted((k for k in every if k not in ledger and every[k] > floor), key=str)
        return {k: AxisComm(ledger.get(k), float(np.mean(self.executed_wire.get(k, 0.0))),
                            every.get(k)) for k in keys}

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
    from jaxtrain.tools import gpu_kernels, gpu_program, hlo, pipeline_flops, targets
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
    grouped = ()
    if scaled.model.moe is not None:
        from jaxtrain.executors.setup import folded, grouped_dot_for
        dot, why = grouped_dot_for(scaled.model, mesh, folded(scaled, mesh))
        grouped = ("mosaic" if dot.__module__.endswith("grouped_matmul") else "ragged_dot", why)
    est = estimate(scaled, layout_from_config(scaled, len(present)), gpu, flash=flash)
    with tempfile.TemporaryDirectory(prefix="jaxtrain-dump-") as dump:
        # the dumps hold each Pallas kernel's launch and PTX (registers, spills)
        extra = {"xla_dump_to": dump} if is_gpu and flash else None
        uses_mosaic = chosen[0] == "mosaic" or grouped[:1] == ("mosaic",)
        mosaic_dir = f"{dump}/mosaic" if is_gpu and uses_mosaic else None
        with gpu_kernels.mosaic_dump(mosaic_dir):
            out = compile_step(scaled, mesh, extra_options=extra)
        report = None
        mem = hlo.memory(out.compiled)
        state_terms = compiled_state_terms(out.compiled, out.setup.abstract_train_state)
        raw_colls = hlo.collectives_from_text(out.text, mesh)
        # each computation's executions per step (pipelined: per rank, as its table runs)
        table = pipeline_flops.table_of(est.executor)
        runs = pipeline_flops.executed_runs(out.text, *table)
        if is_gpu:
            device_memory = (targets.get(target).memory_bytes if target else
                             (present[0].memory_stats() or {}).get("bytes_limit", 0))
            report = gpu_program.GpuReport.read(
                out.text, mesh, dump if extra else None, device_memory, mem["total_bytes"],
                xla_flags.for_platform(scaled, "gpu", mesh.shape), raw_colls, mosaic_dir,
                {k: float(np.mean(v)) for k, v in runs.items()})
    colls = hlo.reclassify_sliced_all_reduce(raw_colls)
    try:
        xla_flops = hlo.compiled_flops(out.compiled)
    except hlo.HloAnalysisUnavailable:
        xla_flops = None
    return DryRun(config_name=config_name, cfg=scaled, planned=planned, changes=changes,
                  estimate=est, memory=mem, collectives=colls,
                  matmul_flops=hlo.matmul_flops_from_text(out.text), xla_flops=xla_flops,
                  lower_s=out.lower_s, compile_s=out.compile_s, device_kind=kind,
                  executed=pipeline_flops.executed_matmul_flops(
                      out.text, *table, grouped_rows_share(scaled, est.layout),
                      (scaled.model.resolved_head_dim, scaled.model.v_head_dim)),
                  executed_wire=pipeline_flops.executed_wire_bytes(colls, runs),
                  gpu_report=report, state_terms=state_terms, attention=chosen,
                  grouped_gemm=grouped)

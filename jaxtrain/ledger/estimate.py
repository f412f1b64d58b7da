"""One layout's full ledger: FLOPs, memory against the budget, communication, expected MFU.

With pipeline stages every figure is the executor's that jaxtrain runs (ledger.pipeline: its
lock-step table, residual stash, embedding and head on their ranks); `bubble` stays
Megatron's (p−1)/(m·v) for comparison.

Expected step time (a budget of losses, each with an optimistic and a pessimistic value; the
optimistic ones give the high MFU):
- compute: model FLOPs at peak × kernel efficiency (per GPU, e.g. H100 0.50–0.70: the whole
  compute stream of a large Llama step, not just cuBLAS GEMMs); FP8 runs the transformer-layer
  matmuls at the FP8 peak, attention and lm_head at bf16. Attention is timed as it runs: the
  causal half with a flash kernel, the full s×s square with XLA's attention.
- recompute: the HFU − model FLOPs at the same rate (the remat config's).
- bubble: (compute + recompute) × the lock-step table's idle fraction (F = 1, B = 2 + the remat
  config's recompute per layer forward).
- communication: each kind's bytes on its nominal link (NVLink inside a node, the NIC between
  nodes), times an exposed fraction: TP 0.3–1.0 (on the critical path; overlap is partial),
  DP 0.1–0.5 (overlaps the backward pass and the next forward), FSDP 0.2–0.6, PP 0.3–1.0,
  vocab 0.5–1.0 (the executor reduces them after its loop; timed in the PP loss, same axis),
  CP all_gather 0.5–1.0 (the gather precedes the attention that needs it), EP all-to-all
  0.5–1.0 (the experts wait for their rows; only independent work, e.g. shared experts, hides
  it). The ring's CP is
  timed hop by hop instead: a hop is exposed by what its transfer takes beyond the attention
  block it overlaps (at the optimistic and the pessimistic kernel rate, the block's time
  counted whole or half), the last dK/dV hop of a backward pass whole.
- context imbalance: without causal load balancing the busiest context rank's attention is
  (2c-1)/c of the average (flops.context_attention_imbalance), the excess timed as compute.
- overhead: 50–150 µs per layer-microbatch (launch gaps, small kernels, host sync) and
  20–100 µs latency per pipeline send (2 per table step).
MFU = ideal step / expected step, ideal = model FLOPs / (devices × peak of the compute dtype),
model FLOPs counting causal attention as half (ledger.flops, the trainer's `mfu`); FP8 runs
still divide by the bf16 peak, so their MFU can exceed the bf16 ceiling. The `*_full_attn`
FLOPs count the full s×s square, as XLA's attention computes it (for comparing with compiled
FLOPs).
"""
from __future__ import annotations

import dataclasses

from jaxtrain.config import Config, RematConfig
from jaxtrain.ledger import comm, device_params, experts, fit, flops, memory, pipeline
from jaxtrain.ledger.hardware import GB, GiB, Gpu, get_gpu
from jaxtrain.ledger.layout import (Layout, mixed_pipeline_problem, stage_layer_counts,
                                    validate_layout)

REMAT_VARIANTS = {
    "none": RematConfig(granularity="none"),
    "selective": RematConfig(granularity="selective", modules=("core_attn",)),
    "full": RematConfig(granularity="full", method="uniform", num_layers=1),
}
# What the planner also tries for a model with MoE layers: Megatron's MoE recompute modules
# (core_attn with them: a selective policy recomputes the attention core's untagged insides).
MOE_REMAT_VARIANTS = {
    "moe_act": RematConfig(granularity="selective", modules=("core_attn", "moe_act")),
    "moe": RematConfig(granularity="selective", modules=("core_attn", "moe")),
}
COMM_KINDS = ("dp", "fsdp", "tp", "pp", "vocab", "cp", "ep")
_LOSS_OF = {"vocab": "pp"}   # kinds timed under another kind's loss (the same axis)


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """Exposed fraction of each kind of communication and fixed overheads: (optimistic,
    pessimistic)."""
    exposed: tuple = (("tp", (0.3, 1.0)), ("dp", (0.1, 0.5)), ("fsdp", (0.2, 0.6)),
                      ("pp", (0.3, 1.0)), ("vocab", (0.5, 1.0)), ("cp", (0.5, 1.0)),
                      ("ep", (0.5, 1.0)))
    ring_overlap: tuple = (1.0, 0.5)   # the share of a ring block's attention a hop hides in
    layer_overhead_s: tuple = (50e-6, 150e-6)
    p2p_latency_s: tuple = (20e-6, 100e-6)


@dataclasses.dataclass(frozen=True)
class Estimate:
    gpu: Gpu
    layout: Layout
    seq_len: int
    global_batch: int
    remat: str                    # label of the remat config the totals use
    flash: bool
    # parameters and FLOPs
    params_total: int
    params_non_embedding: int     # N of 6N
    params_local: float           # held by one device (after TP, PP; every stage alike)
    stage_layers: tuple
    model_flops_per_token: float
    hfu_flops_per_token: float
    model_flops_per_step: float
    hfu_flops_per_step: float
    # memory (bytes, worst stage)
    bytes_per_param: float        # static bytes held per local parameter
    static_breakdown: dict        # memory.STATIC_TERMS -> bytes
    static_bytes: float
    activation_bytes_per_layer: float
    inflight_layer_microbatches: float   # stored layer-microbatches (pipelined: one chunk's)
    activation_bytes: float              # stored layer activations + pipeline buffers
    activation_bytes_by_remat: dict
    reserve_bytes: float
    total_bytes: float
    budget_bytes: float
    fits: bool
    overflow: str                # "" if it fits, else the largest term (static|activations|reserve)
    reason: str
    # communication per device per step
    comm_bytes: dict
    comm_seconds: dict
    comm_links: dict
    # time
    bubble: float                 # Megatron's (p-1)/(m·v)
    ideal_step_s: float
    expected_step_s: tuple        # (optimistic, pessimistic)
    expected_mfu: tuple           # (low, high)
    losses: dict                  # name -> (optimistic s, pessimistic s)
    notes: tuple = ()
    # the pipeline executor (None without stages)
    executor: pipeline.Executor | None = None
    lockstep_bubble: float = 0.0  # the executor's table: idle fraction, used in the step time
    pipeline_buffer_bytes: float = 0.0   # its chunk-input buffers, part of activation_bytes
    chunk_input_bytes: float = 0.0       # one buffer / one send
    # FLOPs with the full s×s attention square (what XLA's attention runs; compiled comparisons)
    model_flops_per_step_full_attn: float = 0.0
    hfu_flops_per_step_full_attn: float = 0.0

    @property
    def n_devices(self) -> int:
        return self.layout.n_devices

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict:
        L = self.layout
        gib = lambda x: round(x / GiB, 3)  # noqa: E731
        out = {"tensor": L.tensor, "stage": L.stage, "data": L.data, "fsdp": L.fsdp,
               "context": L.context, "expert": L.expert, "expert_tensor": L.expert_tensor,
               "virtual_stages": L.virtual_stages,
               "micro_batch": L.micro_batch, "microbatches": L.microbatches,
               "sequence_parallel": L.sequence_parallel, "zero1": L.zero1,
               "schedule": L.schedule, "remat": self.remat, "flash": self.flash,
               "bubble": round(self.bubble, 6),
               "lockstep_bubble": round(self.lockstep_bubble, 6),
               "table_steps": self.executor.steps if self.executor else 0,
               "stash_slots": self.executor.stash_buffer if self.executor else 0,
               "static_gb": gib(self.static_bytes),
               "static_terms_gb": {k: gib(v) for k, v in self.static_breakdown.items()},
               "activation_gb": gib(self.activation_bytes),
               **{f"activation_gb_{k}": gib(v) for k, v in self.activation_bytes_by_remat.items()},
               "reserve_gb": gib(self.reserve_bytes), "total_gb": gib(self.total_bytes),
               "budget_gb": gib(self.budget_bytes), "fits": self.fits, "reason": self.reason,
               **{f"{k}_comm_gb": round(v / GB, 3) for k, v in self.comm_bytes.items()},
               **{f"{k}_comm_s": round(v, 4) for k, v in self.comm_seconds.items()},
               "ideal_step_s": round(self.ideal_step_s, 4),
               "expected_step_s_low": round(self.expected_step_s[0], 4),
               "expected_step_s_high": round(self.expected_step_s[1], 4),
               "expected_mfu_low": round(self.expected_mfu[0], 4),
               "expected_mfu_high": round(self.expected_mfu[1], 4),
               "params_total": self.params_total,
               "model_flops_per_token": self.model_flops_per_token,
               "hfu_flops_per_token": self.hfu_flops_per_token}
        return out


def remat_label(remat: RematConfig) -> str:
    if remat.granularity == "selective":
        return "selective(" + ",".join(remat.modules) + ")"
    if remat.granularity == "full":
        return f"full({remat.method},{remat.num_layers or 1})"
    return "none"


def uses_flash(cfg: Config, gpu: Gpu) -> bool:
    """pallas/cudnn attention store no s×s scores; auto picks a flash kernel on GPUs."""
    if cfg.model.attention in ("pallas", "cudnn"):
        return True
    return cfg.model.attention == "auto" and gpu.name != "cpu"


def estimate(cfg: Config, layout: Layout, gpu: str | Gpu, *, remat: RematConfig | None = None,
             seq_len: int | None = None, flash: bool | None = None,
             assumptions: Assumptions = Assumptions()) -> Estimate:
    """Every ledger figure for `layout` on `gpu`; remat defaults to cfg.remat."""
    gpu = get_gpu(gpu)
    remat = remat or cfg.remat
    seq = seq_len or cfg.train.seq_len
    validate_layout(cfg, layout, seq_len=seq)
    flash = uses_flash(cfg, gpu) if flash is None else flash
    m, L = cfg.model, layout
    stage_layers = stage_layer_counts(cfg, L.stage, L.virtual_stages)
    ex = pipeline.executor(L, stage_layers)
    counts = flops.param_counts(m)
    n_local = device_params.params_local(cfg, L, stage_layers)   # every pipeline rank alike
    n_state = device_params.state_params_local(cfg, L, stage_layers)
    n_expert = device_params.expert_params_held(cfg, L, stage_layers)
    memory_fields = _memory_fields(cfg, L, gpu, remat, flash, seq, stage_layers, ex, n_local,
                                   n_state, n_expert)

    # FLOPs per token: causal attention counted as half (model FLOPs, MFU), and the full s×s
    # square (what XLA's attention runs)
    tokens = L.global_batch * seq
    f_model = flops.model_flops_per_token(cfg, seq)
    f_hfu = flops.hfu_flops_per_token(cfg, remat, stage_layers, L.virtual_stages, seq)
    f_model_full = flops.model_flops_per_token(cfg, seq, causal=False)
    f_hfu_full = flops.hfu_flops_per_token(cfg, remat, stage_layers, L.virtual_stages, seq,
                                           causal=False)
    ideal = f_model * tokens / (L.n_devices * gpu.peak_flops(m.compute_dtype))

    passes, volumes, links, seconds = _communication(cfg, L, gpu, remat, seq, stage_layers, ex,
                                                     n_local, n_expert)

    # expected step time
    # What runs: a flash kernel skips the masked half of the scores, XLA's attention does not.
    run_model, run_hfu = (f_model, f_hfu) if flash else (f_model_full, f_hfu_full)
    step_flops = _step_flops(cfg, L, gpu, flash, seq, counts.layers_active, run_model, run_hfu)
    bubble = comm.bubble_fraction(L.stage, L.microbatches, L.virtual_stages)
    lockstep = _lockstep_bubble(cfg, L, remat, seq, stage_layers, ex)
    losses = _step_losses(cfg, L, gpu, flash, seq, stage_layers, ex, step_flops, passes, links,
                          seconds, lockstep, assumptions)
    step = tuple(sum(v[i] for v in losses.values()) for i in (0, 1))

    return Estimate(
        gpu=gpu, layout=L, seq_len=seq, global_batch=L.global_batch, remat=remat_label(remat),
        flash=flash, params_total=counts.total, params_non_embedding=counts.non_embedding,
        params_local=n_local, stage_layers=stage_layers,
        model_flops_per_token=f_model, hfu_flops_per_token=f_hfu,
        model_flops_per_step=f_model * tokens, hfu_flops_per_step=f_hfu * tokens,
        **memory_fields,
        comm_bytes=volumes, comm_seconds=seconds, comm_links={k: v[0] for k, v in links.items()},
        bubble=bubble, ideal_step_s=ideal, expected_step_s=step,
        expected_mfu=(ideal / step[1], ideal / step[0]), losses=losses,
        notes=_notes(cfg, L, gpu, flash, bubble),
        executor=ex, lockstep_bubble=lockstep,
        chunk_input_bytes=pipeline.chunk_input_bytes(cfg, L, seq) if ex else 0.0,
        model_flops_per_step_full_attn=f_model_full * tokens,
        hfu_flops_per_step_full_attn=f_hfu_full * tokens)


def _memory_fields(cfg: Config, layout: Layout, gpu: Gpu, remat: RematConfig, flash: bool,
                   seq: int, stage_layers: tuple, ex: pipeline.Executor | None, n_local: float,
                   n_state: float, n_expert: float) -> dict:
    """The worst stage's bytes against the budget, as Estimate's memory fields (the stored
    activations also under each of REMAT_VARIANTS)."""
    L = layout

    def activations(rm):
        if ex is not None:
            return memory.pipelined_activations(cfg, L, rm, flash, seq, ex)
        # the MTP modules' blocks store as layers of the stack do
        layers = cfg.model.num_layers + cfg.model.mtp_depths
        return memory.stage_activations(cfg, L, rm, flash, seq, layers, layers)

    static = memory.static_bytes(cfg, L, n_local, n_state, n_expert)
    if ex is not None:
        for k, v in memory.pipeline_static_bytes(cfg, L, remat, stage_layers,
                                                 ex.chunk_layers).items():
            static[k] += v
    static_total = sum(static.values())
    act = activations(remat)
    reserve = memory.reserve_bytes(cfg, L, seq)
    total = static_total + act.total + reserve
    budget = memory.BUDGET_FRACTION * gpu.hbm_bytes
    fits = total <= budget
    terms = {"static": static_total, "activations": act.total, "reserve": reserve}
    overflow = "" if fits else max(terms, key=terms.get)
    return dict(
        bytes_per_param=static_total / n_local, static_breakdown=static,
        static_bytes=static_total, activation_bytes_per_layer=act.per_layer,
        inflight_layer_microbatches=act.inflight, activation_bytes=act.total,
        activation_bytes_by_remat={name: activations(rm).total
                                   for name, rm in REMAT_VARIANTS.items()},
        reserve_bytes=reserve, total_bytes=total, budget_bytes=budget, fits=fits,
        overflow=overflow, reason=fit.reason(terms, total, budget, gpu, overflow,
                          fit.hint(cfg, L, remat, overflow)),
        pipeline_buffer_bytes=act.buffers)


def _communication(cfg: Config, layout: Layout, gpu: Gpu, remat: RematConfig, seq: int,
                   stage_layers: tuple, ex: pipeline.Executor | None, n_local: float,
                   n_expert: float):
    """Per device per step on the stage with the most layers: (the layer passes counted, bytes
    of each kind, its (link name, bytes/s), its seconds on that link at full bandwidth)."""
    L = layout
    recomputed = (flops.recomputed_layers(remat, stage_layers, L.virtual_stages)
                  / cfg.model.num_layers if remat.granularity == "full" else 0.0)
    passes = comm.layer_passes(L, stage_layers, ex, recomputed)
    layer_local = device_params.layer_params_local(cfg, L.tensor, L.expert, L.expert_tensor)
    # the forward passes full recompute adds (the backward reuses what they gather)
    plain = comm.layer_passes(L, stage_layers, ex)
    rerun = passes.forward - plain.forward
    # DP: each rank reduces the gradients it computed: its layers and, with stages, its edge
    # row (all-reduced over data before it reduce-scatters over stage)
    volumes = {"dp": comm.dp_bytes(L, n_local, n_expert, device_params.edge_row_local(cfg, L)),
               # a re-run forward gathers the weights its backward then uses (one gather)
               "fsdp": comm.fsdp_layer_bytes(L, layer_local, plain,
                                             comm.fsdp_gather_bytes(cfg, L, layer_local))
               + comm.fsdp_rest_bytes(cfg, L, seq),
               # re-run forwards' TP savings counted on the unpipelined step (the 128k
               # recipe: 6 all-gathers + 5 reduce-scatters per layer per microbatch); the
               # pipelined chunk's B not yet measured per layer (405B: 0.93x without them)
               "tp": comm.tp_bytes(cfg, L, seq, passes, rerun if ex is None else 0.0)
               + (comm.tp_rest_bytes(cfg, L, seq) if ex is None else 0.0),
               "pp": comm.pp_bytes(cfg, L, seq, ex), "vocab": comm.vocab_bytes(cfg, L),
               "cp": comm.cp_bytes(cfg, L, seq, passes, rerun),
               "ep": experts.all_to_all_bytes(cfg, L, remat, seq, passes)}
    links = {k: comm.link(L, comm.COMM_AXES[k], gpu) for k in COMM_KINDS}
    seconds = {k: volumes[k] / links[k][1] for k in COMM_KINDS}
    return passes, volumes, links, seconds


def _step_flops(cfg: Config, layout: Layout, gpu: Gpu, flash: bool, seq: int,
                layer_params: int, run_model: float, run_hfu: float) -> tuple:
    """FLOPs per step as they run, by the rate they run at: (FP8 transformer-layer matmuls, the
    rest at the compute dtype's peak, recompute). `run_*` are per token, attention counted as
    the kernel runs it."""
    m, L = cfg.model, layout
    tokens = L.global_batch * seq
    layer_flops = 6.0 * layer_params * tokens
    fp8_frac = 0.0
    if cfg.fp8.enabled and gpu.fp8_flops:   # without FP8 tensor cores: timed as bf16 (_notes)
        fp8_layers = max(0, m.num_layers - cfg.fp8.bf16_first_layers - cfg.fp8.bf16_last_layers)
        fp8_frac = fp8_layers / m.num_layers
    fp8_flops_step = layer_flops * fp8_frac
    rest_flops_step = run_model * tokens - fp8_flops_step
    recompute_step = (run_hfu - run_model) * tokens
    # The busiest context rank's extra attention (no causal load balancing), in compute.
    imbalance = flops.context_attention_imbalance(L.context, cfg.parallel.context_load_balance,
                                                  flash)
    rest_flops_step += ((imbalance - 1.0) * tokens
                        * flops.attention_flops_per_token(m, seq, causal=flash))
    return fp8_flops_step, rest_flops_step, recompute_step


def _lockstep_bubble(cfg: Config, layout: Layout, remat: RematConfig, seq: int,
                     stage_layers: tuple, ex: pipeline.Executor | None) -> float:
    """The executor's lock-step table's idle fraction (0 without stages)."""
    if ex is None:
        return 0.0
    m, L = cfg.model, layout
    # B over F per layer: a 2F backward + the remat config's recompute.
    remat_per_fwd = (flops.recompute_flops_per_token(cfg, remat, stage_layers,
                                                     L.virtual_stages, seq)
                     / (m.num_layers * flops.layer_forward_flops_per_token(m, seq)))
    return ex.bubble(2.0 + remat_per_fwd)


def _step_losses(cfg: Config, layout: Layout, gpu: Gpu, flash: bool, seq: int,
                 stage_layers: tuple, ex: pipeline.Executor | None, step_flops: tuple,
                 passes: comm.Passes, links: dict, seconds: dict, lockstep: float,
                 assumptions: Assumptions) -> dict:
    """Each loss of the step time: name -> (optimistic s, pessimistic s); see the module
    docstring. `step_flops` is _step_flops's (FP8, rest, recompute)."""
    L = layout
    fp8_flops_step, rest_flops_step, recompute_step = step_flops
    peak = gpu.peak_flops(cfg.model.compute_dtype)
    D = L.n_devices
    layers_max = max(stage_layers)
    exposed = dict(assumptions.exposed)
    losses = {}
    for i, eff in enumerate(reversed(gpu.kernel_efficiency)):  # i=0 optimistic
        compute = rest_flops_step / (D * peak * eff)
        if fp8_flops_step:
            compute += fp8_flops_step / (D * gpu.fp8_flops * eff)
        recompute = recompute_step / (D * peak * eff)
        parts = {"compute": compute, "recompute": recompute,
                 "bubble": (compute + recompute) * lockstep}
        for k in COMM_KINDS:
            # the vocab all-reduce rides the stage axis: one loss with the PP sends
            key = f"{_LOSS_OF.get(k, k)}_comm"
            shown = seconds[k] * exposed[k][i]
            if k == "cp" and L.context > 1 and cfg.parallel.context_strategy == "ring":
                shown = _ring_exposed(cfg, L, seq, passes, links["cp"][1],
                                      peak * eff, assumptions.ring_overlap[i], flash)
            parts[key] = parts.get(key, 0.0) + shown
        overhead = layers_max * L.microbatches * assumptions.layer_overhead_s[i]
        if ex is not None:
            overhead += ex.sends * assumptions.p2p_latency_s[i]
        parts["overhead"] = overhead
        for k, v in parts.items():
            losses.setdefault(k, [0.0, 0.0])[i] = v
    return {k: tuple(v) for k, v in losses.items()}


def _notes(cfg: Config, layout: Layout, gpu: Gpu, flash: bool, bubble: float) -> tuple:
    """Warnings for describe(): what the figures assume or the layout wastes."""
    L, notes = layout, []
    if cfg.fp8.enabled and not gpu.fp8_flops:
        notes.append(f"{gpu.name} has no FP8 tensor cores: timed as bf16")
    if L.stage > 1 and L.microbatches < L.stage:
        notes.append(f"{L.microbatches} microbatches for {L.stage} stages: the pipeline never "
                     f"fills (bubble {bubble:.0%}); raise the global batch or lower stage")
    problem = mixed_pipeline_problem(cfg, L.stage)
    if problem:
        notes.append(f"train.py refuses this layout: {problem}")
    if gpu.estimate:
        notes.append(f"'{gpu.name}' figures are a rough estimate, not a datasheet")
    if not flash and cfg.model.attention == "auto":
        notes.append("attention=auto on CPU: XLA attention, s×s scores stored")
    return tuple(notes)


def _ring_exposed(cfg: Config, layout: Layout, seq: int, passes: comm.Passes, bandwidth: float,
                  rate: float, overlap: float, flash: bool) -> float:
    """Seconds per step the ring's hops add beyond the attention blocks they overlap."""
    h = comm.cp_hops(cfg, layout, seq)
    block_s = flops.context_block_flops(cfg.model, seq, layout.context, layout.micro_batch,
                                        layout.tensor, flash=flash) / rate
    kv_s, grads_s = h.kv / bandwidth, h.grads / bandwidth
    forward = h.forward * max(0.0, kv_s - overlap * block_s)
    # a backward step carries the next K/V and the previous dK/dV while its block runs (2x
    # the forward's work); the last dK/dV hop (home, compute dtype) has no block left.
    backward = (h.backward_kv * max(0.0, kv_s + grads_s - overlap * 2 * block_s) + kv_s)
    return passes.forward * forward + passes.backward * backward

"""Derive a parallel layout for N devices from the ledger, Megatron-style, and explain it.

    python -m jaxtrain.plan --config configs/llama70b.py --devices 1024 --gpu h100 [--json]
    python -m jaxtrain.plan ... --tensor 8 --stage 4 --virtual-stages 5   # evaluate one layout
    python -m jaxtrain.plan --config configs/mixtral_8x7b.py --devices 64 --stage 4 --expert 8
                                        (what the flags invalidate is re-derived: plan_flags.py)

The walk: tensor parallelism inside the NVLink domain (degrees that divide the heads and KV
heads) -> for each tensor degree and recompute level, the smallest pipeline degree that fits
(layers divisible), with virtual stages and micro-batch 1 or 2 -> with MoE layers, expert
parallelism (each degree dividing the experts and the data ranks it is carved from, and with
tensor > 1 also folded over the tensor ranks, parallel.expert_tensor=1; recompute
levels also Megatron's moe_act and moe modules) -> data parallelism (ZeRO-1) fills the rest
-> context parallelism (with each tensor degree that leaves room for it) when
nothing fits without it or the sequence is long (>= 32K tokens). Every candidate is
costed by `jaxtrain.ledger.estimate`; the recommendation has the highest expected MFU (midpoint
of its range) among those that fit. Exit codes: 0 ok, 1 nothing fits, 2 bad input.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxtrain.config import Config, ConfigError, load_config
from jaxtrain.ledger import (MOE_REMAT_VARIANTS, REMAT_VARIANTS, Estimate, Gpu, Layout,
                             LayoutError, estimate, get_gpu, layout_from_config)
from jaxtrain.ledger.estimate import uses_flash
from jaxtrain.ledger.summary import describe
from jaxtrain.ledger.hardware import GiB
from jaxtrain.ledger.layout import (divisors, resolve_degrees, stage_layer_counts,
                                     tensor_splits_model)
from jaxtrain.tools.plan_report import format_plan, format_table

MICRO_BATCHES = (1, 2)
LONG_SEQUENCE = 32768  # where context parallelism starts to pay (Megatron uses it from 32K)
MIN_LAYERS_PER_CHUNK = 2  # finer interleaving buys little bubble for much more p2p latency


@dataclasses.dataclass
class Candidate:
    estimate: Estimate
    role: str = ""   # "recommended", "configured", "recommended+configured" or ""
    why: str = ""    # why it was recommended, or why it loses

    def to_dict(self, index: int) -> dict:
        return {"index": index, "role": self.role, "why": self.why, **self.estimate.to_dict()}


@dataclasses.dataclass
class Plan:
    n_devices: int
    gpu: Gpu
    candidates: list
    walk: list       # one line per step of the derivation

    @property
    def recommended(self) -> Candidate | None:
        return next((c for c in self.candidates if c.role.startswith("recommended")), None)


def with_shape(cfg: Config, seq_len: int | None = None, global_batch: int | None = None) -> Config:
    """A copy of cfg with another sequence length / global batch (for what-if planning)."""
    train, model = cfg.train, cfg.model
    if seq_len:
        train = dataclasses.replace(train, seq_len=seq_len)
        model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq_len))
    if global_batch:
        train = dataclasses.replace(train, global_batch=global_batch)
    return dataclasses.replace(cfg, train=train, model=model)


def _mid(est: Estimate) -> float:
    return sum(est.expected_mfu) / 2


def tensor_options(cfg: Config, n_devices: int, gpu: Gpu) -> list[int]:
    return [t for t in divisors(min(gpu.gpus_per_node, n_devices))
            if n_devices % t == 0 and tensor_splits_model(cfg.model, t)]


def stage_options(cfg: Config, n_devices: int, per_stage: int) -> list[int]:
    opts = [p for p in divisors(cfg.model.num_layers) if n_devices % (per_stage * p) == 0]
    p_cfg = cfg.parallel.stage
    if p_cfg > 1 and p_cfg not in opts and n_devices % (per_stage * p_cfg) == 0:
        try:  # the config's uneven split (first/last_stage_layers)
            stage_layer_counts(cfg, p_cfg)
            opts = sorted(opts + [p_cfg])
        except LayoutError:
            pass
    return opts


def expert_options(cfg: Config, data: int, tensor: int = 1) -> list[tuple[int, int]]:
    """(expert degree, expert_tensor) pairs: divisors of the experts that divide the data
    ranks, and under tensor > 1 the folded degrees (x·tensor, x dividing the data ranks);
    (1, 0) without MoE."""
    e = cfg.model.moe
    if e is None or not any(cfg.model.moe_layers):
        return [(1, 0)]
    plain = [(x, 0) for x in divisors(e.num_experts) if data % x == 0]
    folded = [(x, 1) for x in divisors(e.num_experts)
              if tensor > 1 and x % tensor == 0 and data % (x // tensor) == 0]
    return plain + folded


def _layouts(cfg: Config, n_devices: int, t: int, p: int, c: int, fsdp: int):
    """Every (virtual stages, micro-batch, expert degree) layout for these degrees that
    divides."""
    per_rank = t * p * c * fsdp
    if n_devices % per_rank:
        return
    d, G = n_devices // per_rank, cfg.train.global_batch
    try:
        counts = stage_layer_counts(cfg, p)
    except LayoutError:
        return
    chunk_opts = [1] if p == 1 else [
        v for v in divisors(min(counts))
        if v == 1 or all(n % v == 0 and n // v >= MIN_LAYERS_PER_CHUNK for n in counts)]
    for b in MICRO_BATCHES:
        if G % (d * fsdp * b):
            continue
        m = G // (d * fsdp * b)
        for v in chunk_opts:
            if v > 1 and m % p:
                continue
            for ep, et in expert_options(cfg, d, t):
                yield Layout(tensor=t, stage=p, data=d, fsdp=fsdp, context=c, virtual_stages=v,
                             micro_batch=b, microbatches=m, sequence_parallel=t > 1,
                             zero1=d * c > 1, schedule="interleaved_1f1b" if v > 1 else "1f1b",
                             expert=ep, expert_tensor=et)


def _costed(cfg, gpu, layouts, remat_name):
    out = []
    for layout in layouts:
        try:
            out.append(estimate(cfg, layout, gpu, remat=_REMATS[remat_name]))
        except LayoutError:
            continue
    return out


_REMATS = {**REMAT_VARIANTS, **MOE_REMAT_VARIANTS}


def _walk(cfg, n_devices, gpu, c, fsdp, walk, tensors=None):
    """Rows for each tensor degree: per recompute level, the best layouts at the smallest
    fitting stage degree (and its v=1 variant), plus the failure that shows why."""
    remats = ["none", "selective", "full"]
    if uses_flash(cfg, gpu):
        remats.remove("selective")  # flash already drops what selective core_attn saves
    if any(cfg.model.moe_layers):
        remats[1:1] = list(MOE_REMAT_VARIANTS)   # less recompute than full first
    rows = []
    for t in tensors or tensor_options(cfg, n_devices, gpu):
        found, last_fail, closest_fail = [], None, None
        for r in remats:
            for p in stage_options(cfg, n_devices, t * c * fsdp):
                ests = _costed(cfg, gpu, _layouts(cfg, n_devices, t, p, c, fsdp), r)
                fitting = [e for e in ests if e.fits]
                if not fitting:
                    if ests:
                        fail = min(ests, key=lambda e: e.total_bytes)
                        if r == remats[0]:
                            last_fail = fail
                        if closest_fail is None or fail.total_bytes < closest_fail.total_bytes:
                            closest_fail = fail
                    continue
                best = max(fitting, key=_mid)
                found.append(best)
                plain = [e for e in fitting if e.layout.virtual_stages == 1
                         and e.layout.micro_batch == best.layout.micro_batch]
                if best.layout.virtual_stages > 1 and plain:
                    found.append(max(plain, key=_mid))
                walk.append(f"tensor={t} context={c} remat={r}: smallest fitting stage={p} "
                            f"(best virtual_stages={best.layout.virtual_stages}, "
                            f"micro_batch={best.layout.micro_batch})")
                break
            else:
                walk.append(f"tensor={t} context={c} remat={r}: no stage degree fits")
        fail = last_fail if found else closest_fail
        rows += ([fail] if fail is not None else []) + found
    return rows


def plan(cfg: Config, n_devices: int, gpu: str | Gpu, *, fsdp: int = 1) -> Plan:
    """Walk TP -> PP -> DP (-> CP) and cost every candidate; see the module docstring."""
    gpu = get_gpu(gpu)
    if n_devices < 1:
        raise LayoutError(f"--devices={n_devices}: need at least one device")
    if n_devices > gpu.gpus_per_node and n_devices % gpu.gpus_per_node:
        raise LayoutError(f"--devices={n_devices} is not a whole number of "
                          f"{gpu.gpus_per_node}-GPU nodes; use a multiple of {gpu.gpus_per_node}")
    walk = [f"tensor candidates (inside a {gpu.gpus_per_node}-GPU NVLink node, dividing "
            f"{cfg.model.num_heads} heads / {cfg.model.num_kv_heads} KV heads): "
            f"{tensor_options(cfg, n_devices, gpu)}"]
    rows = _walk(cfg, n_devices, gpu, 1, fsdp, walk)
    why_cp = _why_context(cfg, rows)
    if why_cp:
        seq = cfg.train.seq_len
        for c in divisors(n_devices)[1:]:
            if seq % c:
                continue
            walk.append(f"{why_cp}: trying context={c}")
            # Every tensor degree that leaves room for c: with grouped-query attention a
            # context rank moves only K/V, less than tensor parallelism's activations.
            tensors = [t for t in tensor_options(cfg, n_devices, gpu) if (n_devices // c) % t == 0]
            rows += _walk(cfg, n_devices, gpu, c, fsdp, walk, tensors=tensors)
            if _why_context(cfg, [e for e in rows if e.layout.context == c]) is None:
                break
    if not rows:
        raise LayoutError(
            f"no layout divides this run: global_batch={cfg.train.global_batch}, "
            f"num_layers={cfg.model.num_layers}, {n_devices} devices; change the batch or "
            "device count")
    candidates = _dedupe([Candidate(e) for e in rows])
    configured = _configured(cfg, n_devices, gpu)
    if configured is not None:
        same = next((c for c in candidates if _key(c.estimate) == _key(configured)), None)
        if same:
            same.role = "configured"
        else:
            candidates.append(Candidate(configured, role="configured"))
    _rank(candidates)
    return Plan(n_devices=n_devices, gpu=gpu, candidates=candidates, walk=walk)


def _why_context(cfg: Config, rows: list) -> str | None:
    """Context parallelism is for very long sequences: tried when nothing fits or when the
    sequence is long (what fits without it may be deep pipelines with huge bubbles: the ranking
    by MFU decides)."""
    if not any(e.fits for e in rows):
        return "nothing fits without context parallelism"
    if cfg.train.seq_len >= LONG_SEQUENCE:
        return f"seq_len {cfg.train.seq_len} >= {LONG_SEQUENCE}"
    return None


def _key(e: Estimate):
    return dataclasses.astuple(e.layout) + (e.remat,)


def _dedupe(cands):
    seen, out = set(), []
    for c in cands:
        if _key(c.estimate) not in seen:
            seen.add(_key(c.estimate))
            out.append(c)
    return out


def _configured(cfg, n_devices, gpu):
    try:
        return estimate(cfg, layout_from_config(cfg, n_devices), gpu)
    except ConfigError:
        return None


_LOSS_NAMES = {"compute": "compute", "recompute": "recompute", "bubble": "pipeline bubble",
               "dp_comm": "DP comm", "fsdp_comm": "FSDP comm", "tp_comm": "TP comm",
               "pp_comm": "PP comm", "cp_comm": "CP comm", "ep_comm": "EP all-to-all",
               "overhead": "launch/p2p overhead"}


def _rank(candidates: list) -> None:
    fitting = [c for c in candidates if c.estimate.fits]
    if not fitting:
        for c in candidates:
            c.why = "does not fit: " + _short_overflow(c.estimate)
        return
    best = max(fitting, key=lambda c: (_mid(c.estimate), -c.estimate.total_bytes))
    best.role = "recommended" + ("+configured" if best.role == "configured" else "")
    b = best.estimate
    best.why = (f"highest expected MFU among fitting layouts ({b.expected_mfu[0]:.0%}-"
                f"{b.expected_mfu[1]:.0%}), {b.total_bytes / GiB:.1f} of "
                f"{b.budget_bytes / GiB:.1f} GiB")
    for c in candidates:
        if c is best:
            continue
        e = c.estimate
        if not e.fits:
            c.why = "does not fit: " + _short_overflow(e)
            continue
        deltas = {k: sum(e.losses[k]) / 2 - sum(b.losses[k]) / 2 for k in e.losses}
        worst = max(deltas, key=deltas.get)
        detail = {"bubble": f" ({e.bubble:.1%})",
                  "recompute": f" ({e.hfu_flops_per_token / e.model_flops_per_token - 1:+.0%} "
                               "FLOPs)",
                  "tp_comm": f" ({e.comm_links['tp']})"}.get(worst, "")
        c.why = (f"{_LOSS_NAMES[worst]}{detail} costs {deltas[worst]:+.2f} s/step more; MFU "
                 f"{e.expected_mfu[0]:.0%}-{e.expected_mfu[1]:.0%}")


def _short_overflow(e: Estimate) -> str:
    return (f"{e.overflow} {getattr(e, _TERM[e.overflow]) / GiB:.1f} GiB, total "
            f"{e.total_bytes / GiB:.1f} > {e.budget_bytes / GiB:.1f} GiB")


_TERM = {"static": "static_bytes", "activations": "activation_bytes", "reserve": "reserve_bytes"}


# ----------------------------------------------------------------------------- one layout

def explicit_layout(cfg: Config, n_devices: int, *, tensor=None, stage=None, virtual_stages=None,
                    context=None, micro_batch=None, fsdp=None, sequence_parallel=None,
                    zero1=None, expert=None, expert_tensor=None) -> Layout:
    """The config's layout with some degrees replaced; data (or the config's -1) fills."""
    par = dataclasses.replace(cfg.parallel)
    if expert_tensor is not None:   # 0 (as tensor) or 1 (folded): check_expert_split's rule
        par.expert_tensor = expert_tensor
    for name, val in (("tensor", tensor), ("stage", stage), ("context", context),
                      ("fsdp", fsdp), ("virtual_stages", virtual_stages), ("expert", expert)):
        if val is not None:
            if val < 1:
                raise LayoutError(f"--{name.replace('_', '-')}={val} must be >= 1")
            setattr(par, name, val)
    if -1 not in (par.data, par.fsdp, par.tensor, par.stage, par.context):
        par.data = -1
    if par.virtual_stages > 1:
        par.schedule = "interleaved_1f1b"
    elif par.schedule == "interleaved_1f1b":
        par.schedule = "1f1b"
    sizes = resolve_degrees(dataclasses.replace(cfg, parallel=par), n_devices)
    dp, G = sizes["data"] * sizes["fsdp"], cfg.train.global_batch
    if micro_batch is not None:
        if micro_batch < 1 or G % (dp * micro_batch):
            raise LayoutError(f"--micro-batch={micro_batch}: global_batch={G} is not divisible by "
                              f"data*fsdp={dp} x micro_batch={micro_batch}")
        microbatches = G // (dp * micro_batch)
    else:
        if G % (dp * par.microbatches):
            raise LayoutError(
                f"global_batch={G} is not divisible by data*fsdp={dp} x parallel.microbatches="
                f"{par.microbatches}; pass --micro-batch (one of "
                f"{[b for b in divisors(G // dp) if b <= 16] if G % dp == 0 else 'none'})")
        microbatches = par.microbatches
        micro_batch = G // (dp * microbatches)
    sp = par.sequence_parallel if sequence_parallel is None else sequence_parallel
    z1 = par.zero1 if zero1 is None else zero1
    return Layout(tensor=sizes["tensor"], stage=sizes["stage"], data=sizes["data"],
                  fsdp=sizes["fsdp"], context=sizes["context"],
                  virtual_stages=par.virtual_stages, micro_batch=micro_batch,
                  microbatches=microbatches, sequence_parallel=sp and sizes["tensor"] > 1,
                  zero1=z1, schedule=par.schedule, expert=par.expert,
                  expert_tensor=par.expert_tensor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtrain.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="recipe file, e.g. configs/llama70b.py")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--gpu", default="h100", help="h100, h200, a100 or cpu (an estimate)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of candidates")
    for flag in ("tensor", "stage", "virtual-stages", "context", "micro-batch", "fsdp", "expert"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--expert-tensor", type=int, default=None, choices=(0, 1),
                    help="the experts' tensor degree (Megatron's --expert-tensor-parallel-size): "
                         "0 as --tensor, 1 folds them (--expert counts the tensor ranks too)")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--zero1", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        cfg = with_shape(load_config(args.config), args.seq_len, args.global_batch)
        gpu = get_gpu(args.gpu)
        explicit = {k: getattr(args, k) for k in ("tensor", "stage", "virtual_stages", "context",
                                                  "micro_batch", "expert", "expert_tensor")}
        if any(v is not None for v in explicit.values()):
            from jaxtrain.tools.plan_flags import flagged_estimate
            est, notes = flagged_estimate(cfg, args.devices, gpu, explicit, fsdp=args.fsdp,
                                          sequence_parallel=args.sequence_parallel,
                                          zero1=args.zero1)
            for note in notes:  # stderr under --json: stdout stays one JSON document
                print(note, file=sys.stderr if args.json else sys.stdout)
            cand = Candidate(est, role="explicit",
                             why=est.reason if est.fits else "does not fit: " + est.reason)
            if args.json:
                print(json.dumps([cand.to_dict(0)], indent=1))
            else:
                print(format_table([cand]) + "\n\n" + describe(est))
            return 0 if est.fits else 1
        result = plan(cfg, args.devices, gpu, fsdp=args.fsdp or 1)
    except ConfigError as err:
        print(f"plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([c.to_dict(i) for i, c in enumerate(result.candidates)], indent=1))
    else:
        print(format_plan(result))
    return 0 if result.recommended else 1


if __name__ == "__main__":
    sys.exit(main())

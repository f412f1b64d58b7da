"""Everything a lent GPU should measure, in one command of at most ~8 minutes.

    python bench/gpu_suite.py [--out DIR] [--budget-s 480]      # on one H100/H200
    python bench/gpu_suite.py --smoke --out /tmp/suite           # CPU smoke test (tiny sizes)

Sections, each a list of rows in one table and one JSON (DIR/gpu_suite.json):
  kernel     the flash kernels on the device against the fp32 reference: forward and
             gradients, GQA, packed segments (max |error|, pass at bf16 tolerance), on Triton
             and on Mosaic GPU with the checked and the fast products (the run that confirms
             the fast ones on Hopper)
  attention  causal fwd and fwd+bwd of mosaic, mosaic_fast, pallas (Triton), cudnn and xla at
             seq 4096 and 8192, head dim 128, one document per row and packed 2048-token
             documents (TFLOP/s), and the Triton kernel's block skipping (bench/attention.py)
  fp8        FP8 vs bf16 GEMM speed and whether the compiled HLO runs cuBLASLt FP8 GEMMs
             (bench/fp8.py)
  moe        the MoE experts' grouped GEMM at Mixtral's shapes, even and uneven groups: the
             Mosaic GPU kernels vs ragged_dot vs a padded einsum vs one dense GEMM of the same
             work (bench/moe.py); target: the kernels' fwd+bwd within 80% of the dense GEMM
  model      a ~1B Llama's step time and MFU with each attention, and with FP8 on and off;
             device memory measured (peak bytes in use) vs compiled vs the ledger
  breakdown  a profiled run of the ~1B model through the trainer and its MFU breakdown
             (jaxtrain.tools.mfu_breakdown)
A section that does not fit the time budget, or cannot run here (cudnn off GPU), is listed
with the reason; nothing is silently dropped. Results go to BENCHMARKS.md by hand, with the
date, the device and this command.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attention as attention_bench  # noqa: E402  (bench/attention.py)
import fp8 as fp8_bench  # noqa: E402  (bench/fp8.py)
import moe as moe_bench  # noqa: E402  (bench/moe.py)
from jaxtrain import step  # noqa: E402
from jaxtrain.executors import setup as setup_lib  # noqa: E402
from jaxtrain.parallel import sharding  # noqa: E402
from jaxtrain.tools import hlo  # noqa: E402
from jaxtrain.config import Fp8Config, load_config  # noqa: E402
from jaxtrain.ledger import estimate, get_gpu, layout_from_config  # noqa: E402
from jaxtrain.ledger.flops import mfu  # noqa: E402
from jaxtrain.ledger.hardware import gpu_for_device_kind  # noqa: E402
from jaxtrain.model.kernels import flash_attention, reference_attention  # noqa: E402
from jaxtrain.model.kernels import grouped_matmul  # noqa: E402

# ~1.2B parameters, Llama proportions: 16 layers of hidden 2048, seq 4096, 4 sequences.
MODEL_1B = ["--model.hidden_size=2048", "--model.num_layers=16", "--model.num_heads=16",
            "--model.num_kv_heads=8", "--model.mlp_size=8192", "--model.vocab_size=32768",
            "--model.max_seq_len=4096", "--train.seq_len=4096", "--train.global_batch=4",
            "--model.compute_dtype=bfloat16", "--parallel.data=1"]
MODEL_SMOKE = ["--model.hidden_size=64", "--model.num_layers=2", "--model.num_heads=4",
               "--model.num_kv_heads=2", "--model.mlp_size=128", "--model.vocab_size=512",
               "--model.max_seq_len=64", "--train.seq_len=32", "--train.global_batch=2",
               "--model.compute_dtype=float32", "--parallel.data=1"]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _err(e: Exception) -> str:
    return attention_bench._short_error(e)


# ----------------------------------------------------------------------------- sections

def kernel_rows(smoke: bool) -> list[dict]:
    """The flash kernel on this device against the fp32 reference, forward and gradients."""
    on_gpu = jax.default_backend() == "gpu"
    cases = [(1, 256, 4, 2, 64)] if smoke else [(2, 2048, 16, 4, 128), (1, 4096, 8, 1, 128),
                                                (2, 1024, 16, 16, 64)]
    dtype = jnp.float32 if smoke else jnp.bfloat16
    tol = 2e-5 if smoke else 3e-2
    mosaic_skip = attention_bench._skip_reason("mosaic")
    backends = [("triton", False)] + ([] if mosaic_skip else [("mosaic", False), ("mosaic", True)])
    rows = [] if not mosaic_skip else [dict(section="kernel", case="mosaic", skipped=mosaic_skip)]
    rng = np.random.default_rng(0)
    for b, s, h, k, d in cases:
        q = jnp.asarray(rng.standard_normal((b, s, h, d)), dtype)
        kv = [jnp.asarray(rng.standard_normal((b, s, k, d)), dtype) for _ in range(2)]
        seg = jnp.asarray(attention_bench.packed_segments(b, s, max(s // 3, 16)))
        do = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)

        def loss(fn, q, k, v):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * do)
        ref = lambda q, k, v: reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                                  seg)  # noqa: E731
        want = jax.jit(jax.value_and_grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, *kv)
        for backend, fast in backends:
            flash = lambda q, k, v: flash_attention(q, k, v, seg, interpret=not on_gpu,  # noqa
                                                    backend=backend, fast_mma=fast)
            got = jax.jit(jax.value_and_grad(lambda *a: loss(flash, *a),
                                             argnums=(0, 1, 2)))(q, *kv)
            out_err = float(jnp.max(jnp.abs(flash(q, *kv).astype(jnp.float32) - ref(q, *kv))))
            grad_err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b_)))
                           for a, b_ in zip(got[1], want[1]))
            name = backend + (" fast" if fast else "")
            rows.append(dict(section="kernel", case=f"{name} B{b} S{s} H{h} K{k} D{d} segments",
                             out_err=out_err, grad_err=grad_err,
                             ok=out_err <= tol and grad_err <= tol * 4))
    return rows


def attention_rows(smoke: bool, budget: Budget) -> list[dict]:
    out = []
    for doc_len in (None, 256 if smoke else 2048):
        if budget.left() < 90:
            out.append(dict(section="attention", doc_len=doc_len, skipped="time budget"))
            continue
        packed = ["--doc-len", str(doc_len)] if doc_len else []
        args = attention_bench.parse_args(
            ["--quick", *packed] if smoke else
            ["--seq-lens", "4096,8192", "--tokens", "16384", "--heads", "32", "--kv-heads", "8",
             "--head-dim", "128", "--iters", "10", *packed])
        rows, skipped = attention_bench.run(args)
        out += [dict(section="attention", doc_len=doc_len, **r) for r in rows]
        out += [dict(section="attention", doc_len=doc_len, impl=i, skipped=why)
                for i, why in skipped.items()]
    if budget.left() > 60:
        packed = attention_bench.packed_documents(
            seq_len=256 if smoke else 8192, doc_lens=(256, 64) if smoke else (8192, 2048, 512),
            tokens=256 if smoke else 16384, heads=2 if smoke else 16, head_dim=16 if smoke else 128,
            dtype="float32" if smoke else "bfloat16", iters=2 if smoke else 10)
        out += [dict(section="attention", skipping=True, **r) for r in packed]
    else:
        out.append(dict(section="attention", skipping=True, skipped="time budget"))
    return out


def fp8_rows(smoke: bool) -> list[dict]:
    sizes = [(256, 256, 256)] if smoke else [(8192, 8192, 8192), (16384, 28672, 8192)]
    cfg = Fp8Config(enabled=True)
    return [dict(section="fp8", **fp8_bench.gemm_row(m, n, k, 2 if smoke else 10, cfg))
            for m, n, k in sizes]


def moe_rows(smoke: bool) -> list[dict]:
    """bench/moe.py's rows, even (skew 0) and Dirichlet(1) group sizes (smoke: the uneven
    ones). ok: the kernels agree with ragged_dot to a few bf16 ulps and, on a GPU, their
    forward+backward runs within 80% of the dense GEMM of the same work (smoke: interpret
    mode, no timing)."""
    shape, config = ((moe_bench.QUICK, grouped_matmul.INTERPRET) if smoke else
                     (moe_bench.MIXTRAL, grouped_matmul.GroupedMatmulConfig()))
    rows = []
    for skew in (1.0,) if smoke else (0.0, 1.0):
        for r in moe_bench.timed_rows(**shape, skew=skew, iters=10, config=config):
            if r["impl"] == "mosaic":
                fast = not r["timing"] or r["passes"] != "fwd+bwd" or r["vs_dense"] >= 0.8
                r["ok"] = r["rel_err_vs_ragged_dot"] <= 2 ** -6 and fast
            rows.append(dict(section="moe", skew=skew, **r))
    return rows


def _peak(cfg) -> float:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return get_gpu("cpu").peak_flops(cfg.model.compute_dtype)
    return gpu_for_device_kind(device.device_kind).peak_flops(cfg.model.compute_dtype)


def model_row(overrides: list[str], label: str, reps: int) -> dict:
    """Step time, MFU and memory (measured, compiled, ledger) of one config on one device."""
    from jaxtrain.tools.remat_sweep import random_batch, zero_train_state
    cfg = load_config("configs/tiny.py", overrides)
    mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:1])
    setup = setup_lib.build(cfg, mesh)
    state = zero_train_state(setup)
    batch = random_batch(cfg, mesh)
    train_step = step.make_train_step(setup, donate=False)
    compiled = train_step.lower(state, batch).compile()
    seconds = fp8_bench.timeit(lambda: compiled(state, batch), reps=reps)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    stats = jax.devices()[0].memory_stats() or {}
    layout = layout_from_config(cfg, 1)
    gpu = gpu_for_device_kind(jax.devices()[0].device_kind) \
        if jax.default_backend() == "gpu" else get_gpu("cpu")
    est = estimate(cfg, layout, gpu)
    return dict(section="model", config=label, step_ms=seconds * 1e3,
                tokens_per_s=tokens / seconds,
                mfu=mfu(cfg, tokens / seconds, 1, _peak(cfg)),
                measured_peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30 or None,
                compiled_gib=hlo.memory(compiled)["total_bytes"] / 2**30,
                ledger_gib=est.total_bytes / 2**30,
                fp8_in_hlo=fp8_bench.fp8_matmuls_in(compiled) if cfg.fp8.enabled else "")


def model_rows(smoke: bool, budget: Budget) -> list[dict]:
    base = MODEL_SMOKE if smoke else MODEL_1B
    impls = ("xla", "pallas") if smoke else ("mosaic", "pallas", "cudnn", "xla")
    variants = [(f"attention={i}", [f"--model.attention={i}"]) for i in impls]
    variants.append(("attention=pallas fp8", ["--model.attention=pallas", "--fp8.enabled=true"]))
    rows = []
    for label, extra in variants:
        if budget.left() < 60:
            rows.append(dict(section="model", config=label, skipped="time budget"))
            continue
        if "cudnn" in label and jax.default_backend() != "gpu":
            rows.append(dict(section="model", config=label, skipped="cuDNN needs a GPU"))
            continue
        try:
            rows.append(model_row([*base, *extra], label, 2 if smoke else 10))
        except Exception as e:  # noqa: BLE001 - a failed row is reported, not fatal
            rows.append(dict(section="model", config=label, error=_err(e)))
    return rows


def breakdown_rows(smoke: bool, out_dir: pathlib.Path) -> list[dict]:
    """Train the ~1B model a few steps with a profile, then the MFU breakdown of the trace."""
    from jaxtrain import trainer
    from jaxtrain.tools.mfu_breakdown import breakdown
    workdir = out_dir / "profiled_run"
    cfg = load_config("configs/tiny.py", [
        *(MODEL_SMOKE if smoke else MODEL_1B), "--model.attention=auto",
        "--train.steps=6", "--train.profile_start=3", "--train.profile_steps=2",
        "--train.eval_every=0", "--train.log_every=1", f"--train.workdir={workdir}",
        "--checkpoint.every=0", "--data.corpus_max_bytes=2000000",
        "--parallel.data=-1", f"--train.global_batch={4 * jax.device_count()}"])
    trainer.train(cfg, log=lambda s: print(s, file=sys.stderr))
    bd = breakdown(workdir)
    bd.save(out_dir)
    print(bd.format())
    return [dict(section="breakdown", **{k: v for k, v in bd.to_json().items()
                                         if not isinstance(v, (list, dict))})]


# ----------------------------------------------------------------------------- the table

def format_rows(rows: list[dict]) -> str:
    lines = [f"GPU suite on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
             f"jax {jax.__version__}"]
    for r in rows:
        cells = [f"{k}={_cell(v)}" for k, v in r.items() if k != "section"]
        lines.append(f"  {r['section']:10} " + "  ".join(cells))
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, tuple):
        return "/".join(_cell(x) for x in v)
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU smoke test")
    ap.add_argument("--out", default=None, help="folder for gpu_suite.json and the breakdown")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting sections after")
    ap.add_argument("--sections", nargs="+", default=["kernel", "attention", "fp8", "moe",
                                                      "model", "breakdown"])
    args = ap.parse_args(argv)
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="gpu_suite_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    sections = {"kernel": lambda: kernel_rows(args.smoke),
                "attention": lambda: attention_rows(args.smoke, budget),
                "fp8": lambda: fp8_rows(args.smoke),
                "moe": lambda: moe_rows(args.smoke),
                "model": lambda: model_rows(args.smoke, budget),
                "breakdown": lambda: breakdown_rows(args.smoke, out_dir)}
    rows = []
    for name in args.sections:
        if budget.left() < 30:
            rows.append(dict(section=name, skipped="time budget"))
            continue
        t0 = time.monotonic()
        try:
            rows += sections[name]()
        except Exception as e:  # noqa: BLE001 - a failed section is reported, not fatal
            rows.append(dict(section=name, error=_err(e)))
        print(f"  {name} done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    print(format_rows(rows))
    (out_dir / "gpu_suite.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
         "jax": jax.__version__, "rows": rows}, indent=1, default=str))
    print(f"wrote {out_dir / 'gpu_suite.json'}")
    failed = [r for r in rows if "error" in r or r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

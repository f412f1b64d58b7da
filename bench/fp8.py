"""FP8 vs bf16: a GEMM sweep and a whole train step.

    python bench/fp8.py                  # GPU: GEMMs up to 8192^3, a ~1B-parameter model step
    python bench/fp8.py --quick          # CPU smoke test (FP8 is emulated there: no speedup)

GEMMs time a jitted forward (y = x @ w) and a forward+backward (grad of sum(y) w.r.t. x and w)
with jaxtrain's delayed-scaling `fp8_dot_general` against a plain bf16 dot; FLOPs are 2·M·N·K
forward and 3x that for forward+backward. The model step is `step.make_train_step` on one
device with `fp8.enabled` true and false. For each FP8 program the script also reports whether
the compiled HLO really runs FP8 matmuls (f8 operands of a dot or a cuBLASLt FP8 custom call),
since XLA silently falls back to upcasting when it cannot use FP8 tensor cores.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.model import fp8_matmul  # noqa: E402
from jaxtrain.config import Fp8Config, load_config  # noqa: E402

_F8_GEMM = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')


def fp8_matmuls_in(compiled) -> str:
    text = compiled.as_text()
    gemms = len(_F8_GEMM.findall(text))
    dots = sum(1 for line in text.splitlines() if "f8e" in line.lower() and " dot(" in line)
    if gemms:
        return f"{gemms} cuBLASLt FP8 GEMMs"
    if dots:
        return f"{dots} dots with f8 operands"
    return "none (upcast)"


def timeit(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_row(m: int, n: int, k: int, reps: int, cfg: Fp8Config) -> dict:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    meta = fp8_matmul.init_meta(cfg)

    def bf16(x, w):
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.bfloat16)

    def f8(x, w, meta):
        return fp8_matmul.fp8_dot_general(x, w, dims, meta=meta, cfg=cfg,
                                          preferred_element_type=jnp.bfloat16)

    def fwd_bwd(f, *extra):
        return jax.jit(jax.grad(lambda x, w, *e: jnp.sum(f(x, w, *e).astype(jnp.float32)),
                                argnums=(0, 1)))

    flops = 2.0 * m * n * k
    fwd_b, fwd_f = jax.jit(bf16), jax.jit(f8)
    fb_b, fb_f = fwd_bwd(bf16), fwd_bwd(f8)
    t = {"fwd_bf16": timeit(fwd_b, x, w, reps=reps), "fwd_fp8": timeit(fwd_f, x, w, meta, reps=reps),
         "fb_bf16": timeit(fb_b, x, w, reps=reps), "fb_fp8": timeit(fb_f, x, w, meta, reps=reps)}
    return {"shape": f"{m}x{n}x{k}",
            "fwd": (flops / t["fwd_bf16"] / 1e12, flops / t["fwd_fp8"] / 1e12),
            "fwd_bwd": (3 * flops / t["fb_bf16"] / 1e12, 3 * flops / t["fb_fp8"] / 1e12),
            "fp8_in_hlo": fp8_matmuls_in(fwd_f.lower(x, w, meta).compile())}


def model_step(overrides: list[str], reps: int) -> dict:
    from jaxtrain import step
    from jaxtrain.executors import setup as setup_lib
    from jaxtrain.parallel import sharding
    from jaxtrain.tools.remat_sweep import random_batch
    out = {}
    for enabled in (False, True):
        cfg = load_config("configs/tiny.py", [*overrides, f"--fp8.enabled={str(enabled).lower()}",
                                              "--parallel.data=-1"])
        mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:1])
        setup = setup_lib.build(cfg, mesh)
        state = setup_lib.init_train_state(setup, 0)
        train_step = step.make_train_step(setup, donate=False)
        batch = random_batch(cfg, mesh)
        b, s = cfg.train.global_batch, cfg.train.seq_len
        run = functools.partial(train_step, state)
        seconds = timeit(run, batch, reps=reps)
        label = "fp8" if enabled else "bf16"
        out[label] = seconds
        if enabled:
            out["fp8_in_hlo"] = fp8_matmuls_in(train_step.lower(state, batch).compile())
        out["tokens"] = b * s
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    cfg = Fp8Config(enabled=True)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    sizes = [(256, 256, 256)] if args.quick else [(m, m, m) for m in (1024, 2048, 4096, 8192)] + [
        (16384, 8192, 8192), (16384, 28672, 8192), (16384, 8192, 28672)]
    print("\n| M x N x K | fwd bf16 TFLOP/s | fwd fp8 | speedup | fwd+bwd bf16 | fwd+bwd fp8 | "
          "speedup | FP8 in compiled HLO |\n|---|---|---|---|---|---|---|---|")
    for m, n, k in sizes:
        r = gemm_row(m, n, k, 2 if args.quick else args.reps, cfg)
        (fb, ff), (bb, bf) = r["fwd"], r["fwd_bwd"]
        print(f"| {r['shape']} | {fb:.1f} | {ff:.1f} | {ff / fb:.2f}x | {bb:.1f} | {bf:.1f} | "
              f"{bf / bb:.2f}x | {r['fp8_in_hlo']} |")
    # ~1.2B parameters: 16 layers of hidden 2048 (Llama proportions), seq 4096.
    model = (["--model.hidden_size=128", "--model.num_layers=2", "--train.global_batch=2",
              "--train.seq_len=64", "--model.mlp_size=384"] if args.quick else
             ["--model.hidden_size=2048", "--model.num_layers=16", "--model.num_heads=16",
              "--model.num_kv_heads=8", "--model.mlp_size=8192", "--model.vocab_size=32768",
              "--model.max_seq_len=4096", "--train.seq_len=4096", "--train.global_batch=4"])
    r = model_step([*model, "--model.compute_dtype=bfloat16"], 2 if args.quick else args.reps)
    print(f"\nmodel step ({' '.join(model)}): bf16 {r['bf16'] * 1e3:.1f} ms, fp8 "
          f"{r['fp8'] * 1e3:.1f} ms, speedup {r['bf16'] / r['fp8']:.2f}x; "
          f"{r['tokens'] / r['fp8']:,.0f} tokens/s with FP8; FP8 in HLO: {r['fp8_in_hlo']}")


if __name__ == "__main__":
    main()

"""The MoE experts' grouped GEMM: jaxtrain's Mosaic GPU kernels vs lax.ragged_dot vs a padded
batched einsum, against one dense GEMM of the same total work.

    python bench/moe.py                            # GPU: Mixtral's shapes, bf16, timed
    python bench/moe.py --compile-only             # no GPU: compiled for a compile-only H100
    python bench/moe.py --quick                    # CPU smoke test: tiny shapes

Shapes: M routed rows (tokens x top-k) over E experts of [K, N] (Mixtral 8x7B's gate/up
projection: 16384 rows, 4096 x 14336, 8 experts). Group sizes: even, or drawn from a Dirichlet
(--skew, smaller is more uneven) as a router in training gives them. The work of one product
is 2·M·K·N FLOPs whatever the grouping; "fwd+bwd" is the forward and both backward products
(dX, dW): 3x. Impls:
  mosaic         kernels/grouped_matmul.py (forward, dX and dW kernels)
  ragged_dot     lax.ragged_dot (XLA; at jax 0.10 one dense GEMM of E times the work on GPU)
  padded_einsum  each expert's rows gathered into [E, C, K] with C the largest group, a
                 batched einsum, scattered back (what fixed-capacity dispatch computes)
  dense          one [M, K] x [K, N] GEMM: the target (the grouped GEMM within 80% of it)

--quick runs the kernels in Mosaic GPU interpret mode: that checks them against ragged_dot,
it is NOT a timing (interpret mode simulates every thread in Python). --compile-only reports
what the compiled H100 program would run: its matmul FLOPs against the grouped work (E-fold
for ragged_dot), the Mosaic kernels' registers, spills and shared memory, and its temporaries.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fp8 as fp8_bench  # noqa: E402  (bench/fp8.py: timeit)
from jaxtrain.model.kernels import grouped_matmul as gm  # noqa: E402

MIXTRAL = dict(m=16384, k=4096, n=14336, e=8)
QUICK = dict(m=192, k=128, n=128, e=4)
IMPLS = ("mosaic", "ragged_dot", "padded_einsum", "dense")


def group_sizes(m: int, e: int, skew: float, seed: int = 0) -> np.ndarray:
    """e int32 sizes summing to m: even (skew <= 0) or from a Dirichlet(skew)."""
    if skew <= 0:
        sizes = np.full(e, m // e)
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    share = np.random.default_rng(seed).dirichlet(np.full(e, skew))
    sizes = np.floor(share * m).astype(np.int64)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes.astype(np.int32)


def _padded_einsum(sizes: np.ndarray):
    """(x, w, _) -> y through [E, C, K] buffers, C the largest group (host-known sizes)."""
    e, cap = len(sizes), int(sizes.max())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows_EC = starts[:, None] + np.arange(cap)
    valid_EC = np.arange(cap) < sizes[:, None]
    rows_EC = jnp.asarray(np.where(valid_EC, rows_EC, 0))
    valid_EC = jnp.asarray(valid_EC)

    def run(x, w, _):
        x_ECK = jnp.where(valid_EC[..., None], x[rows_EC], 0)
        y_ECN = jnp.einsum("eck,ekn->ecn", x_ECK, w)
        y = jnp.zeros((x.shape[0], w.shape[2]), y_ECN.dtype)
        return y.at[rows_EC].add(jnp.where(valid_EC[..., None], y_ECN, 0))
    del e
    return run


def impl_fn(impl: str, sizes: np.ndarray, config: gm.GroupedMatmulConfig):
    if impl == "mosaic":
        return functools.partial(gm.grouped_matmul, config=config)
    if impl == "ragged_dot":
        return gm.reference
    if impl == "padded_einsum":
        return _padded_einsum(sizes)
    return lambda x, w, _: x @ w[0]


def _passes(fn, sizes_arr):
    def fwd(x, w):
        return fn(x, w, sizes_arr)

    def fwd_bwd(x, w, ct):
        y, pull = jax.vjp(fwd, x, w)
        return y, pull(ct)
    return {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(fwd_bwd)}


def timed_rows(m, k, n, e, *, skew=0.0, dtype="bfloat16", iters=10, impls=IMPLS,
               config=gm.GroupedMatmulConfig()) -> list[dict]:
    """Time each impl's forward and forward+backward; TFLOP/s of the grouped work and the
    ratio to the dense GEMM's (the ratio of their times). Off GPU the kernels interpret: their
    error against ragged_dot is reported and the times are not timings."""
    sizes = group_sizes(m, e, skew)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (e, k, n), jnp.float32).astype(dtype)
    ct = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
    on_gpu = jax.default_backend() == "gpu"
    rows, seconds, outs = [], {}, {}
    for impl in impls:
        fns = _passes(impl_fn(impl, sizes, config), jnp.asarray(sizes))
        for name, fn in fns.items():
            args = (x, w) if name == "fwd" else (x, w, ct)
            sec = fp8_bench.timeit(fn, *args, reps=iters if on_gpu else 1)
            seconds[impl, name] = sec
            outs[impl, name] = fn(*args)
            work = 2.0 * m * k * n * (1 if name == "fwd" else 3)
            rows.append(dict(impl=impl, passes=name, sizes=sizes.tolist(), ms=sec * 1e3,
                             tflops=work / sec / 1e12, timing=on_gpu))
    for r in rows:
        dense = seconds.get(("dense", r["passes"]))
        r["vs_dense"] = dense / seconds[r["impl"], r["passes"]] if dense else None
        if r["impl"] in ("mosaic", "padded_einsum"):   # max |diff| / max |ragged_dot|
            pairs = zip(jax.tree.leaves(outs[r["impl"], r["passes"]]),
                        jax.tree.leaves(outs["ragged_dot", r["passes"]]))
            r["rel_err_vs_ragged_dot"] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                      / jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in pairs)
    return rows


def compiled_rows(m, k, n, e, *, target="h100", dtype="bfloat16") -> list[dict]:
    """Each impl's forward+backward compiled for one compile-only GPU: matmul FLOPs the
    program runs over the grouped work, Mosaic kernels and their resources, temporaries."""
    from jax.sharding import SingleDeviceSharding
    from jaxtrain.tools import gpu_kernels, hlo, targets
    sh = SingleDeviceSharding(targets.devices(target, 1)[0])
    sizes = group_sizes(m, e, 0.0)
    shapes = [jax.ShapeDtypeStruct(s, jnp.dtype(dtype), sharding=sh)
              for s in ((m, k), (e, k, n), (m, n))]
    grouped_work = 3 * 2.0 * m * k * n
    rows = []
    for impl in IMPLS:
        fwd_bwd = _passes(impl_fn(impl, sizes, gm.GroupedMatmulConfig()),
                          jnp.asarray(sizes))["fwd+bwd"]
        with tempfile.TemporaryDirectory() as dump:
            t0 = time.perf_counter()
            with gpu_kernels.mosaic_dump(dump):
                compiled = fwd_bwd.lower(*shapes).compile()
            compile_s = time.perf_counter() - t0
            text = compiled.as_text()
            kernels = gpu_kernels.mosaic_kernels(dump, gpu_kernels.mosaic_kernel_names(text))
        rows.append(dict(
            impl=impl, compile_s=compile_s,
            matmul_flops_over_grouped_work=hlo.matmul_flops_from_text(text) / grouped_work,
            mosaic_kernels=text.count('custom_call_target="mosaic_gpu_v2"'),
            temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
            kernels=[dict(name=x.name, registers=x.registers, spills=x.spills,
                          smem_kib=x.shared_memory / 1024, grid=x.grid) for x in kernels]))
    return rows


def format_rows(rows: list[dict]) -> str:
    out = []
    for r in rows:
        cells = []
        for key, v in r.items():
            if key == "kernels":
                v = "; ".join(f"{x['name']} {x['registers']} regs, "
                              f"{'spills' if x['spills'] else 'no spills'}, "
                              f"{x['smem_kib']:.0f} KiB smem" for x in v) or "-"
            elif isinstance(v, float):
                v = f"{v:.4g}"
            cells.append(f"{key}={v}")
        out.append("  ".join(cells))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile for a compile-only GPU (needs JAX_PLATFORMS=cpu)")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="Dirichlet concentration of the group sizes (0: even)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if args.compile_only:
        print(format_rows(compiled_rows(**MIXTRAL, target=args.target)))
        return 0
    if not args.quick and jax.default_backend() != "gpu":
        print("bench/moe.py times the kernels on a GPU; here use --quick (interpret mode, a "
              "check, not a timing) or --compile-only", file=sys.stderr)
        return 2
    shape, config = (QUICK, gm.INTERPRET) if args.quick else (MIXTRAL, gm.GroupedMatmulConfig())
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: M={shape['m']} "
          f"K={shape['k']} N={shape['n']} E={shape['e']}")
    print(format_rows(timed_rows(**shape, skew=args.skew, iters=args.iters, config=config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

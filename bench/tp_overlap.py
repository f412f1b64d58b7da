"""Static overlap of the tensor axis on compile-only H100s under XLA:GPU's own options and
under parallel.collective_matmul (the ppermute rings).

    JAX_PLATFORMS=cpu python bench/tp_overlap.py [--layers 4] [--variants NAME ...]

Compiles a depth-sliced Llama 3 8B at TP8 + SP (one microbatch loop, 8 H100s) once per
variant (`train.xla_flags` and config overrides) and prints, per variant, the tensor axis's wire bytes with a
matmul-class kernel scheduled between each collective's start and done (gpu_program's
static overlap), the collectives' count and the step's memory. Nothing runs: which variant
is faster on hardware is not measured here.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# name -> train.xla_flags, or (train.xla_flags, further config overrides)
VARIANTS = {
    "default": "",
    "windowed_einsum_0": "xla_gpu_threshold_for_windowed_einsum_mib=0",
    "windowed_einsum_0_multi_stream": ("xla_gpu_threshold_for_windowed_einsum_mib=0 "
                                       "xla_gpu_multi_streamed_windowed_einsum=true"),
    "pipelined_ag_rs": ("xla_gpu_enable_pipelined_all_gather=true "
                        "xla_gpu_enable_pipelined_reduce_scatter=true"),
    "overlap_limit_2": "xla_gpu_experimental_parallel_collective_overlap_limit=2",
    "double_buffering": "xla_gpu_enable_while_loop_double_buffering=true",
    "collective_matmul": ("", ["--parallel.collective_matmul=true"]),
    # XLA's own dot-merger threshold (jaxtrain turns the merger off with collective_matmul)
    "collective_matmul_dot_merger": ("xla_gpu_dot_merger_threshold_mb=32",
                                     ["--parallel.collective_matmul=true"]),
    "collective_matmul_overlap_limit_2": (
        "xla_gpu_experimental_parallel_collective_overlap_limit=2",
        ["--parallel.collective_matmul=true"]),
    "collective_matmul_full_remat": ("", ["--parallel.collective_matmul=true",
                                          "--remat.granularity=full", "--remat.num_layers=1"]),
    "full_remat": ("", ["--remat.granularity=full", "--remat.num_layers=1"]),
}


def measure(layers: int, flags: str, extra=()) -> dict:
    from jaxtrain.config import load_config
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import gpu_program, hlo, targets
    from jaxtrain.tools.compile_step import compile_step
    cfg = load_config("configs/llama3_8b.py", [
        "--parallel.tensor=8", "--parallel.sequence_parallel=true", "--parallel.data=1",
        "--parallel.zero1=false", f"--model.num_layers={layers}", "--train.global_batch=4",
        "--parallel.microbatches=4", f"--train.xla_flags={flags}", *extra])
    t = time.perf_counter()
    out = compile_step(cfg, sharding.make_mesh(cfg.parallel, targets.devices("h100", 8)))
    acs = gpu_program.async_collectives(out.text, out.mesh)
    hidden, total = gpu_program.overlap_by_axis(acs).get(("tensor",), (0.0, 0.0))
    return {"tensor_overlap": hidden / total if total else None, "tensor_gb": total / 1e9,
            "tensor_ops": sum(a.collective.axes == ("tensor",) for a in acs),
            "total_gib": hlo.memory(out.compiled)["total_bytes"] / 2 ** 30,
            "compile_s": time.perf_counter() - t}


def main(argv=None) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = ap.parse_args(argv)
    for name in args.variants:
        flags, extra = (VARIANTS[name] if isinstance(VARIANTS[name], tuple)
                        else (VARIANTS[name], []))
        print(json.dumps({"variant": name, "flags": flags, "overrides": extra,
                          **measure(args.layers, flags, extra)}), flush=True)


if __name__ == "__main__":
    main()

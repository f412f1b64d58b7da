"""Communication of the train step compiled for compile-only H100s (no GPU needed).

    JAX_PLATFORMS=cpu python bench/comm_gpu.py [--layouts fsdp8_uniform1 ...] [--fp8] [--json OUT]

The shapes of issue 13's comparison with MaxText: an 8-layer Llama 3 8B, fp32 masters, bf16
compute, seq 4096, on 8 compile-only H100s (the real XLA:GPU compiler; jaxtrain.tools.targets).
For each layout: ring wire bytes per step by kind and mesh axis, temporaries, collectives per
layer per microbatch (inside the layer loop), and the static overlap (wire bytes with compute
scheduled between an async collective's start and done). `--fp8`: every layer in FP8
(`fp8.bf16_first_layers=0`, `bf16_last_layers=0`; issue 30's FSDP gather check).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxtrain import xla_flags  # noqa: E402
from jaxtrain.parallel import sharding  # noqa: E402
from jaxtrain.tools import gpu_program, hlo, targets  # noqa: E402
from jaxtrain.tools.compile_step import compile_step  # noqa: E402
from jaxtrain.config import load_config  # noqa: E402

MODEL = ["--model.num_layers=8", "--train.seq_len=4096", "--model.attention=auto"]
ALL_FP8 = ["--fp8.enabled=true", "--fp8.bf16_first_layers=0", "--fp8.bf16_last_layers=0"]
FSDP8 = ["--parallel.data=1", "--parallel.fsdp=8", "--parallel.tensor=1",
         "--parallel.sequence_parallel=false", "--parallel.zero1=false",
         "--parallel.microbatches=1", "--train.global_batch=8"]
LAYOUTS = {
    "fsdp8_uniform1": FSDP8 + ["--remat.granularity=full", "--remat.method=uniform",
                               "--remat.num_layers=1"],
    "fsdp8_block": FSDP8 + ["--remat.granularity=full", "--remat.method=block",
                            "--remat.num_layers=8"],
    "fsdp8_none": FSDP8 + ["--remat.granularity=none"],
    "tp8_sp": ["--parallel.data=1", "--parallel.fsdp=1", "--parallel.tensor=8",
               "--parallel.sequence_parallel=true", "--parallel.zero1=false",
               "--parallel.microbatches=1", "--train.global_batch=1",
               "--remat.granularity=none"],
}


def measure(name: str, extra: Sequence[str] = (), options: dict | None = None) -> dict:
    cfg = load_config("configs/llama3_8b.py", [*MODEL, *LAYOUTS[name], *extra])
    mesh = sharding.make_mesh(cfg.parallel, targets.devices("h100", 8))
    out = compile_step(cfg, mesh, extra_options=options)
    colls = hlo.collectives_from_text(out.text, mesh)
    wire = collections.Counter()
    for c in colls:
        wire[f"{c.kind} {','.join(c.axes or ('?',))}"] += c.wire_bytes_per_step
    layers = cfg.model.num_layers
    # per layer per microbatch: the ops inside loops that run once per layer
    per_layer = collections.Counter(c.kind for c in colls if c.in_loop and c.count % layers == 0
                                    for _ in range(c.count // layers))
    acs = gpu_program.async_collectives(out.text, mesh)
    overlap = gpu_program.overlap_by_axis(acs)
    ag_overlap = gpu_program.overlap_by_axis([a for a in acs
                                              if a.collective.kind == "all-gather"])
    gathers = [c for c in colls if c.kind == "all-gather"]
    return {
        "layout": name, "wire_bytes": sum(wire.values()), "by_kind_axis": dict(wire),
        "all_gather_wire_bytes": sum(c.wire_bytes_per_step for c in gathers),
        "temp_bytes": hlo.memory(out.compiled)["temp_bytes"],
        "collectives_per_layer": dict(per_layer),
        "overlap": {",".join(a or ("?",)): (h / t if t else None) for a, (h, t) in overlap.items()},
        "all_gather_overlap": {",".join(a or ("?",)): (h / t if t else None)
                               for a, (h, t) in ag_overlap.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--attention", default="auto", help="model.attention (auto: pallas on GPU)")
    ap.add_argument("--fp8", action="store_true", help="every layer in FP8")
    ap.add_argument("--xla", action="append", default=[], metavar="FLAG=VALUE",
                    help="an XLA compile option on top of the defaults (repeatable)")
    args = ap.parse_args(argv)
    options = dict(xla_flags.parse_option(o, "--xla") for o in args.xla)
    rows = []
    for name in args.layouts:
        r = measure(name, [f"--model.attention={args.attention}", *(ALL_FP8 if args.fp8 else [])],
                    options)
        rows.append(r)
        print(f"{name:16} wire {r['wire_bytes'] / 1e9:8.3f} GB  all-gather "
              f"{r['all_gather_wire_bytes'] / 1e9:8.3f} GB  temp {r['temp_bytes'] / 2**30:6.2f} "
              f"GiB  per layer {r['collectives_per_layer']}  overlap "
              + ", ".join(f"{a} {v:.0%}" for a, v in r["overlap"].items() if v is not None)
              + " (all-gathers: " + ", ".join(f"{a} {v:.0%}" for a, v in
                                             r["all_gather_overlap"].items() if v) + ")",
              flush=True)
        for k, v in sorted(r["by_kind_axis"].items()):
            print(f"    {k:28} {v / 1e9:8.3f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

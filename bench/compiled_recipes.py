"""The five recipes' train steps compiled for compile-only H100s: memory and collective bytes.

    JAX_PLATFORMS=cpu python bench/compiled_recipes.py OUT.json       # measure (~2 min)
    python bench/compiled_recipes.py --compare BEFORE.json AFTER.json  # what changed

The recipes and layouts are tests/test_gpu_compile.py's RECIPES (the ledger's calibration
points). Per recipe: memory_analysis() (hlo.memory) and the payload bytes per step of every
collective kind over its mesh axes (hlo.collectives). A refactor that should not change the
program compares the two files: equal bytes, or the differences listed.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def measure(out_path: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from test_gpu_compile import RECIPES

    from jaxtrain.config import load_config
    from jaxtrain.parallel import sharding
    from jaxtrain.tools import hlo, targets
    from jaxtrain.tools.compile_step import compile_step
    out = {}
    for name, (path, n, overrides) in RECIPES.items():
        cfg = load_config(path, overrides)
        step = compile_step(cfg, sharding.make_mesh(cfg.parallel, targets.devices("h100", n)))
        by_kind: dict[str, int] = {}
        colls = hlo.collectives(step.compiled, step.mesh)
        for c in colls:
            key = f"{c.kind}:{','.join(c.axes or ('?',))}"
            by_kind[key] = by_kind.get(key, 0) + c.bytes_per_step
        out[name] = {"memory": hlo.memory(step.compiled), "collectives": len(colls),
                     "collective_bytes": dict(sorted(by_kind.items()))}
        print(name, json.dumps(out[name]), flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


def compare(before_path: str, after_path: str) -> None:
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    for name in before:
        a, b = before[name], after[name]
        diffs = {f"memory {k}": b["memory"][k] - v for k, v in a["memory"].items()
                 if b["memory"][k] != v}
        kinds = set(a["collective_bytes"]) | set(b["collective_bytes"])
        diffs |= {k: b["collective_bytes"].get(k, 0) - a["collective_bytes"].get(k, 0)
                  for k in sorted(kinds)
                  if b["collective_bytes"].get(k, 0) != a["collective_bytes"].get(k, 0)}
        if b["collectives"] != a["collectives"]:
            diffs["collectives"] = b["collectives"] - a["collectives"]
        print(f"{name}: " + (", ".join(f"{k} {v:+,}" for k, v in diffs.items()) or "identical"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        compare(*sys.argv[2:4])
    else:
        measure(sys.argv[1])

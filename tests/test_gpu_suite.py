"""bench/gpu_suite.py runs end to end on CPU at tiny sizes (the GPU run is the same code)."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))

import gpu_suite  # noqa: E402
import moe as moe_bench  # noqa: E402


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
    assert gpu_suite.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = {r["section"] for r in report["rows"]}
    assert sections == {"kernel", "attention", "fp8", "moe", "model", "breakdown"}
    assert all(r["ok"] for r in report["rows"] if r["section"] in ("kernel", "moe") and "ok" in r)
    assert {r["impl"] for r in report["rows"] if r["section"] == "moe"} == set(moe_bench.IMPLS)
    skipped = {r.get("impl") or r.get("case"): r["skipped"] for r in report["rows"]
               if "skipped" in r}
    assert "GPU" in skipped["cudnn"] and "Hopper" in skipped["mosaic"]  # named, not dropped
    assert "Hopper" in skipped["mosaic_fast"]
    models = [r for r in report["rows"] if r["section"] == "model" and "step_ms" in r]
    assert {r["config"] for r in models} >= {"attention=xla", "attention=pallas fp8"}
    assert all(r["compiled_gib"] > 0 and r["ledger_gib"] > 0 for r in models)
    assert (tmp_path / "mfu_breakdown.json").exists()

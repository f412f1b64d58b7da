"""DeepSeek-V3's proxy recipe (configs/deepseek_v3_16b.py: MLA, the sigmoid group-limited
router with its balancing bias, shared experts, a first dense layer; expert 8 carved out of
data 16) compiled by the real XLA:GPU compiler for 16 compile-only H100s, depth-sliced to 4
of its 27 layers, the layout kept: the dry run's compiled memory, executed FLOPs and DP bytes
against the ledger's. README's third command runs it."""
import pathlib

import pytest

from jaxtrain.config import load_config

pytestmark = pytest.mark.gpu_compile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_deepseek_proxy_compiles_for_16_h100s_as_the_ledger_prices_it(h100):
    from jaxtrain.ledger.memory import workspace_bytes
    from jaxtrain.tools import dry_run
    cfg = load_config(ROOT / "configs" / "deepseek_v3_16b.py", ["--model.num_layers=4"])
    r = dry_run.dry_run(cfg, target="h100", devices=16, config_name="deepseek_v3_16b")
    assert not r.changes, r.changes
    assert r.attention[0] == "mosaic" and r.grouped_gemm[0] == "mosaic"
    e = r.estimate
    # a static buffer assignment holds no cuBLAS/NCCL workspace (the ledger's reserve does)
    compiled, ledger = r.memory["total_bytes"], e.total_bytes - workspace_bytes(cfg)
    assert compiled == pytest.approx(ledger, rel=0.10), (compiled, ledger)
    for term in ("master", "moments"):
        assert r.state_terms[term] == pytest.approx(e.static_breakdown[term], rel=0.01), term
    assert r.executed.mean == pytest.approx(e.hfu_flops_per_step_full_attn / e.n_devices,
                                            rel=0.05)
    comm = r.comm_by_axes()
    assert {("data", "expert"), ("data",)} <= set(comm), comm
    assert all(row.off is not None and abs(row.off) <= 0.10 for row in comm.values()), comm

"""bench/moe.py's dispatch rows at tiny shapes: the round trips move the tokens unchanged
(identity experts, router weights summing to 1) and the all-to-all row is the ledger's."""
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import moe as moe_bench  # noqa: E402

SHAPE = moe_bench.QUICK_DISPATCH


def test_dispatch_round_trips_return_the_tokens():
    x, experts, weights, ct = moe_bench._dispatch_args(**SHAPE, dtype="float32")
    fns = moe_bench._dispatch_fns(**SHAPE)
    y, (dx, _) = fns["sort"](x, experts, weights, ct)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ct), rtol=1e-6, atol=1e-6)
    # capacity C = T·k/E keeps the first C rows of each expert's queue: the kept part agrees
    y_cap, _ = fns["capacity"](x, experts, weights, ct)
    kept = np.isclose(np.asarray(y_cap), np.asarray(x), atol=1e-6).all(axis=1)
    assert 0.5 < kept.mean() <= 1.0


def test_dispatch_rows_and_the_ledgers_all_to_all():
    rows = moe_bench.dispatch_rows(**SHAPE, iters=1)
    assert [r["impl"] for r in rows] == ["sort", "capacity", "all_to_all(ledger, expert=4)"]
    t, d, k, ep = SHAPE["t"], SHAPE["d"], SHAPE["k"], 4
    moved = 2 * (ep - 1) / ep * t * k * d * 2        # rows out and back, bf16
    assert rows[-1]["mib_per_pass"] * 2**20 == moved
    assert jnp.isfinite(rows[0]["ms"])

"""The Mixtral recipe's layout (TP1 PP4 EP8 on 64 compile-only H100s) through the dry run.

One compile for the module, the recipe at 4 of its 32 layers (one a stage: the fewest that
keep the layout; everything else as configured: 16 microbatches of one 4096-token sequence,
ZeRO-1, selective core_attn + moe recompute). What it shows is what the H100 program of
the whole recipe holds per layer: the ledger's memory and MoE FLOPs (activated experts and the
router, no E-fold dense GEMM), the dispatch's ragged all-to-all pairs and the experts' Mosaic
GPU grouped GEMMs within an H100's limits. Run with `-m gpu_compile` (the gpu-compile extra).
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxtrain.config import ModelConfig, MoeConfig, load_config
from jaxtrain.model import llama as model_lib
from jaxtrain.model import moe
from jaxtrain.model.kernels import grouped_matmul as gm
from jaxtrain.tools import gpu_kernels, hlo, pipeline_flops
from jaxtrain.ledger.memory import workspace_bytes
from jaxtrain.model.kernels import grouped_matmul_kernels as gmk

pytestmark = pytest.mark.gpu_compile

MIXTRAL_SLICE = ["--model.num_layers=4"]   # 32 -> 4: one layer a stage, the layout kept
H100_SMEM_PER_BLOCK = 232448


@pytest.fixture(scope="module")
def mixtral(h100):
    from jaxtrain.tools import dry_run
    h100(64)   # the target's check (the fixture fails saying how to install it)
    cfg = load_config("configs/mixtral_8x7b.py", MIXTRAL_SLICE)
    return dry_run.dry_run(cfg, target="h100", devices=64, config_name="mixtral_8x7b")


def test_mixtral_compiles_its_layout_with_the_grouped_gemm_kernels(mixtral):
    r = mixtral
    assert not r.changes, r.changes
    L = r.estimate.layout
    assert (L.tensor, L.stage, L.expert, L.data, r.n_devices) == (1, 4, 8, 16, 64)
    assert r.grouped_gemm[0] == "mosaic", r.grouped_gemm
    assert r.attention[0] == "mosaic", r.attention


def test_mixtral_compiled_memory_is_the_ledgers(mixtral):
    """Per static term the program's state arguments are the ledger's (fp32 master; Adam's
    m and v, ZeRO-1 sharded over data x expert, the experts' over data alone), and the peak
    (memory_analysis) within 10% of the ledger's total less the GPU workspace. The experts'
    gate, up and out are stored at the executor's receive-buffer size (ep x T x top_k rows),
    not the routed rows (the ledger priced those before: with moe_act 13.0 GiB against 41.1
    compiled), and `moe`'s backward re-materialises them with the gate/up cotangents.
    Measured: 15.97 GiB compiled, ledger 15.43."""
    r = mixtral
    ledger = r.estimate.static_breakdown
    for term in ("master", "moments"):
        assert r.state_terms[term] == pytest.approx(ledger[term], rel=0.01), term
    compiled = r.memory["total_bytes"]
    want = r.estimate.total_bytes - workspace_bytes(r.cfg)
    assert abs(compiled / want - 1) <= 0.10, (compiled / 2**30, want / 2**30)


def test_mixtral_executes_the_ledgers_moe_flops(mixtral):
    """The matmul FLOPs a device executes (GEMMs, attention kernels as their dense matmuls,
    the grouped GEMM kernels by their routed rows) within 5% of the ledger's (top-2 experts
    and the router, Megatron's count, with `moe`'s recompute). Measured: equal to 4 digits
    (2.317e14). With lax.ragged_dot (an E-fold dense GEMM) the program ran 6.2x."""
    r, e = mixtral, mixtral.estimate
    ledger = e.hfu_flops_per_step_full_attn / e.n_devices
    assert r.executed.mean == pytest.approx(ledger, rel=0.05), (r.executed.mean, ledger)
    # no GEMM multiplies every expert: XLA's GEMMs alone are the attention and router's
    gemms = sum(f for _, f in r.gpu_report.gemms.values())
    assert gemms < 0.25 * r.executed.every_branch, (gemms, r.executed.every_branch)


def test_mixtral_data_parallel_bytes_per_axes_are_the_ledgers(mixtral):
    """The dense params' gradients reduce over data and expert, the experts' over data alone
    (the ranks that hold the same experts): each within 10% of the ledger's (dry_run.dp_terms);
    the report counts the dispatch pairs with compute between start and done."""
    comm = mixtral.comm_by_axes()
    for axes in (("data", "expert"), ("data",)):
        row = comm[axes]
        assert row.ledger and abs(row.off) <= 0.10, (axes, row)
    g = mixtral.gpu_report
    assert 0 <= g.ragged_hidden <= g.ragged[0]
    assert f"{g.ragged_hidden} of {g.ragged[0]} pairs" in g.format()


def test_mixtral_dispatch_is_ragged_all_to_all_pairs_and_kernels_fit(mixtral):
    """The dispatch and combine are async ragged all-to-all start/done pairs (none
    synchronous), and the experts run as the two Mosaic GPU grouped GEMM kernels (rows x
    group: forward and dX; per group: dW) within a block's shared memory and 255 registers,
    without spills (ptxas' report from Mosaic's dump)."""
    g = mixtral.gpu_report
    pairs, sync = g.ragged
    assert pairs >= 4 and sync == 0, g.ragged   # dispatch + combine, forward and backward
    grouped = {k.name: k for k in g.kernels if k.name.startswith("jaxtrain_grouped")}
    assert set(grouped) == {gmk.ROWS_KERNEL, gmk.PER_GROUP_KERNEL}, [k.name for k in g.kernels]
    for k in grouped.values():
        assert 0 < k.shared_memory <= H100_SMEM_PER_BLOCK, k
        assert k.registers is not None and k.registers <= 255 and not k.spills, k


# ----------------------------------------------------------------------------- MoE

MIXTRAL_ROWS, MIXTRAL_D, MIXTRAL_F, MIXTRAL_E = 16384, 4096, 14336, 8  # 8k tokens x top-2


def test_grouped_matmul_kernels_fit_an_h100_at_mixtral_shapes(h100, tmp_path):
    """One Mixtral expert projection's forward, dX and dW (16k routed rows, 4096 x 14336,
    8 experts) compile to three Mosaic GPU kernels within the shared memory a block may use,
    without spills, and nothing else in the program multiplies or holds a transposed copy."""
    sh = SingleDeviceSharding(h100(1)[0])
    x = jax.ShapeDtypeStruct((MIXTRAL_ROWS, MIXTRAL_D), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((MIXTRAL_E, MIXTRAL_D, MIXTRAL_F), jnp.bfloat16, sharding=sh)
    sizes = jax.ShapeDtypeStruct((MIXTRAL_E,), jnp.int32, sharding=sh)

    def fwd_bwd(x, w, sizes):
        y, pull = jax.vjp(lambda a, b: gm.grouped_matmul(a, b, sizes), x, w)
        return y, pull(y)
    with gpu_kernels.mosaic_dump(tmp_path):
        compiled = jax.jit(fwd_bwd).lower(x, w, sizes).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="mosaic_gpu_v2"') == 3
    assert hlo.matmul_flops_from_text(text) == 0
    assert compiled.memory_analysis().temp_size_in_bytes < 2 ** 20
    names = gpu_kernels.mosaic_kernel_names(text)
    assert names == {gmk.PER_GROUP_KERNEL, gmk.ROWS_KERNEL}   # rows: forward and dX
    kernels = gpu_kernels.mosaic_kernels(tmp_path, names)   # the worst instance of each
    assert {k.name for k in kernels} == names
    for k in kernels:
        assert k.grid == (132, 1, 1) and k.threads == (128,), k
        assert 0 < k.shared_memory <= 232448, k
        assert k.registers is not None and k.registers <= 255 and not k.spills, k


def test_moe_layer_on_the_kernels_runs_no_expert_dense_gemm(h100):
    """lax.ragged_dot on XLA:GPU multiplies E times the grouped work (a dense GEMM over every
    expert, ../shared/notes/moe-and-mosaic-gpu-without-gpu.md); the layer on the kernels runs
    its experts as Mosaic GPU kernels (3 forward, 6 backward), and only the router is a GEMM;
    the executed count reads the kernels as the grouped work they do."""
    sh = SingleDeviceSharding(h100(1)[0])
    t, d, f, e, k = 2048, 512, 1024, 8, 2
    cfg = ModelConfig(hidden_size=d, compute_dtype="bfloat16", num_layers=1,
                      moe=MoeConfig(num_experts=e, top_k=k, mlp_size=f))
    grouped = 3 * 3 * 2 * (t * k) * d * f     # forward + 2 backward products, 3 projections
    router = 3 * 2 * t * d * e

    def compiled(grouped_dot):
        layer = nnx.eval_shape(lambda: moe.MoeLayer(cfg, model_lib.Ops(grouped_dot=grouped_dot),
                                                    nnx.Rngs(0)))
        graphdef, state = nnx.split(layer)
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state)
        x = jax.ShapeDtypeStruct((1, t, d), jnp.bfloat16, sharding=sh)

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    ragged, kernels = compiled(moe.ragged_dot), compiled(gm.grouped_matmul)
    assert hlo.matmul_flops_from_text(ragged) == pytest.approx(e * grouped + router, rel=0.01)
    assert hlo.matmul_flops_from_text(kernels) == pytest.approx(router, rel=0.01)
    assert kernels.count('custom_call_target="mosaic_gpu_v2"') == 9
    # as the dry run counts them (kernel_flops): every buffer row is routed on one device
    executed = pipeline_flops.executed_matmul_flops(kernels, None).mean
    assert executed == pytest.approx(grouped + router, rel=0.01)

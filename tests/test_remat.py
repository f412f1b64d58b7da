"""Remat policies: same numbers, ordered memory and FLOPs, Megatron's validation, the sweep."""
import csv
import dataclasses
import pathlib
import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxtrain.executors import replica, setup as setup_lib
from jaxtrain.parallel import remat, sharding
from jaxtrain.tools import hlo, remat_sweep
from jaxtrain.model import llama as model_lib
from jaxtrain.config import ParallelConfig, RematConfig
from util import random_batch, tiny_config

TINY = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"

# XLA CPU's legacy emitters at -O0 compile ~3x faster; the properties below hold with the
# default options too (checked by hand: same ordering and identical matmul FLOPs).
FAST = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}

# Eight layers and a sequence twice the hidden size: attention is a modest share of the
# FLOPs (selective stays cheap) while s x s scores dominate the saved activations (memory
# orders clearly). Full MHA keeps the projections' share of the recompute up.
SHAPE = ("model.vocab_size=256", "model.hidden_size=64", "model.num_layers=8",
         "model.num_heads=4", "model.num_kv_heads=4", "model.mlp_size=192",
         "model.max_seq_len=128", "model.attention=xla", "train.seq_len=128",
         "train.global_batch=2")

POLICIES = ("none", "selective:core_attn", "selective:core_attn,mlp", "selective:core_attn_out",
            "uniform:1", "uniform:2", "block:1", "block:4", "dots_saveable", "offload:mlp")


def _cfg(policy="none", *overrides):
    cfg = tiny_config(*SHAPE, "parallel.data=1", *overrides)
    return dataclasses.replace(cfg, remat=remat.parse(policy))


def _mean_loss(setup, params, mb):
    objective, sums = replica.loss_sums(setup, params, mb)
    return objective / sums.tokens


def _init_params(setup):
    """The model's initial parameters, compiled fast (the whole train-state init is slow)."""
    def init():
        model = model_lib.Llama(setup.model_cfg, rngs=nnx.Rngs(0),
                                real_vocab=setup.cfg.model.vocab_size)
        return nnx.to_pure_dict(nnx.state(model))
    return jax.jit(init).lower().compile(compiler_options=FAST)()


def _compile_value_and_grad(cfg, mesh, params, mb):
    setup = setup_lib.build(cfg, mesh)
    f = jax.jit(jax.value_and_grad(lambda p, b: _mean_loss(setup, p, b)))
    return f.lower(params, mb).compile(compiler_options=FAST)


@pytest.fixture(scope="module")
def one_device():
    """Per policy: (loss, grads, compiled temp bytes, compiled matmul FLOPs) on one device."""
    mesh = sharding.make_mesh(ParallelConfig(data=1), jax.devices()[:1])
    cfg = _cfg()
    params = _init_params(setup_lib.build(cfg, mesh))
    mb = {k: np.asarray(v) for k, v in random_batch(cfg).items()}
    out = {}
    for policy in POLICIES:
        compiled = _compile_value_and_grad(_cfg(policy), mesh, params, mb)
        loss, grads = compiled(params, mb)
        out[policy] = (float(loss), jax.device_get(grads), hlo.memory(compiled)["temp_bytes"],
                       hlo.matmul_flops(compiled))
    return out, params, mb


def _assert_same(got, want, tol):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_every_policy_gives_the_same_loss_and_gradients(one_device):
    out, _, _ = one_device
    for policy in POLICIES:
        _assert_same(out[policy], out["none"], 1e-6)


def test_compiled_memory_orders_as_theory_says(one_device):
    temp = {p: v[2] for p, v in one_device[0].items()}
    assert temp["none"] > temp["selective:core_attn"] > temp["selective:core_attn,mlp"] \
        > temp["uniform:1"]
    # Full recompute of two layers at a time holds two layers' activations in the backward.
    assert temp["uniform:2"] > temp["uniform:1"]


def test_block_lies_between_none_and_full_and_moves_with_its_depth(one_device):
    # block:1 is a one-layer scan: without remat._fenced XLA runs its recompute in the forward
    # pass, keeping a layer's activations alive all step (~12% of this step's temporaries).
    # Fenced, the one layer block:1 stops saving roughly pays for the two slice copies of the
    # stacked parameters and their gradients that block makes (measured: 20.67 MB against
    # none's 20.43; 25.68 against 26.16 before the norms and SwiGLU recomputed their fp32
    # insides, which made none's layers lighter).
    temp = {p: v[2] for p, v in one_device[0].items()}
    assert temp["block:1"] < 1.02 * temp["none"]
    assert temp["none"] > temp["block:4"] > temp["uniform:1"]
    assert temp["block:1"] > temp["block:4"]
    flops = {p: v[3] for p, v in one_device[0].items()}
    assert flops["none"] < flops["block:1"] < flops["block:4"] < flops["uniform:1"]


def test_recompute_flops_overheads(one_device):
    flops = {p: v[3] for p, v in one_device[0].items()}
    ratio = {p: f / flops["none"] for p, f in flops.items()}
    # A full forward is 1/3 of forward+backward; the last matmul of each recomputed group
    # (w_down) feeds nothing the backward needs, so XLA drops it: ~1.27, not 4/3.
    assert 1.25 <= ratio["uniform:1"] <= 1.40
    assert ratio["uniform:2"] > ratio["uniform:1"]
    assert 1.0 < ratio["selective:core_attn"] <= 1.10
    assert ratio["dots_saveable"] == 1.0  # every matmul output is saved


@pytest.mark.parametrize("policy", ["uniform:1", "uniform:2", "block:1", "block:4",
                                    "selective:core_attn", "selective:core_attn,mlp",
                                    "selective:core_attn_out", "offload:mlp"])
def test_recompute_flops_are_the_ledgers(one_device, policy):
    """The ledger's recompute FLOPs are the compiled program's re-run matmuls. Full: a forward
    of each recomputed layer, less the down projection where each layer is its own checkpoint
    (uniform:1, block: its output feeds nothing the backward needs); uniform:2 scans two
    layers in one checkpoint and re-runs every down projection. Selective: QK^T in every
    layer (the core's untagged insides), PV too with core_attn_out, gate and up with mlp
    (offloaded: fetched, not re-run). The ledger counts the norm weights as parameters (2 FLOPs each per token per recomputed
    layer), XLA does not; XLA's attention core computes the full s x s square
    (causal=False)."""
    from jaxtrain import ledger
    from jaxtrain.ledger.flops import recomputed_layers
    flops = {p: v[3] for p, v in one_device[0].items()}
    cfg = _cfg(policy)
    tokens, m = 2 * 128, cfg.model
    n = (recomputed_layers(cfg.remat, (m.num_layers,))
         if cfg.remat.granularity == "full" else 0)
    norms = 2 * ledger.param_counts(m).per_layer["norms"] * n * tokens
    want = ledger.recompute_flops_per_token(cfg, causal=False) * tokens - norms
    assert flops[policy] - flops["none"] == pytest.approx(want, rel=1e-9)


def test_selective_recomputes_exactly_the_matmuls_megatron_names(one_device):
    flops = {p: v[3] for p, v in one_device[0].items()}
    m = _cfg().model
    tokens, s, layers = 2 * 128, 128, m.num_layers
    qk = 2 * s * m.num_heads * m.resolved_head_dim * tokens * layers      # QK^T, not PV
    gate_up = 4 * m.hidden_size * m.mlp_size * tokens * layers           # not w_down
    extra = {p: f - flops["none"] for p, f in flops.items()}
    # core_attn keeps the context (as Megatron's out projection does), so only the scores
    # are recomputed; mlp adds gate and up; offloading mlp instead of recomputing it costs none.
    assert extra["selective:core_attn"] == pytest.approx(qk, rel=1e-9)
    assert extra["selective:core_attn,mlp"] == pytest.approx(qk + gate_up, rel=1e-9)
    assert extra["offload:mlp"] == pytest.approx(qk, rel=1e-9)


def test_policies_compose_with_fsdp_tensor_and_sequence_parallel(one_device):
    out, params, mb = one_device
    par = ("parallel.fsdp=2", "parallel.tensor=2", "parallel.sequence_parallel=true")
    mesh = sharding.make_mesh(_cfg("none", *par).parallel, jax.devices()[:4])
    batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh))
    mb = {k: jax.device_put(v, batch_sh) for k, v in mb.items()}
    # block:1 covers both a checkpointed (fenced) layer and plain scanned ones.
    cfg = _cfg("block:1", *par)
    placed = jax.device_put(params, setup_lib.build(cfg, mesh).param_shardings)
    loss, grads = _compile_value_and_grad(cfg, mesh, placed, mb)(placed, mb)
    _assert_same((float(loss), jax.device_get(grads)), out["none"], 1e-5)


# A GPU-style module: a cuBLAS GEMM custom call inside a 5-trip loop, a dot inside a fusion.
_GEMM_IN_LOOP = """HloModule synth, entry_computation_layout={(f32[4,8]{1,0}, f32[8,8]{1,0})->f32[4,8]{1,0}}

%cond (c.1: (s32[], f32[4,8], f32[8,8])) -> pred[] {
  %c.1 = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%c.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%body (b.1: (s32[], f32[4,8], f32[8,8])) -> (s32[], f32[4,8], f32[8,8]) {
  %b.1 = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b.1), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%b.1), index=1
  %w = f32[8,8]{1,0} get-tuple-element(%b.1), index=2
  %g = (f32[4,8]{1,0}, s8[256]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %y = f32[4,8]{1,0} get-tuple-element(%g), index=0
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%i2, %y, %w)
}

%fused (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[4,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,8], w.1: f32[8,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %w.1 = f32[8,8]{1,0} parameter(1)
  %f = f32[4,8]{1,0} fusion(%a, %w.1), kind=kCustom, calls=%fused
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) tuple(%zero, %f, %w.1)
  %loop = (s32[], f32[4,8]{1,0}, f32[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_matmul_flops_count_loop_trips_and_gemm_custom_calls():
    per_matmul = 2 * 4 * 8 * 8
    assert hlo.matmul_flops_from_text(_GEMM_IN_LOOP) == 6 * per_matmul


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("fields, message", [
    (dict(granularity="full"), "needs remat.method and remat.num_layers"),
    (dict(granularity="full", num_layers=3), "does not divide the 8 layers"),
    (dict(granularity="full", method="block", num_layers=9), "exceeds the 8 layers"),
    (dict(granularity="selective", num_layers=2), "only used with remat.granularity=full"),
    (dict(granularity="selective", method="block"), "only used with remat.granularity=full"),
    (dict(granularity="none", num_layers=1), "only used with remat.granularity=full"),
    (dict(granularity="selective", modules=("attn",)), "allowed: core_attn, mlp, layernorm"),
    (dict(granularity="selective", modules=("core_atn",)), "did you mean 'core_attn'"),
    (dict(granularity="selective", modules=()), "needs remat.modules"),
    (dict(modules=("attn",)), "unknown module 'attn'.*allowed: core_attn"),  # granularity none
    (dict(modules=("mlp",)), "only used with remat.granularity=selective.*none nothing reads"),
    (dict(granularity="full", num_layers=1, modules=("mlp",)), "with remat.granularity=full"),
    (dict(policy="dots_saveable", modules=("mlp",)), "with remat.policy=dots_saveable"),
    (dict(granularity="full", num_layers=1, offload=True), "needs remat.granularity=selective"),
    (dict(offload=True), "needs remat.granularity=selective"),
    (dict(granularity="selective", offload=True), "nothing tagged to offload"),
    (dict(policy="auto"), "choose_policy"),
    (dict(policy="dots_savable"), "did you mean 'dots_saveable'"),
    (dict(policy="dots_saveable", granularity="full", num_layers=1), "replaces granularity"),
    (dict(policy="save:qkv_proj,bogus"), "unknown tags \\['bogus'\\]"),
    (dict(policy="save_only_these_names"), "save_only_these_names:tag1,tag2"),
    (dict(policy="dots_saveable:core_attn"), "takes no tag list"),
    (dict(policy="save_and_offload_only_these_names"), "remat.offload=true"),
])
def test_invalid_combinations_fail_with_clear_messages(fields, message):
    with pytest.raises(remat.RematConfigError, match=message):
        remat.validate(RematConfig(**fields), 8)


def test_valid_combinations_pass_and_uneven_chunks_are_checked_each():
    for label in POLICIES + ("block:8", "uniform:8", "save:qkv_proj,core_attn",
                             "save_anything_except_these_names:core_attn", "nothing_saveable"):
        remat.validate(remat.parse(label), 8)
    with pytest.raises(remat.RematConfigError, match="does not divide the 6 layers"):
        remat.validate(remat.parse("uniform:4"), (8, 6))


def test_offload_needs_pinned_host_memory():
    no_host = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [
        types.SimpleNamespace(kind="device")])
    with pytest.raises(remat.RematConfigError, match="pinned_host.*offload=false"):
        remat.check_offload_supported(no_host)


def test_build_rejects_an_invalid_remat_config():
    mesh = sharding.make_mesh(ParallelConfig(data=1), jax.devices()[:1])
    with pytest.raises(remat.RematConfigError, match="does not divide"):
        setup_lib.build(_cfg("uniform:3"), mesh)


def test_labels_round_trip():
    for label in POLICIES + ("block:2", "save:qkv_proj,core_attn", "offload:core_attn,mlp"):
        assert remat.label(remat.parse(label)) == label
    with pytest.raises(remat.RematConfigError, match="block:N"):
        remat.parse("block:x")


# ----------------------------------------------------------------------------- sweep and auto

def test_sweep_writes_its_table_csv_and_plot(tmp_path, capsys):
    argv = ["--config", str(TINY), "--devices", "1", "--parallel.data=1",
            "--train.global_batch=2", "--policies", "none", "uniform:1", "--run", "--steps", "1",
            "--workdir", str(tmp_path)]
    argv += [f"--compiler-option={k}={v}" for k, v in FAST.items()]
    assert remat_sweep.main(argv) == 0
    assert "uniform:1" in capsys.readouterr().out
    assert (tmp_path / remat_sweep.PNG_NAME).stat().st_size > 0
    with open(tmp_path / remat_sweep.CSV_NAME) as f:
        rows = {r["policy"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"none", "uniform:1"}
    none, full = rows["none"], rows["uniform:1"]
    assert int(none["temp_bytes"]) > int(full["temp_bytes"])
    assert float(none["recompute_overhead"]) == 0 and float(full["recompute_overhead"]) > 0.2
    assert float(full["ledger_activation_bytes"]) < float(none["ledger_activation_bytes"])
    assert float(full["step_time_s"]) > 0


class _FakeCompiled:
    def __init__(self, gib):
        self.stats = types.SimpleNamespace(
            temp_size_in_bytes=int(gib * 2**30), argument_size_in_bytes=0,
            output_size_in_bytes=0, alias_size_in_bytes=0)

    def memory_analysis(self):
        return self.stats


def test_auto_tries_the_least_recompute_first_and_takes_the_first_that_fits(
        monkeypatch, caplog):
    footprint = {"none": 9.0, "selective:core_attn": 6.0, "block:2": 5.0, "block:4": 3.0,
                 "uniform:1": 2.0}
    compiled = []

    def fake_compile(cfg, mesh, extra_options=None):
        compiled.append(remat.label(cfg.remat))
        return types.SimpleNamespace(compiled=_FakeCompiled(footprint.get(compiled[-1], 3.5)))
    monkeypatch.setattr(remat_sweep, "compile_step", fake_compile)
    cfg = _cfg("none")
    cfg.remat = RematConfig(policy="auto", memory_budget_gb=4.0)
    mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:1])
    shuffled = [remat.parse(p) for p in ("uniform:1", "block:4", "none", "block:2",
                                         "selective:core_attn")]
    with caplog.at_level("INFO", logger="jaxtrain.parallel.remat"):
        chosen = remat_sweep.choose_policy(cfg, mesh, candidates=shuffled)
    assert remat.label(chosen) == "block:4" and chosen.policy == ""
    assert compiled == ["none", "selective:core_attn", "block:2", "block:4"]
    assert "chose block:4" in caplog.text
    compiled.clear()
    default = remat_sweep.choose_policy(cfg, mesh)  # every block depth, selective, full
    assert compiled[0] == "none" and remat.label(default) == compiled[-1] != "none"
    cfg.remat = RematConfig(policy="auto", memory_budget_gb=1.0)
    with pytest.raises(remat.RematConfigError, match="no candidate fits.*uniform:1=2.000GiB"):
        remat_sweep.choose_policy(cfg, mesh, candidates=shuffled)
    cfg.remat = RematConfig(policy="auto")
    with pytest.raises(remat.RematConfigError, match="memory_budget_gb > 0"):
        remat_sweep.choose_policy(cfg, mesh)

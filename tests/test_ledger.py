"""The ledger against hand-computed numbers (docs/design.md §5). Pure Python, milliseconds."""
import dataclasses
import pathlib
import subprocess
import sys
import time

import pytest

from jaxtrain import ledger
from jaxtrain.config import (Config, Fp8Config, ModelConfig, ParallelConfig, RematConfig,
                             TrainConfig, load_recipe)
from jaxtrain.ledger import comm, device_params, memory
from jaxtrain.ledger.hardware import GiB

ROOT = pathlib.Path(__file__).resolve().parents[1]


def recipe(name):
    return load_recipe(ROOT / "configs" / f"{name}.py")


# ----------------------------------------------------------------------------- parameters

def test_llama3_8b_param_count():
    counts = ledger.param_counts(recipe("llama3_8b").model)
    assert counts.total == 8_030_261_248
    assert counts.embedding == 128256 * 4096
    assert counts.non_embedding == 8_030_261_248 - 128256 * 4096
    # q, o: 4096², k, v: 4096·8·128, gate/up/down: 4096·14336, two RMSNorm scales.
    assert counts.layer == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096


def test_llama3_70b_param_count():
    counts = ledger.param_counts(recipe("llama70b").model)
    assert counts.total == 70_553_706_496
    assert counts.non_embedding == 70_553_706_496 - 128256 * 8192


def test_tied_embeddings_count_once_and_as_lm_head():
    model = dataclasses.replace(recipe("llama3_8b").model, tie_embeddings=True)
    counts = ledger.param_counts(model)
    assert counts.total == 8_030_261_248 - 128256 * 4096
    assert counts.non_embedding == counts.total  # the one table is the lm_head matmul


# ----------------------------------------------------------------------------- FLOPs

def test_flops_per_token_8b_and_70b_at_8192():
    """Causal attention counts half of PaLM's 12·L·h·s (Megatron's and MaxText's convention);
    causal=False keeps the full square."""
    n_8b = 8_030_261_248 - 128256 * 4096
    assert ledger.model_flops_per_token(recipe("llama3_8b"), 8192) == \
        6 * n_8b + 6 * 32 * 4096 * 8192
    assert ledger.model_flops_per_token(recipe("llama3_8b"), 8192, causal=False) == \
        6 * n_8b + 12 * 32 * 4096 * 8192
    n_70b = 70_553_706_496 - 128256 * 8192
    cfg = recipe("llama70b")
    assert ledger.model_flops_per_token(cfg, 8192) == 6 * n_70b + 6 * 80 * 8192 * 8192
    per_step = ledger.model_flops_per_token(cfg) * 512 * 8192
    assert ledger.estimate(cfg, ledger.layout_from_config(cfg, 1024), "h100") \
        .model_flops_per_step == pytest.approx(per_step)


def test_hfu_flops_follow_remat():
    cfg = recipe("llama3_8b")
    s, layer = 8192, 218_112_000
    base = 6 * (8_030_261_248 - 128256 * 4096) + 6 * 32 * 4096 * s   # causal attention
    none = RematConfig(granularity="none")
    full = RematConfig(granularity="full", method="uniform", num_layers=2)
    sel = RematConfig(granularity="selective", modules=("core_attn",))
    block = RematConfig(granularity="full", method="block", num_layers=2)
    assert ledger.hfu_flops_per_token(cfg, none, seq_len=s) == base
    assert ledger.hfu_flops_per_token(cfg, full, seq_len=s) == \
        base + 32 * (2 * layer + 2 * 4096 * s)
    assert ledger.hfu_flops_per_token(cfg, sel, seq_len=s) == base + 32 * 2 * 4096 * s
    # XLA's core (the full square) re-runs QK^T alone: half of 4·H·s
    assert ledger.hfu_flops_per_token(cfg, sel, seq_len=s, causal=False) == \
        base + 6 * 32 * 4096 * s + 32 * 2 * 4096 * s
    # Block: the first 2 layers of each of 4 stages x 2 chunks are recomputed, each its own
    # checkpoint, whose re-run drops the down projection (2·F·h: its output feeds nothing the
    # backward needs); the pipeline executor adds nothing (each B applies the pullback its F
    # stashed).
    layer_fwd = 2 * layer + 2 * 4096 * s - 2 * 14336 * 4096
    assert ledger.hfu_flops_per_token(cfg, block, (8, 8, 8, 8), 2, s) == \
        base + 16 * layer_fwd
    assert ledger.hfu_flops_per_token(cfg, none, (8, 8, 8, 8), 2, s) == base
    with pytest.raises(ValueError, match="unknown"):
        ledger.recompute_flops_per_token(
            cfg, RematConfig(granularity="selective", modules=("attention_blob",)))
    # every module the trainer accepts is priced (core_attn_out once crashed the HFU metric)
    from jaxtrain.parallel.remat import MODULES
    for mod in MODULES:
        ledger.recompute_flops_per_token(cfg, RematConfig(granularity="selective",
                                                          modules=(mod,)))


def test_mfu_and_hfu():
    cfg = recipe("llama3_8b")
    per_token = ledger.model_flops_per_token(cfg)
    tokens_per_sec = 0.5 * 8 * 989e12 / per_token
    assert ledger.mfu(cfg, tokens_per_sec, 8, 989e12) == pytest.approx(0.5)
    cfg.remat = RematConfig(granularity="full")
    assert ledger.hfu(cfg, tokens_per_sec, 8, 989e12) > 0.5 * 1.3  # full recompute ≈ +32%


# ----------------------------------------------------------------------------- memory

def test_bytes_per_param():
    assert ledger.bytes_per_param() == 18
    assert ledger.bytes_per_param(grad_bf16=True) == 16
    held = ledger.held_bytes_per_param(ledger.Layout(data=8, zero1=True))
    assert held == {"weights": 2, "gradients": 0, "accumulator": 4, "master": 4 / 8,
                    "moments": 8 / 8}
    # FSDP shards what the step holds: fp32 gradients (the step accumulates them in fp32, not
    # Megatron-FSDP's bf16), and no bf16 gradient of the stack when microbatches add up (each
    # layer's goes into the accumulator: static_bytes prices the one layer in flight)
    held = ledger.held_bytes_per_param(ledger.Layout(fsdp=8))
    assert sum(held.values()) == 18 / 8
    held = ledger.held_bytes_per_param(ledger.Layout(fsdp=8, microbatches=4))
    assert held["gradients"] + held["accumulator"] == 4 / 8


def _cfg_8b(**parallel):
    cfg = recipe("llama3_8b")
    cfg.parallel = ParallelConfig(**parallel)
    cfg.train.global_batch = 8
    cfg.remat = RematConfig(granularity="full")
    return cfg


def test_zero1_and_fsdp_static_memory():
    n = 8_030_261_248  # t=1: 128256 is already a multiple of 128
    cfg = _cfg_8b(data=8, zero1=True)
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 8), "h100")
    assert est.params_local == n
    layer = 218_112_000
    # + one layer's bf16 gradient on its way into the fp32 accumulator
    assert est.static_bytes == pytest.approx(n * (2 + 4 + 12 / 8) + 2 * layer)
    cfg = _cfg_8b(data=1, fsdp=8)
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 8), "h100")
    # fp32 gradients (the step accumulates in fp32) sharded too, + 2 gathered bf16 layers
    assert est.static_bytes == pytest.approx(n * 18 / 8 + 2 * 2 * layer + 2 * layer / 8)
    cfg = _cfg_8b(data=8)
    assert ledger.estimate(cfg, ledger.layout_from_config(cfg, 8), "h100").static_bytes == \
        pytest.approx(n * 18 + 2 * layer)


def _gpt3_like():
    # Korthikanti et al.'s shapes: h=12288, a=96, s=2048.
    return Config(model=ModelConfig(vocab_size=51200, hidden_size=12288, num_layers=96,
                                    num_heads=96, num_kv_heads=96, mlp_size=49152,
                                    max_seq_len=2048, compute_dtype="bfloat16"),
                  train=TrainConfig(global_batch=64, seq_len=2048))


def _stored_per_layer(s, b, h, a, f, t, sp=True, flash=True):
    """What a layer keeps (ledger.memory.layer_activation_bytes), by hand for MHA: residual
    streams and norm outputs 4 x 2sbh (over t with SP), q, o, k, v 4 x 2sbh/t, gate, up and
    their product 3 x 2sbf/t; with flash the fp32 lse 4sba/t, else Korthikanti's 5 bytes per
    score x1.2."""
    return (8 * s * b * h / (t if sp else 1) + 8 * s * b * h / t + 6 * s * b * f / t
            + (4 * s * b * a / t if flash else 5 * a * s * s * b / t * 1.2))


def test_layer_activations_hand_example():
    cfg = _gpt3_like()
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sp = ledger.Layout(tensor=t, data=1, micro_batch=b, microbatches=64, sequence_parallel=True)
    flash = memory.layer_activation_bytes(cfg, sp, s, flash=True)
    assert flash == pytest.approx(_stored_per_layer(s, b, h, a, 4 * h, t))
    # 40·sbh/t for this GPT shape, next to Korthikanti et al.'s 34·sbh/t (with dropout masks,
    # GeLU's one input where SwiGLU keeps three)
    assert flash == pytest.approx(s * b * h * 40 / t + 4 * s * b * a / t)
    # XLA attention keeps the s x s scores too: Korthikanti's 5 bytes per score, x1.2
    per_layer = memory.layer_activation_bytes(cfg, sp, s, flash=False)
    assert per_layer == pytest.approx(_stored_per_layer(s, b, h, a, 4 * h, t, flash=False))
    no_sp = dataclasses.replace(sp, sequence_parallel=False)
    assert memory.layer_activation_bytes(cfg, no_sp, s, flash=True) == pytest.approx(
        _stored_per_layer(s, b, h, a, 4 * h, t, sp=False))
    assert memory.layer_checkpoint_bytes(cfg, sp, s) == 2 * s * b * h / t


def test_activations_in_estimate_for_the_pipeline_executor():
    cfg = _gpt3_like()
    cfg.model.attention = "xla"
    cfg.parallel = ParallelConfig(tensor=8, sequence_parallel=True, stage=4, data=2,
                                  microbatches=8)
    cfg.remat = RematConfig(granularity="selective", modules=("core_attn",))
    layout = ledger.layout_from_config(cfg, 64)
    assert layout.micro_batch == 4
    sbh = 2048 * 4 * 12288
    # attention=xla: selective core_attn drops the scores (no lse either), none keeps them
    per_layer = _stored_per_layer(2048, 4, 12288, 96, 4 * 12288, 8, flash=False)
    scores = 5 * 96 * 2048 * 2048 * 4 / 8 * 1.2
    per_layer -= scores
    est = ledger.estimate(cfg, layout, "h100")
    ex = est.executor
    # 1F1B, 4 stages: rank 0 stashes 2(p-1) = 6 microbatches' chunk residuals (lock-step's
    # warm-up), and every rank allocates that (one SPMD program); the last stage's B holds a
    # seventh set while it runs its chunk forward and backward at once, and one more is in
    # transit to or from the stash. Buffers: 1 inbox, 1 cotangent, 2 receive slots, each a
    # bf16 chunk input split over tensor.
    assert ex.chunk_layers == 24 and est.chunk_input_bytes == sbh * 2 / 8
    assert ex.stash_buffer == 6 and ex.buffers == 1 + 1 + 2
    buffers = 4 * sbh * 2 / 8
    assert est.pipeline_buffer_bytes == buffers
    assert est.inflight_layer_microbatches == 8 * 24
    assert est.activation_bytes == pytest.approx(buffers + 8 * 24 * per_layer)
    assert est.activation_bytes_by_remat["none"] == pytest.approx(
        buffers + 8 * 24 * (per_layer + scores))
    # Full recompute: each layer's input (2sbh/t) stashed, one layer re-materialised by a B.
    assert est.activation_bytes_by_remat["full"] == pytest.approx(
        buffers + 8 * 24 * 2 * sbh / 8 + per_layer + scores)
    # Without stages: gradient accumulation holds one microbatch of all 96 layers.
    cfg.parallel = ParallelConfig(tensor=8, sequence_parallel=True, data=2, microbatches=8)
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 16), "h100")
    assert est.executor is None and est.pipeline_buffer_bytes == 0
    assert est.activation_bytes == pytest.approx(96 * per_layer)


def test_budget_reserve_and_overflow():
    cfg = recipe("llama70b")
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 1024), "h100")
    assert est.budget_bytes == 0.9 * 80 * GiB
    # 6 GiB of workspace at 70B scale + one bf16 copy of the logits and an fp32 s·h
    assert 6.1 * GiB < est.reserve_bytes < 6.7 * GiB
    assert est.fits and est.total_bytes == pytest.approx(
        est.static_bytes + est.activation_bytes + est.reserve_bytes)
    small = memory.reserve_bytes(recipe("tiny"), ledger.Layout(), 128)
    assert small < 0.5 * GiB  # scales down with the hidden size
    # Pipeline off: 70B's static state no longer fits beside its activations.
    too_big = ledger.Layout(tensor=8, stage=1, data=128, micro_batch=1, microbatches=4,
                            sequence_parallel=True, zero1=True)
    est = ledger.estimate(cfg, too_big, "h100", remat=RematConfig(granularity="none"))
    assert not est.fits and est.overflow == "static"
    assert "static" in est.reason and "budget" in est.reason
    long_acts = ledger.Layout(tensor=8, stage=2, data=32, micro_batch=4, microbatches=4,
                              sequence_parallel=True, zero1=True)
    est = ledger.estimate(cfg, long_acts, "h100", remat=RematConfig(granularity="none"))
    assert not est.fits and est.overflow == "activations"
    # a 40-layer chunk's activations, 3 microbatches of them held: full recompute keeps each
    # layer's input only, and fits
    assert ledger.estimate(cfg, long_acts, "h100", remat=ledger.REMAT_VARIANTS["full"]).fits
    half = dataclasses.replace(long_acts, data=64, micro_batch=2)
    assert ledger.estimate(cfg, half, "h200",
                           remat=RematConfig(granularity="none")).fits  # 140 GiB


# ----------------------------------------------------------------------------- communication

def _small():
    cfg = Config(model=ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8,
                                   num_heads=16, num_kv_heads=8, mlp_size=4096,
                                   max_seq_len=2048),
                 train=TrainConfig(global_batch=32, seq_len=2048))
    cfg.parallel = ParallelConfig(tensor=2, sequence_parallel=True, stage=2, data=2,
                                  microbatches=4, zero1=True)
    return cfg


def test_comm_formulas_small_layout():
    cfg = _small()
    layout = ledger.layout_from_config(cfg, 8)
    assert (layout.data, layout.micro_batch, layout.microbatches) == (2, 4, 4)
    est = ledger.estimate(cfg, layout, "h100")
    s, b, h = 2048, 4, 1024
    # 1F1B, p=2, m=4 on the executor: 6 table steps, F in 4, B in 5 (tests/test_ledger_pipeline).
    ex = est.executor
    assert (ex.steps, ex.f_steps, ex.b_steps) == (6, 4, 5)
    # TP with SP: each rank runs 4 forward passes of its 4 layers (4 sequence-sized
    # collectives each) and 4 backward ones (6: Megatron-SP's 10), each (t-1)/t.s.b.h.2.
    one = (1 / 2) * s * b * h * 2
    assert est.comm_bytes["tp"] == 4 * one * (4 * 4 + 6 * 4)
    # PP: one activation right and one cotangent left per table step, bf16, split over tensor.
    assert est.comm_bytes["pp"] == 2 * 6 * s * b * h * 2 / 2
    layer_local = (1024 * 1024 * 2 + 3 * 1024 * 4096) / 2 + 2 * 1024 * 512 / 2 + 2 * 1024
    table = 32000 * 1024 / 2  # vocab-parallel; 32000 is a multiple of 128 x 2
    # A stage rank computes with its layers and its edge row (one table, the final norm); the
    # masters and Adam moments of both tables and the norm split over stage (1/p each); DP
    # reduces what the rank computed, its layers and its edge row, before the stage
    # reduce-scatter (the H100 program, tests/test_gpu_compile_parallel.py).
    n_local = 4 * layer_local + table + 1024
    assert est.params_local == n_local
    n_state = 4 * layer_local + (2 * table + 1024) / 2
    assert est.static_breakdown["master"] == n_state * 4 / 2
    # ZeRO-1: the layers' fp32 gradients reduce-scattered, their bf16 params all-gathered;
    # the edge row's fp32 gradient all-reduced before its stage reduce-scatter (H100 program)
    edge = table + 1024
    assert est.comm_bytes["dp"] == (n_local - edge) * (4 + 2) + edge * 8
    # Each data rank's 1/2 share of the tables' fp32 gradients reduce-scattered over stage to
    # the masters' shards, (p-1)/p; their bf16 copy gathered from all p x 2 shards at once.
    held = 2 * table + 1024
    assert est.comm_bytes["vocab"] == (1 / 2) * held * 4 / 2 + (3 / 4) * held * 2
    assert est.comm_bytes["fsdp"] == est.comm_bytes["cp"] == 0
    assert set(est.comm_links.values()) == {"nvlink"}  # 8 devices: one node
    fsdp = dataclasses.replace(layout, data=1, fsdp=2, zero1=False)
    # Outside the layers: the head + final norm gathered once per step and reduce-scattered
    # per microbatch (m=4); the embedding lookup's two all-to-alls (SP: a sequence shard).
    assert comm.fsdp_rest_bytes(cfg, fsdp, s) == (table + 1024) * 2 * (1 + 4) \
        + 2 * s * b * h * 2 / 2 * 4
    # Without stages the layer passes are L.m each, and FSDP's layer term is 3.N_layers.2.m.
    flat = comm.layer_passes(layout, (8,), None)
    assert flat == (32, 32)
    assert comm.fsdp_layer_bytes(fsdp, layer_local, flat) == 3 * 8 * layer_local * 2 * 4
    assert comm.tp_bytes(cfg, layout, s, flat) == 10 * one * 8 * 4
    # Full recompute re-runs the forward collectives of the layers it recomputes.
    assert comm.layer_passes(layout, (8,), None, recomputed=1.0) == (64, 32)


def test_fsdp_gathers_of_fp8_layers_move_one_byte_a_parameter():
    """FP8 layers' projections are cast on their FSDP shard and gathered in FP8 (measured on
    the H100 program: tests/test_gpu_compile.py's FSDP test); their gradients are still
    reduce-scattered in the compute dtype, and bf16 first/last layers gather 2 bytes."""
    cfg = _cfg_8b(data=1, fsdp=8, zero1=False)
    layout = ledger.layout_from_config(cfg, 8)
    layer = device_params.layer_params_local(cfg, 1)
    assert comm.fsdp_gather_bytes(cfg, layout, layer) == 2.0  # FP8 off
    cfg.fp8 = Fp8Config(enabled=True, bf16_first_layers=0, bf16_last_layers=0)
    assert comm.fsdp_gather_bytes(cfg, layout, layer) == 1.0
    cfg.fp8 = Fp8Config(enabled=True, bf16_first_layers=8, bf16_last_layers=8)
    assert comm.fsdp_gather_bytes(cfg, layout, layer) == 2.0 - 16 / 32  # 16 of 32 in FP8
    passes = comm.Passes(forward=64, backward=32)
    assert comm.fsdp_layer_bytes(layout, layer, passes, 1.5) == layer * (1.5 * 96 + 2 * 32)
    est = ledger.estimate(cfg, layout, "h100")
    bf16 = ledger.estimate(_cfg_8b(data=1, fsdp=8, zero1=False), layout, "h100")
    # at 2 bytes a parameter, a gather per forward and per backward layer pass: the
    # backward uses what its full-recompute forward gathered (one gather, on the H100 program)
    gathers = layer * 2 * (32 + 32)
    assert bf16.comm_bytes["fsdp"] - est.comm_bytes["fsdp"] == pytest.approx(gathers / 4)


def test_links_follow_device_order():
    gpu = ledger.get_gpu("h100")
    layout = ledger.Layout(tensor=8, stage=4, data=32)
    assert comm.link(layout, ("tensor",), gpu) == ("nvlink", 450e9)
    assert comm.link(layout, ("context", "data"), gpu) == ("nic", 50e9)
    assert comm.link(layout, ("stage",), gpu)[0] == "nic"
    assert comm.link(ledger.Layout(tensor=2, data=4), ("context", "data"), gpu)[0] == "nvlink"


def test_bubble_and_ideal_step():
    assert ledger.bubble_fraction(4, 16, 5) == 3 / 80
    assert ledger.bubble_fraction(8, 64) == 7 / 64
    assert ledger.bubble_fraction(1, 4) == 0
    cfg = recipe("llama70b")
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 1024), "h100")
    assert est.bubble == 1 / 64  # the recipe: stage 2 x 8 virtual, 8 microbatches
    # The executor's lock-step table: F in 64 of its 80 steps, B in 65 (B = 2F, no recompute).
    assert est.lockstep_bubble == pytest.approx((64 + 2 * 65) / (64 * 3) - 1)
    assert est.ideal_step_s == pytest.approx(est.model_flops_per_step / (1024 * 989e12))
    low, high = est.expected_mfu
    assert 0.2 < low < high < 0.8
    assert est.expected_step_s[0] > est.ideal_step_s


# ----------------------------------------------------------------------------- layout, hardware

def test_layout_from_config_resolves_fill():
    layout = ledger.layout_from_config(recipe("llama70b"), 1024)
    assert (layout.tensor, layout.stage, layout.data, layout.virtual_stages) == (8, 2, 64, 8)
    assert layout.micro_batch == 512 // (64 * 8) == 1
    assert layout.sequence_parallel and layout.zero1 and layout.n_devices == 1024


@pytest.mark.parametrize("change, n, match", [
    ({}, 1000, "not divisible by"),
    ({"stage": 3, "virtual_stages": 1}, 768, "num_layers=80 is not divisible"),
    ({"virtual_stages": 3}, 1024, "num_layers=80"),
    ({"microbatches": 6}, 1024, "global_batch=512"),
    ({"microbatches": 4, "stage": 8, "virtual_stages": 2}, 1024, "divisible by stage"),
    ({"tensor": 128}, 1024, "num_heads=64 is not divisible by tensor=128"),
    ({"tensor": 3}, 384, "num_heads=64 is not divisible"),
])
def test_layout_errors(change, n, match):
    cfg = recipe("llama70b")
    cfg.parallel = dataclasses.replace(cfg.parallel, **change)
    with pytest.raises(ledger.LayoutError, match=match):
        ledger.layout_from_config(cfg, n)


def test_gpu_table():
    assert ledger.get_gpu("H100").bf16_flops == 989e12
    assert ledger.get_gpu("h200").hbm_bytes > ledger.get_gpu("h100").hbm_bytes
    assert ledger.get_gpu("a100").bf16_flops == 312e12
    assert ledger.get_gpu("cpu").estimate and not ledger.get_gpu("h100").estimate
    assert ledger.gpu_for_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    with pytest.raises(ledger.UnknownGpuError, match="h100.*h200.*a100.*cpu"):
        ledger.get_gpu("b200")


def test_describe_and_speed():
    cfg = recipe("llama70b")
    layout = ledger.layout_from_config(cfg, 1024)
    start = time.perf_counter()
    est = ledger.estimate(cfg, layout, "h100")
    assert time.perf_counter() - start < 0.05
    text = ledger.describe(est)
    assert "tensor=8" in text and "fits" in text and "MFU" in text and "bubble 1.6%" in text
    assert "pipeline executor: 80 lock-step steps" in text and "16 + 2 stashed" in text


def test_ledger_imports_without_jax():
    code = ("import sys, jaxtrain.ledger, jaxtrain.tools.plan; "
            "assert 'jax' not in sys.modules, 'ledger pulled in jax'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_context_parallel_terms():
    """CP bytes per strategy (K/V heads only), the ring's hops timed against their blocks,
    activations / c without scores, the imbalance of unbalanced causal shards."""
    cfg = recipe("llama3_8b_128k")
    layout = ledger.layout_from_config(cfg, 8)
    assert (layout.tensor, layout.context, layout.micro_batch) == (2, 4, 2)
    s, b, c = 131072, 2, 4
    kv = 2 * (s / c) * b * (8 * 128 / 2) * 2       # one shard's K and V: 4 KV heads per rank
    fwd, bwd = comm.cp_pass_bytes(cfg, layout, s)
    assert (fwd.kv, fwd.fixed) == (3 * kv, 0)      # ring: c-1 hops
    assert (bwd.kv, bwd.fixed) == (4 * kv, 3 * 2 * kv)   # + home hop; fp32 dK/dV x (c-1)
    gathered = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, context_strategy="all_gather"))
    fwd, bwd = comm.cp_pass_bytes(gathered, layout, s)
    assert (fwd.total, bwd.total) == (3 * kv, 6 * kv)   # gather; gather again + RS
    # Full recompute: the re-run forward's transfers the backward shares (GPU compiler).
    passes = comm.layer_passes(layout, (32,), None, recomputed=1.0)
    assert comm.cp_bytes(gathered, layout, s, passes, 32 * 32) == (
        3 * kv * 64 * 32 + 6 * kv * 32 * 32 - 3 * kv * 32 * 32)
    # Activations: s/c of everything, no s x s scores even on the XLA core, the LSE kept.
    xla = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="xla"))
    per_layer = memory.layer_activation_bytes(xla, layout, s, flash=False)
    one = dataclasses.replace(layout, context=1, micro_batch=2)
    assert per_layer == pytest.approx(
        memory.layer_activation_bytes(xla, one, s, flash=True) / c)
    est = ledger.estimate(cfg, layout, "h100")
    assert est.comm_bytes["cp"] > 0 and est.losses["cp_comm"][0] <= est.losses["cp_comm"][1]
    # The ring hides its hops when a block's attention outlasts the transfer (NVLink).
    assert est.losses["cp_comm"][0] < 0.2 * est.comm_seconds["cp"]
    # Unbalanced shards: the last rank's causal work is (2c-1)/c of the average.
    assert ledger.flops.context_attention_imbalance(4, False, True) == 7 / 4
    assert ledger.flops.context_attention_imbalance(4, True, True) == 1.0
    unbalanced = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, context_load_balance=False))
    slow = ledger.estimate(unbalanced, layout, "h100")
    assert slow.losses["compute"][0] > est.losses["compute"][0]

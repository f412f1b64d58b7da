"""The ledger's model of the pipeline executor (jaxtrain.ledger.pipeline) against hand-derived
lock-step tables and hand-computed memory, FLOPs and traffic. Pure Python, milliseconds."""
import dataclasses
import pathlib
import subprocess
import sys

import pytest

from jaxtrain import ledger
from jaxtrain.config import (Config, ModelConfig, ParallelConfig, RematConfig, TrainConfig,
                             load_recipe)
from jaxtrain.ledger import flops, memory

ROOT = pathlib.Path(__file__).resolve().parents[1]


def table(schedule, p, m, v=1, layers=8):
    return ledger.executor(ledger.Layout(stage=p, microbatches=m, virtual_stages=v,
                                         schedule=schedule), (layers,) * p)


# ----------------------------------------------------------------------------- tables by hand

def test_1f1b_two_stages_four_microbatches():
    """Lock-step, fused F+B steps (rank: ops per step; the last stage's B follows its F):
        step    0    1      2      3      4      5
        rank 0  F0   F1     F2 B0  F3 B1  B2     B3
        rank 1  -    F0 B0  F1 B1  F2 B2  F3 B3  -
    Rank 1's F is the last virtual stage's, folded into its B (one vjp, nothing stashed), so
    only steps 0-3 have an F; steps 1-5 have a B. Rank 0 stashes F_k's residuals from step k
    to B_k at step k+2, and a B frees its slot for the same step's F: 2 slots. Rank 1 keeps
    each arriving activation one step (1 inbox slot); rank 0 reads the tokens, and waits one
    step for each cotangent (1 cotangent slot)."""
    ex = table("1f1b", 2, 4)
    assert (ex.steps, ex.f_steps, ex.b_steps, ex.head_steps) == (6, 4, 5, 4)
    assert (ex.stash_slots, ex.inbox_slots, ex.grad_slots) == ((2, 0), (0, 1), (1, 0))
    # Every rank allocates 2 stash slots, 1 inbox + 1 cotangent slot, 2 receive buffers.
    assert (ex.stash_buffer, ex.inbox_buffer, ex.grad_buffer, ex.buffers) == (2, 1, 1, 4)
    assert ex.sends == 12                                   # 6 steps x (right + left)
    # each rank runs each of its chunk's 4 forwards and 4 backwards once
    assert (ex.forward_passes, ex.backward_passes) == (4, 4)
    # Lock-step time 4F + 5B over the ideal 4(F + B), B = 2F: 14/12 - 1; Megatron's 1/4
    # charges the last stage's separate F, which the executor folds into its B.
    assert ex.bubble(2.0) == pytest.approx(1 / 6)
    assert ledger.bubble_fraction(2, 4) == 1 / 4


def test_gpipe_two_stages_holds_every_microbatch():
    """GPipe: rank 0 runs F0..F3 in steps 0-3 and B0..B3 in steps 5-8 (4 residual sets held
    at step 3); rank 1 gets activations in steps 1-4 and runs their folded F + B in 4-7, so
    its inbox holds all four at step 4."""
    ex = table("gpipe", 2, 4)
    assert (ex.steps, ex.f_steps, ex.b_steps) == (9, 4, 5)
    assert (ex.stash_slots, ex.inbox_slots) == ((4, 0), (0, 4))
    assert ex.buffers == 4 + 1 + 2 and ex.sends == 18


def test_interleaved_two_stages_two_chunks_two_microbatches():
    """p=2, v=2, m=2 (virtual stage g on rank g % 2), derived step by step:
        step    0       1       2       3              4              5       6       7
        rank 0  F(0,0)  F(0,1)  F(2,0)  F(2,1)         B(2,0)         B(2,1)  B(0,0)  B(0,1)
        rank 1  -       F(1,0)  F(1,1)  F(3,0) B(3,0)  F(3,1) B(3,1)  B(1,0)  B(1,1)  -
    Rank 0 stashes (0,0) over steps 0-6, (0,1) 1-7, (2,0) 2-4 and (2,1) 3-5: 4 sets at step 3;
    rank 1 (1,0) 1-5 and (1,1) 2-6: 2 sets, its (3,k) being the last virtual stage's."""
    ex = table("interleaved_1f1b", 2, 2, v=2)
    assert (ex.steps, ex.f_steps, ex.b_steps, ex.head_steps) == (8, 4, 5, 2)
    assert (ex.stash_slots, ex.inbox_slots, ex.grad_slots) == ((4, 2), (1, 1), (1, 1))
    assert ex.buffers == 1 + 1 + 2 and ex.chunk_layers == 4
    assert (ex.forward_passes, ex.backward_passes) == (4, 4)
    assert ex.bubble(2.0) == pytest.approx((4 + 2 * 5) / (4 * 3) - 1)


def test_llama70b_table():
    """The recipe's 2 stages x 8 virtual, 8 microbatches: 80 steps; rank 0 stashes Megatron's
    interleaved warm-up, 2(p-1) + (v-1)p = 16 chunk residual sets."""
    ex = table("interleaved_1f1b", 2, 8, v=8, layers=40)
    assert (ex.steps, ex.stash_buffer, ex.grad_buffer, ex.chunk_layers) == (80, 16, 1, 5)
    assert ex.stash_slots == (16, 14) and (ex.f_steps, ex.b_steps) == (64, 65)
    assert ex.sends == 160 < 2 * 8 * 8 * 2   # vs Megatron's 2.m.v sends per direction pair
    assert table("1f1b", 1, 8) is None


# ----------------------------------------------------------------------------- the estimate

H, F, LAYERS, V, S = 1024, 4096, 8, 32000, 2048


def small(**parallel) -> Config:
    cfg = Config(model=ModelConfig(vocab_size=V, hidden_size=H, num_layers=LAYERS,
                                   num_heads=16, num_kv_heads=8, mlp_size=F, max_seq_len=S),
                 train=TrainConfig(global_batch=32, seq_len=S))
    cfg.parallel = ParallelConfig(**{**dict(tensor=2, sequence_parallel=True, stage=2, data=2,
                                            microbatches=4, zero1=True), **parallel})
    cfg.remat = RematConfig(granularity="none")
    return cfg


LAYER = 2 * H * H + 2 * H * 512 + 3 * H * F + 2 * H           # q, o; k, v; MLP; norms
LAYER_LOCAL = (2 * H * H + 3 * H * F) / 2 + 2 * H * 512 / 2 + 2 * H
TABLE_LOCAL = V * H / 2                                        # vocab-parallel over t=2
SBH = S * 4 * H                                                # micro_batch 4
# flash, SP over t=2: streams and norm outputs 8sbh, q and o 4sbh, k and v (8 of 16 heads)
# 2sbh, all over t; the fp32 lse 4 bytes per (token, head); gate, up and their product 6sbF
PER_LAYER_ACTS = (8 + 4 + 2) * SBH / 2 + 4 * S * 4 * 16 / 2 + 6 * S * 4 * F / 2


def estimate(cfg, n=8):
    return ledger.estimate(cfg, ledger.layout_from_config(cfg, n), "h100")


def test_small_pipelined_estimate_by_hand():
    cfg = small()
    est = estimate(cfg)
    ex = est.executor
    assert (ex.steps, ex.stash_buffer, ex.buffers, ex.chunk_layers) == (6, 2, 4, 4)
    # Static: a rank computes with its 4 layers and its edge row (one vocab table and the
    # final norm: rank 0's embedding, rank 1's head); both tables' and the norm's masters and
    # Adam moments split over the 2 stages (and ZeRO-1 over data 2); the B's 4-layer chunk
    # gradient in bf16.
    n_local = 4 * LAYER_LOCAL + TABLE_LOCAL + H
    n_state = 4 * LAYER_LOCAL + (2 * TABLE_LOCAL + H) / 2
    assert est.params_local == n_local
    assert est.static_bytes == pytest.approx(n_local * (2 + 4) + n_state * 12 / 2
                                             + 4 * LAYER_LOCAL * 2)
    # Activations: 2 stashed + 1 (the last stage's B) + 1 (in transit) sets of 4 layers'
    # residuals, and 4 chunk-input buffers (bf16, split over tensor).
    chunk_input = SBH * 2 / 2
    assert est.chunk_input_bytes == chunk_input
    assert est.activation_bytes == pytest.approx(4 * chunk_input + 4 * 4 * PER_LAYER_ACTS)
    # Full recompute inside the chunk: each layer's input in a set + one layer re-materialised.
    assert est.activation_bytes_by_remat["full"] == pytest.approx(
        4 * chunk_input + 4 * 4 * SBH * 2 / 2 + PER_LAYER_ACTS)
    # HFU: nothing is run again without remat.
    assert est.model_flops_per_token == ledger.model_flops_per_token(cfg)
    assert est.hfu_flops_per_token == est.model_flops_per_token
    # Communication: 12 sends of a chunk input; over stage, each data rank's 1/2 share of the
    # vocab gradients reduce-scattered (fp32), their bf16 copy gathered from the p x 2 shards.
    assert est.comm_bytes["pp"] == 12 * chunk_input
    held = 2 * TABLE_LOCAL + H
    assert est.comm_bytes["vocab"] == (1 / 2) * held * 4 / 2 + (3 / 4) * held * 2
    # TP+SP: 4 sequence-sized collectives per forward pass (4 per rank), 6 per backward pass
    # (4), each (t-1)/t.s.b.h.2, over the chunk's 4 layers
    assert est.comm_bytes["tp"] == 4 * (1 / 2) * SBH * 2 * (4 * 4 + 6 * 4)
    # The step time pays the table's idle fraction, not Megatron's.
    assert est.bubble == 1 / 4 and est.lockstep_bubble == pytest.approx(1 / 6)
    comp, recomp = est.losses["compute"][0], est.losses["recompute"][0]
    assert recomp == 0
    assert est.losses["bubble"][0] == pytest.approx((comp + recomp) * 1 / 6)


def test_remat_recompute_is_the_only_one():
    """Full recompute inside the chunk's backward re-runs each layer's forward once: B = 3F,
    and the recomputed layers' forward collectives run once more in every backward pass."""
    cfg = small()
    cfg.remat = RematConfig(granularity="full", method="uniform", num_layers=1)
    est = estimate(cfg)
    # causal attention: half of 4·H·S; a one-layer checkpoint's re-run drops the down
    # projection (its output feeds nothing the backward needs)
    layer_fwd = 2 * LAYER + 2 * H * S - 2 * F * H
    assert est.hfu_flops_per_token == pytest.approx(
        ledger.model_flops_per_token(cfg) + LAYERS * layer_fwd)
    # B over F: 2 + the re-run forward (a whole forward less the dropped down projection)
    b = 2 + layer_fwd / (2 * LAYER + 2 * H * S)
    assert est.lockstep_bubble == pytest.approx((4 + b * 5) / (4 * (1 + b)) - 1)
    assert est.comm_bytes["tp"] == 4 * (1 / 2) * SBH * 2 * (4 * (4 + 4) + 6 * 4)


def test_uneven_stages_pad_every_rank_to_the_largest_chunk():
    cfg = small(first_stage_layers=3, last_stage_layers=5)
    est = estimate(cfg)
    assert est.stage_layers == (3, 5) and est.executor.chunk_layers == 5
    # Both ranks hold 5 layers (the executor's chunks are padded) and an edge row.
    assert est.params_local == 5 * LAYER_LOCAL + TABLE_LOCAL + H
    assert est.inflight_layer_microbatches == 4 * 5
    # The per-layer switch that skips padding makes a B copy its chunk's weights (bf16),
    # besides the chunk gradient, without full recompute; inside a checkpoint it does not.
    weights = 5 * LAYER_LOCAL * 2
    assert est.static_breakdown["gradients"] == pytest.approx(weights)
    assert est.static_breakdown["other"] == pytest.approx(weights)
    cfg.remat = RematConfig(granularity="full", method="uniform", num_layers=1)
    assert estimate(cfg).static_breakdown["other"] == 0


def test_virtual_stages_slice_their_chunks():
    """With virtual stages the F and the B each copy their chunk out of the rank's v."""
    cfg = small(virtual_stages=2, schedule="interleaved_1f1b")
    est = estimate(cfg)
    assert est.static_breakdown["gradients"] == pytest.approx(2 * LAYER_LOCAL * 2)
    assert est.static_breakdown["other"] == pytest.approx(2 * 2 * LAYER_LOCAL * 2)


def test_without_tensor_or_fsdp_the_b_taps_its_gradients():
    """Without tensor and fsdp sharding (executors/pipeline.fuses) the B adds each layer's
    weight gradient into the accumulator: one layer's bf16 gradient, not the chunk's, and of
    the virtual stages' chunk slices one at a time."""
    cfg = small(virtual_stages=2, schedule="interleaved_1f1b", tensor=1,
                sequence_parallel=False, data=4)
    layer = (2 * H * H + 3 * H * F + 2 * H * 512 + 2 * H) * 2
    static = estimate(cfg).static_breakdown
    assert static["gradients"] == pytest.approx(layer)
    assert static["other"] == pytest.approx(2 * layer)


def test_tied_embeddings_hold_one_table_and_reduce_one_gradient():
    cfg = small()
    cfg.model = dataclasses.replace(cfg.model, tie_embeddings=True)
    est = estimate(cfg)
    assert est.params_local == 4 * LAYER_LOCAL + TABLE_LOCAL + H
    # Rank 0's and rank p-1's copies of the one table: their gradients summed in one
    # reduce-scatter over stage to its master's shards, its bf16 copy all-gathered.
    held = TABLE_LOCAL + H
    assert est.comm_bytes["vocab"] == (1 / 2) * held * 4 / 2 + (3 / 4) * held * 2


def test_hfu_from_the_config_counts_the_remat_only():
    """The trainer's metrics call hfu_flops_per_token(cfg): the configured stages add none."""
    cfg = small()
    assert flops.hfu_flops_per_token(cfg) == ledger.model_flops_per_token(cfg)
    cfg.remat = RematConfig(granularity="full", method="block", num_layers=1)
    layer_fwd = 2 * LAYER + 2 * H * S - 2 * F * H   # less the dropped down projection
    # block:1 recomputes the first layer of each of the 2 stages' chunks
    assert flops.hfu_flops_per_token(cfg) == pytest.approx(
        ledger.model_flops_per_token(cfg) + 2 * layer_fwd)


def test_candidate_a_of_the_worked_example():
    """Llama 3 70B on 1024 H100s, TP 8 (SP), PP 4 with 4 virtual stages, DP 32, micro-batch 1
    (16 microbatches): Megatron's accounting holds 27.4 GB of activations on the first stage
    (80 layers x 34·s·b·h/t, x1.2 for SwiGLU). The executor's rank 0 stashes the interleaved
    warm-up's 18 chunk residual sets, the last stage's B and the one in transit two more:
    20 x 5 layers (Megatron's 19 in flight, with its own 34·s·b·h/t per layer)."""
    cfg = load_recipe(str(ROOT / "configs" / "llama70b.py"))
    layout = ledger.Layout(tensor=8, stage=4, virtual_stages=4, data=32, micro_batch=1,
                           microbatches=16, sequence_parallel=True, zero1=True,
                           schedule="interleaved_1f1b")
    est = ledger.estimate(cfg, layout, "h100")
    assert est.executor.stash_buffer == 18 and est.inflight_layer_microbatches == 20 * 5
    assert est.activation_bytes == pytest.approx(27.4e9, rel=0.05)
    assert est.fits


def test_chunk_input_follows_dtype_and_sequence_parallelism():
    cfg = small()
    layout = ledger.layout_from_config(cfg, 8)
    assert ledger.chunk_input_bytes(cfg, layout, S) == SBH * 2 / 2
    no_sp = dataclasses.replace(layout, sequence_parallel=False)
    assert ledger.chunk_input_bytes(cfg, no_sp, S) == SBH * 2
    cfg.model = dataclasses.replace(cfg.model, compute_dtype="float32")
    assert ledger.chunk_input_bytes(cfg, layout, S) == SBH * 4 / 2
    assert memory.pipelined_activations(cfg, layout, cfg.remat, True, S,
                                        ledger.executor(layout, (4, 4))).buffers == 4 * SBH * 2


def test_pipelined_estimate_needs_no_jax():
    code = ("import sys; from jaxtrain.config import load_recipe; from jaxtrain import ledger; "
            "cfg = load_recipe('configs/llama70b.py'); "
            "e = ledger.estimate(cfg, ledger.layout_from_config(cfg, 1024), 'h100'); "
            "assert e.executor.steps == 80; "
            "assert 'jax' not in sys.modules, 'the executor model pulled in jax'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

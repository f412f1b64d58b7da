"""The ledger's MoE terms against hand-derived formulas (docs/design.md §5): activated-expert
FLOPs (Megatron's count), expert weights per expert rank, the all-to-all and its link, the MoE
remat modules' recompute and memory, the expert degree's errors, the planner's --expert.
Pure Python, milliseconds."""
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from jaxtrain import ledger
from jaxtrain.config import (Config, ModelConfig, MoeConfig, ParallelConfig, RematConfig,
                             TrainConfig, load_recipe)
from jaxtrain.ledger import device_params, experts, memory
from jaxtrain.ledger.hardware import GiB
from jaxtrain.tools import plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIXTRAL = load_recipe(ROOT / "configs" / "mixtral_8x7b.py")


def _small(moe: MoeConfig | None = None, **parallel) -> Config:
    """A 4-layer model with distinct sizes, so each term of a formula shows."""
    return Config(model=ModelConfig(vocab_size=1000, hidden_size=64, num_layers=4, num_heads=4,
                                    num_kv_heads=2, mlp_size=96, moe=moe,
                                    compute_dtype="bfloat16"),
                  parallel=ParallelConfig(**parallel),
                  train=TrainConfig(global_batch=16, seq_len=32))


def _attention_params(m: ModelConfig) -> int:
    h, e = m.hidden_size, m.resolved_head_dim
    return h * m.num_heads * e * 2 + 2 * h * m.num_kv_heads * e + 2 * h   # q, o, k, v, norms


# ----------------------------------------------------------------------------- FLOPs

def test_mixtral_params_total_and_active_match_the_published_figures():
    """Mistral's Mixtral 8x7B: 46.7 B parameters, 12.9 B active per token."""
    counts = ledger.param_counts(MIXTRAL.model)
    assert counts.total == pytest.approx(46.7e9, rel=2e-3)
    active = counts.active_non_embedding + counts.embedding   # the published count has both
    assert active == pytest.approx(12.9e9, rel=5e-3)


@pytest.mark.parametrize("recipe", ["tiny_moe", "tiny_deepseek"])
def test_the_ledgers_parameters_are_the_models_leaves(recipe):
    """Every parameter the MoE model holds, the ledger counts: DeepSeek's MLA, shared expert,
    first dense layer and balancing bias; Mixtral-style experts."""
    import jax
    from flax import nnx
    from jaxtrain.model import llama
    cfg = load_recipe(ROOT / "configs" / f"{recipe}.py")
    state = nnx.state(nnx.eval_shape(lambda: llama.Llama(cfg.model, rngs=nnx.Rngs(0))))
    assert ledger.param_counts(cfg.model).total == sum(x.size for x in jax.tree.leaves(state))


def test_a_pipelined_layout_with_dense_first_layers_is_priced_and_said_to_be_refused():
    """DeepSeek-V3's first dense layers among the MoE ones: the ledger prices its pipelined
    layout as Megatron runs it, its notes say train.py refuses it, and config_check does."""
    from jaxtrain import config_check
    from jaxtrain.config import ConfigError
    cfg = load_recipe(ROOT / "configs" / "deepseek_v3.py")
    est = ledger.estimate(cfg, ledger.layout_from_config(cfg, 1024), "h100")
    refusal = "stage=16 with dense layers among the MoE ones (model.moe.first_k_dense=3"
    assert any(n.startswith("train.py refuses this layout: " + refusal) for n in est.notes)
    with pytest.raises(ConfigError, match=re.escape("parallel." + refusal)):
        config_check.check(cfg, 1024)


def test_moe_flops_count_top_k_experts_the_router_and_shared_experts():
    moe = MoeConfig(num_experts=8, top_k=2, mlp_size=40, shared_experts=2, shared_mlp_size=24)
    cfg = _small(moe)
    m, h, s = cfg.model, 64, 32
    moe_layer = _attention_params(m) + h * 8 + 2 * 3 * h * 40 + 3 * h * 2 * 24
    active = 4 * moe_layer + 1000 * h + h       # every layer MoE; lm_head and final norm
    attn = 6 * 4 * m.num_heads * m.resolved_head_dim * s   # causal half of 12·L·(H·E)·s
    assert ledger.model_flops_per_token(cfg) == 6 * active + attn
    every_expert = 6 * ledger.param_counts(m).non_embedding + attn
    assert every_expert - ledger.model_flops_per_token(cfg) == 6 * 4 * 6 * 3 * h * 40
    # MFU divides activated work: the same throughput on every expert would read 8/2 higher.
    mfu = ledger.mfu(cfg, 1000.0, 1, 1e12)
    assert mfu == pytest.approx(1000.0 * (6 * active + attn) / 1e12)


def test_dense_first_layers_and_layer_freq_are_respected():
    # Layer i is MoE when i >= 1 and i % 2 == 0: only layer 2 of 4.
    cfg = _small(MoeConfig(num_experts=4, top_k=1, pre_softmax=True, first_k_dense=1,
                           layer_freq=2))
    m, h = cfg.model, 64
    assert m.moe_layers == (False, False, True, False)
    dense = _attention_params(m) + 3 * h * 96
    moe_active = _attention_params(m) + h * 4 + 1 * 3 * h * 96   # expert size: model.mlp_size
    counts = ledger.param_counts(m)
    assert (counts.dense_layers, counts.moe_layers) == (3, 1)
    assert counts.layers_active == 3 * dense + moe_active
    assert counts.layers == 3 * dense + _attention_params(m) + h * 4 + 4 * 3 * h * 96


# ----------------------------------------------------------------------------- memory

def test_expert_weights_and_their_optimizer_state_split_over_expert_ranks():
    """data=8 (ZeRO-1): expert=4 holds 2 of the 8 experts per layer, and their optimizer state
    shards over the 8/4 = 2 ranks that hold the same experts, the rest over all 8."""
    moe = MoeConfig(num_experts=8, top_k=2)
    base = ledger.Layout(data=8, zero1=True, micro_batch=2)
    cfg1, cfg4 = _small(moe, data=8, zero1=True), _small(moe, data=8, zero1=True, expert=4)
    one = ledger.estimate(cfg1, base, "h100")
    four = ledger.estimate(cfg4, dataclasses.replace(base, expert=4), "h100")
    experts_per_layer = 8 * 3 * 64 * 96
    assert one.params_local - four.params_local == 4 * experts_per_layer * (1 - 1 / 4)
    held = 4 * experts_per_layer / 4                      # expert params a rank holds (EP 4)
    rest = four.params_local - held
    state = four.static_breakdown["master"] + four.static_breakdown["moments"]
    assert state == pytest.approx(held * 12 / 2 + rest * 12 / 8)
    assert four.static_breakdown["master"] == pytest.approx(state / 3)   # 4 of the 12 bytes
    assert four.static_breakdown["weights"] == pytest.approx(2 * four.params_local)


def test_dp_bytes_split_dense_params_over_every_data_rank_and_experts_over_their_peers():
    """data=8, expert=4: the dense params' gradients are reduced over all 8 data ranks, the
    experts' over the 8/4 = 2 that hold the same experts (comm.dp_split), and the dry run
    compares them against the mesh axes they run on: data,expert and data (dry_run.dp_terms);
    with expert = data no rank shares an expert, so the experts reduce nothing."""
    from jaxtrain.ledger import comm
    from jaxtrain.tools import dry_run
    moe = MoeConfig(num_experts=8, top_k=2)
    L = ledger.Layout(data=8, expert=4, micro_batch=2)
    dense, routed = comm.dp_split(L, 1000.0, 600.0)
    assert (dense, routed) == (400 * 8.0, 600 * 8.0)   # plain DP: fp32 sums, all-reduced
    assert comm.dp_bytes(L, 1000.0, 600.0) == dense + routed
    assert comm.dp_split(dataclasses.replace(L, expert=8), 1000.0, 600.0) == (400 * 8.0, 0.0)
    assert comm.dp_split(dataclasses.replace(L, expert=1), 1000.0, 600.0) == (1000 * 8.0, 0.0)
    cfg = _small(moe, data=8, expert=4)
    terms = dry_run.dp_terms(cfg, L, 1.0)
    assert [(axes, ranks) for axes, _, ranks in terms] == [(("data", "expert"), 8),
                                                           (("data",), 2)]
    assert sum(payload for _, payload, _ in terms) == pytest.approx(
        ledger.estimate(cfg, L, "h100").comm_bytes["dp"])


def test_moe_activations_by_tag_and_what_moe_act_and_moe_recompute():
    """One MoE layer's stored bytes (bf16): rows = tokens x top_k; moe_act drops rows·F,
    moe the router choices, gate/up, SwiGLU and expert outputs."""
    cfg = _small(MoeConfig(num_experts=8, top_k=2, mlp_size=40), data=1)
    layout = ledger.Layout(micro_batch=4, microbatches=4)
    tokens, rows = 32 * 4, 32 * 4 * 2
    by_tag = experts.activation_bytes_by_tag(cfg, layout, 32)
    assert by_tag["moe_in"] == 2 * 2 * rows * 40 and by_tag["moe_act"] == 2 * rows * 40
    assert by_tag["moe_router"] == tokens * 2 * 8 and by_tag["moe_out"] == 2 * rows * 64

    def stored(modules):
        rm = RematConfig(granularity="selective", modules=modules)
        return memory.stage_activations(cfg, layout, rm, False, 32, 4, 4).total
    # 4 layers x 1 microbatch in flight, unpipelined; the backward re-materialises one layer's
    # dropped tags at once (the working set), with `moe` also gate/up's cotangents (moe_in's
    # size)
    stored_less = 4 - 1
    assert stored(("core_attn",)) - stored(("core_attn", "moe_act")) == \
        stored_less * by_tag["moe_act"]
    assert stored(("core_attn",)) - stored(("core_attn", "moe")) == stored_less * sum(
        by_tag[t] for t in ("moe_router", "moe_in", "moe_act", "moe_out")) - by_tag["moe_in"]


def test_expert_parallel_buffers_hold_every_senders_worst_case():
    """Under expert parallelism the expert GEMMs run on (and store) a rank's receive buffer:
    ep blocks of tokens x top_k rows (static shapes: dropless' worst case), ep times the
    routed rows; the dispatch buffers are the T·k rows sent and that buffer. The FLOPs stay
    the routed rows' (flops.expert_rows_per_token)."""
    cfg = _small(MoeConfig(num_experts=8, top_k=2, mlp_size=40), data=4)
    one = ledger.Layout(micro_batch=4, microbatches=4)
    four = dataclasses.replace(one, expert=4, data=4)
    by_one = experts.activation_bytes_by_tag(cfg, one, 32)
    by_four = experts.activation_bytes_by_tag(cfg, four, 32)
    for tag in ("moe_in", "moe_act", "moe_out", "rows"):
        assert by_four[tag] == 4 * by_one[tag], tag
    assert by_four["moe_router"] == by_one["moe_router"]
    rows = 32 * 4 * 2
    assert experts.dispatch_buffer_bytes(cfg, four, 32) == 2 * (1 + 4) * rows * 64
    assert experts.rows_per_token(cfg) == 2 and experts.buffer_rows_per_token(cfg, four) == 8


def test_moe_recompute_flops_of_each_module():
    moe = MoeConfig(num_experts=8, top_k=2, mlp_size=40, shared_experts=1, shared_mlp_size=24)
    cfg = _small(moe)
    h = 64

    def extra(*modules):   # a module's own, beside what every selective policy re-runs
        return (ledger.recompute_flops_per_token(
            cfg, RematConfig(granularity="selective", modules=("core_attn", *modules)))
            - ledger.recompute_flops_per_token(
                cfg, RematConfig(granularity="selective", modules=("core_attn",))))
    assert extra("moe_act") == 0.0                                # elementwise
    assert extra("moe") == 4 * (6 * h * 40 * 2)                   # in and out projections
    assert extra("shared_experts") == 4 * (4 * h * 24)            # gate and up
    assert extra("mlp") == 0.0                                    # no dense MLP in MoE layers


# ----------------------------------------------------------------------------- all-to-all

def test_all_to_all_bytes_per_step_and_the_link_they_travel():
    """Unpipelined: L·m forward and L·m backward MoE layer passes, two all-to-alls each of
    (ep-1)/ep · tokens·top_k · h · 2 bytes."""
    moe = MoeConfig(num_experts=8, top_k=2)
    cfg = _small(moe, data=16, expert=8)
    layout = ledger.Layout(data=16, expert=8, micro_batch=1, microbatches=1)
    est = ledger.estimate(cfg, layout, "h100")
    one_pass = 2 * (8 - 1) / 8 * (32 * 1 * 2) * 64 * 2
    assert est.comm_bytes["ep"] == pytest.approx(4 * (1 + 1) * one_pass)
    assert est.comm_links["ep"] == "nvlink"               # 8 adjacent ranks: one node
    wide = ledger.Layout(tensor=2, data=8, expert=8, micro_batch=2, microbatches=1)
    assert ledger.estimate(_small(moe, tensor=2, data=8, expert=8), wide,
                           "h100").comm_links["ep"] == "nic"   # 2 x 8 ranks: two nodes
    # selective moe re-runs the forward's all-to-alls in each backward pass
    again = ledger.estimate(cfg, layout, "h100",
                            remat=RematConfig(granularity="selective", modules=("moe",)))
    assert again.comm_bytes["ep"] == pytest.approx(4 * 3 * one_pass)
    assert ledger.estimate(cfg, dataclasses.replace(layout, expert=1),
                           "h100").comm_bytes["ep"] == 0.0


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("moe, parallel, message", [
    (MoeConfig(num_experts=6), dict(data=8, expert=4),
     "model.moe.num_experts=6 is not divisible by expert=4"),
    (MoeConfig(num_experts=8), dict(data=6, expert=4), "expert=4 does not divide data=6"),
    (None, dict(data=8, expert=2), "expert=2 with no MoE layer"),
])
def test_bad_expert_degrees_are_one_line_errors(moe, parallel, message):
    cfg = dataclasses.replace(_small(moe, **parallel),
                              train=TrainConfig(global_batch=48, seq_len=32))
    with pytest.raises(ledger.LayoutError, match=message) as err:
        ledger.layout_from_config(cfg, parallel["data"])
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the planner

def test_the_planner_walks_expert_degrees_and_takes_expert_as_a_flag():
    cfg = _small(MoeConfig(num_experts=8, top_k=2), data=-1)
    result = plan.plan(cfg, 8, "h100")
    degrees = {c.estimate.layout.expert for c in result.candidates}
    assert degrees > {1} and degrees <= {1, 2, 4, 8}
    out = subprocess.run([sys.executable, "-m", "jaxtrain.plan", "--config",
                          str(ROOT / "configs" / "mixtral_8x7b.py"), "--devices", "64",
                          "--stage", "4", "--expert", "4"], capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    assert "expert=4" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxtrain.plan", "--config",
                          str(ROOT / "configs" / "mixtral_8x7b.py"), "--devices", "64",
                          "--stage", "4", "--expert", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expert=3" in bad.stderr


def test_mixtral_layout_fits_64_h100s_only_with_its_recompute():
    est = ledger.estimate(MIXTRAL, ledger.layout_from_config(MIXTRAL, 64), "h100")
    assert est.fits and est.remat == "selective(core_attn,moe)"
    # the executor stores the experts' tensors at its receive buffer's rows: moe_act alone
    # does not fit
    act = dataclasses.replace(MIXTRAL, remat=dataclasses.replace(
        MIXTRAL.remat, modules=("core_attn", "moe_act")))
    assert not ledger.estimate(act, ledger.layout_from_config(act, 64), "h100").fits
    assert 0.3 < est.expected_mfu[0] < est.expected_mfu[1] < 0.7
    assert est.total_bytes < est.budget_bytes <= 72 * GiB


def test_the_mfu_breakdown_budgets_the_all_to_all_on_expert():
    from jaxtrain.tools.mfu_breakdown import ledger_budget
    budget = ledger_budget(MIXTRAL, 64, "h100")
    assert budget.by_axis["expert"][0] > 0


def test_a_flag_that_leaves_the_expert_degree_impossible_rederives_it():
    from jaxtrain.tools.plan_flags import flagged_estimate
    flags = dict(tensor=8, stage=None, virtual_stages=None, context=None, micro_batch=None,
                 expert=None)
    est, notes = flagged_estimate(MIXTRAL, 64, ledger.get_gpu("h100"), flags)
    assert est.layout.data == 2 and est.layout.expert in (1, 2)
    assert "expert=8 does not divide data=2" in notes[0] and "(the recipe's 8)" in notes[0]
    with pytest.raises(ledger.LayoutError, match="expert=8 does not divide data=2"):
        flagged_estimate(MIXTRAL, 64, ledger.get_gpu("h100"), {**flags, "expert": 8})


def test_pipeline_ranks_hold_the_moe_layers_of_their_chunks():
    """first_k_dense=2 of 4 layers, stage 2: rank 1 holds both MoE layers; interleaved (v=2,
    one-layer chunks 0..3 on ranks 0,1,0,1) each rank holds one of each kind."""
    cfg = _small(MoeConfig(num_experts=8, top_k=2, first_k_dense=2))
    m = cfg.model
    dense = _attention_params(m) + 3 * 64 * 96
    moe = _attention_params(m) + 64 * 8 + 8 * 3 * 64 * 96
    edge = device_params.edge_params_local(cfg, 1)        # one (padded) vocab table, the final norm
    plain = ledger.Layout(stage=2, data=1, micro_batch=1, microbatches=16)
    assert device_params.held_moe_layers(cfg, plain, (2, 2)) == 2
    assert device_params.params_local(cfg, plain, (2, 2)) == 2 * moe + edge
    inter = dataclasses.replace(plain, virtual_stages=2, schedule="interleaved_1f1b")
    assert device_params.held_moe_layers(cfg, inter, (2, 2)) == 1
    assert device_params.params_local(cfg, inter, (2, 2)) == moe + dense + edge

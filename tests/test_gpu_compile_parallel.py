"""The pipeline's and context parallelism's H100 programs (compile-only H100s,
jaxtrain.tools.targets): the pipelined step executes the unpipelined step's matmuls, 1F1B's
memory does not grow with microbatches, the attention kernels count as dense attention's
matmuls, the context collectives against the ledger, ring attention inside pipeline stages.
Run with `-m gpu_compile` (the gpu-compile extra)."""
import re

import pytest

from jaxtrain.parallel import sharding
from jaxtrain.tools import gpu_kernels, gpu_program, hlo, hlo_module, pipeline_flops
from jaxtrain.tools.compile_step import compile_step
from jaxtrain.config import load_config
from jaxtrain.ledger import comm, estimate, layout_from_config
from util import tiny_config
from gpu_compile_util import BF16, CUDNN_TARGET, FLASH_KERNELS, LAYOUTS, compile_tiny

pytestmark = pytest.mark.gpu_compile


# ----------------------------------------------------------------------------- the pipeline

def _executed(out):
    s = out.setup.cfg.parallel
    from jaxtrain.ledger.pipeline_schedule import build_schedule
    table = build_schedule(s.schedule, out.mesh.shape["stage"], s.microbatches,
                           s.virtual_stages).table
    return pipeline_flops.executed_matmul_flops(out.text, table.columns, out.mesh.shape["stage"],
                                                s.virtual_stages)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_pipelined_step_executes_the_unpipelined_steps_matmuls(h100, schedule, v):
    """Without recompute a pipelined device runs the matmuls of the unpipelined step's device
    (same model, batch and device count) within 3%: an F stashes what its B needs and each
    rank runs only its own ops. Counting every branch of every table step, as the HLO reader
    does, gives several times that."""
    layout = ("--parallel.tensor=2", "--model.attention=xla", "--model.num_layers=4")
    piped = compile_tiny(h100, *layout, "--parallel.stage=2", "--parallel.data=2",
                     f"--parallel.schedule={schedule}", f"--parallel.virtual_stages={v}",
                     "--parallel.microbatches=4")
    flat = compile_tiny(h100, *layout, "--parallel.data=4", "--parallel.microbatches=4")
    executed, reference = _executed(piped), hlo.matmul_flops_from_text(flat.text)
    assert 0.97 <= executed.mean / reference <= 1.03, (executed, reference)
    assert executed.every_branch > 2 * executed.max


def test_1f1b_compiled_memory_does_not_grow_with_microbatches(h100):
    """1F1B's stash is fixed by the stages: from 8 to 32 microbatches of the same size the
    compiled step's memory grows by the token buffers only (each rank holds 2(p-1-r) stashed
    residual sets whatever m). GPipe's grows by a residual set per microbatch."""
    mem = {}
    for kind in ("1f1b", "gpipe"):
        for m in (8, 32):
            out = compile_tiny(h100, "--parallel.stage=4", "--parallel.data=2",
                           f"--parallel.schedule={kind}", f"--parallel.microbatches={m}",
                           f"--train.global_batch={2 * m}", "--model.num_layers=4")
            mem[kind, m] = hlo.memory(out.compiled)["total_bytes"]
    growth = {k: (mem[k, 32] - mem[k, 8]) / 24 for k in ("1f1b", "gpipe")}
    assert growth["1f1b"] < 0.05 * growth["gpipe"], (mem, growth)
    assert mem["1f1b", 32] < 1.02 * mem["1f1b", 8], mem


VOCAB_LEAVES = ("embed", "lm_head", "final_norm")


def _vocab_state_bytes(out) -> float:
    """Per-device bytes of the tables' and the final norm's fp32 masters and Adam moments, by
    the shardings the compiled step takes the train state in."""
    import jax
    import numpy as np
    total = 0.0

    def add(path, leaf, sh):
        nonlocal total
        if {str(getattr(k, "key", "")) for k in path} & set(VOCAB_LEAVES):
            total += float(np.prod(sh.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    jax.tree_util.tree_map_with_path(add, out.setup.abstract_train_state,
                                     out.compiled.input_shardings[0][0])
    return total


@pytest.mark.parametrize("zero1", [False, True])
def test_vocab_tables_state_is_split_over_stage_at_less_stage_traffic(h100, zero1):
    """Issue 31: under stages the embedding's, lm_head's and final norm's masters and Adam
    moments are split over `stage` (1/p per rank of what replicated masters held; Megatron
    keeps them on the first and last stage), and over `stage` the step moves their fp32
    gradients reduce-scattered and the bf16 copy all-gathered, (p-1)/p·(4 + 2) bytes a
    parameter, where replicated masters took an fp32 all-reduce, 2·(p-1)/p·4: the ledger's
    vocab term exactly, 3/4 of the all-reduce's. Under ZeRO-1 each data rank reduce-scatters
    its share over stage and the copy's gather runs over (stage, data) at once: the ledger's
    two vocab terms (comm.vocab_terms)."""
    from jaxtrain.ledger.device_params import vocab_params_local
    out = compile_tiny(h100, *LAYOUTS[2], f"--parallel.zero1={str(zero1).lower()}")
    cfg, mesh = out.setup.cfg, out.setup.mesh
    p, d, t = mesh.shape["stage"], mesh.shape["data"], mesh.shape["tensor"]
    zero = d if zero1 else 1
    tables = vocab_params_local(cfg, t)             # both tables + the norm per tensor rank
    replicated = 3 * 4 * tables / zero              # master + mu + nu, on every stage rank
    assert _vocab_state_bytes(out) == pytest.approx(replicated / p)

    colls = [c for c in hlo.collectives_from_text(out.text, mesh)
             if c.kind != "collective-permute" and c.bytes > 1024]   # not the loss scalars
    stage = sum(c.wire_bytes * c.count for c in colls if c.axes == ("stage",))
    joint = sum(c.wire_bytes * c.count for c in colls if c.axes == ("stage", "data"))
    assert joint if zero1 else not joint
    over_stage, joint_ledger = comm.vocab_terms(cfg, layout_from_config(cfg, mesh.size))
    assert stage == pytest.approx(over_stage, rel=0.01)
    assert joint == pytest.approx(joint_ledger, rel=0.01)
    all_reduce = 2 * (p - 1) / p * tables * 4 / zero
    # 3/4 of the all-reduce without ZeRO-1; with it, each data rank's share reduce-scattered
    # over stage (half the all-reduce) and the copy gathered once, over stage x data
    assert over_stage == pytest.approx((0.5 if zero1 else 0.75) * all_reduce)


# the Mosaic kernels' head size 128; TP with SP, FSDP and data
ATTENTION_SHAPES = ("--train.seq_len=256", "--model.max_seq_len=256", "--model.hidden_size=256",
                    "--model.num_heads=2", *LAYOUTS[1])


@pytest.mark.parametrize("impl", ["pallas", "mosaic", "cudnn"])
def test_attention_kernels_count_as_the_dense_attentions_matmuls(h100, impl):
    """A step whose attention runs in a kernel executes, as the dry run counts it, the matmul
    FLOPs of the same step on XLA's attention (dots over the full square): each kernel call
    counts as the dense attention's matmuls it stands for (measured: equal to the FLOP)."""
    kernel = compile_tiny(h100, f"--model.attention={impl}", *ATTENTION_SHAPES)
    dense = compile_tiny(h100, "--model.attention=xla", *ATTENTION_SHAPES)
    counted = pipeline_flops.executed_matmul_flops(kernel.text, None).mean
    assert counted == pytest.approx(hlo.matmul_flops_from_text(dense.text), rel=1e-9)
    assert counted > 1.2 * hlo.matmul_flops_from_text(kernel.text)   # the kernels' share


# ----------------------------------------------------------------------------- context

def _float_share(shape: str) -> float:
    """The floating-point part of a collective's (tuple) shape: K/V and their gradients, not
    the int32 segment ids and positions the combiner packs in with them."""
    arrays = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", shape)
    total = sum(hlo_module.shape_bytes(a) for a in arrays)
    return sum(hlo_module.shape_bytes(a) for a in arrays if not a.startswith(("s32", "u32"))) / total


CP = ("--model.attention=pallas", "--parallel.data=2", "--parallel.context=4",
      "--parallel.microbatches=2", "--train.seq_len=128", "--model.max_seq_len=128")


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_collectives_match_the_ledger_and_the_ring_hides_every_hop(h100, strategy,
                                                                           remat):
    """Over `context`, the K/V (and dK/dV) bytes of the GPU program are the ledger's, with full
    recompute too (whose re-run forward shares its first hop, or its whole gather, with the
    backward); the ring's permutes are async start/done pairs with a Pallas attention block
    scheduled between every start and its done, in the forward and the backward loop."""
    remat_args = ["--remat.granularity=full", "--remat.num_layers=1"] if remat == "full" else []
    cfg = tiny_config(*BF16, *CP, f"--parallel.context_strategy={strategy}", *remat_args)
    out = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8)))
    acs = [a for a in gpu_program.async_collectives(out.text, out.mesh)
           if a.collective.axes == ("context",)]
    layout = layout_from_config(cfg, 8)
    passes = comm.layer_passes(layout, (cfg.model.num_layers,), None, float(remat == "full"))
    base = comm.layer_passes(layout, (cfg.model.num_layers,), None)
    want = comm.cp_bytes(cfg, layout, cfg.train.seq_len, passes, passes.forward - base.forward)
    got = sum(a.collective.wire_bytes_per_step * _float_share(a.collective.shape) for a in acs)
    assert got == pytest.approx(want, rel=1e-6)
    if strategy == "ring":
        hops = [a for a in acs if a.collective.in_loop and _float_share(a.collective.shape) > 0]
        assert hops and {a.collective.kind for a in hops} == {"collective-permute"}
        assert all(a.is_async and a.overlapped for a in hops), [
            (a.collective.op, a.overlapped) for a in hops]


def test_ring_attention_inside_pipeline_stages_compiles_for_h100(h100):
    """stage 2 x context 2 x data 2 with the ring (refused on XLA:CPU, which crashes running
    it): its hops are collective-permutes over `context` inside the executor's loop (the
    all-reduces there are the weight gradients GSPMD reduces over context, docs/design.md §9)."""
    out = compile_tiny(h100, "--model.attention=pallas", "--parallel.stage=2", "--parallel.data=2",
                   "--parallel.context=2", "--parallel.context_strategy=ring",
                   "--parallel.microbatches=2", "--train.seq_len=128", "--model.max_seq_len=128")
    assert gpu_kernels.pallas_kernel_names(out.text) == FLASH_KERNELS
    kinds = {c.kind for c in hlo.collectives_from_text(out.text, out.mesh)
             if c.axes == ("context",) and c.in_loop}
    assert kinds == {"collective-permute", "all-reduce"}, kinds


def test_activation_memory_falls_with_the_context_degree(h100):
    """Llama 3 8B at 64K tokens (tensor 2 + SP) on 8 H100s: the compiled memory one more layer
    costs (4 layers minus 2, halved; the logits and head cancel) less the ledger's per-layer
    state is the ledger's per-layer activations, which context parallelism divides by c."""
    per_layer = {}
    for c in (1, 2, 4):
        compiled, ledger = {}, {}
        for layers in (2, 4):
            cfg = load_config("configs/llama3_8b.py", [
                f"--model.num_layers={layers}", "--train.seq_len=65536",
                "--model.max_seq_len=65536", f"--parallel.context={c}",
                f"--parallel.data={4 // c}", "--parallel.microbatches=2",
                f"--train.global_batch={2 * (4 // c)}", "--parallel.context_strategy=ring"])
            out = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8)))
            compiled[layers] = hlo.memory(out.compiled)["total_bytes"]
            ledger[layers] = estimate(cfg, layout_from_config(cfg, 8), "h100")
        layer_state = (ledger[4].static_bytes - ledger[2].static_bytes) / 2
        per_layer[c] = (compiled[4] - compiled[2]) / 2 - layer_state
        assert per_layer[c] == pytest.approx(ledger[4].activation_bytes_per_layer, rel=0.05)
    assert per_layer[1] / per_layer[2] == pytest.approx(2, rel=0.05)
    assert per_layer[1] / per_layer[4] == pytest.approx(4, rel=0.05)


def test_cudnn_runs_the_all_gather_strategy(h100):
    """cuDNN's fused attention (forward and backward) attends a context shard's queries to
    the gathered keys under an explicit causal/document mask."""
    cfg = tiny_config(*BF16, *CP, "--model.attention=cudnn")
    text = compile_step(cfg, sharding.make_mesh(cfg.parallel, h100(8))).text
    assert len(CUDNN_TARGET.findall(text)) == 2
    assert not gpu_kernels.pallas_kernel_names(text)

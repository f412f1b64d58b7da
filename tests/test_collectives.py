"""The compiled train step moves the bytes the ledger says it does (docs/design.md §5, §6).

Measured: `jaxtrain.tools.hlo` reading the optimized, partitioned HLO of `step.make_train_step`.
Expected: `jaxtrain.ledger.comm`'s formulas evaluated with this model's sizes, plus the terms
the formulas leave out, each derived below from the model's shapes (never from a measurement).

Compared per mesh axis and per class of collective, at the level every backend agrees on
(shared/notes/xla-cpu-collectives.md): the CPU pipeline has no reduce-scatter creator, so a
gradient reduce-scatter is an all-reduce whose result is only sliced. Inside the tuples the
all-reduce combiner builds, `hlo` cannot tell the two apart. Reduce-scatters and all-reduces
therefore form one class, "reduce", whose payload is the unreduced operand either way (the same
number on GPU). "gather" is the all-gather payload (the gathered buffer).

Byte widths: the tests compute in fp32 (tests/util.tiny_config), and gradients are reduced in
fp32 (step.py accumulates them in fp32), so every collective here moves 4-byte elements. The
ledger's formulas count bf16 (2 bytes), so they are scaled by WIDTH / 2.

The model has 8 query heads and 4 KV heads, so tensor <= 4 splits every projection: that is
the case the formulas describe. (With fewer KV heads than tensor ranks, K and V are replicated
and their gradients are summed over sub-groups of the tensor axis: traffic the formulas leave
out.)
"""
import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxtrain import step
from jaxtrain.executors import setup as setup_lib
from jaxtrain.parallel import sharding
from jaxtrain.tools import hlo, hlo_module
from jaxtrain.ledger import comm
from jaxtrain.ledger.layout import layout_from_config
from test_parallel import LAYOUTS
from util import tiny_config

MODEL = ("--model.vocab_size=512", "--model.num_heads=8", "--model.num_kv_heads=4",
         "--train.global_batch=16")
WIDTH = 4          # bytes per element of every collective in these fp32 tests
LEDGER_WIDTH = 2   # the ledger's formulas count bf16
LOSS_WIDTH = 4     # cross entropy runs in fp32 whatever the compute dtype
TOLERANCE = 0.05
# Reductions of scalars (loss sum, token count, grad-norm partial sums) ride on whatever axes
# the partitioner picks; their bytes are not communication volume worth a formula.
SCALAR_BYTES = 256


@functools.lru_cache(maxsize=None)
def compiled_step(name: str):
    """(cfg, setup, compiled train step, collectives) of one layout of test_parallel.py (or of
    CP_LAYOUTS below)."""
    cfg = tiny_config(*MODEL, *{**LAYOUTS, **CP_LAYOUTS}[name])
    setup = setup_lib.build(cfg, sharding.make_mesh(cfg.parallel))
    batch_sh = setup.batch_shardings
    batch = {k: jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len),
                                     jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=batch_sh[k]) for k in setup_lib.BATCH_KEYS}
    compiled = step.make_train_step(setup).lower(
        setup.abstract_train_state, batch).compile()
    return cfg, setup, compiled, hlo.collectives(compiled, setup.mesh)


# ----------------------------------------------------------------------------- expected

def local_elements(setup) -> dict[str, int]:
    """Parameter elements one device computes with after the tensor split, by role."""
    shapes = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(setup.abstract_state))[0]
    shardings = jax.tree.leaves(setup.compute_shardings)
    t = setup.mesh.shape["tensor"]
    out = collections.Counter()
    for (path, x), sh in zip(shapes, shardings):
        keys = [str(getattr(k, "key", k)) for k in path]
        split = math.prod(setup.mesh.shape[a] for axes in sh.spec if axes
                          for a in ((axes,) if isinstance(axes, str) else axes) if a == "tensor")
        role = ("embed" if keys[0] == "embed" else "head" if keys[0] == "lm_head"
                else "norm" if keys[-2].endswith("norm") else "layer")
        # The formulas assume every matrix is split t ways; norms are never split.
        assert split == (1 if role == "norm" else t), (keys, sh.spec)
        out[role] += math.prod(x.shape) // split
    return out


def expected_bytes(cfg, setup) -> dict[tuple, float]:
    """Payload bytes per step by (mesh axes, class): the ledger plus the named extra terms."""
    layout = layout_from_config(cfg, setup.mesh.size)
    n = local_elements(setup)
    n_local = sum(n.values())  # §5's N_local: parameters held after the tensor split
    scale = WIDTH / LEDGER_WIDTH
    m, L, t = layout.microbatches, cfg.model.num_layers, layout.tensor
    out = collections.Counter()

    if layout.data > 1:
        # Ledger: the fp32 gradients of N_local/fsdp reduced (ZeRO-1: reduce-scattered, its
        # params all-gathered in the compute dtype; plain DP: all-reduced, one payload that a
        # ring moves twice).
        shard = n_local / layout.fsdp
        assert comm.dp_bytes(layout, n_local) == (shard * (4 + 2) if layout.zero1
                                                  else 2 * shard * 4)
        out[("data",), "reduce"] += shard * 4
        if layout.zero1:
            out[("data",), "gather"] += shard * 2 * scale
        else:
            # Norm scales are not fsdp-sharded, so DP reduces all of them, not 1/fsdp.
            out[("data",), "reduce"] += n["norm"] * WIDTH * (1 - 1 / layout.fsdp)

    if layout.fsdp > 1:
        # Ledger: the layers' weights gathered in each forward and backward pass and their
        # gradients reduce-scattered in each backward one (L.m passes each).
        layers = comm.fsdp_layer_bytes(layout, n["layer"], comm.layer_passes(
            layout, (L,), None)) / L * scale  # n["layer"] holds all L layers' elements
        out[("fsdp",), "gather"] += 2 * layers / 3
        out[("fsdp",), "reduce"] += layers / 3
        # The head gathered once per step (loop-invariant: outside the microbatch scan), its
        # gradient reduce-scattered per microbatch; norm scales are replicated over fsdp,
        # never gathered, their gradients all-reduced (the same payload) per microbatch.
        out[("fsdp",), "gather"] += n["head"] * WIDTH
        out[("fsdp",), "reduce"] += m * (n["head"] + n["norm"]) * WIDTH
        # The embedding table never moves: the lookup gathers the token ids (int32) and trades
        # the looked-up rows for all of D in one all-to-all, and back in the backward.
        b, s_, d = layout.micro_batch, cfg.train.seq_len, cfg.model.hidden_size
        s_local = s_ // t if layout.sequence_parallel else s_
        out[("fsdp",), "gather"] += m * layout.fsdp * b * s_ * 4
        out[("fsdp",), "all-to-all"] += m * 2 * b * s_local * d * WIDTH

    if t > 1:
        b, s, d = layout.micro_batch, cfg.train.seq_len, cfg.model.hidden_size
        sbh = b * s * d * WIDTH                 # one residual-stream activation, full sequence
        loss = 3 * b * s * LOSS_WIDTH           # vocab-parallel CE: max, sum of exp, target logit
        # Ledger: ring wire bytes per layer and microbatch, 8·(t−1)/t·s·b·h.
        tp = comm.tp_bytes_per_layer_microbatch(cfg, layout, s) * scale
        # CPU has no AllReduceReassociate: the input gradients of the separate q, k, v and
        # gate, up projections are reduced one by one (5 per layer) where a GPU adds them
        # first and reduces twice (tests/test_gpu_compile.py). Three extra reductions of a
        # residual-stream activation.
        unreassociated = 3 * sbh
        if layout.sequence_parallel:
            payload = tp / ((t - 1) / t)        # 6 all-gathers + 4 reduce-scatters
            # (the backward's 6 include re-gathering the two sequence-sharded norm outputs for
            # the weight gradients, as Megatron does); norm-scale gradients are partial over
            # the sequence.
            layer_gather = payload * 6 / 10
            layer_reduce = payload * 4 / 10 + unreassociated + 2 * d * WIDTH
            # Embedding: vocab-parallel lookup reduce-scattered to the sequence shards, its
            # gradient all-gathered back; lm_head: the final norm output all-gathered, its
            # gradient reduce-scattered; the final norm's scale gradient all-reduced.
            rest_gather = 2 * sbh
            rest_reduce = 2 * sbh + d * WIDTH + loss
        else:
            payload = tp / (2 * (t - 1) / t)    # 4 all-reduces
            layer_gather, layer_reduce = 0, payload + unreassociated
            # Vocab-parallel embedding all-reduce; lm_head input-gradient all-reduce.
            rest_gather, rest_reduce = 0, 2 * sbh + loss
        if layer_gather + rest_gather:
            out[("tensor",), "gather"] += m * (L * layer_gather + rest_gather)
        out[("tensor",), "reduce"] += m * (L * layer_reduce + rest_reduce)
    return dict(out)


def measured_bytes(colls) -> dict[tuple, int]:
    out = collections.Counter()
    for c in colls:
        cls = {"all-gather": "gather", "all-reduce": "reduce", "reduce-scatter": "reduce",
               "all-to-all": "all-to-all"}
        out[c.axes, cls.get(c.kind, c.kind)] += c.bytes_per_step
    return dict(out)


def comparison(name: str) -> list[tuple]:
    """(axes, class, expected, measured) rows of one layout, unexpected keys with expected 0."""
    cfg, setup, _, colls = compiled_step(name)
    want, got = expected_bytes(cfg, setup), measured_bytes(colls)
    return [(axes, cls, want.get((axes, cls), 0.0), got.get((axes, cls), 0))
            for axes, cls in sorted(set(want) | set(got), key=str)]


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_axis_match_ledger(name):
    rows = comparison(name)
    print(f"\n{name}")
    for axes, cls, want, got in rows:
        print(f"  {str(axes):12s} {cls:8s} expected {want:>10.0f}  measured {got:>10d}")
    stray = sum(got for _, _, want, got in rows if want == 0)
    assert stray <= SCALAR_BYTES, f"collectives the ledger does not explain: {rows}"
    for axes, cls, want, got in rows:
        if want:
            assert got == pytest.approx(want, rel=TOLERANCE), (axes, cls, rows)


def test_no_data_parallel_collective_inside_microbatch_loop():
    _, _, _, colls = compiled_step("data2_fsdp2_tensor2_mb4")
    assert not hlo.loop_collectives(colls, ("data",))
    # The loops are there and read: FSDP and TP traffic runs per microbatch and per layer.
    assert {c.axes for c in hlo.loop_collectives(colls, ("fsdp", "tensor"))} == {
        ("fsdp",), ("tensor",)}
    reduced = sum(c.bytes_per_step for c in colls if c.axes == ("data",))
    reduced_mb1 = sum(c.bytes_per_step for c in compiled_step("data2_fsdp2_tensor2")[3]
                      if c.axes == ("data",))
    assert reduced == reduced_mb1  # once per step, however many microbatches


def _only_sliced(comps, c: hlo.Collective) -> bool:
    """Every tuple element of all-reduce `c` is used only through a 1/group slice: the CPU
    spelling of a reduce-scatter (hlo's `sliced` flag covers single, not combined, ops)."""
    comp = comps[c.computation]
    op = comp.by_name[c.op]
    elements = ([u for u in comp.instrs if op.name in u.operands]
                if op.shape.startswith("(") else [op])
    for element in elements:
        users = [u for u in comp.instrs if element.name in u.operands]
        if not users:
            return False
        for user in users:
            if hlo_module.shape_bytes(user.shape) * c.group_size != hlo_module.shape_bytes(element.shape):
                return False
            fused = re.findall(r"calls=%?([\w.\-]+)", user.attrs) if user.opcode == "fusion" else []
            if user.opcode != "dynamic-slice" and not any(
                    i.opcode == "dynamic-slice" for f in fused for i in comps[f].instrs):
                return False
    return True


def _residual_stream_tp_collectives(name):
    """(kind, sliced) of each in-loop tensor collective that moves residual-stream activations."""
    cfg, setup, compiled, colls = compiled_step(name)
    layout = layout_from_config(cfg, setup.mesh.size)
    sbh = layout.micro_batch * cfg.train.seq_len * cfg.model.hidden_size * WIDTH
    comps, _ = hlo_module.parse_module(compiled.as_text())
    out = []
    for c in colls:
        if c.axes == ("tensor",) and c.in_loop and c.bytes % sbh == 0:
            out.append((c.kind, c.kind == "all-reduce" and _only_sliced(comps, c), c.count))
    return out, cfg.model.num_layers


def test_sequence_parallel_uses_gathers_and_reduce_scatters():
    found, layers = _residual_stream_tp_collectives("tensor2_sp_fsdp4")
    assert found
    plain = [f for f in found if f[0] == "all-reduce" and not f[1]]
    assert not plain, f"plain all-reduces of the residual stream under SP: {found}"
    # Per layer: forward 2 all-gathers + 2 reduce-scatters, backward the same and more.
    assert sum(n for kind, _, n in found if kind == "all-gather") >= 4 * layers
    assert sum(n for kind, sliced, n in found if sliced) >= 4 * layers


def test_tensor_parallel_without_sp_all_reduces():
    """The check above can fail: without SP the same activations are plainly all-reduced."""
    found, layers = _residual_stream_tp_collectives("tensor4_data2")
    assert found and all(kind == "all-reduce" and not sliced for kind, sliced, _ in found)


# ----------------------------------------------------------------------------- context

CP_LAYOUTS = {
    "context2_all_gather_tensor2_data2_mb2": [
        "--parallel.data=2", "--parallel.context=2", "--parallel.tensor=2",
        "--parallel.microbatches=2"],
    "context4_ring_data2_mb2": [
        "--parallel.data=2", "--parallel.context=4", "--parallel.context_strategy=ring",
        "--parallel.microbatches=2"],
}


@pytest.mark.parametrize("name", list(CP_LAYOUTS))
def test_context_collectives_match_ledger(name):
    """Over `context`: the attention's K/V gathers (and dK/dV reduce-scatters) or ring hops
    (K/V in the compute dtype, dK/dV accumulators in fp32) are the ledger's cp bytes, wire
    for wire; the int32 segment ids and positions that travel with K/V are small (the ledger
    leaves them out); the gradients are reduced once, over data x context together, after the
    microbatches (no per-layer reduction over context)."""
    cfg, setup, _, colls = compiled_step(name)
    layout = layout_from_config(cfg, setup.mesh.size)
    passes = comm.layer_passes(layout, (cfg.model.num_layers,), None)
    fwd, bwd = comm.cp_pass_bytes(cfg, layout, cfg.train.seq_len)
    scale = WIDTH / LEDGER_WIDTH
    want = ((fwd.kv * scale + fwd.fixed) * passes.forward
            + (bwd.kv * scale + bwd.fixed) * passes.backward)
    over_context = [c for c in colls if c.axes == ("context",)]
    floats = [c for c in over_context if c.shape.startswith("f32")]
    got = sum(c.wire_bytes_per_step for c in floats)
    kinds = {c.kind for c in floats}
    assert kinds == ({"collective-permute"} if cfg.parallel.context_strategy == "ring"
                     else {"all-gather", "reduce-scatter"}), kinds
    assert got == pytest.approx(want, rel=1e-6), (got, want)
    ids = [c for c in over_context if c not in floats]
    assert all(c.shape.startswith("s32") for c in ids)
    assert sum(c.wire_bytes_per_step for c in ids) < 0.05 * got
    reduced = [c for c in colls if c.axes == ("data", "context")]
    assert reduced and all(not c.in_loop and c.count == 1 for c in reduced)
    n_local = sum(local_elements(setup).values())
    assert sum(c.bytes_per_step for c in reduced) == pytest.approx(  # the fp32 gradients
        n_local * 4, rel=TOLERANCE)

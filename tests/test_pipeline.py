"""Pipeline executor: loss and grads equal the unpipelined model; what an F stashes; stash
counter; data-parallel reduction after the loop; memory in m; bad inputs.

Toy model (fp32, tiny dims) on the public API (`Fns`, edge rows): an embedding of raw features
inside the first virtual stage, residual tanh-MLP layers as chunks (one layer per virtual
stage), a linear head with integer-label cross entropy inside the last; both edge tables sit
in every rank's row (rank 0 reads the embedding, rank p-1 the head). The executor returns sums
over microbatches and data replicas: divided by their number they are the unpipelined mean.
Compiling dominates the run time, so the executor is checked on a representative subset of
(schedule, p, v, m); the simulator tests cover every combination. All executor runs fill idle
slots and empty buffers with NaN: any leak would show in the loss or a gradient.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.tools import hlo
from jaxtrain.parallel import pipeline as pl

E, D, F, C, B, S = 3, 8, 16, 5, 4, 2     # raw input, model, mlp, classes, batch, seq
V = 11                                  # vocab of the token-input variant
NAN = float("nan")
TOL = 1e-5


def compile_fast(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def jit_fast(fn):
    """jax.jit(fn) compiled for these args (a new compile per call: call it once)."""
    return lambda *args: compile_fast(fn, *args)(*args)


def layer(x_BSD, w):
    return x_BSD + jnp.tanh(x_BSD @ w["w1_DF"]) @ w["w2_FD"]


def chunk_fn(chunk_params, x_BSD, chunk_aux=()):
    return lax.scan(lambda h, w: (layer(h, w), None), x_BSD, chunk_params)[0]


def head_loss_fn(head_params, x_BSD, labels_BS):
    logits_BSC = x_BSD @ head_params["w_DC"]
    logp_BSC = jax.nn.log_softmax(logits_BSC)
    return -jnp.mean(jnp.take_along_axis(logp_BSC, labels_BS[..., None], axis=-1))


def edge_head(edge_row, x_BSD, labels_BS):
    """The head on rank p-1's edge row: (objective, sums), both the microbatch's mean loss."""
    loss = head_loss_fn(edge_row["head"], x_BSD, labels_BS)
    return loss, loss


def edge_embed(edge_row, raw_BSE):
    return raw_BSE @ edge_row["embed"]


FNS = pl.Fns(chunk_fn, edge_head, edge_embed)


def make_model(num_layers, m, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {
        "embed": jax.random.normal(k[0], (E, D)),
        "layers": {"w1_DF": jax.random.normal(k[1], (num_layers, D, F)) / np.sqrt(D),
                   "w2_FD": jax.random.normal(k[2], (num_layers, F, D)) / np.sqrt(F)},
        "head": {"w_DC": jax.random.normal(k[3], (D, C)) / np.sqrt(D)},
    }
    raw_MBSE = jax.random.normal(k[4], (m, B, S, E))
    labels_MBS = jax.random.randint(k[5], (m, B, S), 0, C)
    return params, raw_MBSE, labels_MBS


def reference_loss(params, raw_MBSE, labels_MBS):
    """The unpipelined model: all layers in order, mean loss over microbatches."""
    def one(raw_BSE, labels_BS):
        return head_loss_fn(params["head"], chunk_fn(params["layers"], raw_BSE @ params["embed"]),
                            labels_BS)
    return jnp.mean(jax.vmap(one)(raw_MBSE, labels_MBS))


def edge_rows(params, p):
    """The embedding and head tables in every rank's row ([p, ...]): rank 0 reads one, rank
    p-1 the other."""
    tables = {"embed": params["embed"], "head": params["head"]}
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (p,) + a.shape), tables)


def replicas(schedule, mesh):
    """How many losses the executor sums: microbatches x data replicas."""
    return schedule.microbatches * mesh.shape.get("data", 1)


def pipeline_value_and_grad(schedule, mesh, pparams, raw_MBSE, labels_MBS, fill=NAN, fns=FNS,
                            chunk_aux=()):
    """(mean loss, grads in the params' layout, stats) of the model with its layers in the
    pipeline (pparams['layers'] is [p, v, Lc, ...]): the executor's sums divided by the number
    of (microbatch, replica) losses, the edge rows' gradients summed over the ranks."""
    sums, (d_layers, d_edge), stats = pl.pipelined_value_and_grad(
        fns, pparams["layers"], edge_rows(pparams, schedule.stages), raw_MBSE, labels_MBS,
        chunk_aux, schedule=schedule, mesh=mesh, bubble_fill=fill)
    n = replicas(schedule, mesh)
    grads = {"layers": d_layers, **jax.tree.map(lambda d: jnp.sum(d, axis=0), d_edge)}
    return sums / n, jax.tree.map(lambda g: g / n, grads), stats


def stage_mesh(p):
    return jax.make_mesh((p,), ("stage",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:p])


def max_diff(a, b):
    """Largest |a - b| over all leaves; a NaN anywhere counts as infinitely far."""
    diffs = [np.abs(np.asarray(u, np.float64) - np.asarray(w, np.float64))
             for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return max(float(np.max(np.nan_to_num(d, nan=np.inf))) for d in diffs)


def to_pipeline(params, p, v):
    return dict(params, layers=pl.stack_stages(params["layers"], p, v))


def from_pipeline(grads):
    return dict(grads, layers=pl.unstack_stages(grads["layers"]))


@functools.cache
def reference(num_layers, m):
    params, raw, labels = make_model(num_layers, m)
    loss, grads = jit_fast(jax.value_and_grad(reference_loss))(params, raw, labels)
    return params, raw, labels, loss, grads


# (schedule, p, v, m) run through the executor; together they cover p in {2, 4}, v in {1, 2},
# m in {4, 8}, all three schedules, m == p, m > p and the interleaved wrap from rank p-1 to 0.
EXECUTOR_CASES = [
    ("gpipe", 2, 1, 4),
    ("1f1b", 4, 1, 8),
    ("interleaved_1f1b", 2, 2, 8),
    ("interleaved_1f1b", 4, 2, 4),
]


@pytest.mark.parametrize("kind,p,v,m", EXECUTOR_CASES)
def test_pipelined_grad_matches_unpipelined(kind, p, v, m):
    params, raw, labels, ref_loss, ref_grads = reference(p * v, m)
    schedule = pl.build_schedule(kind, p, m, v)
    run = functools.partial(pipeline_value_and_grad, schedule, stage_mesh(p))
    loss, grads, _ = jit_fast(run)(to_pipeline(params, p, v), raw, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    assert max_diff(from_pipeline(grads), ref_grads) < TOL


def padded_chunk_fn(chunk_params, x_BSD, chunk_aux=()):
    """chunk_fn for padded chunks: a layer runs only where its stacked flag `real` is set."""
    def step(h, w):
        return lax.cond(w["real"] > 0, lambda: layer(h, w), lambda: h), None
    return lax.scan(step, x_BSD, chunk_params)[0]


def test_stack_stages_orders_and_pads_uneven_stages():
    layers = {"w": jnp.arange(8.0)}
    chunks = pl.stack_stages(layers, 2, 2, stage_layers=(2, 6))["w"]     # chunks (1,1),(3,3)
    # virtual stages in order g = j*p + r: [0], [1 2 3], [4], [5 6 7]
    np.testing.assert_array_equal(chunks, [[[0, 0, 0], [4, 0, 0]], [[1, 2, 3], [5, 6, 7]]])
    np.testing.assert_array_equal(pl.unstack_stages({"w": chunks}, (2, 6))["w"], layers["w"])
    np.testing.assert_array_equal(pl.chunk_layer_counts(8, 2, 2, (2, 6)), [[1, 1], [3, 3]])
    even = pl.stack_stages(layers, 2, 2)
    np.testing.assert_array_equal(pl.unstack_stages(even)["w"], layers["w"])
    with pytest.raises(pl.PipelineError, match="multiples of virtual_stages=2"):
        pl.stack_stages(layers, 2, 2, stage_layers=(3, 5))


@pytest.mark.parametrize("kind,p,v,stage_layers", [
    ("1f1b", 4, 1, (1, 3, 3, 1)),
    ("interleaved_1f1b", 2, 2, (2, 4)),
])
def test_uneven_stages_match_unpipelined_and_skip_padding(kind, p, v, stage_layers):
    m = 4
    params, raw, labels, ref_loss, ref_grads = reference(sum(stage_layers), m)
    schedule = pl.build_schedule(kind, p, m, v)
    layers = dict(params["layers"], real=jnp.ones(sum(stage_layers)))
    chunks = pl.stack_stages(layers, p, v, stage_layers)     # padding rows: real = 0
    # padding rows hold NaN weights: a padding layer that ran would poison loss and grads
    real = chunks["real"][..., None, None] > 0
    chunks = dict(chunks, w1_DF=jnp.where(real, chunks["w1_DF"], NAN),
                  w2_FD=jnp.where(real, chunks["w2_FD"], NAN))

    run = functools.partial(pipeline_value_and_grad, schedule, stage_mesh(p),
                            fns=FNS._replace(chunk=padded_chunk_fn))
    loss, grads, _ = jit_fast(run)(dict(params, layers=chunks), raw, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    layer_grads = pl.unstack_stages(grads["layers"], stage_layers)
    del layer_grads["real"]
    assert max_diff(dict(grads, layers=layer_grads), ref_grads) < TOL


def test_forward_only_path_and_autodiff_through_it_match():
    """pipelined_forward runs the forward table only (evaluation); jax.grad through it (the
    schedule's forward ops, differentiated by autodiff) gives the unpipelined gradients too."""
    kind, p, v, m = "interleaved_1f1b", 2, 2, 4
    params, raw, labels, ref_loss, ref_grads = reference(p * v, m)
    schedule = pl.build_schedule(kind, p, m, v)
    pparams = to_pipeline(params, p, v)
    mesh = stage_mesh(p)

    def forward_loss(pp, raw, labels):
        sums = pl.pipelined_forward(FNS, pp["layers"], edge_rows(pp, p), raw, labels, (),
                                    schedule=schedule, mesh=mesh, bubble_fill=NAN)
        return sums / replicas(schedule, mesh)
    assert abs(float(jit_fast(forward_loss)(pparams, raw, labels)) - float(ref_loss)) < TOL
    loss, grads = jit_fast(jax.value_and_grad(forward_loss))(pparams, raw, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    assert max_diff(from_pipeline(grads), ref_grads) < TOL


def test_nan_bubbles_change_nothing_and_stash_counter_meets_static_bound():
    kind, p, v, m = "interleaved_1f1b", 2, 2, 8
    params, raw, labels, ref_loss, _ = reference(p * v, m)
    schedule = pl.build_schedule(kind, p, m, v)
    pparams = to_pipeline(params, p, v)
    run = compile_fast(lambda fill: pipeline_value_and_grad(
        schedule, stage_mesh(p), pparams, raw, labels, fill=fill), 0.0)
    clean, polluted = run(0.0), run(NAN)
    assert max_diff(clean[:2], polluted[:2]) == 0.0
    assert abs(float(clean[0]) - float(ref_loss)) < TOL
    # the in-loop counter of stashed residual sets reaches the static bound and no further,
    # and that bound is the same for 4x as many microbatches
    peak = tuple(int(n) for n in polluted[2]["peak_stash"])
    assert peak == schedule.stash_slots == pl.build_schedule(kind, p, 4 * m, v).stash_slots


def embed_fn(embed_params, tokens_BS):
    return jnp.take(embed_params["table_VD"], tokens_BS, axis=0)


def gated_chunk_fn(chunk_params, x_BSD, chunk_aux):
    """chunk_fn with a per-microbatch side input (as positions are for the real model)."""
    return chunk_fn(chunk_params, x_BSD) * chunk_aux["gate_BS"][..., None]


TOKEN_FNS = pl.Fns(gated_chunk_fn, edge_head, lambda e, tokens: embed_fn(e["embed"], tokens))


def token_model_loss(params, tokens_MBS, gate_MBS, labels_MBS):
    """Unpipelined: embed, every layer with its gate, head; mean loss over microbatches."""
    def one(tokens_BS, gate_BS, labels_BS):
        x_BSD = embed_fn(params["embed"], tokens_BS)
        for i in range(params["layers"]["w1_DF"].shape[0]):
            layer_i = jax.tree.map(lambda a: a[i:i + 1], params["layers"])
            x_BSD = gated_chunk_fn(layer_i, x_BSD, {"gate_BS": gate_BS})
        return head_loss_fn(params["head"], x_BSD, labels_BS)
    return jnp.mean(jax.vmap(one)(tokens_MBS, gate_MBS, labels_MBS))


def test_data_replicas_with_embedding_inside_reduce_once_after_the_loop():
    """stage=2 x data=2 x fsdp=2, tokens embedded by the first virtual stage: equal loss and
    grads, and the compiled step has no collective over `data` inside the schedule loop; inside
    it nothing over stage but the permutes (no hidden psum from autodiff)."""
    kind, p, v, m = "interleaved_1f1b", 2, 2, 4
    params, _, labels = make_model(p * v, m)
    k = jax.random.split(jax.random.key(1), 3)
    params["embed"] = {"table_VD": jax.random.normal(k[0], (V, D))}
    tokens = jax.random.randint(k[1], (m, B, S), 0, V)
    gate = 1.0 + 0.1 * jax.random.normal(k[2], (m, B, S))
    ref_loss, ref_grads = jit_fast(jax.value_and_grad(token_model_loss))(params, tokens, gate,
                                                                         labels)
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "fsdp"), axis_types=(AxisType.Auto,) * 3)
    shard = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    pparams = to_pipeline(params, p, v)
    pparams["layers"] = {"w1_DF": shard(pparams["layers"]["w1_DF"], "stage", None, None, "fsdp"),
                         "w2_FD": shard(pparams["layers"]["w2_FD"], "stage", None, None, None,
                                        "fsdp")}
    batch = lambda a: shard(a, None, ("data", "fsdp"))
    tokens, gate, labels = batch(tokens), batch(gate), batch(labels)
    schedule = pl.build_schedule(kind, p, m, v)

    def run(pp, tokens, gate, labels):
        return pipeline_value_and_grad(schedule, mesh, pp, tokens, labels, fns=TOKEN_FNS,
                                       chunk_aux={"gate_BS": gate})[:2]
    step = compile_fast(run, pparams, tokens, gate, labels)
    loss, grads = step(pparams, tokens, gate, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    assert max_diff(from_pipeline(grads), ref_grads) < TOL

    colls = hlo.collectives(step, mesh)
    assert hlo.loop_collectives(colls, "data") == []
    # over stage, only the sends (fsdp's per-use gathers and reductions stay, as in ZeRO-3)
    assert {c.kind for c in colls if c.in_loop and "stage" in (c.axes or ())} == {
        "collective-permute"}
    assert any(c.kind == "all-reduce" and "data" in (c.axes or ()) for c in colls)


# Compiled temp memory per device (CPU, p=4, D=256, 4x32 tokens per microbatch: 0.125 MiB of
# activations), embedding inside the first stage, m = 8 -> 32. Measured on jax 0.10.2 with the
# residual stash (each F keeps its layer's x, x @ w1 and tanh of it, ...: 4 x 0.125 MiB), the
# same before and after the public-API port of issue 25 (7.02 and 9.39 -> 30.39 MiB recorded
# here earlier, with the stash holding 7 activations):
#   executor 1F1B    4.39 -> 4.39 MiB: 0.000 MiB per microbatch (stash (6, 4, 2, 0) at both m)
#   executor GPipe   6.02 -> 18.02 MiB: 0.5 MiB per microbatch (stash m per rank)
# (Before, with only chunk inputs stashed and the chunk recomputed in every B: 2.02 -> 2.02 and
# 2.39 -> 5.39 MiB; autodiff through the forward ops, no remat: 13.37 -> 37.59 MiB.)
# GPipe stashes every microbatch's residuals (m per rank); 1F1B's stash is fixed by p, and
# with the embedding inside nothing else of activation size is held per microbatch.
MEM_P, MEM_D, MEM_B, MEM_S = 4, 256, 4, 32


def _memory_case(kind, m):
    k = jax.random.split(jax.random.key(2), 4)
    layers = {"w1_DF": jax.random.normal(k[0], (MEM_P, MEM_D, MEM_D)) / np.sqrt(MEM_D),
              "w2_FD": jax.random.normal(k[1], (MEM_P, MEM_D, MEM_D)) / np.sqrt(MEM_D)}
    pp = {"layers": pl.stack_stages(layers, MEM_P), "head": {"w_DC": jnp.ones((MEM_D, C))},
          "embed": {"table_VD": jax.random.normal(k[2], (V, MEM_D))}}
    tokens = jax.random.randint(k[3], (m, MEM_B, MEM_S), 0, V)
    labels = tokens % C
    schedule = pl.build_schedule(kind, MEM_P, m)
    mesh = stage_mesh(MEM_P)

    fns = FNS._replace(embed=TOKEN_FNS.embed)

    def run(pp, tokens, labels):
        return pipeline_value_and_grad(schedule, mesh, pp, tokens, labels, fill=0.0, fns=fns)
    compiled = jax.jit(run).lower(pp, tokens, labels).compile()
    return schedule, compiled, (pp, tokens, labels)


def test_1f1b_stash_and_memory_do_not_grow_with_microbatches():
    mib = lambda c: hlo.memory(c)["temp_bytes"] / 2**20
    slope, peaks = {}, {}
    for kind in ("1f1b", "gpipe"):
        temp = {}
        for m in (8, 32):
            schedule, compiled, args = _memory_case(kind, m)
            temp[m] = mib(compiled)
            if kind == "1f1b":
                # the in-loop counter of stashed residual sets meets the static bound, at both m
                peaks[m] = tuple(int(n) for n in compiled(*args)[2]["peak_stash"])
                assert peaks[m] == schedule.stash_slots
        slope[kind] = (temp[32] - temp[8]) / 24
    assert peaks[8] == peaks[32]
    act_mib = MEM_B * MEM_S * MEM_D * 4 / 2**20
    # GPipe holds a residual set (several activations) more per microbatch; 1F1B a small
    # fraction of one activation
    assert slope["gpipe"] > 0.5 * act_mib
    assert slope["1f1b"] < 0.1 * act_mib


def test_bad_inputs_raise_clear_errors():
    p, v, m = 2, 1, 4
    params, raw, labels = make_model(p * v, m)
    pparams = to_pipeline(params, p, v)
    schedule = pl.build_schedule("1f1b", p, m, v)
    args = {"fns": FNS, "chunk_params": pparams["layers"], "edge_params": edge_rows(pparams, p),
            "inputs": raw, "aux": labels, "chunk_aux": (), "schedule": schedule,
            "mesh": stage_mesh(p)}
    call = lambda **kw: pl.pipelined_forward(**{**args, **kw})  # noqa: E731
    with pytest.raises(pl.PipelineError, match="no 'stage' axis"):
        call(mesh=jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,),
                                devices=jax.devices()[:2]))
    with pytest.raises(pl.PipelineError, match="has size 4 but the schedule has stages=2"):
        call(mesh=stage_mesh(4))
    with pytest.raises(pl.PipelineError, match=r"leading dims \[stages=2, virtual_stages=1\]"):
        call(chunk_params=params["layers"])
    with pytest.raises(pl.PipelineError, match=r"edge param .* leading dim \[stages=2\]"):
        call(edge_params={"embed": params["embed"], "head": params["head"]})
    with pytest.raises(pl.PipelineError, match="microbatches=4"):
        call(inputs=raw[:3])
    with pytest.raises(pl.PipelineError, match=r"aux has shape \(2, 4, 2\)"):
        call(aux=labels[:2])
    data_mesh = jax.make_mesh((2, 3), ("stage", "data"), axis_types=(AxisType.Auto,) * 2,
                              devices=jax.devices()[:6])
    with pytest.raises(pl.PipelineError, match="does not split over data=3"):
        call(mesh=data_mesh)
    with pytest.raises(pl.PipelineError, match="Schedule from build_schedule"):
        call(schedule="1f1b")
    to_bf16 = lambda w, x, a: chunk_fn(w, x).astype(jnp.bfloat16)  # noqa: E731
    with pytest.raises(pl.PipelineError, match="must return the shape and dtype it gets"):
        call(fns=FNS._replace(chunk=to_bf16))
    with pytest.raises(pl.PipelineError, match="must return the shape and dtype it gets"):
        # the same check where the F/B executor runs
        pl.pipelined_value_and_grad(**{**args, "fns": FNS._replace(chunk=to_bf16)})
    with pytest.raises(pl.PipelineError, match="must return a scalar"):
        row_losses = lambda e, x, y: (jnp.mean(x @ e["head"]["w_DC"], axis=-1),) * 2  # noqa
        call(fns=FNS._replace(head_loss=row_losses))
    with pytest.raises(pl.PipelineError, match=r"must return \(objective, sums\)"):
        call(fns=FNS._replace(head_loss=lambda e, x, y: head_loss_fn(e["head"], x, y)))
    untapped = jax.tree.map(lambda _: True, pparams["layers"])  # chunk_fn runs no taps
    with pytest.raises(pl.PipelineError, match="did not tap"):
        pl.pipelined_value_and_grad(**{**args, "fns": FNS._replace(taps=untapped)})
    with pytest.raises(pl.PipelineError, match="do not split"):
        pl.stack_stages(params["layers"], 4, 2)
    assert issubclass(pl.PipelineError, ValueError)


def test_chunk_program_stashes_what_depends_on_the_microbatch_only():
    """The F's residuals split by what they depend on: a weight passed through or quantized
    (here rounded, as an FP8 cast would) is recomputed by the B, never stashed; the
    activations are. Forward + stashed backward equal jax.vjp; under a checkpoint per layer
    only each layer's input is stashed."""
    from jaxtrain.parallel.pipeline_stash import chunk_program
    L = 3
    params, raw, _ = make_model(L, 1)
    x = raw[0] @ params["embed"]
    gate = {"g": jnp.full(x.shape[:2], 0.5)}

    def rounded(h, w):
        w = dict(w, w1_DF=jnp.round(w["w1_DF"] * 64) / 64)   # parameter-only work
        return layer(h, w), None

    def chunk(w, h, aux):
        return lax.scan(rounded, h, w)[0] * aux["g"][..., None]

    prog = chunk_program(chunk, params["layers"], x, gate)
    weights = {a.shape for a in jax.tree.leaves(params["layers"])}
    assert not any(a.shape in weights for a in prog.saved_avals), prog.saved_avals
    assert prog.saved_avals and not all(prog.is_saved)
    y, saved, _ = prog.forward(params["layers"], x, gate)   # no side sums
    dy = jnp.cos(y)
    ref_y, pull = jax.vjp(lambda w, h: chunk(w, h, gate), params["layers"], x)
    assert max_diff(y, ref_y) == 0.0
    assert max_diff(prog.backward(params["layers"], saved, dy), pull(dy)) < TOL

    def remat_chunk(w, h, aux):
        body = jax.checkpoint(rounded, policy=jax.checkpoint_policies.nothing_saveable)
        return lax.scan(body, h, w)[0] * aux["g"][..., None]
    prog = chunk_program(remat_chunk, params["layers"], x, gate)
    # each layer's input (stacked) and the gate the output's cotangent is scaled by
    assert sorted(a.shape for a in prog.saved_avals) == [(L,) + x.shape,
                                                         gate["g"].shape + (1,)]
    y, saved, _ = prog.forward(params["layers"], x, gate)   # no side sums
    assert max_diff(prog.backward(params["layers"], saved, dy), pull(dy)) < TOL

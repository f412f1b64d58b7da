"""Pipeline executor: loss and grads equal the unpipelined model; stash counter; bad inputs.

Toy model (fp32, tiny dims): an embedding outside the pipeline, residual tanh-MLP layers as
chunks (one layer per virtual stage), a linear head with integer-label cross entropy inside
the last virtual stage. Compiling dominates the run time, so the executor is checked on a
representative subset of (schedule, p, v, m); the simulator tests cover every combination.
All executor runs fill idle slots and empty buffers with NaN: any leak would show in the
loss or a gradient.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import pipeline as pl

E, D, F, C, B, S = 3, 8, 16, 5, 2, 2     # raw input, model, mlp, classes, batch, seq
NAN = float("nan")
TOL = 1e-5


def layer(x_BSD, w):
    return x_BSD + jnp.tanh(x_BSD @ w["w1_DF"]) @ w["w2_FD"]


def chunk_fn(chunk_params, x_BSD):
    return lax.scan(lambda h, w: (layer(h, w), None), x_BSD, chunk_params)[0]


def head_loss_fn(head_params, x_BSD, labels_BS):
    logits_BSC = x_BSD @ head_params["w_DC"]
    logp_BSC = jax.nn.log_softmax(logits_BSC)
    return -jnp.mean(jnp.take_along_axis(logp_BSC, labels_BS[..., None], axis=-1))


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


def pipeline_loss(loss_impl, schedule, mesh, pparams, raw_MBSE, labels_MBS, fill=NAN):
    """The same model with the layers in the pipeline; pparams['layers'] is [p, v, Lc, ...]."""
    x_MBSD = raw_MBSE @ pparams["embed"]           # embedding outside: its grad flows through x
    return loss_impl(chunk_fn, head_loss_fn, pparams["layers"], pparams["head"], x_MBSD,
                     labels_MBS, schedule=schedule, mesh=mesh, bubble_fill=fill)


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
    loss, grads = jax.jit(jax.value_and_grad(reference_loss))(params, raw, labels)
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
    loss_fn = functools.partial(pipeline_loss, pl.pipelined_loss, schedule, stage_mesh(p))
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(to_pipeline(params, p, v), raw, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    assert max_diff(from_pipeline(grads), ref_grads) < TOL


def test_autodiff_reference_and_forward_only_path_match():
    kind, p, v, m = "interleaved_1f1b", 2, 2, 4
    params, raw, labels, ref_loss, ref_grads = reference(p * v, m)
    schedule = pl.build_schedule(kind, p, m, v)
    pparams = to_pipeline(params, p, v)
    mesh = stage_mesh(p)
    gpipe = functools.partial(pipeline_loss, pl.gpipe_loss, schedule, mesh)
    loss, grads = jax.jit(jax.value_and_grad(gpipe))(pparams, raw, labels)
    assert abs(float(loss) - float(ref_loss)) < TOL
    assert max_diff(from_pipeline(grads), ref_grads) < TOL
    # pipelined_loss outside of a grad runs the forward ops only
    eval_loss = jax.jit(functools.partial(pipeline_loss, pl.pipelined_loss, schedule, mesh))
    assert abs(float(eval_loss(pparams, raw, labels)) - float(ref_loss)) < TOL


def test_nan_bubbles_change_nothing_and_stash_counter_meets_static_bound():
    kind, p, v, m = "interleaved_1f1b", 2, 2, 8
    params, raw, labels, ref_loss, _ = reference(p * v, m)
    schedule = pl.build_schedule(kind, p, m, v)
    pparams = to_pipeline(params, p, v)
    run = jax.jit(lambda fill: pl.pipelined_value_and_grad(
        chunk_fn, head_loss_fn, pparams["layers"], pparams["head"], raw @ pparams["embed"],
        labels, schedule=schedule, mesh=stage_mesh(p), bubble_fill=fill))
    clean, polluted = run(0.0), run(NAN)
    assert max_diff(clean[:2], polluted[:2]) == 0.0
    assert abs(float(clean[0]) - float(ref_loss)) < TOL
    # the in-loop counter of stashed chunk inputs reaches the static bound and no further,
    # and that bound is the same for 4x as many microbatches
    peak = tuple(int(n) for n in polluted[2]["peak_stash"])
    assert peak == schedule.stash_slots == pl.build_schedule(kind, p, 4 * m, v).stash_slots


def test_stage_mesh_with_sharded_params_and_batch_inside():
    """stage=2 x fsdp=2 x tensor=2: the chunk's params and batch stay sharded over auto axes."""
    kind, p, v, m = "interleaved_1f1b", 2, 2, 4
    params, raw, labels, ref_loss, ref_grads = reference(p * v, m)
    mesh = jax.make_mesh((2, 2, 2), ("stage", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    shard = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    pparams = to_pipeline(params, p, v)
    pparams = {
        "embed": shard(pparams["embed"], None, "fsdp"),
        "layers": {"w1_DF": shard(pparams["layers"]["w1_DF"], "stage", None, None, "fsdp",
                                  "tensor"),
                   "w2_FD": shard(pparams["layers"]["w2_FD"], "stage", None, None, "tensor",
                                  "fsdp")},
        "head": {"w_DC": shard(pparams["head"]["w_DC"], "fsdp", None)},
    }
    raw, labels = shard(raw, None, "fsdp"), shard(labels, None, "fsdp")
    schedule = pl.build_schedule(kind, p, m, v)
    # an outer factor checks that the custom_vjp scales its gradients by the incoming cotangent
    loss_fn = lambda *a: 3.0 * pipeline_loss(pl.pipelined_loss, schedule, mesh, *a)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(pparams, raw, labels)
    assert abs(float(loss) - 3.0 * float(ref_loss)) < 3 * TOL
    assert max_diff(from_pipeline(grads), jax.tree.map(lambda g: 3.0 * g, ref_grads)) < 3 * TOL


def test_bad_inputs_raise_clear_errors():
    p, v, m = 2, 1, 4
    params, raw, labels = make_model(p * v, m)
    pparams = to_pipeline(params, p, v)
    x = raw @ params["embed"]
    schedule = pl.build_schedule("1f1b", p, m, v)
    call = lambda **kw: pl.pipelined_loss(**{
        "chunk_fn": chunk_fn, "head_loss_fn": head_loss_fn, "chunk_params": pparams["layers"],
        "head_params": pparams["head"], "x_MBSD": x, "aux": labels, "schedule": schedule,
        "mesh": stage_mesh(p), **kw})
    with pytest.raises(pl.PipelineError, match="no 'stage' axis"):
        call(mesh=jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,),
                                devices=jax.devices()[:2]))
    with pytest.raises(pl.PipelineError, match="has size 4 but the schedule has stages=2"):
        call(mesh=stage_mesh(4))
    with pytest.raises(pl.PipelineError, match=r"leading dims \[stages=2, virtual_stages=1\]"):
        call(chunk_params=params["layers"])
    with pytest.raises(pl.PipelineError, match="microbatches=4"):
        call(x_MBSD=x[:3])
    with pytest.raises(pl.PipelineError, match="aux leaf"):
        call(aux=labels[:2])
    with pytest.raises(pl.PipelineError, match="Schedule from build_schedule"):
        call(schedule="1f1b")
    with pytest.raises(pl.PipelineError, match="must return the shape and dtype it gets"):
        call(chunk_fn=lambda w, x: chunk_fn(w, x).astype(jnp.bfloat16))
    with pytest.raises(pl.PipelineError, match="must return a scalar"):
        call(head_loss_fn=lambda w, x, y: jnp.mean(x @ w["w_DC"], axis=-1))
    with pytest.raises(pl.PipelineError, match="do not split"):
        pl.stack_stages(params["layers"], 4, 2)
    assert issubclass(pl.PipelineError, ValueError)

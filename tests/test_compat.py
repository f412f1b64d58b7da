"""jaxtrain.compat, the one place version-specific jax internals are reached: each helper on a
tiny program, so a jax release that moves an internal fails here, naming the helper."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxtrain import compat


def test_varying_axes_inside_shard_map():
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    seen = {}

    def body(x_sharded, x_replicated):
        seen["sharded"] = compat.varying_axes(x_sharded)
        seen["replicated"] = compat.varying_axes(x_replicated)
        return x_sharded + x_replicated[:2]

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))(
        jnp.ones(4), jnp.ones(4))
    assert seen == {"sharded": frozenset({"data"}), "replicated": frozenset()}


def _f(p, x):
    unused = jnp.sin(p) * 3.0      # no output depends on it
    del unused
    return p * 2.0, p * x


def test_dead_code_removed_drops_what_no_output_needs_and_computes_the_same():
    closed = jax.make_jaxpr(_f)(1.0, 2.0)
    pruned = compat.dead_code_removed(closed)
    prims = [e.primitive.name for e in pruned.jaxpr.eqns]
    assert "sin" in [e.primitive.name for e in closed.jaxpr.eqns] and "sin" not in prims
    assert [float(v) for v in compat.jaxpr_as_fun(pruned)(1.5, 4.0)] == [3.0, 6.0]


def test_partial_evaluation_splits_parameter_only_outputs():
    """What the pipeline stash relies on: which outputs depend on the microbatch, and a
    program for the parameter-only ones from the parameters alone."""
    closed = jax.make_jaxpr(_f)(1.0, 2.0)
    unknown = [False, True]            # p known (parameters), x unknown (the microbatch)
    assert compat.outputs_depending_on(closed, unknown) == [False, True]
    known = compat.known_outputs(closed, unknown, [True, False])
    assert len(known.jaxpr.invars) == 1
    assert [float(v) for v in compat.jaxpr_as_fun(known)(1.5)] == [3.0]
    with pytest.raises(ValueError, match="depends on the unknown"):
        compat.known_outputs(closed, unknown, [False, True])


def test_triton_compiler_params_carry_warps_and_stages():
    params = compat.triton_compiler_params(4, 2)
    if params is not None:     # this jaxlib has Pallas's Triton backend
        assert (params.num_warps, params.num_stages) == (4, 2)


def test_a_pullbacks_residuals_are_its_leaves():
    """The remat fence maps over the saved activations of a jax.vjp pullback."""
    x = jnp.arange(3.0)
    _, pullback = jax.vjp(lambda a: jnp.sin(a) * a, x)
    leaves = jax.tree.leaves(pullback)
    assert leaves and any(l.shape == x.shape for l in leaves)
    same = compat.map_vjp_residuals(lambda r: r, pullback)
    np.testing.assert_allclose(same(jnp.ones(3))[0], pullback(jnp.ones(3))[0])
    zeroed = compat.map_vjp_residuals(jnp.zeros_like, pullback)
    assert not np.allclose(zeroed(jnp.ones(3))[0], pullback(jnp.ones(3))[0])


def test_logical_partition_specs_read_flax_sharding_metadata():
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self):
            # how the model declares its params (model/llama.py)
            self.w = nnx.Param(jnp.zeros((4, 8)), out_sharding=("embed", "mlp"),
                               eager_sharding=False)
            self.b = nnx.Param(jnp.zeros(8))

    state = nnx.state(nnx.eval_shape(Tiny))
    assert compat.logical_partition_specs(state) == {"w": P("embed", "mlp"), "b": P(None)}


def test_saved_tree_metadata_of_an_orbax_item(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(tmp_path / "item", {"params": {"w": np.ones((2, 3), np.float32)}})
    monkeypatch.chdir(tmp_path)
    for path in (tmp_path / "item", "item"):  # relative too (orbax reads none under one)
        tree = compat.saved_tree_metadata(ckptr, path)
        assert tuple(tree["params"]["w"].shape) == (2, 3)


def test_mosaic_gpu_params_run_a_kernel_in_interpret_mode():
    """A Mosaic GPU kernel (warpgroup semantics) runs on CPU with the interpret params."""
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0 + 1.0
    x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)
    kernel = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                            compiler_params=compat.mosaic_gpu_compiler_params(),
                            interpret=compat.mosaic_gpu_interpret_params())
    np.testing.assert_array_equal(jax.jit(kernel)(x), 2 * x + 1)


def test_mosaic_gpu_dump_sets_and_restores_the_compiler_variables(tmp_path, monkeypatch):
    import os
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "0")
    monkeypatch.delenv("MOSAIC_GPU_DUMP_TO", raising=False)
    with compat.mosaic_gpu_dump(tmp_path / "dump") as folder:
        assert os.environ["MOSAIC_GPU_DUMP_TO"] == folder == str(tmp_path / "dump")
        assert os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "1" and os.path.isdir(folder)
    assert "MOSAIC_GPU_DUMP_TO" not in os.environ
    assert os.environ["MOSAIC_GPU_DUMP_PTXAS"] == "0"

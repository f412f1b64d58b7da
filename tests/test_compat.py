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


def test_mosaic_gpu_spellings_and_its_interpreter_run_a_tiny_kernel():
    """Every Mosaic GPU name the flash kernels use exists, and a Warpgroup-semantics kernel
    (TMA in, a wgmma, a store out) runs in jax's GPU interpreter through compat's params."""
    plgpu = compat.mosaic_gpu()
    assert plgpu is not None, "this jax has no Mosaic GPU backend with " + \
        ", ".join(compat.MOSAIC_GPU_NAMES)
    from jax.experimental import pallas as pl
    tile = plgpu.SMEM((64, 64), jnp.float16, transforms=(plgpu.TilingTransform((8, 64)),
                                                         plgpu.SwizzleTransform(128)))

    def body(a_ref, o_ref, a_smem, bar):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, a_smem)
            return acc_ref[...]
        o_ref[...] = pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))

    a = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) / 8, jnp.float16)
    run = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(1,),
                       grid_names=("x",), scratch_types=[tile, plgpu.Barrier(num_barriers=1)],
                       compiler_params=compat.mosaic_compiler_params(plgpu),
                       interpret=compat.mosaic_interpret_params())
    want = a.astype(jnp.float32) @ a.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(run)(a)), np.asarray(want), atol=1e-3)
    compat.reset_mosaic_interpreter()  # callable (jax asks for it after a kernel raised)


def test_persistent_compile_cache_caches_inside_and_stops_after(tmp_path):
    with compat.persistent_compile_cache(tmp_path):
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
    cached = set(tmp_path.iterdir())
    assert cached, "nothing was written to the cache"
    jax.jit(lambda x: jnp.cos(x) * 5.0 - 2.0)(jnp.arange(9.0)).block_until_ready()
    assert set(tmp_path.iterdir()) == cached and jax.config.jax_compilation_cache_dir is None

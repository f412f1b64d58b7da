"""What differs between the jax (and flax, orbax) versions jaxtrain runs on, in one place.

jaxtrain runs on jax 0.10 (this machine's package index) and jax 0.11 (the GPU machines). Code
elsewhere calls these helpers instead of reaching into version-specific internals, so a new
release breaks here, loudly, and tests/test_compat.py says which helper.
"""
from __future__ import annotations

from typing import Any

import jax


def varying_axes(a) -> frozenset:
    """The manual mesh axes (inside shard_map) over which `a` may differ between devices."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10 and 0.11 spell it differently
    return frozenset(mat.varying if mat is not None else getattr(t, "vma", ()))


def dead_code_removed(closed_jaxpr):
    """`closed_jaxpr` without the equations no output depends on (nested jaxprs included):
    what XLA would run. (A custom VJP that re-traces a forward for its pullback leaves that
    forward's unused outputs in the jaxpr; XLA removes them.)"""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe
    jaxpr, _ = pe.dce_jaxpr(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars))
    return core.ClosedJaxpr(jaxpr, closed_jaxpr.consts)


def unused_inputs_removed(closed_jaxpr):
    """(`closed_jaxpr` without dead code and without the inputs no output depends on, a bool
    per original input: kept)."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe
    jaxpr, used = pe.dce_jaxpr(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars))
    return core.ClosedJaxpr(jaxpr, closed_jaxpr.consts), tuple(used)


def jaxpr_as_fun(closed_jaxpr):
    """A ClosedJaxpr as a function of its flat inputs (to lower it again)."""
    from jax._src import core
    return core.jaxpr_as_fun(closed_jaxpr)


def outputs_depending_on(closed_jaxpr, unknown_inputs) -> list:
    """Per output of `closed_jaxpr`: whether it depends on an input flagged in
    `unknown_inputs` (jax's partial evaluation decides, through loops and conditionals)."""
    from jax._src.interpreters import partial_eval as pe
    return list(pe.partial_eval_jaxpr_nounits(closed_jaxpr, list(unknown_inputs), False)[2])


def known_outputs(closed_jaxpr, unknown_inputs, wanted) -> Any:
    """A ClosedJaxpr computing the `wanted` outputs (which must not depend on the unknown
    inputs) from the known inputs alone, in their order: what partial evaluation's known part
    runs, with everything else removed."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe
    known, _, out_unknowns, _ = pe.partial_eval_jaxpr_nounits(closed_jaxpr, list(unknown_inputs),
                                                              False)
    if any(w and u for w, u in zip(wanted, out_unknowns)):
        raise ValueError("a wanted output depends on the unknown inputs")
    n_res = len(known.jaxpr.outvars) - sum(not u for u in out_unknowns)
    used = [w for w, u in zip(wanted, out_unknowns) if not u] + [False] * n_res
    jaxpr, _ = pe.dce_jaxpr(known.jaxpr, used, instantiate=True)
    return core.ClosedJaxpr(jaxpr, known.consts)


def triton_compiler_params(num_warps: int, num_stages: int):
    """Pallas's Triton compiler params (warps, software-pipelining stages), or None where this
    jaxlib has no Triton backend (CPU interpret mode needs none). jax 0.10 and 0.11 name the
    class CompilerParams; earlier releases TritonCompilerParams."""
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError:  # pragma: no cover - depends on the jaxlib build
        return None
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


# The Mosaic GPU (Pallas, Hopper) spellings the flash kernels use: `mosaic_gpu()` checks them
# all, so a release that renames one fails in tests/test_compat.py, not inside a kernel.
MOSAIC_GPU_NAMES = ("kernel", "CompilerParams", "LoweringSemantics", "SMEM", "Barrier",
                    "TilingTransform", "SwizzleTransform", "ACC", "wgmma", "transpose_ref",
                    "copy_gmem_to_smem", "copy_smem_to_gmem", "wait_smem_to_gmem",
                    "commit_smem", "barrier_wait", "barrier_arrive", "set_max_registers")


def mosaic_gpu():
    """jax.experimental.pallas.mosaic_gpu (Pallas's Hopper backend: TMA, wgmma, warpgroups)
    when this jax has every name in MOSAIC_GPU_NAMES, else None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:  # pragma: no cover - depends on the jaxlib build
        return None
    return plgpu if all(hasattr(plgpu, n) for n in MOSAIC_GPU_NAMES) else None


def mosaic_compiler_params(plgpu):
    """Warpgroup lowering semantics (Mosaic infers register layouts: the kernels are plain
    jnp on tiles, which the GPU interpreter also runs) with fast approximate exp2/division."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                approx_math=True)


def mosaic_interpret_params():
    """What `interpret=` takes to run a Mosaic GPU kernel on CPU: jax's GPU interpreter
    (simulated shared memory, barriers and TMA; jax 0.10 and 0.11 keep it in jax._src)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


class persistent_compile_cache:
    """Within the context, XLA executables are cached on disk in `path` (every compile, however
    quick). jax's GPU interpreter compiles each warpgroup's program anew at every grid point;
    the same programs then load from the cache (the Mosaic tests: half the time). The cache
    is process-wide state that jax decides once, hence the resets."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        from jax._src import compilation_cache
        self._old = {k: getattr(jax.config, k) for k in self._KEYS}
        for k, v in zip(self._KEYS, (self.path, 0.0, 0)):
            jax.config.update(k, v)
        compilation_cache.reset_cache()
        return self

    def __exit__(self, *exc):
        from jax._src import compilation_cache
        for k, v in self._old.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()

    _KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def reset_mosaic_interpreter():
    """The GPU interpreter's global state after an exception inside a kernel: jax requires a
    reset before it interprets again in the same process."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def map_vjp_residuals(f, pullback):
    """The pullback `jax.vjp` returned, with `f` applied to each of its residuals (what the
    remat fence uses to tie saved activations to the cotangent). jax's pullback is a pytree
    (a Partial) whose leaves are those residuals."""
    return jax.tree.map(f, pullback)


def logical_partition_specs(abstract_state):
    """Pure-dict tree of PartitionSpec(logical names...) from an nnx.State's per-variable
    sharding metadata (flax spells it `out_sharding`; a variable without one is unnamed)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    names = jax.tree.map(
        lambda v: P(*(v.get_metadata().get("out_sharding") or (None,) * v.ndim)),
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(names) if isinstance(names, nnx.State) else names


def saved_tree_metadata(checkpointer, directory):
    """The array metadata tree of a saved PyTree item (orbax returns it bare or wrapped in
    `.item_metadata.tree`, by version). The path is made absolute: orbax 0.11 reads no item
    metadata under a relative one (a bare StepMetadata comes back)."""
    import pathlib
    meta = checkpointer.metadata(pathlib.Path(directory).absolute())
    return getattr(getattr(meta, "item_metadata", None), "tree", meta)


def orbax_sync_directory_options():
    """orbax's AsyncOptions that make a save's directories in `save()` on the caller's thread
    (None where this orbax has no such option: it then makes them in the save's own thread)."""
    import dataclasses

    import orbax.checkpoint as ocp
    if "create_directories_asynchronously" not in {f.name for f in
                                                   dataclasses.fields(ocp.AsyncOptions)}:
        return None
    return ocp.AsyncOptions(create_directories_asynchronously=False)

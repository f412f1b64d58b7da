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


def mosaic_gpu_compiler_params():
    """Mosaic GPU (Hopper) kernel compiler params with warpgroup lowering semantics: layouts
    and shared-memory transforms inferred, wgmma/TMA issued per warpgroup. plgpu is
    experimental; jax 0.10 and 0.11 spell it CompilerParams(lowering_semantics=...)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def mosaic_gpu_interpret_params():
    """What `plgpu.kernel(..., interpret=...)` takes to run a Mosaic GPU kernel on CPU,
    simulating shared memory, barriers and TMA: jax 0.10 keeps the class in jax._src (no
    public name yet)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    cls = getattr(plgpu, "InterpretParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


# The Mosaic GPU compiler (in the jax CUDA plugin) writes, per kernel it compiles, ptxas's
# report (`<kernel>.ptxas`), the PTX and a log of its MLIR passes (which holds the launch's
# dynamic shared memory) into this folder when both variables are set at compile time.
MOSAIC_GPU_DUMP_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")


class mosaic_gpu_dump:
    """`with mosaic_gpu_dump(folder):` compiles inside write each Mosaic GPU kernel's ptxas
    report and pass log into `folder` (read by tools.gpu_program.mosaic_kernels); the
    variables are restored on exit."""

    def __init__(self, folder):
        self.folder = str(folder)

    def __enter__(self):
        import os
        os.makedirs(self.folder, exist_ok=True)
        self.saved = {k: os.environ.get(k) for k in MOSAIC_GPU_DUMP_ENV}
        os.environ.update(zip(MOSAIC_GPU_DUMP_ENV, (self.folder, "1")))
        return self.folder

    def __exit__(self, *exc):
        import os
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def orbax_sync_directory_options():
    """orbax's AsyncOptions that make a save's directories in `save()` on the caller's thread
    (None where this orbax has no such option: it then makes them in the save's own thread)."""
    import dataclasses

    import orbax.checkpoint as ocp
    if "create_directories_asynchronously" not in {f.name for f in
                                                   dataclasses.fields(ocp.AsyncOptions)}:
        return None
    return ocp.AsyncOptions(create_directories_asynchronously=False)

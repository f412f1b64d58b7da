"""What differs between the jax (and flax, orbax) versions jaxtrain runs on, in one place.

jaxtrain runs on jax 0.10 (this machine's package index) and jax 0.11 (the GPU machines). Code
elsewhere calls these helpers instead of reaching into version-specific internals, so a new
release breaks here, loudly, and tests/test_compat.py says which helper.
"""
from __future__ import annotations

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

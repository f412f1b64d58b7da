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

"""What a checkpoint must read back as: the fingerprints of its values and of its data
position, the step its folder names, the shapes the configured model needs; and the errors
that say which of them failed (checkpoint.py raises and reports them)."""
from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp

from jaxtrain.config import ConfigError

DATA_KEY = "data"  # the fingerprint's entry for the data item (no state leaf has this path)


class CheckpointMismatchError(ConfigError):
    """A checkpoint that does not fit the configured model; names the parameter."""


class CheckpointSaveError(ConfigError):
    """A save that could not be written (disk full, permissions); the previous one is kept."""


class CheckpointCorruptError(ConfigError):
    """Checkpoints exist but none can be read back as it was saved."""


def fingerprint(state) -> dict[str, list[int]]:
    """{leaf path: [sum of its values' bits, sum of bits x (flat index + 1)]}, both mod 2**32.

    Exact integer sums, so the same values give the same fingerprint on any mesh and sharding;
    any one changed value changes the first, moved values the second. One reduction per leaf
    on the device; the host reads a few integers."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    sums = _fingerprint_sums([a for _, a in leaves])
    return {path_name(p): [int(a), int(b)] for (p, _), (a, b) in zip(leaves, jax.device_get(sums))}


@jax.jit
def _fingerprint_sums(arrays):
    def sums(x):
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
        index = jnp.zeros(x.shape, jnp.uint32)
        for axis, size in enumerate(x.shape):  # the flat (row-major) index, wrapping at 2**32
            index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        return jnp.sum(bits), jnp.sum(bits * (index + 1))
    return [sums(x) for x in arrays]


def check_fingerprint(state, saved: dict, source: str) -> None:
    now = fingerprint(state)
    for name, value in now.items():
        if name in saved and list(saved[name]) != value:
            raise CheckpointCorruptError(f"{source}: {name} does not hold the values that were "
                                         "saved (its fingerprint differs); the files are damaged")


def data_fingerprint(data_state: dict) -> list[int]:
    """Two 32-bit words of the sha256 of the data state's JSON: an edited position (or any
    other field) reads back as damage, like the state's values."""
    digest = hashlib.sha256(json.dumps(data_state, sort_keys=True).encode()).digest()
    return [int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")]


def check_data_fingerprint(data_state: dict, saved: dict, source: str) -> None:
    if DATA_KEY in saved and list(saved[DATA_KEY]) != data_fingerprint(data_state):
        raise CheckpointCorruptError(f"{source}: its data position does not hold what was saved "
                                     "(its fingerprint differs); the files are damaged")


def check_step(state, step: int, source: str) -> None:
    """The folder's name is the step its state was saved at: a renamed or copied folder is
    damage (restored, it would collide with the saves after it)."""
    if isinstance(state, dict) and "step" in state and int(state["step"]) != step:
        raise CheckpointCorruptError(f"{source}: it holds the train state of step "
                                     f"{int(state['step'])}, not {step} (a renamed or copied "
                                     "folder)")


def check_shapes(have, want, source: str, *, missing: str, different) -> None:
    """Raise CheckpointMismatchError naming the first leaf of `want` (params first) that `have`
    lacks or holds in another shape; both are pytrees of things with a .shape (`have` may be
    {leaf name: shape}). `different`: the advice, or a function (name, have, want) -> it."""
    have_shapes = have if isinstance(have, dict) and all(isinstance(v, tuple) for v in
                                                         have.values()) else {
        path_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(have)[0]}
    wanted = jax.tree_util.tree_flatten_with_path(want)[0]
    wanted.sort(key=lambda pw: not path_name(pw[0]).startswith("params"))
    for path, w in wanted:
        name = path_name(path)
        if name not in have_shapes:
            raise CheckpointMismatchError(f"{source} has no entry {name}; {missing}")
        if have_shapes[name] != tuple(w.shape):
            advice = (different(name, have_shapes[name], tuple(w.shape)) if callable(different)
                      else different)
            raise CheckpointMismatchError(
                f"{source}: {name} has shape {have_shapes[name]} but the configured model needs "
                f"{tuple(w.shape)}; {advice}")


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)

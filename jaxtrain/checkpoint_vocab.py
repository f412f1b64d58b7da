"""Checkpoints across tensor degrees: the vocab tables are stored as the writer padded them
(to a multiple of 128·tensor, docs/design.md §8) and re-padded on restore, and a shape that
still differs is named by its cause.

The padding rows are zeros in every leaf that holds a table (params, Adam's moments: they
never get a gradient, and weight decay keeps a zero at zero), so restoring under another
tensor degree is exact: read the table in its saved shape, keep the real vocab's rows, pad
with zeros to this layout's size. Leaves are tables by their name (`embed`: [V, D],
`lm_head`: [D, V]), in params and in the optimizer state alike.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

VOCAB_AXIS = {"embed": 0, "lm_head": 1}  # leaf name -> its vocab dim


def vocab_axis(name: str) -> int | None:
    return VOCAB_AXIS.get(name.rsplit("/", 1)[-1])


def as_saved(target, saved_shapes: dict, real_vocab: int, path_name):
    """`target` (ShapeDtypeStructs) with each vocab table in the shape the checkpoint holds it
    (`saved_shapes`: leaf name -> shape), its vocab dim unsharded, where only the padding
    differs; other leaves (and real differences, for check_shapes to name) as they are."""
    def one(path, a):
        name = path_name(path)
        axis, have = vocab_axis(name), saved_shapes.get(name)
        if axis is None or have is None or tuple(have) == tuple(a.shape):
            return a
        rest = lambda s: tuple(s[:axis]) + tuple(s[axis + 1:])  # noqa: E731
        if len(have) != a.ndim or rest(have) != rest(a.shape) or have[axis] < real_vocab:
            return a
        sharding = a.sharding
        if isinstance(sharding, NamedSharding):
            spec = list(sharding.spec) + [None] * (a.ndim - len(sharding.spec))
            spec[axis] = None
            sharding = NamedSharding(sharding.mesh, P(*spec))
        return jax.ShapeDtypeStruct(tuple(have), a.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(one, target)


def repad(state, wanted, real_vocab: int, path_name):
    """`state`'s vocab tables cut to the real vocab and zero-padded to `wanted`'s shapes
    (traced: run it inside the jit that places the state)."""
    def one(path, x, w):
        axis = vocab_axis(path_name(path))
        if axis is None or x.shape == w.shape:
            return x
        real = jax.lax.slice_in_dim(x, 0, real_vocab, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, w.shape[axis] - real_vocab)
        return jnp.pad(real, pad)
    return jax.tree_util.tree_map_with_path(one, state, wanted)


def shape_cause(name: str, have: tuple, want: tuple, model) -> str:
    """Why a leaf's saved shape differs from the configured one, in config keys: the vocab
    (beyond padding), or the model sizes whose values the differing dims now take."""
    axis = vocab_axis(name)
    if len(have) != len(want):
        return f"it has {len(have)} dims, the configured model {len(want)}"
    if axis is not None and have[axis] < model.vocab_size:
        return (f"its vocab dim holds {have[axis]} rows, fewer than model.vocab_size="
                f"{model.vocab_size}: the vocab differs from the run that wrote it")
    keys = {"model.hidden_size": model.hidden_size, "model.mlp_size": model.mlp_size,
            "model.num_heads": model.num_heads, "model.num_kv_heads": model.num_kv_heads,
            "model.head_dim": model.resolved_head_dim}
    causes = []
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w and i != axis:  # a vocab dim differs by padding only (restored re-padded)
            named = [k for k, v in keys.items() if v == w]
            causes.append(f"dim {i} is {h} in the checkpoint and {w} now"
                          + (f" ({' or '.join(named)}={w})" if named else ""))
    return "; ".join(causes)

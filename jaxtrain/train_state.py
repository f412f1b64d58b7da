"""The train state, typed: what a step takes and returns, checkpoints save and tools read.

A frozen pytree (flax.struct): jit, shardings and donation see its fields as a tree, and a
step returns a new one (`state.replace(...)`). At the checkpoint boundary it is the dict
`{"params", "opt_state", "step"[, "fp8_meta"]}` the checkpoints have always held
(`to_tree`/`from_tree`), so checkpoints written before it restore unchanged.

The data position is not a field: it is the host's (the iterator's count of sequences
consumed), saved beside the state as the checkpoint's `data` item and never traced.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    params: Any              # fp32 masters, a pure dict (layer-stacked under "blocks")
    opt_state: Any           # optax's state of `params`
    step: jax.Array          # int32: steps taken
    fp8_meta: Any = flax.struct.field(default_factory=dict)   # the FP8 converter's metas
    #                          ({} with FP8 off), replaced each step, never optimised

    def to_tree(self) -> dict:
        """The checkpoint's `state` item: a dict of the fields; `fp8_meta` only when it holds
        metas (a run without FP8 saves none, as before the state was typed)."""
        tree = {"params": self.params, "opt_state": self.opt_state, "step": self.step}
        if jax.tree.leaves(self.fp8_meta):
            tree["fp8_meta"] = self.fp8_meta
        return tree

    @classmethod
    def from_tree(cls, tree: dict) -> "TrainState":
        """The inverse of `to_tree`."""
        return cls(**tree)

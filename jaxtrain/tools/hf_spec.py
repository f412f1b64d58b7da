"""One HF tensor of a decoder layer and where it lives in our params, and where each layer
lives: the shared vocabulary of the Llama, Mixtral (hf.py) and DeepSeek-V3 (hf_deepseek.py)
weight maps.

HF Linear weights are [out, in]; our kernels are [in, out] with heads split. Our per-layer
weights are stacked on a leading axis: every layer in `blocks`, or, in a model mixing dense and
MoE layers, the MoE layers in `blocks` and the dense ones in `dense_blocks`, each in layer
order (model/llama.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Spec:
    """One HF tensor of a layer and where it lives in ours (`expert`: its row of a stacked
    [E, ...] expert weight)."""
    hf_name: str
    path: tuple            # under the layer's stack (`blocks` or `dense_blocks`)
    hf_shape: tuple
    our_shape: tuple       # of this tensor in one layer (an expert's row when `expert` is set)
    to_ours: Any
    to_hf: Any
    expert: int | None = None
    fp32: bool = False     # kept in fp32 on export whatever --dtype (HF keeps it fp32)

    def layer_shape(self, m: ModelConfig) -> tuple:
        """The per-layer shape of the array it lands in (stacked experts: [E, ...])."""
        return self.our_shape if self.expert is None else (m.moe.num_experts, *self.our_shape)


def same(shape):
    return shape, shape, lambda w: w, lambda w: w


def transpose(hf_shape):
    """HF [out, in] <-> ours [in, out]."""
    return hf_shape, hf_shape[::-1], lambda w: w.T, lambda w: w.T


def heads_out(d: int, n: int, e: int):
    """HF [n*e, d] <-> ours [d, n, e] (a projection into n heads of e)."""
    return ((n * e, d), (d, n, e), lambda w: w.T.reshape(d, n, e),
            lambda w: w.reshape(d, n * e).T)


def heads_in(n: int, e: int, d: int):
    """HF [d, n*e] <-> ours [n, e, d] (the output projection from n heads of e)."""
    return (d, n * e), (n, e, d), lambda w: w.T.reshape(n, e, d), lambda w: w.reshape(n * e, d).T


def layer_slots(m: ModelConfig) -> list[tuple[str, int, bool]]:
    """Per layer: (our stack, its row there, whether it is an MoE layer)."""
    kinds = m.moe_layers
    if not any(kinds):
        return [("blocks", i, False) for i in range(m.num_layers)]
    rows = {True: 0, False: 0}
    slots = []
    for moe in kinds:
        slots.append(("blocks" if moe else "dense_blocks", rows[moe], moe))
        rows[moe] += 1
    return slots

"""Causal load balancing for context parallelism: the order a batch's sequence is fed in.

With the sequence split into c contiguous shards over the `context` axis and a causal mask,
rank r's queries see about (2r+1)/c² of the score matrix and the last rank sets the pace. The
dual-chunk ("zigzag") order fixes that once, in the data pipeline: each row is cut into 2c
chunks and rank r holds chunks r and 2c-1-r, so every rank does the same work (MaxText's
`reorder_sequence`, Megatron's `get_batch_on_this_cp_rank`). Every [B, S] array of a batch
(inputs, targets, positions, segment ids, loss mask) is permuted alike after packing: labels
were shifted before it, RoPE positions and segment ids travel with their tokens, and the
attention masks by each token's global position, `context_order(S, c)` (context_attention.py).

numpy only: it runs in the loader's reader threads.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.config import Config


def load_balance_degree(cfg: Config) -> int:
    """The context degree the batches of `cfg` are reordered for: parallel.context when it is
    > 1 and parallel.context_load_balance is on, else 1 (the natural order)."""
    p = cfg.parallel
    return p.context if p.context > 1 and p.context_load_balance else 1


def context_order(seq_len: int, context: int) -> np.ndarray:
    """[S] int32: the original position of the token at each slot of a reordered row; its
    contiguous S/c slices are the ranks' shards (rank r: chunks r and 2c-1-r)."""
    if context == 1:
        return np.arange(seq_len, dtype=np.int32)
    if seq_len % (2 * context):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x "
                         f"context={context} chunks")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * context, -1)
    ranks = [np.concatenate([chunks[r], chunks[2 * context - 1 - r]]) for r in range(context)]
    return np.concatenate(ranks)


def reorder_batch(batch: dict, context: int) -> dict:
    """Every [B, S] array of `batch` in the load-balanced order (the identity at context 1)."""
    if context == 1:
        return batch
    out = {}
    for key, x in batch.items():
        x = np.asarray(x)
        out[key] = x[:, context_order(x.shape[1], context)]
    return out


def restore_order(x, context: int, axis: int = 1):
    """The inverse of reorder_batch along `axis` (per-position outputs back in sequence
    order, e.g. to compare them with a run without context parallelism)."""
    x = np.asarray(x)
    if context == 1:
        return x
    inverse = np.argsort(context_order(x.shape[axis], context))
    return np.take(x, inverse, axis=axis)

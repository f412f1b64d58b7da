"""Packing: a split's documents as one stream, read in windows with segment ids.

The documents of a split are one stream, read in windows of seq_len+1 tokens that start every
seq_len tokens, so every token is a target once per epoch. The last window is padded. Segment
ids, per-document positions and the loss mask keep attention and loss inside documents.
"""
from __future__ import annotations

import numpy as np

from jaxtrain.data.documents import Documents


class PackedStream:
    """A split's documents as one stream, read in windows of seq_len+1 tokens."""

    def __init__(self, docs: Documents, select: np.ndarray, seq_len: int, pad_id: int):
        self.tokens = docs.tokens
        self.starts = docs.starts[select]
        lengths = docs.lengths[select]
        self.cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_docs = len(self.starts)
        self.num_tokens = int(self.cum[-1])
        self.seq_len, self.pad_id = seq_len, pad_id
        # Windows overlap by one token so that every token but the first is a target once.
        self.num_windows = -(-(self.num_tokens - 1) // seq_len) if self.num_tokens > 1 else 0

    def pack(self, window_B: np.ndarray) -> dict[str, np.ndarray]:
        S = self.seq_len
        pos_BT = window_B.astype(np.int64)[:, None] * S + np.arange(S + 1)  # T = S + 1
        real_BT = pos_BT < self.num_tokens
        pos_BT = np.minimum(pos_BT, self.num_tokens - 1)
        doc_BT = np.searchsorted(self.cum, pos_BT, side="right") - 1
        src = (self.starts[doc_BT] + pos_BT - self.cum[doc_BT]).ravel()
        tok_BT = np.asarray(self.tokens[src]).reshape(pos_BT.shape).astype(np.int32)
        tok_BT = np.where(real_BT, tok_BT, self.pad_id)
        doc_BT = np.where(real_BT, doc_BT, -1)
        real_BS, doc_BS = real_BT[:, :-1], doc_BT[:, :-1]
        doc_start_BS = np.maximum(self.cum[np.maximum(doc_BS, 0)], pos_BT[:, :1])
        return {
            "inputs": tok_BT[:, :-1],
            "targets": tok_BT[:, 1:],
            "segment_ids": np.where(real_BS, doc_BS - doc_BT[:, :1] + 1, 0).astype(np.int32),
            "positions": np.where(real_BS, pos_BT[:, :-1] - doc_start_BS, 0).astype(np.int32),
            "loss_mask": ((doc_BS == doc_BT[:, 1:]) & real_BT[:, 1:]).astype(np.float32),
        }

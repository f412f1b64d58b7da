"""Batches: sources -> splits -> packed windows -> a resumable grain iterator of global batches.

A run reads one source, or (data.source=prepared with data.mixture) several prepared
directories blended by weight (mixture.py). Each component is a grain MapDataset of its split's
window indices, reshuffled every epoch from the seed; the blend picks the component of every
sequence, `batch` groups consecutive sequences into global batches of window indices, and
each process packs only its contiguous slice of rows, in grain's reader threads ahead of the
step. So the k-th sequence of a run is the same whatever the process count or mesh, and the
iterator's state is one number, the sequences consumed: it restores the exact next batch on
any layout, and under another train.global_batch that divides it. Under context parallelism
with causal load balancing every batch (synthetic ones too) comes in the reordered sequence
order of data/context.py; the iterator's state does not depend on it.
"""
from __future__ import annotations

import fractions
import functools
import hashlib
from typing import Iterator, Sequence

import numpy as np

from jaxtrain.config import parse_mixture, validate_data
from jaxtrain.data import documents as documents_lib
from jaxtrain.data import mixture
from jaxtrain.data.context import load_balance_degree, reorder_batch
from jaxtrain.data.documents import Documents, split_mask
from jaxtrain.data.errors import DataError
from jaxtrain.data.packing import PackedStream
from jaxtrain.data.prepared import prepared_documents
from jaxtrain.data.tokenizer import check_vocab, make_tokenizer

_STATE_VERSION = 2
_EVAL_SEED = 0x5EED_E7A1  # eval batches stay the same whatever train.seed is


def load_documents(cfg, path: str | None = None) -> Documents:
    """The documents of data.source (`path`: one prepared directory of a mixture)."""
    d = cfg.data
    tok = make_tokenizer(d)
    check_vocab(tok, cfg.model.vocab_size)
    if path is None:   # a mixture's directory is checked where the mixture is read
        validate_data(d, DataError)
    if d.source == "prepared":
        return prepared_documents(path or d.path, tok)
    if d.source == "tokens":
        return documents_lib.token_file_documents(d.path, tok, cfg.model.vocab_size)
    if d.source not in ("corpus", "text"):
        raise DataError(f"data.source={d.source!r}: choose corpus, text, tokens or prepared")
    return documents_lib.text_source_documents(d, tok)


def load_splits(cfg, split: str) -> list[tuple[str, PackedStream]]:
    """(weight, stream) per component: one for a plain source, one per mixture directory
    (those of weight 0 are checked, then left out)."""
    if split not in ("train", "eval"):
        raise DataError(f"split={split!r}: choose 'train' or 'eval'")
    d = cfg.data
    parts = (parse_mixture(d.mixture) if d.source == "prepared" and d.mixture else
             [("1", d.path if d.source == "prepared" else None)])
    pad_id = make_tokenizer(d).pad_id
    out = []
    for weight, path in parts:
        docs = load_documents(cfg, path)
        is_eval = split_mask(docs.unit, d.eval_fraction)
        select = is_eval if split == "eval" else ~is_eval
        if not select.any():
            where = f"{path}: " if d.mixture else ""
            raise DataError(
                f"{where}the {split} split is empty: {len(docs.unit)} document(s) with "
                f"data.eval_fraction={d.eval_fraction}; add documents" +
                (" or set train.eval_every=0" if split == "eval" else ""))
        if fractions.Fraction(weight) > 0:
            out.append((weight, PackedStream(docs, select, cfg.train.seq_len, pad_id)))
    return out


def load_split(cfg, split: str) -> PackedStream:
    """The one stream of a source that is not a mixture."""
    if cfg.data.mixture:
        raise DataError("data.mixture has several streams; use load_splits")
    return load_splits(cfg, split)[0][1]


def _grain_seed(tag: str, seed: int) -> int:
    # Hashed, because grain reshuffles epoch e with seed+e: nearby seeds would share epochs.
    digest = hashlib.blake2b(f"jaxtrain/{tag}/{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _tag(component: int, window: int) -> tuple[int, int]:
    return component, window


class BatchIterator:
    """Infinite iterator of this process's rows of each global batch; resumable."""

    def __init__(self, streams: Sequence[PackedStream], shares: Sequence[int], *, split: str,
                 seed: int, global_batch: int, process_index: int, process_count: int,
                 read_threads: int = 2, prefetch: int = 2, context: int = 1):
        import grain  # heavy import, only when batches are made
        self.streams, self.split, self.global_batch = list(streams), split, global_batch
        self.local_batch = global_batch // process_count
        self.context = context  # the load-balanced reorder's degree (1: natural order)
        self._identity = {"version": _STATE_VERSION, "split": split, "seed": seed,
                          "seq_len": self.streams[0].seq_len,
                          "components": [{"windows": s.num_windows, "share": int(p)}
                                         for s, p in zip(self.streams, shares)]}
        lo = process_index * self.local_batch
        self._rows = slice(lo, lo + self.local_batch)
        many = len(self.streams) > 1
        parts = [grain.MapDataset.range(s.num_windows)
                 .shuffle(seed=_grain_seed(f"{split}/{c}" if many else split, seed))
                 .repeat(None)  # reshuffles each epoch (grain seeds epoch e with seed + e)
                 .map(functools.partial(_tag, c)) for c, s in enumerate(self.streams)]
        sequences = (grain.MapDataset.select_from_datasets(parts, mixture.Blend(shares))
                     if many else parts[0])
        # Batching window indices (cheap) before packing lets a process read only its rows.
        self._batches = sequences.batch(global_batch, drop_remainder=True).map(self._pack_rows)
        self._read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
        self._position = 0  # global batches handed out
        self._it = None  # built at the first batch, from the position

    def _pack_rows(self, batch) -> dict[str, np.ndarray]:
        # Packed (labels shifted) first, then reordered for context parallelism.
        return reorder_batch(self._packed_rows(batch), self.context)

    def _packed_rows(self, batch) -> dict[str, np.ndarray]:
        component_L, window_L = (np.asarray(x)[self._rows] for x in batch)
        if len(self.streams) == 1:
            return self.streams[0].pack(window_L)
        out = {}
        for c in np.unique(component_L):
            at = component_L == c
            for key, value in self.streams[c].pack(window_L[at]).items():
                out.setdefault(key, np.empty((len(window_L), *value.shape[1:]), value.dtype))
                out[key][at] = value
        return out

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._it is None:
            self._it = iter(self._batches[self._position:].to_iter_dataset(self._read))
        batch = next(self._it)
        self._position += 1
        return batch

    def get_state(self) -> dict:
        """Where the run is, in global sequences: the same on every process and layout."""
        return dict(self._identity, global_batch=self.global_batch,
                    sequences=self._position * self.global_batch)

    def set_state(self, state: dict) -> None:
        state = _upgrade(state)
        diff = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in self._identity.items()
                if state.get(k) != v]
        if diff:
            raise DataError(
                "the saved data iterator state does not match this run (" + "; ".join(diff) +
                "); resume with the same train.seed/seq_len and data, or start the data from "
                "scratch")
        seen, G = int(state["sequences"]), self.global_batch
        if seen % G:
            raise DataError(
                f"the checkpoint's data position, {seen} sequences (batches of "
                f"{state.get('global_batch')}), is not a whole number of train.global_batch={G} "
                "batches; resume with a global batch that divides it")
        self._position, self._it = seen // G, None


def _upgrade(state: dict) -> dict:
    """Version 1 (one source; grain's own position in batches) in version 2's terms."""
    if state.get("version") != 1:
        return state
    return {"version": 2, "split": state["split"], "seed": state["seed"],
            "seq_len": state["seq_len"], "global_batch": state["global_batch"],
            "components": [{"windows": state["num_windows"], "share": 1}],
            "sequences": state["grain"]["next_index"] * state["global_batch"]}


def make_batches(cfg, split: str = "train", process_index: int = 0,
                 process_count: int = 1) -> BatchIterator:
    """Batches of [global_batch // process_count, seq_len]; see the module docstring."""
    G = cfg.train.global_batch
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must be in [0, {process_count})")
    if G % process_count:
        raise DataError(f"train.global_batch={G} is not divisible by the {process_count} "
                        "processes; each process feeds an equal share")
    parts = load_splits(cfg, split)
    total = sum(s.num_windows for _, s in parts)
    empty = [w for w, s in parts if s.num_windows == 0]
    if total < G or empty:
        raise DataError(
            f"the {split} split has {sum(s.num_tokens for _, s in parts)} tokens: {total} "
            f"windows of train.seq_len={cfg.train.seq_len}"
            f"{' (a mixture directory has none)' if empty else ''}, fewer than one batch of "
            f"train.global_batch={G}; add data (data.corpus_max_bytes, data.path), lower the "
            "batch or sequence length" +
            (", or raise data.eval_fraction" if split == "eval" else ""))
    seed = cfg.train.seed if split == "train" else _EVAL_SEED
    return BatchIterator([s for _, s in parts], mixture.shares([w for w, _ in parts]),
                         split=split, seed=seed, global_batch=G, process_index=process_index,
                         process_count=process_count, context=load_balance_degree(cfg))


def synthetic_batch(cfg, seed: int = 0, docs_per_row: int = 2) -> dict:
    """A host batch [global_batch, seq_len] of random tokens, `docs_per_row` packed documents
    per row (segment ids, per-document positions, the loss masked at each document's end):
    for tests, sweeps and benchmarks that need the real batch format without a corpus. In the
    load-balanced order of context parallelism when the config asks for it, as make_batches."""
    rng = np.random.default_rng(seed)
    b, s = cfg.train.global_batch, cfg.train.seq_len
    tokens = rng.integers(0, min(256, cfg.model.vocab_size), (b, s + 1)).astype(np.int32)
    cut = s // docs_per_row
    segment_ids = np.minimum(np.arange(s) // cut + 1, docs_per_row).astype(np.int32)
    starts = (np.arange(s) // cut) * cut
    positions = (np.arange(s) - np.minimum(starts, (docs_per_row - 1) * cut)).astype(np.int32)
    loss_mask = np.ones(s, np.float32)
    loss_mask[[cut * k - 1 for k in range(1, docs_per_row)]] = 0.0
    tile = lambda x: np.tile(x, (b, 1))  # noqa: E731
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": tile(segment_ids), "positions": tile(positions),
             "loss_mask": tile(loss_mask)}
    return reorder_batch(batch, load_balance_degree(cfg))

"""Data: tokenizers, document sources, packing into windows, and a resumable grain iterator.

Sources (`data.source`):
  corpus  the running Python's standard library (.py and .txt files under
          `sysconfig.get_paths()['stdlib']`, walked in sorted relative-path order, skipping
          site-packages/dist-packages, test suites and __pycache__), at most
          `data.corpus_max_bytes` bytes (the last file is cut). One file is one document. It is
          the same on every machine with the same Python version; nothing is downloaded.
  text    `data.path` is a folder: every *.txt below it (sorted) is one document. `data.path` is
          a file: documents are separated by blank lines (a line holding only whitespace).
  tokens  `data.path` is a token stream with EOS after every document, memory-mapped:
          .npy (1-D integer array) or raw .bin: uint16 by default, uint32 when the name ends in
          .u32.bin. A sidecar `<path>.json` may set {"dtype": "uint16"|"uint32"|..., "eos_id": N};
          otherwise EOS is the tokenizer's (`data.tokenizer`). A document ends at each EOS.

Packing: every document becomes BOS + tokens + EOS (BOS is left out when a tokenizer's BOS is
its EOS, GPT-2 style); the documents of a split are one stream, read in windows of seq_len+1
tokens that start every seq_len tokens, so every token is a target once per epoch. The last
window is padded. Segment ids, per-document positions and the loss mask keep attention and loss
inside documents.

Split: a document is held out for eval when a stable hash of its key (relative path, or index
for token files) falls below `data.eval_fraction`; eval never reaches train.

Iteration: a grain MapDataset over window indices, reshuffled every epoch, batched into global
batches of window indices; each process packs only its contiguous slice of rows. The iterator's
state is a small JSON-able dict.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import re
import sysconfig
from typing import Iterator, Optional, Sequence

import numpy as np

from jaxtrain.config import ConfigError
from jaxtrain.ledger.memory import padded_vocab

_STATE_VERSION = 1
_EVAL_SEED = 0x5EED_E7A1  # eval batches stay the same whatever train.seed is
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})
_SCAN_CHUNK = 1 << 24  # tokens per pass when scanning a token file


class DataError(ConfigError):
    """Data that cannot feed a run; the message says what to change."""


# ----------------------------------------------------------------------------- tokenizers

class Tokenizer:
    """Common interface: encode/decode, special ids, vocab_size (ids used)."""
    name: str
    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size, tensor=1)  # Megatron's rounding, as the model

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(self.encode(t), np.int64) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, then BOS=256, EOS=257, PAD=258."""
    name = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`; special tokens found by their usual names."""

    def __init__(self, path: str):
        import tokenizers  # the only user of this dependency
        self.name = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise DataError(f"data.tokenizer={path}: not a readable Hugging Face tokenizer.json "
                            f"({e})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        eos = self._find(_EOS_NAMES)
        if eos is None:
            raise DataError(f"data.tokenizer={path} has no end-of-text token (looked for "
                            f"{', '.join(_EOS_NAMES)}); add one to the tokenizer")
        bos = self._find(_BOS_NAMES)
        pad = self._find(_PAD_NAMES)
        self.eos_id = eos
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad

    def _find(self, names: Sequence[str]) -> Optional[int]:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in encs]


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(path)


def make_tokenizer(data_cfg) -> Tokenizer:
    """`data.tokenizer`: "byte", a tokenizer.json, or a folder holding one."""
    return tokenizer_from_spec(data_cfg.tokenizer)


def tokenizer_from_spec(spec: str) -> Tokenizer:
    if spec == "byte":
        return ByteTokenizer()
    path = pathlib.Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"data.tokenizer={spec}: no such file; use 'byte' or the path of a "
                        "Hugging Face tokenizer.json (or its folder)")
    return _load_hf_tokenizer(str(path.resolve()))


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {tokenizer.name} uses {tokenizer.vocab_size} ids but model.vocab_size="
            f"{model_vocab_size}; set model.vocab_size={tokenizer.padded_vocab_size} (its size "
            "rounded up to a multiple of 128)")


# ----------------------------------------------------------------------------- documents

@dataclasses.dataclass(frozen=True)
class Documents:
    """Documents as spans of one token array; `unit` in [0,1) is each one's split hash."""
    tokens: np.ndarray  # in memory or memory-mapped
    starts: np.ndarray  # int64 [n_docs]
    lengths: np.ndarray  # int64 [n_docs]
    unit: np.ndarray  # float64 [n_docs]


def _unit_of_key(key: str) -> float:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _unit_of_index(i_N: np.ndarray) -> np.ndarray:
    """splitmix64 of the index, as a float in [0, 1): stable and vectorised."""
    z = i_N.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0 ** 53


def corpus_texts(max_bytes: int) -> list[tuple[str, str]]:
    """(relative path, text) of the embedded corpus, in its fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    rels = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for f in files:
            if f.endswith((".py", ".txt")):
                rels.append(os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/"))
    out, left = [], max_bytes
    for rel in sorted(rels):
        if left <= 0:
            break
        try:
            raw = pathlib.Path(root, rel).read_bytes()
            raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # not UTF-8 text: skipped the same way on every machine
        raw = raw[:left]
        left -= len(raw)
        # A cut may split a multi-byte character; drop its remains.
        out.append((rel, raw.decode("utf-8", errors="ignore")))
    return out


def text_documents(path: str) -> list[tuple[str, str]]:
    """(key, text) from a folder of .txt files or a blank-line-separated file."""
    p = pathlib.Path(path)
    if not p.exists():
        raise DataError(f"data.path={path} does not exist; give a .txt file or a folder of them")

    def read(f: pathlib.Path) -> str:
        try:
            return f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not UTF-8 text ({e}); convert it or remove it") from None

    if p.is_dir():
        files = sorted(p.rglob("*.txt"), key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise DataError(f"data.path={path} holds no .txt files")
        return [(f.relative_to(p).as_posix(), read(f)) for f in files]
    parts = re.split(r"\n[ \t\r\f\v]*\n", read(p))
    return [(f"{p.name}#{i}", t) for i, t in enumerate(parts) if t.strip()]


@functools.lru_cache(maxsize=4)
def _documents_from_text(source: str, path: str, corpus_max_bytes: int,
                         tokenizer_spec: str) -> Documents:
    tok = tokenizer_from_spec(tokenizer_spec)
    if source == "corpus":
        pairs = corpus_texts(corpus_max_bytes)
        where = f"the embedded corpus (data.corpus_max_bytes={corpus_max_bytes})"
    else:
        pairs = text_documents(path)
        where = f"data.path={path}"
    pairs = [(k, t) for k, t in pairs if t.strip()]
    if not pairs:
        raise DataError(f"{where} is empty: no document has any text")
    ids = tok.encode_batch([t for _, t in pairs])
    head = [tok.bos_id] if tok.bos_id != tok.eos_id else []
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    docs = [np.concatenate([np.asarray(head, dtype), d.astype(dtype),
                            np.asarray([tok.eos_id], dtype)]) for d in ids]
    lengths = np.array([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    unit = np.array([_unit_of_key(k) for k, _ in pairs], np.float64)
    return Documents(np.concatenate(docs), starts, lengths, unit)


def open_token_file(path: str) -> tuple[np.ndarray, Optional[int]]:
    """Memory-map a token file; returns (tokens, eos_id from its sidecar or None)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise DataError(f"data.path={path} does not exist; data.source=tokens needs a .npy or "
                        ".bin token file")
    sidecar = pathlib.Path(str(p) + ".json")
    meta = {}
    if sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{sidecar} is not valid JSON ({e})") from None
    if p.suffix == ".npy":
        tokens = np.load(p, mmap_mode="r")
    elif p.suffix == ".bin":
        dtype = meta.get("dtype", "uint32" if p.name.endswith(".u32.bin") else "uint16")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise DataError(f"{sidecar}: dtype {dtype!r} is not a numpy dtype") from None
        if p.stat().st_size % dtype.itemsize:
            raise DataError(f"{path}: {p.stat().st_size} bytes is not a whole number of {dtype} "
                            "tokens; check the dtype (.u32.bin or a sidecar .json)")
        tokens = np.memmap(p, dtype=dtype, mode="r")
    else:
        raise DataError(f"data.path={path}: token files are .npy or .bin")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path} holds a {tokens.dtype} array of shape {tokens.shape}; expected a "
                        "1-D integer token stream")
    return tokens, meta.get("eos_id")


@functools.lru_cache(maxsize=4)
def _documents_from_tokens(path: str, size: int, mtime_ns: int, eos_id: int,
                           vocab_size: int) -> Documents:
    del size, mtime_ns  # cache keys: a rewritten file is scanned again
    tokens, _ = open_token_file(path)
    if len(tokens) == 0:
        raise DataError(f"data.path={path} holds no tokens")
    ends, lo, hi = [], 0, 0
    for s in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[s:s + _SCAN_CHUNK])
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        ends.append(np.flatnonzero(chunk == eos_id) + s + 1)
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"{path} holds token ids in [{lo}, {hi}] but model.vocab_size="
                        f"{vocab_size}; set model.vocab_size above the largest id or re-tokenize")
    ends = np.concatenate(ends).astype(np.int64)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))  # trailing tokens without EOS: one more document
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return Documents(tokens, starts, ends - starts, _unit_of_index(np.arange(len(starts))))


def load_documents(cfg) -> Documents:
    d = cfg.data
    tok = make_tokenizer(d)
    check_vocab(tok, cfg.model.vocab_size)
    if d.source == "tokens":
        if not d.path:
            raise DataError("data.source=tokens needs data.path (a .npy or .bin token file)")
        _, eos = open_token_file(d.path)
        st = os.stat(d.path)
        return _documents_from_tokens(str(pathlib.Path(d.path).resolve()), st.st_size,
                                      st.st_mtime_ns, tok.eos_id if eos is None else int(eos),
                                      cfg.model.vocab_size)
    if d.source == "text" and not d.path:
        raise DataError("data.source=text needs data.path (a .txt file or a folder of them)")
    if d.source not in ("corpus", "text"):
        raise DataError(f"data.source={d.source!r}: choose corpus, text or tokens")
    spec = d.tokenizer if d.tokenizer == "byte" else tok.name
    path = str(pathlib.Path(d.path).resolve()) if d.source == "text" else ""
    return _documents_from_text(d.source, path, d.corpus_max_bytes if d.source == "corpus" else 0,
                                spec)


def split_mask(unit: np.ndarray, eval_fraction: float) -> np.ndarray:
    """True where a document is held out for eval; both splits nonempty when possible."""
    is_eval = unit < eval_fraction
    if eval_fraction > 0 and len(unit) >= 2:
        if not is_eval.any():
            is_eval[np.argmin(unit)] = True
        if is_eval.all():
            is_eval[np.argmax(unit)] = False
    return is_eval


# ----------------------------------------------------------------------------- packing

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


def load_split(cfg, split: str) -> PackedStream:
    if split not in ("train", "eval"):
        raise DataError(f"split={split!r}: choose 'train' or 'eval'")
    docs = load_documents(cfg)
    is_eval = split_mask(docs.unit, cfg.data.eval_fraction)
    select = is_eval if split == "eval" else ~is_eval
    if not select.any():
        raise DataError(
            f"the {split} split is empty: {len(docs.unit)} document(s) with data.eval_fraction="
            f"{cfg.data.eval_fraction}; add documents" +
            (" or set train.eval_every=0" if split == "eval" else ""))
    return PackedStream(docs, select, cfg.train.seq_len, make_tokenizer(cfg.data).pad_id)


# ----------------------------------------------------------------------------- iteration

def _grain_seed(tag: str, seed: int) -> int:
    # Hashed, because grain reshuffles epoch e with seed+e: nearby seeds would share epochs.
    digest = hashlib.blake2b(f"jaxtrain/{tag}/{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class BatchIterator:
    """Infinite iterator of this process's rows of each global batch; resumable."""

    def __init__(self, stream: PackedStream, *, split: str, seed: int, global_batch: int,
                 process_index: int, process_count: int, read_threads: int = 2,
                 prefetch: int = 2):
        import grain  # heavy import, only when batches are made
        self.stream, self.split = stream, split
        self.local_batch = global_batch // process_count
        self._identity = {"version": _STATE_VERSION, "split": split, "seed": seed,
                          "global_batch": global_batch, "seq_len": stream.seq_len,
                          "num_windows": stream.num_windows}
        lo = process_index * self.local_batch
        rows = slice(lo, lo + self.local_batch)
        windows = (grain.MapDataset.range(stream.num_windows)
                   .shuffle(seed=_grain_seed(split, seed))
                   .repeat(None)  # reshuffles each epoch (grain seeds epoch e with seed + e)
                   .batch(global_batch, drop_remainder=True))
        # Batching window indices (cheap) before packing lets a process read only its rows.
        batches = windows.map(lambda w_G: stream.pack(np.asarray(w_G)[rows] % stream.num_windows))
        self._it = iter(batches.to_iter_dataset(
            grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict:
        return dict(self._identity, grain=self._it.get_state())

    def set_state(self, state: dict) -> None:
        diff = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in self._identity.items()
                if state.get(k) != v]
        if diff:
            raise DataError(
                "the saved data iterator state does not match this run (" + "; ".join(diff) +
                "); resume with the same train.seed/global_batch/seq_len and data, or start the "
                "data from scratch")
        self._it.set_state(state["grain"])


def make_batches(cfg, split: str = "train", process_index: int = 0,
                 process_count: int = 1) -> BatchIterator:
    """Batches of [global_batch // process_count, seq_len]; see the module docstring."""
    G = cfg.train.global_batch
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must be in [0, {process_count})")
    if G % process_count:
        raise DataError(f"train.global_batch={G} is not divisible by the {process_count} "
                        "processes; each process feeds an equal share")
    stream = load_split(cfg, split)
    if stream.num_windows < G:
        raise DataError(
            f"the {split} split has {stream.num_tokens} tokens: {stream.num_windows} windows of "
            f"train.seq_len={cfg.train.seq_len}, fewer than one batch of train.global_batch={G}; "
            "add data (data.corpus_max_bytes, data.path), lower the batch or sequence length" +
            (", or raise data.eval_fraction" if split == "eval" else ""))
    seed = cfg.train.seed if split == "train" else _EVAL_SEED
    return BatchIterator(stream, split=split, seed=seed, global_batch=G,
                         process_index=process_index, process_count=process_count)


def synthetic_batch(cfg, seed: int = 0, docs_per_row: int = 2) -> dict:
    """A host batch [global_batch, seq_len] of random tokens, `docs_per_row` packed documents
    per row (segment ids, per-document positions, the loss masked at each document's end):
    for tests, sweeps and benchmarks that need the real batch format without a corpus."""
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
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": tile(segment_ids),
            "positions": tile(positions), "loss_mask": tile(loss_mask)}

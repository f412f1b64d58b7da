"""Documents from the in-memory sources: the embedded corpus, text files, one token file.

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

Split: a document is held out for eval when a stable hash of its key (relative path, or index
for token files) falls below `data.eval_fraction`; eval never reaches train.
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
from typing import Optional

import numpy as np

from jaxtrain.data.errors import DataError
from jaxtrain.data.tokenizer import tokenizer_from_spec

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})
_SCAN_CHUNK = 1 << 24  # tokens per pass when scanning a token file


@dataclasses.dataclass(frozen=True)
class Documents:
    """Documents as spans of one token array; `unit` in [0,1) is each one's split hash."""
    tokens: np.ndarray  # in memory or memory-mapped (or prepared.ShardedTokens)
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
    docs = [tok.document_ids(d) for d in tok.encode_batch([t for _, t in pairs])]
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


def token_file_documents(path: str, tok, vocab_size: int) -> Documents:
    _, eos = open_token_file(path)
    st = os.stat(path)
    return _documents_from_tokens(str(pathlib.Path(path).resolve()), st.st_size, st.st_mtime_ns,
                                  tok.eos_id if eos is None else int(eos), vocab_size)


def text_source_documents(d, tok) -> Documents:
    """data.source corpus or text (`d`: the DataConfig)."""
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

"""`python -m jaxtrain.data prepare`: raw documents -> token shards + index + manifest.

The inputs (readers.py) are hashed and cut into pieces; consecutive pieces are grouped into
shards of about `shard_bytes` of input text. A shard is a pure function of its pieces and the
tokenizer, so it is tokenized by one worker process, in any order, and the same on every run.

A shard k is three files, each written to a temporary name, fsynced and renamed:
  shard-0000k.bin       its documents' tokens (BOS + ids + EOS each), uint16 or uint32
  shard-0000k.docs.npy  per document: end offset in the shard's tokens, split key (uint64)
  shard-0000k.json      the commit record, written last: counts, hashes, the plan it belongs to
A shard without its record is unfinished (an interrupted run); a re-run redoes exactly those
and skips the rest. `manifest.json` (tokenizer, sources with their hashes, shards, totals) is
written after every shard is committed: a directory without it is not ready to train on.
"""
from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import pathlib
import time

import numpy as np

from jaxtrain.config import ConfigError, PrepareConfig
from jaxtrain.data import readers, shard_check
from jaxtrain.data.errors import DataError
from jaxtrain.data.readers import Piece, Source
from jaxtrain.data.tokenizer import Tokenizer, tokenizer_from_spec

FORMAT = "jaxtrain-prepared/1"
MANIFEST = "manifest.json"
DOC_DTYPE = np.dtype([("end", "<i8"), ("key", "<u8")])


def shard_files(k: int) -> tuple[str, str, str]:
    return f"shard-{k:05d}.bin", f"shard-{k:05d}.docs.npy", f"shard-{k:05d}.json"


def validate_prepare(p: PrepareConfig) -> None:
    """prepare's own options (its command line, not a run's Config)."""
    for ok, msg in ((bool(p.inputs), "prepare needs --input (files, folders or globs of "
                     ".jsonl, .parquet or .txt)"),
                    (bool(p.out), "prepare needs --out DIR (where the shards and manifest go)"),
                    (bool(p.text_field), "--text-field must name the jsonl key / parquet column"),
                    (p.workers >= 0, f"--workers={p.workers} must be >= 0 (0: one per CPU)"),
                    (p.shard_bytes >= 1, f"--shard-bytes={p.shard_bytes} must be positive")):
        if not ok:
            raise ConfigError(msg)


def prepare(pcfg: PrepareConfig, *, echo=print, progress: bool = True) -> dict:
    """Tokenize `pcfg.inputs` into `pcfg.out`, resuming an interrupted run; returns the
    manifest."""
    from tqdm import tqdm
    validate_prepare(pcfg)
    tok = tokenizer_from_spec(pcfg.tokenizer)
    paths = readers.expand_inputs(pcfg.inputs)
    out = pathlib.Path(pcfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp"):  # half-written files of an interrupted run
        stale.unlink()
    workers = pcfg.workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    with _Workers(workers, tok.name) as pool:
        planned = pool.map(_plan_source, [(p, pcfg.text_field, pcfg.shard_bytes) for p in paths])
        sources = [s for s, _ in planned]
        shards = _group(planned, pcfg.shard_bytes)
        plan = _plan_id(tok, pcfg.text_field, sources, shards)
        done = _existing(out, plan)
        if done is not None:
            echo(f"{out} is already prepared ({done['num_tokens']:,} tokens); nothing to do")
            return done
        records = {k: r for k in range(len(shards)) if (r := _finished(out, k, plan, tok))}
        todo = [k for k in range(len(shards)) if k not in records]
        total = sum(p.bytes for s in shards for p in s)
        with tqdm(total=total, initial=sum(p.bytes for k in records for p in shards[k]),
                  unit="B", unit_scale=True, desc="prepare", disable=not progress) as bar:
            new_tokens = 0
            tasks = [(k, shards[k], {p.source: sources[p.source] for p in shards[k]},
                      pcfg.text_field, str(out), plan) for k in todo]
            for record in pool.imap_unordered(_write_shard, tasks):
                records[record["index"]] = record
                new_tokens += record["num_tokens"]
                bar.update(record["bytes"])
                bar.set_postfix(tokens=f"{new_tokens:,}")
    manifest = _manifest(tok, pcfg, plan, sources, [records[k] for k in range(len(shards))])
    if not manifest["num_documents"]:
        raise DataError(f"--input {' '.join(pcfg.inputs)}: no document has any text")
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(out)
    # What this run wrote matches its hashes: training then checks it by size and mtime only
    # (shards an earlier run left are hashed once, at the first start).
    shard_check.record(out, [records[k][f] for k in todo for f in ("tokens", "docs")])
    seconds = time.perf_counter() - t0
    echo(f"prepared {manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens "
         f"in {len(shards)} shards ({len(shards) - len(todo)} already done) -> {out}; "
         f"{new_tokens / seconds:,.0f} tokens/s over {seconds:.1f} s with {workers} worker(s)")
    return manifest


def _group(planned, shard_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces (in source order) into shards of at most shard_bytes, or one piece."""
    shards, current, size = [], [], 0
    for i, (_, pieces) in enumerate(planned):
        for lo, hi, row, nbytes in pieces:
            if current and size + nbytes > shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(Piece(i, lo, hi, row, nbytes))
            size += nbytes
    return shards + [current] if current else shards


def _plan_id(tok: Tokenizer, text_field: str, sources, shards) -> str:
    """What the shards are a function of; a shard record of another plan is not ours."""
    spec = {"format": FORMAT, "tokenizer": tok.fingerprint, "text_field": text_field,
            "sources": [[s.kind, s.sha256] for s in sources],
            "shards": [[list(p) for p in shard] for shard in shards]}
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()


def _another_prepare(out: pathlib.Path) -> DataError:
    return DataError(f"--out {out} holds the output of another prepare (other inputs, tokenizer, "
                     f"--text-field or --shard-bytes); use a new --out or delete {out}")


def _existing(out: pathlib.Path, plan: str) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("plan") != plan:
        raise _another_prepare(out)
    return manifest


def _finished(out: pathlib.Path, k: int, plan: str, tok: Tokenizer) -> dict | None:
    tokens_name, docs_name, record_name = shard_files(k)
    if not (out / record_name).is_file():
        return None
    record = json.loads((out / record_name).read_text())
    if record.get("plan") != plan:
        raise _another_prepare(out)
    tokens = out / tokens_name
    complete = ((out / docs_name).is_file() and tokens.is_file() and
                tokens.stat().st_size == record["num_tokens"] * tok.token_dtype.itemsize)
    return record if complete else None


def _manifest(tok: Tokenizer, pcfg: PrepareConfig, plan: str, sources, records) -> dict:
    return {
        "format": FORMAT, "plan": plan,
        "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint,
                      "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                      "pad_id": tok.pad_id},
        "dtype": tok.token_dtype.name, "text_field": pcfg.text_field,
        "shard_bytes": pcfg.shard_bytes,
        "sources": [s._asdict() for s in sources],
        "shards": [{k: r[k] for k in ("tokens", "docs", "num_tokens", "num_documents",
                                      "sha256_tokens", "sha256_docs")} for r in records],
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_documents": sum(r["num_documents"] for r in records),
    }


# ----------------------------------------------------------------------------- workers

_tokenizer: Tokenizer | None = None  # each worker process loads it once


def _init_worker(tokenizer_spec: str, threads: bool) -> None:
    global _tokenizer
    if not threads:  # one process per core already; the library's own threads would contend
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _tokenizer = tokenizer_from_spec(tokenizer_spec)


class _Workers:
    """A spawn pool of tokenizing processes, or this process itself for one worker."""

    def __init__(self, n: int, tokenizer_spec: str):
        self.n, self.spec, self.pool = n, tokenizer_spec, None

    def __enter__(self):
        if self.n > 1:
            ctx = multiprocessing.get_context("spawn")  # no forked tokenizer or tqdm threads
            self.pool = ctx.Pool(self.n, initializer=_init_worker, initargs=(self.spec, False))
        else:
            _init_worker(self.spec, True)
        return self

    def map(self, fn, items):
        return self.pool.map(fn, items) if self.pool else [fn(x) for x in items]

    def imap_unordered(self, fn, items):
        return self.pool.imap_unordered(fn, items) if self.pool else map(fn, items)

    def __exit__(self, *exc):
        if self.pool:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()


def _plan_source(args) -> tuple[Source, list[tuple]]:
    return readers.plan_source(*args)


def _write_shard(args) -> dict:
    k, pieces, sources, text_field, out, plan = args
    tok, out = _tokenizer, pathlib.Path(out)
    docs, ends, keys, n = [], [], [], 0
    for piece in pieces:
        source = sources[piece.source]
        for batch in readers.read_piece(source, piece, text_field):
            batch = [(row, text) for row, text in batch if text.strip()]
            for (row, _), ids in zip(batch, tok.encode_batch([t for _, t in batch])):
                docs.append(tok.document_ids(ids))
                n += len(docs[-1])
                ends.append(n)
                keys.append(readers.document_key(source, row))
    tokens = np.concatenate(docs) if docs else np.zeros(0, tok.token_dtype)
    index = np.empty(len(ends), DOC_DTYPE)
    index["end"], index["key"] = ends, keys
    buf = io.BytesIO()
    np.save(buf, index)
    tokens_name, docs_name, record_name = shard_files(k)
    token_bytes, doc_bytes = tokens.tobytes(), buf.getvalue()
    _write_atomic(out / tokens_name, token_bytes)
    _write_atomic(out / docs_name, doc_bytes)
    _fsync_dir(out)  # both renames durable before the record that vouches for them
    record = {"index": k, "plan": plan, "tokens": tokens_name, "docs": docs_name,
              "num_tokens": int(len(tokens)), "num_documents": len(ends),
              "bytes": sum(p.bytes for p in pieces),
              "sha256_tokens": hashlib.sha256(token_bytes).hexdigest(),
              "sha256_docs": hashlib.sha256(doc_bytes).hexdigest()}
    _write_atomic(out / record_name, json.dumps(record, indent=1).encode())
    _fsync_dir(out)
    return record


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write, fsync, rename: the name appears only with its full contents."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

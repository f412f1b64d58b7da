"""A prepared directory (prepare.py) at train time: checked, then memory-mapped as documents.

Opening reads only the manifest and the per-shard document indexes; tokens stay on disk and
are paged in as windows read them. A directory is refused before training when its prepare
did not finish, when it was made with another tokenizer than `data.tokenizer`, when a shard
on disk is not the size its manifest says, or when its bytes are not those whose sha256 the
manifest records (shard_check.py: hashed once, then checked by size and mtime).
"""
from __future__ import annotations

import functools
import json
import pathlib

import numpy as np

from jaxtrain.data import shard_check
from jaxtrain.data.documents import Documents
from jaxtrain.data.errors import DataError
from jaxtrain.data.prepare import FORMAT, MANIFEST
from jaxtrain.data.tokenizer import Tokenizer


class ShardedTokens:
    """The shards' tokens as one array of global positions (read with an index array)."""

    def __init__(self, arrays: list[np.ndarray], dtype: np.dtype):
        self.arrays, self.dtype = arrays, dtype
        self.offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, pos) -> np.ndarray:
        pos = np.asarray(pos, np.int64)
        shard = np.searchsorted(self.offsets, pos, side="right") - 1
        out = np.empty(pos.shape, self.dtype)
        for s in np.unique(shard):
            at = shard == s
            out[at] = self.arrays[s][pos[at] - self.offsets[s]]
        return out


def read_manifest(path: str) -> dict:
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise DataError(f"{path} is not a directory; data.source=prepared reads the --out "
                        "directory of `python -m jaxtrain.data prepare`")
    if not (folder / MANIFEST).is_file():
        unfinished = any(folder.glob("shard-*.json"))
        raise DataError(
            f"{path} has no {MANIFEST}: " +
            ("its prepare did not finish; re-run the same prepare command (it resumes)"
             if unfinished else "not a prepared directory; run `python -m jaxtrain.data prepare "
             f"--input ... --tokenizer ... --out {path}`"))
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}/{MANIFEST} is format {manifest.get('format')!r}, not {FORMAT}; "
                        "prepare it again with this jaxtrain")
    return manifest


def check_tokenizer(manifest: dict, tok: Tokenizer, path: str) -> None:
    made = manifest["tokenizer"]
    if made["fingerprint"] != tok.fingerprint:
        raise DataError(
            f"{path} was prepared with tokenizer {made['name']} ({made['vocab_size']} ids, "
            f"{made['fingerprint'][:19]}) but data.tokenizer={tok.name} is another "
            f"({tok.vocab_size} ids, {tok.fingerprint[:19]}); set data.tokenizer={made['name']} "
            "or prepare the data with this tokenizer")


def prepared_documents(path: str, tok: Tokenizer) -> Documents:
    manifest = read_manifest(path)
    check_tokenizer(manifest, tok, path)
    folder = pathlib.Path(path).resolve()
    return _open(str(folder), (folder / MANIFEST).stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _open(folder: str, mtime_ns: int) -> Documents:
    del mtime_ns  # cache key: a re-prepared directory is opened again
    manifest = json.loads(pathlib.Path(folder, MANIFEST).read_text())
    dtype = np.dtype(manifest["dtype"])
    arrays, ends, keys, offset = [], [], [], 0
    for shard in manifest["shards"]:
        tokens_path = pathlib.Path(folder, shard["tokens"])
        want = shard["num_tokens"] * dtype.itemsize
        have = tokens_path.stat().st_size if tokens_path.is_file() else None
        if have != want:
            raise DataError(f"{tokens_path} is {have} bytes but {MANIFEST} says {want}; the "
                            "directory is damaged: prepare it again into a new --out")
        arrays.append(np.memmap(tokens_path, dtype=dtype, mode="r") if want else
                      np.zeros(0, dtype))
    shard_check.verify(pathlib.Path(folder), manifest, MANIFEST)  # after the sizes: cheap first
    for shard in manifest["shards"]:
        index = np.load(pathlib.Path(folder, shard["docs"]))
        ends.append(index["end"] + offset)
        keys.append(index["key"])
        offset += shard["num_tokens"]
    ends_D = np.concatenate(ends).astype(np.int64)
    starts_D = np.concatenate([[0], ends_D[:-1]]).astype(np.int64)
    unit_D = np.concatenate(keys).astype(np.float64) / 2.0 ** 64
    return Documents(ShardedTokens(arrays, dtype), starts_D, ends_D - starts_D, unit_D)

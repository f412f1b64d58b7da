"""Prepared shards against the sha256 their manifest records, cheaply.

A file is hashed only when its (size, mtime) differs from the one `verified.json` recorded
the last time its hash matched the manifest: prepare records the files it writes, so a fresh
directory costs one stat per file at each start; a copied one (new mtimes) or one whose files
changed is read once in full (sha256 from the page cache ran at up to 1.3 GiB/s on one core of
the 2-core CI machine, BENCHMARKS.md: about 13 min per TB), then recorded. A file changed in place (same size, new bytes) is
refused. Where the directory is read-only nothing is recorded and each start hashes again.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

from jaxtrain.data.errors import DataError

VERIFIED = "verified.json"


def _stamp(path: pathlib.Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read(folder: pathlib.Path) -> dict:
    try:
        return json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}


def record(folder: pathlib.Path, names) -> None:
    """Note `names` (files in `folder` whose sha256 matches the manifest) as verified."""
    verified = _read(folder)
    verified.update({name: _stamp(folder / name) for name in names})
    tmp = folder / f"{VERIFIED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(verified, indent=0))
        os.replace(tmp, folder / VERIFIED)
    except OSError:  # a read-only directory: verified again at the next start
        tmp.unlink(missing_ok=True)


def verify(folder: pathlib.Path, manifest: dict, manifest_name: str) -> None:
    """DataError unless every shard file holds the bytes whose sha256 the manifest records."""
    verified, checked = _read(folder), []
    for shard in manifest["shards"]:
        for name, digest in ((shard["tokens"], shard["sha256_tokens"]),
                             (shard["docs"], shard["sha256_docs"])):
            path = folder / name
            if not path.is_file():
                raise DataError(f"{path} is missing though {manifest_name} lists it; the "
                                "directory is damaged: prepare it again into a new --out")
            if verified.get(name) == _stamp(path):
                continue
            with open(path, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                    raise DataError(
                        f"{path} does not hold the bytes whose sha256 {manifest_name} records "
                        "(it changed after prepare); the directory is damaged: prepare it again "
                        "into a new --out")
            checked.append(name)
    if checked:
        record(folder, checked)

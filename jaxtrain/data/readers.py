"""Raw documents for `prepare`: which files, how they split into pieces, what a piece holds.

  .jsonl  one JSON object per line, its text under the text field (`--text-field`); blank
          lines are skipped. Pieces are byte ranges cut at line ends.
  .parquet  one row per document, its text in the text-field column. Pieces are row groups.
  .txt    the whole file is one document (as a folder under data.source=text). One piece.

A piece is (source, lo, hi, first_row): a byte range of a jsonl file, a row-group range of a
parquet file, or a whole txt file; `first_row` numbers its first document within the source.
A document's key (for the train/eval split) is its source's content hash and its row, so
renaming or adding files moves no document between the splits.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
from typing import Iterator, NamedTuple

from jaxtrain.data.errors import DataError

KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "txt"}
_READ_BLOCK = 1 << 24


class Source(NamedTuple):
    path: str
    kind: str
    size: int
    sha256: str


class Piece(NamedTuple):
    source: int  # index into the plan's sources
    lo: int
    hi: int
    first_row: int
    bytes: int  # input bytes (for shard sizing and the progress bar)


def expand_inputs(patterns) -> list[str]:
    """Files named by paths, folders (every supported file below) and globs; sorted, unique."""
    found = set()
    for pattern in patterns:
        matches = glob.glob(os.path.expanduser(pattern), recursive=True)
        if not matches:
            raise DataError(f"--input {pattern!r} matches no files; check the path or the glob")
        files = []
        for m in map(pathlib.Path, matches):
            files += (sorted(f for f in m.rglob("*") if f.suffix in KINDS and f.is_file())
                      if m.is_dir() else [m])
        unknown = [str(f) for f in files if f.suffix not in KINDS]
        if unknown:
            raise DataError(f"--input {pattern!r}: {unknown[0]} is not one of "
                            f"{', '.join(KINDS)}; prepare reads only those")
        if not files:
            raise DataError(f"--input {pattern!r} holds no {', '.join(KINDS)} files")
        found.update(str(f.resolve()) for f in files)
    return sorted(found)


def plan_source(path: str, text_field: str, piece_bytes: int) -> tuple[Source, list[tuple]]:
    """Hash one file and cut it into pieces (lo, hi, first_row, bytes)."""
    kind = KINDS[pathlib.Path(path).suffix]
    if kind == "parquet":
        return _plan_parquet(path, text_field, piece_bytes)
    digest, size, cuts = hashlib.sha256(), 0, [(0, 0)]
    target, lines = piece_bytes, 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
            # jsonl cuts: the first line end at or past each multiple of piece_bytes
            while kind == "jsonl" and (k := block.find(b"\n", max(0, target - 1 - size))) >= 0:
                cut = size + k + 1
                cuts.append((cut, lines + block.count(b"\n", 0, k + 1)))
                target = cut + piece_bytes
            lines += block.count(b"\n")
            size += len(block)
    source = Source(path, kind, size, digest.hexdigest())
    if kind == "txt":
        return source, [(0, size, 0, size)]
    if cuts[-1][0] < size:
        cuts.append((size, lines + 1))
    if kind == "jsonl" and size:
        _check_first_line(path, text_field)
    return source, [(lo, hi, row, hi - lo) for (lo, row), (hi, _) in zip(cuts, cuts[1:])]


def _check_first_line(path: str, text_field: str) -> None:
    """A wrong --text-field fails here, before any tokenizing, rather than in a worker."""
    with open(path, "rb") as f:
        for row, line in enumerate(f):
            if line.strip():
                _text_of(line, path, row, text_field)
                return


def _plan_parquet(path: str, text_field: str, piece_bytes: int) -> tuple[Source, list[tuple]]:
    import pyarrow.parquet as pq
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path} is not a readable parquet file ({e})") from None
    names = meta.schema.names
    if text_field not in names:
        raise DataError(f"{path} has no column {text_field!r} (columns: {', '.join(names)}); "
                        "pass --text-field NAME")
    column = names.index(text_field)
    with open(path, "rb") as f:
        source = Source(path, "parquet", os.fstat(f.fileno()).st_size,
                        hashlib.file_digest(f, "sha256").hexdigest())
    pieces, lo, row, nbytes, rows = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):  # whole row groups, about piece_bytes of text each
        group = meta.row_group(g)
        nbytes += group.column(column).total_uncompressed_size
        rows += group.num_rows
        if nbytes >= piece_bytes or g == meta.num_row_groups - 1:
            pieces.append((lo, g + 1, row, nbytes))
            lo, row, nbytes, rows = g + 1, row + rows, 0, 0
    return source, pieces


def _text_of(line: bytes, path: str, row: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:  # json.loads decodes bytes first
        raise DataError(f"{path} line {row + 1} is not UTF-8 ({e.reason} at byte {e.start}); "
                        "convert the file to UTF-8 or remove the line") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {row + 1} is not JSON ({e}); fix or remove it") from None
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path} line {row + 1} has no {text_field!r} field (it has: {fields}); "
                        "pass --text-field NAME")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{path} line {row + 1}: {text_field!r} is {type(text).__name__}, not "
                        "text")
    return text


def read_piece(source: Source, piece: Piece, text_field: str,
               batch_rows: int = 1024) -> Iterator[list[tuple[int, str]]]:
    """The piece's documents as batches of (row within the source, text)."""
    if source.kind == "txt":
        try:
            yield [(0, pathlib.Path(source.path).read_text(encoding="utf-8"))]
        except UnicodeDecodeError as e:
            raise DataError(f"{source.path} is not UTF-8 text ({e}); convert or remove "
                            "it") from None
    elif source.kind == "jsonl":
        with open(source.path, "rb") as f:
            f.seek(piece.lo)
            lines = f.read(piece.hi - piece.lo).split(b"\n")
        batch = []
        for i, line in enumerate(lines):
            if line.strip():
                row = piece.first_row + i
                batch.append((row, _text_of(line, source.path, row, text_field)))
            if len(batch) == batch_rows:
                yield batch
                batch = []
        yield batch
    else:
        import pyarrow.parquet as pq
        row = piece.first_row
        groups = list(range(piece.lo, piece.hi))
        for rb in pq.ParquetFile(source.path).iter_batches(batch_size=batch_rows, row_groups=groups,
                                                           columns=[text_field]):
            texts = rb.column(0).to_pylist()
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise DataError(f"{source.path} row {row + i}: {text_field!r} is "
                                    f"{type(t).__name__}, not text")
            yield list(zip(range(row, row + len(texts)), texts))
            row += len(texts)


def document_key(source: Source, row: int) -> int:
    """A document's split key as an unsigned 64-bit int (its unit is key / 2**64)."""
    digest = hashlib.blake2b(f"{source.sha256}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")

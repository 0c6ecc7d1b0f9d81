"""Documents of text files (`training.data.format: jsonl | parquet | text`), tokenized on the fly.

  jsonl    *.jsonl, one document per line: a JSON object whose `textField` (default `text`) is a string
  parquet  *.parquet, one document per row: the string column `textField`
  text     *.txt, one document per line of UTF-8 text

Files are read in sorted order (files.py), as the token formats are; blank lines are no documents.
Lines and parquet values are at most MAX_DOCUMENT_BYTES and a parquet row group's column at most
MAX_ROW_GROUP_BYTES: the files are untrusted input, and each error names the file, the line (or row)
and the field.

`Tokenized` is what packing reads (the interface of records.Documents): every document's length in
tokens, then any document's first tokens. The lengths need every document tokenized once at start-up
(batched, in the tokenizer library's own threads); the rows are tokenized again when the read-ahead
workers read them (readahead.py). For a corpus too large to tokenize at every start, `tpujob data
prepare` (prepare.py) writes the same tokens to ArrayRecord files once, which `format: arrayrecord`
then reads into the same rows.

Lines are found by one vectorised pass over each file's bytes (memory-mapped; files behind a URL are
copied to a local cache first, as ArrayRecord files are), so a document's text is one slice of a map.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Iterator

import fsspec
import fsspec.implementations.local
import numpy as np

from ..process.exits import UserError
from . import files as files_lib
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_DOCUMENT_BYTES = 16 << 20
MAX_ROW_GROUP_BYTES = 256 << 20
# Documents encoded per batch at start-up (and by `tpujob data prepare`).
ENCODE_BATCH = 1024
# Bytes scanned for newlines at a time.
SCAN_BYTES = 1 << 26


def local_files(path: str, fmt: str) -> list[str]:
    """The files of `path` in reading order, as local paths (URLs copied to a local cache once)."""
    fs, _, sizes = files_lib.matching(path, fmt)
    files = list(sizes)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        return files
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return list(fsspec.open_local([f"simplecache::{protocol}://{f}" for f in files]))


def _lines(mm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every non-blank line of a file's bytes, without its newline ("\\n" or "\\r\\n")."""
    ends = [np.flatnonzero(mm[c : c + SCAN_BYTES] == 10) + c for c in range(0, len(mm), SCAN_BYTES)]
    ends_ = np.concatenate(ends).astype(np.int64) if ends else np.zeros(0, np.int64)
    if len(mm) and (not len(ends_) or ends_[-1] != len(mm) - 1):
        ends_ = np.append(ends_, len(mm))  # a last line without its newline
    starts = np.concatenate([[0], ends_[:-1] + 1]).astype(np.int64) if len(ends_) else ends_
    cr = np.zeros(len(ends_), bool)
    inside = ends_ > starts
    cr[inside] = mm[ends_[inside] - 1] == 13
    ends_ = ends_ - cr
    keep = ends_ > starts
    return starts[keep], ends_[keep]


class LineDocuments:
    """The non-blank lines of jsonl or text files; document i's text is `text(i)`."""

    def __init__(self, path: str, fmt: str, field: str):
        self.fmt, self.field = fmt, field
        self.files = local_files(path, fmt)
        self.maps, starts, ends, owner = [], [], [], []
        for k, name in enumerate(self.files):
            mm = np.memmap(name, np.uint8, mode="r") if os.path.getsize(name) else np.zeros(0, np.uint8)
            s, e = _lines(mm)
            if len(s) and (too := np.flatnonzero(e - s > MAX_DOCUMENT_BYTES)).size:
                i = int(too[0])
                raise UserError(
                    f"{name}, line {self._line_number(mm, int(s[i]))}: {int(e[i] - s[i])} bytes, more than "
                    f"the {MAX_DOCUMENT_BYTES} a document may have"
                )
            self.maps.append(mm)
            starts.append(s)
            ends.append(e)
            owner.append(np.full(len(s), k, np.int32))
        self.starts, self.ends = np.concatenate(starts), np.concatenate(ends)
        self.owner = np.concatenate(owner)

    def __len__(self) -> int:
        return len(self.starts)

    @staticmethod
    def _line_number(mm: np.ndarray, at: int) -> int:
        return int(np.count_nonzero(mm[:at] == 10)) + 1

    def where(self, i: int) -> str:
        k = int(self.owner[i])
        return f"{self.files[k]}, line {self._line_number(self.maps[k], int(self.starts[i]))}"

    def raw(self, i: int) -> bytes:
        return self.maps[int(self.owner[i])][int(self.starts[i]) : int(self.ends[i])].tobytes()

    def value(self, i: int) -> object:
        """Document i: its text (text), or its JSON object's `field` (jsonl), unchecked."""
        raw = self.raw(i)
        if self.fmt == "text":
            try:
                return raw.decode()
            except UnicodeDecodeError as e:
                raise UserError(f"{self.where(i)}: not UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
            raise UserError(f"{self.where(i)}: not a JSON object ({str(e)[:200]})") from None
        if not isinstance(record, dict) or self.field not in record:
            raise UserError(f"{self.where(i)}: no field {self.field!r} (training.data.textField)")
        return record[self.field]

    def text(self, i: int) -> str:
        value = self.value(i)
        if not isinstance(value, str):
            raise UserError(
                f"{self.where(i)}: field {self.field!r} (training.data.textField) is a "
                f"{type(value).__name__}, not a string"
            )
        return value


class ParquetDocuments:
    """The rows of parquet files; document i is row i's `field` string. Rows are read a row group at a
    time (the last few cached per process)."""

    def __init__(self, path: str, field: str):
        import pyarrow.parquet as pq

        self.field, self.files = field, local_files(path, "parquet")
        self.groups: list[tuple[int, int]] = []  # (file, row group) of each group, in reading order
        counts = []
        for k, name in enumerate(self.files):
            meta = pq.ParquetFile(name).metadata
            names = [meta.schema.column(c).name for c in range(meta.num_columns)]
            if field not in names:
                raise UserError(f"{name}: no column {field!r} (training.data.textField)")
            column = names.index(field)
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                size = group.column(column).total_uncompressed_size
                if size > MAX_ROW_GROUP_BYTES:
                    raise UserError(
                        f"{name}, row group {g}: column {field!r} has {size} bytes, more than the "
                        f"{MAX_ROW_GROUP_BYTES} read at a time; write smaller row groups"
                    )
                self.groups.append((k, g))
                counts.append(group.num_rows)
        self.offsets = np.cumsum([0] + counts).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @functools.lru_cache(maxsize=4)  # noqa: B019 -- one instance per run; the cache is the point
    def _group(self, index: int) -> list:
        import pyarrow.parquet as pq

        k, g = self.groups[index]
        return pq.ParquetFile(self.files[k]).read_row_group(g, columns=[self.field]).column(0).to_pylist()

    def where(self, i: int) -> str:
        index = int(np.searchsorted(self.offsets, i, side="right")) - 1
        k, g = self.groups[index]
        return f"{self.files[k]}, row group {g}, row {i - int(self.offsets[index])}"

    def value(self, i: int) -> object:
        index = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self._group(index)[i - int(self.offsets[index])]

    def text(self, i: int) -> str:
        value = self.value(i)
        if not isinstance(value, str):
            raise UserError(
                f"{self.where(i)}: column {self.field!r} (training.data.textField) holds a "
                f"{type(value).__name__}, not a string"
            )
        if len(value) > MAX_DOCUMENT_BYTES:
            raise UserError(f"{self.where(i)}: more than the {MAX_DOCUMENT_BYTES} characters a document may have")
        return value


def documents(path: str, fmt: str, field: str) -> LineDocuments | ParquetDocuments:
    return ParquetDocuments(path, field) if fmt == "parquet" else LineDocuments(path, fmt, field)


def encoded(
    docs: LineDocuments | ParquetDocuments, tokenizer: Tokenizer, every_s: float = 30.0
) -> Iterator[np.ndarray]:
    """Every document's tokens, in order, encoded ENCODE_BATCH at a time (logged every `every_s`)."""
    t0 = last = time.perf_counter()
    for a in range(0, len(docs), ENCODE_BATCH):
        yield from tokenizer.encode_many([docs.text(i) for i in range(a, min(a + ENCODE_BATCH, len(docs)))])
        if time.perf_counter() - last > every_s:
            last = time.perf_counter()
            log.info("tokenized %d of %d documents in %.0fs", a + ENCODE_BATCH, len(docs), last - t0)


class Tokenized:
    """Documents of text files as packing reads them: `lengths()`, then `read(i, length)`."""

    def __init__(self, path: str, fmt: str, tokenizer: Tokenizer, field: str = "text"):
        self.docs, self.tokenizer = documents(path, fmt, field), tokenizer

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> np.ndarray:
        """Every document's length in tokens (tokenizes every document once)."""
        return np.fromiter((len(t) for t in encoded(self.docs, self.tokenizer)), np.int64, count=len(self.docs))

    def read(self, i: int, length: int) -> np.ndarray:
        """Document i's first `length` tokens."""
        return self.tokenizer.encode(self.docs.text(i))[:length]

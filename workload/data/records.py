"""ArrayRecord token files: one record = one tokenized document, stored as the raw little-endian
bytes of its tokens (uint16 when the vocabulary fits, else uint32: the dtype of flat .bin files), so
a writer needs nothing but `np.asarray(doc, dtype).tobytes()`.

The ArrayRecord reader opens local paths only; files behind an fsspec URL (gs://) are copied to a
local cache once at start-up (fsspec's simplecache), then read at random like local ones.
"""

from __future__ import annotations

import fsspec
import fsspec.implementations.local
import grain
import numpy as np

from . import files as files_lib


def token_dtype(vocab: int):
    """The dtype of stored tokens (flat .bin files, records): uint16 when `vocab` fits, else uint32."""
    return np.uint16 if vocab <= 65536 else np.uint32


def encode(document, dtype) -> bytes:
    """A record of `document` (how files for `format: arrayrecord` are written)."""
    return np.asarray(document, np.dtype(dtype).newbyteorder("<")).tobytes()


class Documents:
    """The records of the ArrayRecord files under `path` (a directory, glob or URL), in sorted order."""

    def __init__(self, path: str, dtype):
        fs, _, sizes = files_lib.matching(path, "arrayrecord")
        files = list(sizes)
        if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
            files = fsspec.open_local([f"simplecache::{protocol}://{f}" for f in files])
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.source = grain.sources.ArrayRecordDataSource(files)  # its readers are set up for random access

    def __len__(self) -> int:
        return len(self.source)

    def lengths(self) -> np.ndarray:
        """Every document's length in tokens (reads every record once)."""
        size = self.dtype.itemsize
        return np.fromiter(
            (len(self.source[i]) // size for i in range(len(self.source))), np.int64, count=len(self.source)
        )

    def read(self, i: int, length: int) -> np.ndarray:
        """Document i's first `length` tokens."""
        return np.frombuffer(self.source[i], self.dtype, count=length).astype(np.int32)

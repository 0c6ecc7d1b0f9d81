"""Which files a `files` data source reads: one rule for the sources (batches.py, records.py) and for
the data-order fingerprint (fingerprint.py)."""

from __future__ import annotations

import fsspec

SUFFIX = {
    "npy": "*.npy",
    "bin": "*.bin",
    "arrayrecord": "*.array_record*",
    "jsonl": "*.jsonl",
    "parquet": "*.parquet",
    "text": "*.txt",
}


def matching(path: str, fmt: str) -> tuple[fsspec.AbstractFileSystem, str, dict[str, int]]:
    """(the filesystem, the glob, each matching file's bytes by name in sorted order: the order they are
    read in) of `path`: a glob as given, or a directory's files of the format; local or any fsspec URL
    (gs://). One listing gives names and sizes (the fingerprint's), never a request per file."""
    fs, root = fsspec.core.url_to_fs(path)
    pattern = root if any(c in root for c in "*?[") else root.rstrip("/") + "/" + SUFFIX[fmt]
    files = {name: int(info["size"]) for name, info in sorted(fs.glob(pattern, detail=True).items())}
    if not files:
        raise FileNotFoundError(f"no {fmt} files match {path if pattern == root else pattern}")
    return fs, pattern, files

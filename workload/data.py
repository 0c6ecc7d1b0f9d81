"""Token batches, deterministic in (seed, step): resume is exact because data position = step.

Each process builds only the rows its devices hold (`jax.make_array_from_callback`). With context
parallelism the sequence is stored in load-balanced order (attention.load_balance_order) and
`positions` carries each token's original position.

Sources:
  synthetic  arithmetic sequences mod vocab with a per-row start and stride (learnable: the
             loss falls), from a hash of (seed, step, row).
  files      flat token arrays (`*.npy`, or raw `*.bin`: uint16 when vocab <= 65536, else
             uint32) under a local directory or a gs:// prefix, read in sorted order as one
             stream of windows of sequenceLength + 1 tokens, served by a Grain MapDataset
             (optionally shuffled) indexed by global sequence g = step * globalBatch + row, so
             a batch is a pure function of its step.
"""

from __future__ import annotations

import fsspec
import fsspec.implementations.local
import grain
import jax
import numpy as np

from . import attention


def _mix(*xs: np.ndarray) -> np.ndarray:
    """A splitmix-style 64-bit hash of integer arrays (deterministic, vectorised)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for x in xs:
            h = (h ^ np.asarray(x, np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(29))


class SyntheticTokens:
    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int):
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed

    def rows(self, step: int, rows: range) -> np.ndarray:
        r = np.arange(rows.start, rows.stop)
        h = _mix(np.full_like(r, self.seed), np.full_like(r, step), r)
        start = (h % np.uint64(self.vocab)).astype(np.int64)
        stride = 1 + ((h >> np.uint64(20)) % np.uint64(7)).astype(np.int64)
        t = np.arange(self.seq_len + 1)
        return ((start[:, None] + stride[:, None] * t[None, :]) % self.vocab).astype(np.int32)


class TokenWindows:
    """Random-access Grain source: window w is tokens [w * seq_len, w * seq_len + seq_len + 1) of
    the files read in sorted order as one stream (windows overlap by the one target token)."""

    def __init__(self, arrays: list, seq_len: int):
        self.arrays, self.seq_len = arrays, seq_len
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])
        self.windows = (int(self.offsets[-1]) - 1) // seq_len

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, w: int) -> np.ndarray:
        out, pos, length = [], int(w) * self.seq_len, self.seq_len + 1
        while length > 0:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            local = pos - int(self.offsets[i])
            piece = np.asarray(self.arrays[i][local:local + length])
            out.append(piece)
            pos, length = pos + len(piece), length - len(piece)
        return np.concatenate(out).astype(np.int32)


class RemoteTokens:
    """A flat token file on an fsspec filesystem (gs:// through gcsfs), read by byte range: a
    window costs one ranged read, never a download of the file."""

    def __init__(self, fs, path: str, fmt: str, dtype):
        self.fs, self.path = fs, path
        self.offset, self.dtype = 0, np.dtype(dtype)
        if fmt == "npy":
            with fs.open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _fortran, self.dtype = read_header(f)
                self.offset, self.length = f.tell(), int(np.prod(shape))
        else:
            self.length = fs.size(path) // self.dtype.itemsize

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b, _ = s.indices(self.length)
        size = self.dtype.itemsize
        raw = self.fs.cat_file(self.path, start=self.offset + a * size, end=self.offset + b * size)
        return np.frombuffer(raw, self.dtype)


def _open_token_files(path: str, fmt: str, dtype) -> tuple[str, list]:
    """(the glob used, one array-like per file in sorted order): local files memory-mapped, URLs
    (gs://bucket/dir, or any fsspec protocol) read by byte range."""
    fs, root = fsspec.core.url_to_fs(path)
    pattern = root if any(c in root for c in "*?[") else root.rstrip("/") + f"/*.{fmt}"
    files = sorted(fs.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no .{fmt} token files match {path if pattern == root else pattern}")
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        return pattern, [np.load(f, mmap_mode="r").reshape(-1) if fmt == "npy" else np.memmap(f, dtype=dtype, mode="r")
                         for f in files]
    return pattern, [RemoteTokens(fs, f, fmt, dtype) for f in files]


class FileTokens:
    """A Grain MapDataset over the token windows, indexed by global sequence g = step * batch + row.

    Past the end of the data g wraps around; with `shuffle` each pass over the data is a fresh
    permutation seeded by (seed, pass). Either way the batch of a step is a pure function of the
    step, so the data position is the training step and resume is exact with no iterator state.
    """

    def __init__(self, path: str, fmt: str, vocab: int, seq_len: int, batch: int, *, shuffle: bool = False,
                 seed: int = 0):
        dtype = np.uint16 if vocab <= 65536 else np.uint32
        pattern, arrays = _open_token_files(path, fmt, dtype)
        self.seq_len, self.batch = seq_len, batch
        self.source = TokenWindows(arrays, seq_len)
        self.windows = self.source.windows
        if self.windows < 1:
            raise ValueError(f"{pattern}: {self.source.offsets[-1]} tokens, fewer than one sequence of {seq_len + 1}")
        # Both index any g >= 0: the source wraps g % windows, the shuffle re-permutes every pass.
        self.dataset = grain.MapDataset.source(self.source)
        if shuffle:
            # Grain seeds pass p with seed + p: hash the seed, or seed s's second pass would be
            # seed s+1's first.
            self.dataset = self.dataset.shuffle(seed=int(_mix(seed) >> np.uint64(32)))

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Rows `rows` of the global batch of `step`, one sequence of seq_len + 1 tokens each."""
        return np.stack([self.dataset[step * self.batch + r] for r in rows])


def make_source(training, vocab: int):
    d = training.data
    if d.source == "files":
        return FileTokens(d.path, d.format, vocab, training.sequence_length, training.global_batch,
                          shuffle=d.shuffle, seed=training.seed)
    return SyntheticTokens(vocab, training.sequence_length, training.global_batch, training.seed)


class Batches:
    """Global (inputs, targets, positions) arrays for a step, sharded as `sharding` says."""

    def __init__(self, source, sharding: jax.sharding.NamedSharding, context: int):
        self.source, self.sharding = source, sharding
        self.shape = (source.batch, source.seq_len)
        self.order = attention.load_balance_order(source.seq_len, context).astype(np.int32)

    def __call__(self, step: int):
        cache: dict = {}

        def rows(index):
            r = range(*index[0].indices(self.shape[0]))
            if (r.start, r.stop) not in cache:
                seq = self.source.rows(step, r)
                cache[(r.start, r.stop)] = (seq[:, :-1][:, self.order], seq[:, 1:][:, self.order])
            return cache[(r.start, r.stop)], index[1]

        def part(which):
            def cb(index):
                (inputs, targets), cols = rows(index)
                if which == 2:
                    return np.broadcast_to(self.order, (len(inputs), self.shape[1]))[:, cols].copy()
                return (inputs, targets)[which][:, cols]
            return jax.make_array_from_callback(self.shape, self.sharding, cb)

        return part(0), part(1), part(2)

"""Token batches, deterministic in (seed, step): resume is exact because data position = step.

Each process builds only the rows its devices hold (`jax.make_array_from_callback`). With context
parallelism the sequence is stored in load-balanced order (attention.load_balance_order) and
`positions` carries each token's original position.

Sources:
  synthetic  arithmetic sequences mod vocab with a per-row start and stride (learnable: the
             loss falls), from a hash of (seed, step, row).
  files      flat token arrays (`*.npy`, or raw `*.bin`: uint16 when vocab <= 65536, else
             uint32) under a directory, read in sorted order as one stream of windows of
             sequenceLength + 1 tokens; global sequence g = step * globalBatch + row.
"""

from __future__ import annotations

import glob
import os

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


class FileTokens:
    def __init__(self, path: str, fmt: str, vocab: int, seq_len: int, batch: int):
        pattern = path if any(c in path for c in "*?[") else os.path.join(path, f"*.{fmt}")
        files = sorted(glob.glob(pattern))
        if not files:
            raise FileNotFoundError(f"no .{fmt} token files match {pattern}")
        dtype = np.uint16 if vocab <= 65536 else np.uint32
        self.arrays = [np.load(f, mmap_mode="r").reshape(-1) if fmt == "npy" else np.memmap(f, dtype=dtype, mode="r")
                       for f in files]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.seq_len, self.batch = seq_len, batch
        self.windows = (int(self.offsets[-1]) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"{pattern}: {self.offsets[-1]} tokens, fewer than one sequence of {seq_len + 1}")

    def _read(self, start: int, length: int) -> np.ndarray:
        out, pos = [], start
        while length > 0:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            local = pos - int(self.offsets[i])
            piece = np.asarray(self.arrays[i][local:local + length])
            out.append(piece)
            pos, length = pos + len(piece), length - len(piece)
        return np.concatenate(out)

    def rows(self, step: int, rows: range) -> np.ndarray:
        g = step * self.batch + np.arange(rows.start, rows.stop)
        return np.stack([self._read(int(w) * self.seq_len, self.seq_len + 1) for w in g % self.windows]).astype(np.int32)


def make_source(training, vocab: int):
    d = training.data
    if d.source == "files":
        return FileTokens(d.path, d.format, vocab, training.sequence_length, training.global_batch)
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

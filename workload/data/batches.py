"""Token batches, deterministic in (seed, step): resume is exact because data position = step.

Each process builds only the rows its devices hold (`jax.make_array_from_callback`); rows of files
are read ahead of the loop by worker threads (readahead.py). With context parallelism the sequence
is stored in load-balanced order (attention.load_balance_order) and `positions` carries each
token's original position.

Sources:
  synthetic  arithmetic sequences mod vocab with a per-row start and stride (learnable: the
             loss falls), from a hash of (seed, step, row); packed, several such documents a row.
  files      flat token arrays (`*.npy`, or raw `*.bin`: uint16 when vocab <= 65536, else
             uint32) under a local directory or a gs:// prefix, read in sorted order as one
             stream of windows of sequenceLength + 1 tokens, served by a Grain MapDataset
             (optionally shuffled) indexed by global sequence g = step * globalBatch + row, so
             a batch is a pure function of its step. Packed (packing.py), the stream is cut into
             documents at the EOS token (or read one document per ArrayRecord record, records.py)
             and whole documents are packed into each row by a plan built at start-up. Text files
             (jsonl, parquet, text) are documents tokenized on the fly (text.py), packed alike."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import fsspec.implementations.local
import grain
import jax
import numpy as np

from tpu_operator.api.contract import TEXT_FORMATS

from ..model import attention
from . import chat as chat_lib
from . import files as files_lib
from . import packing, readahead, records, text
from . import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)


def _mix(*xs: np.ndarray) -> np.ndarray:
    """A splitmix-style 64-bit hash of integer arrays (deterministic, vectorised)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for x in xs:
            h = (h ^ np.asarray(x, np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(29))


class SyntheticTokens:
    packed, reads = False, False

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int):
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed

    def rows(self, step: int, rows: range) -> np.ndarray:
        r = np.arange(rows.start, rows.stop)
        h = _mix(np.full_like(r, self.seed), np.full_like(r, step), r)
        start = (h % np.uint64(self.vocab)).astype(np.int64)
        stride = 1 + ((h >> np.uint64(20)) % np.uint64(7)).astype(np.int64)
        t = np.arange(self.seq_len + 1)
        return ((start[:, None] + stride[:, None] * t[None, :]) % self.vocab).astype(np.int32)


class TokenStream:
    """The files read in sorted order as one stream of tokens (local memory maps or RemoteTokens)."""

    def __init__(self, arrays: list):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, pos: int, length: int) -> np.ndarray:
        """Tokens [pos, pos + length), across file boundaries: one read per file touched."""
        out = []
        while length > 0:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            local = pos - int(self.offsets[i])
            piece = np.asarray(self.arrays[i][local : local + length])
            out.append(piece)
            pos, length = pos + len(piece), length - len(piece)
        return np.concatenate(out).astype(np.int32)


class TokenWindows:
    """Random-access Grain source: window w is tokens [w * seq_len, w * seq_len + seq_len + 1) of
    the stream (windows overlap by the one target token)."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.offsets = stream.offsets
        self.windows = (len(stream) - 1) // seq_len

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, w: int) -> np.ndarray:
        return self.stream.read(int(w) * self.seq_len, self.seq_len + 1)


class RemoteTokens:
    """A flat token file on an fsspec filesystem (gs:// through gcsfs), read by byte range: a
    window costs one ranged read, never a download of the file."""

    def __init__(self, fs, path: str, fmt: str, dtype):
        self.fs, self.path = fs, path
        self.offset, self.dtype = 0, np.dtype(dtype)
        if fmt == "npy":
            with fs.open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
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
    fs, pattern, files = files_lib.matching(path, fmt)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        return pattern, [
            np.load(f, mmap_mode="r").reshape(-1) if fmt == "npy" else np.memmap(f, dtype=dtype, mode="r")
            for f in files
        ]
    return pattern, [RemoteTokens(fs, f, fmt, dtype) for f in files]


class _Indexed:
    """Rows from a Grain MapDataset (`self.dataset`, wrapping past its end) indexed by global sequence
    g = step * batch + row; with `shuffle` each pass over it is a fresh permutation seeded by (seed,
    pass). Either way the batch of a step is a pure function of the step, so the data position is
    the training step and resume is exact with no iterator state."""

    packed = False
    reads = True  # rows cost reads: worth worker threads

    def _index(self, source, shuffle: bool, seed: int) -> None:
        # Both index any g >= 0: the source wraps g % len, the shuffle re-permutes every pass.
        self.dataset = grain.MapDataset.source(source)
        if shuffle:
            # Grain seeds pass p with seed + p: hash the seed, or seed s's second pass would be
            # seed s+1's first.
            self.dataset = self.dataset.shuffle(seed=int(_mix(seed) >> np.uint64(32)))

    def rows(self, step: int, rows: range):
        """Rows `rows` of the global batch of `step`, seq_len + 1 tokens each (Packed when packed)."""
        items = [self.dataset[step * self.batch + r] for r in rows]
        return packing.stacked(items) if self.packed else np.stack(items)


class FileTokens(_Indexed):
    """The token windows of flat files (TokenWindows)."""

    def __init__(
        self, path: str, fmt: str, vocab: int, seq_len: int, batch: int, *, shuffle: bool = False, seed: int = 0
    ):
        pattern, arrays = _open_token_files(path, fmt, records.token_dtype(vocab))
        self.seq_len, self.batch = seq_len, batch
        self.source = TokenWindows(TokenStream(arrays), seq_len)
        self.windows = self.source.windows
        if self.windows < 1:
            raise ValueError(f"{pattern}: {self.source.offsets[-1]} tokens, fewer than one sequence of {seq_len + 1}")
        self._index(self.source, shuffle, seed)


class PackedFiles(_Indexed):
    """Rows of whole documents (packing.py): EOS-separated in npy/bin files, one per ArrayRecord record,
    or text tokenized on the fly (text.py). The plan is built here, once: every document's length is read
    first (all of a flat file's tokens; every text document tokenized)."""

    packed = True

    def __init__(
        self,
        path: str,
        fmt: str,
        vocab: int,
        seq_len: int,
        batch: int,
        *,
        eos: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        tokenizer: str | None = None,
        text_field: str = "text",
        chat: bool = False,
    ):
        t0 = time.perf_counter()
        self.seq_len, self.batch = seq_len, batch
        if fmt in TEXT_FORMATS:
            if tokenizer is None:
                raise ValueError(f"format {fmt}: needs a tokenizer")
            encoder = tokenizer_lib.Tokenizer(tokenizer, eos)
            encoder.check_fits(vocab)
            docs = chat_lib.ChatDocuments(path, encoder) if chat else text.Tokenized(path, fmt, encoder, text_field)
            lengths, read = docs.lengths(), docs.read
        elif fmt == "arrayrecord":
            docs = records.Documents(path, records.token_dtype(vocab))
            lengths, read = docs.lengths(), docs.read
        else:
            _, arrays = _open_token_files(path, fmt, records.token_dtype(vocab))
            stream = TokenStream(arrays)
            starts, lengths = packing.separated_documents(arrays, stream.offsets, eos)
            read = lambda d, n: stream.read(int(starts[d]), n)  # noqa: E731
        if not lengths.sum():
            raise ValueError(f"{path}: no tokens")
        self.source = packing.PlannedRows(read, lengths, seq_len + 1)
        fill = self.source.lengths.sum() / (len(self.source) * (seq_len + 1))
        log.info(
            "packed %d documents into %d sequences (%.0f%% tokens, the rest padding) in %.1fs",
            len(lengths),
            len(self.source),
            100 * fill,
            time.perf_counter() - t0,
        )
        self._index(self.source, shuffle, seed)


class SyntheticDocuments:
    """Packed synthetic rows: documents of 2 .. (seq_len + 1) / 2 + 1 tokens, each an arithmetic
    sequence like SyntheticTokens', placed one after another until the next does not fit; all from a
    hash of (seed, step, row, document)."""

    packed, reads = True, False

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int):
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed

    def _row(self, step: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        capacity, docs, at = self.seq_len + 1, [], 0
        while True:
            h = int(_mix(self.seed, step, row, len(docs)))
            length = 2 + h % (capacity // 2)
            if at + length > capacity:
                return packing.assemble(docs, capacity)
            start, stride = (h >> 20) % self.vocab, 1 + (h >> 40) % 7
            docs.append((start + stride * np.arange(length)) % self.vocab)
            at += length

    def rows(self, step: int, rows: range) -> packing.Packed:
        return packing.Packed(*map(np.stack, zip(*(self._row(step, r) for r in rows))))


def make_source(training, vocab: int):
    d, t = training.data, training
    if d.source == "synthetic":
        return (SyntheticDocuments if d.packing else SyntheticTokens)(vocab, t.sequence_length, t.global_batch, t.seed)
    if d.packing:
        return PackedFiles(
            d.path,
            d.format,
            vocab,
            t.sequence_length,
            t.global_batch,
            eos=d.eos_id,
            shuffle=d.shuffle,
            seed=t.seed,
            tokenizer=d.tokenizer,
            text_field=d.text_field,
            chat=t.objective == "sft",
        )
    return FileTokens(d.path, d.format, vocab, t.sequence_length, t.global_batch, shuffle=d.shuffle, seed=t.seed)


class Batch(NamedTuple):
    """One step's batch: global [globalBatch, sequenceLength] arrays, batch sharded over data x fsdp x
    expert and the sequence over context, in the context load-balance order (all five alike)."""

    inputs: jax.Array  # int32 tokens
    targets: jax.Array  # int32: the token after each input
    positions: jax.Array  # int32: each input's position in its sequence (packed: in its document)
    segments: jax.Array | None = None  # packed only, int32: the input's document in its row, 1..; 0 on padding
    mask: jax.Array | None = None  # packed only, float32: 1 where the target is the next token of the same document


def abstract_batch(training, sharding: jax.sharding.NamedSharding) -> Batch:
    """The Batch of `training` as ShapeDtypeStructs (to lower the step without data)."""
    shape = (training.global_batch, training.sequence_length)
    of = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    packed = training.data.packing
    return Batch(
        of(np.int32), of(np.int32), of(np.int32), of(np.int32) if packed else None, of(np.float32) if packed else None
    )


class Batches:
    """The Batch of a step. Each process builds only the rows its devices hold; the rows of file
    sources are read ahead by `workers` threads, `prefetch` steps ahead (readahead.ReadAhead)."""

    def __init__(
        self, source, sharding: jax.sharding.NamedSharding, context: int, *, workers: int = 0, prefetch: int = 1
    ):
        self.source, self.sharding = source, sharding
        self.shape = (source.batch, source.seq_len)
        self.order = attention.load_balance_order(source.seq_len, context).astype(np.int32)
        # This process's rows: one block per distinct batch slice of its devices.
        indices = sharding.addressable_devices_indices_map(self.shape).values()
        self.blocks = sorted({index[0].indices(self.shape[0])[:2] for index in indices})
        self.reader = None
        if workers and source.reads:
            rows = [r for a, b in self.blocks for r in range(a, b)]
            self.reader = readahead.ReadAhead(
                lambda step, r: source.rows(step, range(r, r + 1)), rows, workers, prefetch
            )

    def _rows(self, step: int) -> dict:
        if self.reader is None:
            return {(a, b): self.source.rows(step, range(a, b)) for a, b in self.blocks}
        rows, out, at = self.reader(step), {}, 0
        for a, b in self.blocks:
            block, at = rows[at : at + b - a], at + b - a
            out[(a, b)] = (
                type(block[0])(*(np.concatenate(x) for x in zip(*block)))
                if self.source.packed
                else np.concatenate(block)
            )
        return out

    def _parts(self, seq) -> tuple[np.ndarray, ...]:
        """A block's host arrays, in Batch order, columns in the load-balance order."""
        if not self.source.packed:  # the positions in load-balance order are the order itself
            positions = np.broadcast_to(self.order, (len(seq), self.shape[1]))
            return seq[:, :-1][:, self.order], seq[:, 1:][:, self.order], positions
        positions, mask = packing.positions_and_mask(seq.segments)
        if isinstance(seq, packing.Weighted):  # sft: only the assistant's tokens are targets
            mask = mask * seq.weights[:, 1:]
        parts = (seq.tokens[:, :-1], seq.tokens[:, 1:], positions, seq.segments[:, :-1], mask)
        return tuple(p[:, self.order] for p in parts)

    def __call__(self, step: int) -> Batch:
        parts = {block: self._parts(seq) for block, seq in self._rows(step).items()}

        def array(i):
            def cb(index):
                return np.ascontiguousarray(parts[index[0].indices(self.shape[0])[:2]][i][:, index[1]])

            return jax.make_array_from_callback(self.shape, self.sharding, cb)

        return Batch(*(array(i) for i in range(5 if self.source.packed else 3)))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

"""Packing whole documents into fixed-length rows, from a plan built once, so that row i is a pure
function of i (and a batch, as before, a pure function of its step).

A document is cut to `capacity` (sequenceLength + 1) tokens and placed whole in one row; what is
left of a row is padding (token 0, segment 0). Within a row the documents are numbered 1.. in the
order they were placed (`segments`).

The plan is first fit in document order over the OPEN_ROWS most recently opened rows: a document
goes into the oldest open row with room for it, else opens a new row (closing the oldest when
OPEN_ROWS are open). Bounding the open rows bounds the cost at O(documents x OPEN_ROWS) steps of
Python (about a second per million documents when rows fill quickly) and keeps the documents of a
row close together in the data. The plan is a function of the documents' lengths only, so every
process builds the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

OPEN_ROWS = 16
# Tokens scanned for separators at a time (bounds the memory of the start-up scan).
SCAN_TOKENS = 1 << 24


class Packed(NamedTuple):
    """Rows of a packed source."""

    tokens: np.ndarray  # [n, capacity] int32, 0 on padding
    segments: np.ndarray  # [n, capacity] int32, the row's documents numbered 1.., 0 on padding


class Weighted(NamedTuple):
    """Rows of a packed source whose documents weigh their tokens (sft: 1 on the assistant's, chat.py)."""

    tokens: np.ndarray  # [n, capacity] int32, 0 on padding
    segments: np.ndarray  # [n, capacity] int32, the row's documents numbered 1.., 0 on padding
    weights: np.ndarray  # [n, capacity] float32: 1 where the token counts as a target, 0 elsewhere and on padding


def stacked(rows: list) -> Packed | Weighted:
    """Rows (each a (tokens, segments[, weights]) tuple) stacked into one Packed or Weighted."""
    parts = tuple(np.stack(x) for x in zip(*rows))
    return Weighted(*parts) if len(parts) == 3 else Packed(*parts)


def separated_documents(arrays: list, offsets: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) in the stream of each document of `arrays` read as one stream (`offsets`: each
    array's start in it): a document ends with its `eos` token; tokens after the last one form a last
    document. Reads every token once."""
    ends = []
    for base, a in zip(offsets, arrays):
        for c in range(0, len(a), SCAN_TOKENS):
            chunk = np.asarray(a[c : c + SCAN_TOKENS])
            ends.append(np.flatnonzero(chunk == eos).astype(np.int64) + int(base) + c + 1)
    total = int(offsets[-1])
    ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    if not len(ends) or ends[-1] < total:
        ends = np.append(ends, total)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return starts, ends - starts


def first_fit(lengths: np.ndarray, capacity: int, open_rows: int = OPEN_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """The plan: (documents grouped by row, each row's start in that list). Row i holds documents
    `order[offsets[i]:offsets[i + 1]]`, in document order; `lengths` are already cut to `capacity`."""
    row_of = np.empty(len(lengths), np.int64)
    free: list[int] = []  # room left in the open rows, oldest first
    ids: list[int] = []
    rows = 0
    for d, length in enumerate(lengths.tolist()):
        for j, room in enumerate(free):
            if room >= length:
                free[j] -= length
                row_of[d] = ids[j]
                if free[j] == 0:
                    del free[j], ids[j]
                break
        else:
            if len(free) == open_rows:
                del free[0], ids[0]
            row_of[d] = rows
            if length < capacity:
                free.append(capacity - length)
                ids.append(rows)
            rows += 1
    order = np.argsort(row_of, kind="stable")
    return order, np.searchsorted(row_of[order], np.arange(rows + 1))


def assemble(documents: list, capacity: int) -> tuple[np.ndarray, ...]:
    """One row (tokens, segments) of `documents` placed one after another, the rest padding; documents
    given as (tokens, weights) pairs make it (tokens, segments, weights)."""
    weighted = bool(documents) and isinstance(documents[0], tuple)
    tokens, segments = np.zeros(capacity, np.int32), np.zeros(capacity, np.int32)
    weights = np.zeros(capacity, np.float32)
    at = 0
    for i, doc in enumerate(documents, start=1):
        ids, w = doc if weighted else (doc, None)
        tokens[at : at + len(ids)], segments[at : at + len(ids)] = ids, i
        if w is not None:
            weights[at : at + len(ids)] = w
        at += len(ids)
    return (tokens, segments, weights) if weighted else (tokens, segments)


class PlannedRows:
    """Random-access Grain source of packed rows: row i reads the documents the plan put in it
    (`read(document, length)`: its first `length` tokens)."""

    def __init__(self, read: Callable[[int, int], np.ndarray], lengths: np.ndarray, capacity: int):
        self.read, self.capacity = read, capacity
        self.lengths = np.minimum(lengths, capacity)
        self.order, self.offsets = first_fit(self.lengths, capacity)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        docs = self.order[self.offsets[i] : self.offsets[i + 1]]
        return assemble([self.read(int(d), int(self.lengths[d])) for d in docs], self.capacity)


def positions_and_mask(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of `segments` [n, T + 1]: each input token's position in its document ([n, T] int32,
    0 on padding) and whether its target is the next token of the same document ([n, T] float32:
    0 on padding and on a document's last token)."""
    seg = segments[:, :-1]
    idx = np.arange(seg.shape[1])
    starts = np.ones_like(seg, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    positions = np.where(seg != 0, idx - first, 0).astype(np.int32)
    mask = ((seg != 0) & (segments[:, 1:] == seg)).astype(np.float32)
    return positions, mask

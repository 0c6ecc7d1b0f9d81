"""Read-ahead (readahead.py): worker threads read a process's rows of the coming steps concurrently,
and the batches are exactly the unprefetched pure function of the step, from any start step."""

from __future__ import annotations

import threading

import numpy as np
from conftest import trainer_config

from tpu_workload.data import batches as data
from tpu_workload.data import readahead
from tpu_workload.model import sharding


def test_read_ahead_returns_the_pure_function_of_the_step_from_any_start():
    src = data.SyntheticDocuments(vocab=256, seq_len=16, batch=8, seed=5)  # packed rows: tuples
    rows = [1, 2, 6]
    reader = readahead.ReadAhead(lambda step, r: src.rows(step, range(r, r + 1)), rows, workers=3, prefetch=2)
    try:
        for step in (0, 1, 2, 9, 10, 3):  # a jump forward is a resume; back, a fresh start
            got = reader(step)
            want = src.rows(step, range(0, 8))
            for row, item in zip(rows, got, strict=True):
                np.testing.assert_array_equal(item.tokens[0], want.tokens[row])
                np.testing.assert_array_equal(item.segments[0], want.segments[row])
    finally:
        reader.close()


class GatedTokens(data.SyntheticTokens):
    """Rows that record (step, row) when read. Read one at a time (by the workers): rows 0 and 1 of
    step 0 each wait for the other (a serial reader would never pass), and step 2's rows wait until
    released."""

    reads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.read, self.lock = set(), threading.Lock()
        self.pair = threading.Barrier(2, timeout=60)
        self.release = threading.Event()
        self.ahead = threading.Event()

    def rows(self, step, rows):
        if step == 0 and rows.start < 2 and len(rows) == 1:
            self.pair.wait()  # raises BrokenBarrierError if two rows are never read at once
        if step == 2 and len(rows) == 1:
            self.ahead.set()
            self.release.wait(60)
        with self.lock:
            self.read.add((step, rows.start))
        return super().rows(step, rows)


def test_workers_read_rows_concurrently_and_ahead_of_the_step():
    cfg = trainer_config("tiny", mesh=dict(data=1, fsdp=4, context=2, expert=1, tensor=1))
    mesh = sharding.make_mesh(cfg.mesh.shape)
    batch_sharding = sharding.Sharder(mesh).named(("batch", "length"), (8, 16))
    src = GatedTokens(256, 16, 8, 0)
    batches = data.Batches(src, batch_sharding, context=2, workers=4, prefetch=2)
    try:
        first = batches(0)  # rows 0 and 1 of step 0 meet at the barrier: read at the same time
        # Step 0 was served; the workers go on to steps 1 and 2 without being asked.
        assert src.ahead.wait(60), "step 2 was never read ahead"
        with src.lock:
            assert {(1, r) for r in range(8)} <= src.read
        src.release.set()
        unprefetched = data.Batches(src, batch_sharding, context=2)
        for step in (0, 1, 2, 3):
            got = first if step == 0 else batches(step)
            want = unprefetched(step)
            for a, b in zip(got, want, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        src.release.set()
        batches.close()

"""Reading a process's rows ahead of the training loop, in worker threads, through Grain.

The rows a process needs are its devices' rows of each step (`rows`); element k of the read-ahead is
row rows[k % n] of step k // n. Grain's prefetching iterator reads `prefetch` steps of elements
ahead in `workers` threads while the loop trains, and returns them in order. What an element holds
is the source's pure function of (step, row), so the iterator carries no state worth saving: asked
for a step other than the next one (a resume, a test), it seeks to that step's first element.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grain

# Steps the element index covers: the read-ahead is a finite MapDataset, made long enough to never end.
HORIZON_STEPS = 1 << 40


class ReadAhead:
    def __init__(self, read: Callable[[int, int], object], rows: Sequence[int], workers: int, prefetch: int):
        """`read(step, row)`: one row; `rows`: the global rows this process reads, in order."""
        n = len(rows)
        dataset = grain.MapDataset.range(HORIZON_STEPS * n).map(lambda k: read(k // n, rows[k % n]))
        options = grain.ReadOptions(num_threads=workers, prefetch_buffer_size=prefetch * n)
        self._rows = n
        self._iter = iter(dataset.to_iter_dataset(options))
        self._next_step: int | None = None

    def __call__(self, step: int) -> list:
        """Step `step`'s rows, in the order of `rows`."""
        if step != self._next_step:
            self._iter.set_state({"next_index": step * self._rows})
        out = [next(self._iter) for _ in range(self._rows)]
        self._next_step = step + 1
        return out

    def close(self) -> None:
        self._iter.close()

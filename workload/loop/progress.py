"""The trainer's own clock: what the operator's goodput and hang detection read (`lifecycle.Progress`).

The loop tells it when each step completes, how long each blocking checkpoint took and how long it
waited for each batch; the first step of a run (compilation) counts as start-up, and blocking
checkpoint and data-wait time is taken out of the step it fell in. Read from the HTTP thread (/status), written by the loop: one lock.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from tpu_operator.api.lifecycle import Progress

T = TypeVar("T")
MEDIAN_WINDOW = 100


class Clock:
    def __init__(self, started_at: float | None = None):
        self._lock = threading.Lock()
        self._p = Progress(started_at=time.time() if started_at is None else started_at)
        self._recent: collections.deque[float] = collections.deque(maxlen=MEDIAN_WINDOW)
        self._blocked_in_step = 0.0

    def _set(self, **values) -> None:
        with self._lock:
            self._p = self._p.model_copy(update=values)

    def start(self, step: int) -> None:
        """Set up: training starts from `step` (0, or the restored checkpoint's)."""
        self._set(start_step=step, step=step)

    def step_done(self, step: int, step_time_s: float, last_checkpoint_step: int | None) -> None:
        now, p = time.time(), self._p
        update = dict(step=step, last_step_at=now, last_checkpoint_step=last_checkpoint_step)
        if p.first_step_at is None:
            update["first_step_at"] = now
        else:
            spent = max(0.0, step_time_s - self._blocked_in_step)
            self._recent.append(spent)
            update.update(
                step_seconds=p.step_seconds + spent,
                steps_timed=p.steps_timed + 1,
                median_step_seconds=statistics.median(self._recent),
            )
        self._blocked_in_step = 0.0
        self._set(**update)

    def timed(self, fn: Callable[..., T], bucket: str = "checkpoint") -> Callable[..., T]:
        """`fn` with its (blocking) time counted as `bucket` time (checkpoint, eval), not step time."""

        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self._blocked_in_step += spent
                field = f"{bucket}_seconds"
                self._set(**{field: getattr(self._p, field) + spent})

        return run

    def data_waited(self, seconds: float) -> None:
        """The loop blocked `seconds` for a batch. Before the first step is done that is start-up (the
        first batches are read while the step compiles), so only later waits count as data time."""
        if self._p.first_step_at is None:
            return
        self._blocked_in_step += seconds
        self._set(data_wait_seconds=self._p.data_wait_seconds + seconds)

    def finish_checkpoints(self, ckpt) -> int | None:
        """Wait for the checkpoints in flight (blocking: checkpoint time); the latest complete step."""
        last = self.timed(ckpt.finish)()
        if last is not None:
            self._set(last_checkpoint_step=last, step=max(last, self._p.step or 0))
        return last

    def snapshot(self) -> Progress:
        with self._lock:
            return self._p

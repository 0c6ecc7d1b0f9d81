"""The work queue: which jobs to reconcile, and the one place transient failures are retried.

Modelled on controller-runtime's rate-limited workqueue. A key is in the queue at most once, and
processed by one worker at a time: a key added while it is being processed is processed once more
afterwards, so nothing that happened meanwhile is missed and nothing runs twice at once. A key has at
most one pending timer (`add_after`): a second call keeps the earlier due time and merges the reasons,
as client-go's delaying queue does. A failed key comes back after an exponential backoff (`retry`,
capped: any number of failures in a row is fine), which success resets (`forget`). Every key carries
the reasons it was added for (job event, JobSet event, resync, metrics, retry), merged while it waits:
the reconcile reads them, and the operator's metrics count by them.

What is retried is the manager's call (manager.py): a transient failure backs off here; a permanent
one (the API refused the request) is not retried until the job changes or a long resync comes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ..api.backoff import exponential

BASE_DELAY_S = 0.5
MAX_DELAY_S = 300.0


K = TypeVar("K", bound=Hashable)  # a key of the queue: the manager's is (namespace, job name)


class WorkQueue(Generic[K]):
    def __init__(
        self,
        base_delay_s: float = BASE_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base_delay_s, self.max_delay_s, self.clock = base_delay_s, max_delay_s, clock
        self._ready: asyncio.Queue[K] = asyncio.Queue()
        self._reasons: dict[K, set[str]] = {}  # queued keys and why
        self._active: dict[K, set[str]] = {}  # keys being processed, and why they come back after
        self._later: list[tuple[float, int, K]] = []  # (due, tie-breaker, key); stale ones skipped
        self._due: dict[K, tuple[float, set[str]]] = {}  # the one pending timer of a key, and why
        self._order = itertools.count()
        self._failures: dict[K, int] = {}
        self._wake = asyncio.Event()

    def add(self, key: K, reason: str) -> None:
        if key in self._active:
            self._active[key].add(reason)
        elif key in self._reasons:
            self._reasons[key].add(reason)
        else:
            self._reasons[key] = {reason}
            self._ready.put_nowait(key)

    def add_after(self, key: K, delay_s: float, reason: str) -> None:
        """Add `key` in `delay_s`, or when its pending timer is due if that is earlier (one timer per key)."""
        due = self.clock() + delay_s
        pending = self._due.get(key)
        if pending is not None:
            pending[1].add(reason)
            if pending[0] <= due:
                return
        self._due[key] = (due, pending[1] if pending else {reason})
        heapq.heappush(self._later, (due, next(self._order), key))  # the later entry, if any, goes stale
        self._wake.set()

    def pending(self, key: K) -> float | None:
        """When the key's timer is due (None: no timer)."""
        entry = self._due.get(key)
        return entry[0] if entry else None

    def retry(self, key: K) -> float:
        """Add `key` back after its backoff (doubling with each failure in a row); the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = exponential(self.base_delay_s, self.max_delay_s, failures)
        self.add_after(key, delay, "retry")
        return delay

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)

    async def get(self) -> tuple[K, set[str]]:
        key = await self._ready.get()
        reasons = self._reasons.pop(key)
        self._active[key] = set()
        return key, reasons

    def done(self, key: K) -> None:
        again = self._active.pop(key)
        if again:
            for reason in again:
                self.add(key, reason)

    async def run_timers(self) -> None:
        """Move delayed keys into the queue when they are due (run as a task for the queue's life)."""
        while True:
            now = self.clock()
            while self._later and self._later[0][0] <= now:
                due, _, key = heapq.heappop(self._later)
                pending = self._due.get(key)
                if pending is not None and pending[0] == due:
                    del self._due[key]
                    for reason in pending[1]:
                        self.add(key, reason)
            timeout = self._later[0][0] - now if self._later else None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def __len__(self) -> int:
        return self._ready.qsize()

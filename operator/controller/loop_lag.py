"""How late the event loop runs: the operator's one loop serves every job, so the time one piece of
work holds it is time every other job's watch events, reconciles and reads wait.

`watch` asks for a wake-up every `interval_s` and records how much later than asked it came: with an idle
loop, about nothing; behind a reconcile that computes for 300 ms, about 300 ms. The figures go to the
operator's `/metrics` as the histogram `tpu_operator_event_loop_lag_seconds` (stats.py), so a job whose
validation or rendering is slow shows as lag for all, before liveness fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.1


async def watch(observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
    """Observe the loop's lag every `interval_s`, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - asked - interval_s))

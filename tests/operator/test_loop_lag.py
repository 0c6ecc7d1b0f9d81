"""The event loop's lag, as the operator exports it (loop_lag.py, stats.py): a loop held by one piece of
work shows in the histogram every job's reads and reconciles wait behind."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest

from tpu_operator.controller import loop_lag
from tpu_operator.controller.stats import Stats

NAME = "tpu_operator_event_loop_lag_seconds"


def series(stats: Stats) -> dict[str, float]:
    """The histogram's series as exported: `le` bucket or `count`/`sum` -> value."""
    found = {}
    for line in generate_latest(stats.registry).decode().splitlines():
        if line.startswith(f"{NAME}_bucket"):
            found[line.split('le="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith((f"{NAME}_count", f"{NAME}_sum")):
            found[line.split(" ")[0].removeprefix(f"{NAME}_")] = float(line.rsplit(" ", 1)[1])
    return found


def test_the_lag_histogram_is_exported_and_moves_when_the_loop_is_blocked():
    stats = Stats()
    assert series(stats)["count"] == 0 and "0.25" in series(stats)

    async def scenario() -> tuple[dict[str, float], dict[str, float]]:
        watcher = asyncio.create_task(loop_lag.watch(stats.loop_lag.observe, interval_s=0.01))
        while series(stats)["count"] < 3:  # it runs: a few wake-ups observed
            await asyncio.sleep(0.01)
        before = series(stats)
        time.sleep(0.3)  # one piece of work holds the loop: the timer due within 0.01 s waits behind it
        count = before["count"]
        while series(stats)["count"] == count:
            await asyncio.sleep(0.01)
        watcher.cancel()
        return before, series(stats)

    before, after = asyncio.run(scenario())
    # A lower bound, not a timing: the wake-up asked for before the 0.3 s block came at least 0.29 s late.
    late_before = before["count"] - before["0.25"]
    late_after = after["count"] - after["0.25"]
    assert late_after >= late_before + 1 and after["sum"] - before["sum"] >= 0.29

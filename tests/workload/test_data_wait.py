"""Data-wait time: the trainer's clock takes the loop's wait for batches out of step time, the goodput
ledger counts it as `data` badput, and a real run with a slow source reports it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import trainer_config

from tpu_operator.api import goodput as g
from tpu_operator.api.lifecycle import Progress
from tpu_workload.data import batches as data
from tpu_workload.loop import train
from tpu_workload.loop.hooks import Hook
from tpu_workload.loop.progress import Clock


def test_the_clock_takes_data_waits_out_of_the_step_they_fell_in():
    clock = Clock(started_at=0.0)
    clock.start(0)
    clock.data_waited(4.0)  # the first batches, read while the first step compiles: start-up
    clock.step_done(1, 30.0, None)
    clock.data_waited(0.25)
    clock.data_waited(0.25)
    clock.step_done(2, 2.0, None)
    clock.step_done(3, 1.0, None)
    p = clock.snapshot()
    assert p.data_wait_seconds == 0.5
    assert (p.step_seconds, p.steps_timed) == (1.5 + 1.0, 2)


def test_the_ledger_counts_data_wait_as_badput_and_not_as_productive_time():
    ledger = g.start_attempt(g.Ledger(), 10.0, created=0.0)
    # First step done at 20 s, then 10 steps over 10 s of which the loop waited 2 s for data.
    p = Progress(
        started_at=10.0,
        start_step=0,
        first_step_at=20.0,
        last_step_at=30.0,
        step=11,
        step_seconds=8.0,
        steps_timed=10,
        data_wait_seconds=2.0,
    )
    ledger = g.reported(ledger, p, 30.0, 0.0)
    running = g.report(ledger, 0.0, 30.0)
    ledger = g.end_attempt(ledger, 30.0, "succeeded")
    for fraction, productive, badput in (running, g.report(ledger, 0.0)):
        assert (productive, badput.data, badput.startup, badput.queued) == (8.0, 2.0, 10.0, 10.0)
        assert productive + badput.named() + badput.other == pytest.approx(30.0)
        assert fraction == pytest.approx(8.0 / 30.0)


class SlowTokens(data.SyntheticTokens):
    """Synthetic rows that take `delay` seconds to read, and say who read them."""

    reads = True

    def __init__(self, *args, delay: float):
        super().__init__(*args)
        self.delay, self.readers = delay, set()

    def rows(self, step, rows):
        self.readers.add(threading.current_thread().name)
        time.sleep(self.delay)
        return super().rows(step, rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_on_a_slow_source_reports_its_data_wait(workers):
    cfg = trainer_config("tiny", steps=4, batch=8, seq=32, mesh=dict(data=1, fsdp=8, context=1, expert=1, tensor=1))
    run = train.setup(cfg, peak_flops_per_device=5e10)
    t = cfg.training
    source = SlowTokens(cfg.model.vocab, t.sequence_length, t.global_batch, t.seed, delay=0.05)
    run.batches = data.Batches(source, run.trainer.batch_sharding, 1, workers=workers, prefetch=1)
    records = []
    try:
        train.train(run, [Hook(1, on_record=records.append)])
    finally:
        run.batches.close()
    progress = run.clock.snapshot()
    assert [r.step for r in records] == [1, 2, 3, 4]
    assert progress.data_wait_seconds > 0
    if workers == 0:  # read on the loop's thread: the waits of steps 3 and 4 at least sleep 8 rows each
        assert progress.data_wait_seconds >= 2 * 8 * source.delay
    # Every wait after the first step is in some step's record, and in the clock.
    assert sum(r.data_wait_s for r in records[1:]) == pytest.approx(progress.data_wait_seconds)
    assert (source.readers == {threading.current_thread().name}) == (workers == 0)
    np.testing.assert_array_equal(np.isfinite([r.loss for r in records]), True)

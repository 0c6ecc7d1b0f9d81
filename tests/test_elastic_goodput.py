"""Goodput of an elastic run, without processes: the gap before an attempt on fewer slices is `shrinking`,
the gap of a grow-back `growing` (not `restarting`), in the operator's ledger (api/goodput.py),
which a local run's status comes from too; `tpujob report` shades the steps trained on fewer slices (slices.json)."""

from __future__ import annotations

import json

import yaml

from tpu_operator.api import goodput
from tpu_operator.local.report import _fewer_slices, write_report


def test_the_ledger_puts_a_shrink_and_a_grow_back_in_their_own_buckets():
    """The ledger the operator folds a job's attempts into (controller/accounting.py), a local run's included."""
    ledger = goodput.start_attempt(goodput.Ledger(), 1.0, 0.0)
    ledger = goodput.end_attempt(ledger, 10.0, "failure")  # slice 1 lost
    ledger = goodput.resized(ledger, "shrink")
    ledger = goodput.start_attempt(ledger, 14.0, 0.0)  # on the slice left: 4 s shrinking
    ledger = goodput.end_attempt(ledger, 30.0, "preemption", None, "grow")  # stopped to grow back
    ledger = goodput.start_attempt(ledger, 33.0, 0.0)  # on every slice again: 3 s growing
    ledger = goodput.end_attempt(ledger, 40.0, "failure")  # a plain restart: its gap is restarting
    ledger = goodput.start_attempt(ledger, 42.0, 0.0)
    _, _, badput = goodput.report(ledger, 0.0)
    assert (badput.queued, badput.shrinking, badput.growing, badput.restarting) == (1.0, 4.0, 3.0, 2.0)
    assert set(goodput.BUCKETS) == set(goodput.Badput.model_fields)


def test_report_shades_the_steps_run_on_fewer_slices(tmp_path):
    records = [
        {"step": s, "loss": 1.0 / s, "step_time_s": 0.1, "mfu": 0.1, "progress": {"started_at": t}}
        for s, t in [
            (1, 1.5),
            (2, 1.5),
            (3, 1.5),
            (4, 1.5),
            (5, 11.0),
            (6, 11.0),
            (7, 11.0),
            (8, 11.0),
            (8, 21.0),
            (9, 21.0),
        ]
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "slices.json").write_text(json.dumps({"desired": 2, "history": [[1.0, 2], [10.0, 1], [20.0, 2]]}))
    (tmp_path / "status.yaml").write_text(yaml.safe_dump({"status": {"goodput": 0.5, "badput": {"shrinking": 1.0}}}))
    assert _fewer_slices(tmp_path, records) == [(5, 8, 1, 2)]
    assert write_report(tmp_path).stat().st_size > 1000

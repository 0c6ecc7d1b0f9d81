"""The goodput ledger of a local run (api/goodput.py), folded from the supervisor's events the way the
operator folds it from a JobSet's: an attempt starts when its processes start, every JSON step line
of process 0 carries the trainer's clock (`progress`), and an attempt ends when a process fails
(`pod_failed`, at the moment it was seen), when all succeed, or when the run is given up. The job
was "created" when the run started."""

from __future__ import annotations

import time
from typing import Any

from ..api import goodput as ledger_lib
from ..api.lifecycle import Progress


class LocalLedger:
    def __init__(self, created: float | None = None):
        self.created = time.time() if created is None else created
        self.ledger = ledger_lib.Ledger()

    def __call__(self, kind: str, **d: Any) -> None:
        if kind == "started":
            self.ledger = ledger_lib.start_attempt(self.ledger, d["at"], self.created)
        elif kind == "metrics" and d["record"].get("progress"):
            progress = Progress.lenient(d["record"]["progress"])
            if progress is not None:
                self.ledger = ledger_lib.reported(self.ledger, progress, time.time(), self.created)
        elif kind == "pod_failed":
            how = "user" if d["failure"].cause == "user" else d["failure"].cause
            self.ledger = ledger_lib.end_attempt(self.ledger, d["at"], how, d["failure"].progress)
        elif kind == "resized" and d["resize"].reason == "GrewBack":  # stopped as a preemption, to grow back
            self.ledger = ledger_lib.end_attempt(self.ledger, d["at"], "preemption", d["progress"], "grow")
        elif kind == "resized" and d["resize"].reason == "SliceLost":  # after the failure that ended the attempt
            self.ledger = ledger_lib.resized(self.ledger, "shrink")
        elif kind == "succeeded":
            final = next((e.record.progress for e in d["exits"] if e.record and e.record.progress), None)
            self.ledger = ledger_lib.end_attempt(self.ledger, d["at"], "succeeded", final)
        elif kind in ("failed", "interrupted"):
            self.ledger = ledger_lib.end_attempt(self.ledger, d["at"], "failed")

    def report(self) -> tuple[float, float, ledger_lib.Badput]:
        return ledger_lib.report(self.ledger, self.created)

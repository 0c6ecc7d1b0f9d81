"""The job's goodput ledger (api/goodput.py) moved along by what a reconcile saw. Pure.

Attempt boundaries come from the phase the reconcile computed and its restart decision:
- an attempt starts when the job becomes Running with none open (the trainer's own start time
  replaces that observation once it reports);
- the trainer's reports (`Sample.progress`) update it; a report from an older process is ignored;
- it ends when a restart is decided (cause failure, preemption, hang or hardware), a grow-back stops the
  smaller JobSet (as a preemption), or the job Succeeds, Fails or is Suspended; `final` is the best last
  word of the attempt (the failed pods' termination records, or the final /status read on completion);
  the gap to the next attempt is `shrinking` or `growing` when that attempt runs on another slice count.
The figures in the status (`goodput`, `badput`) are recomputed only when the ledger changes, as of
that change, so a reconcile that learns nothing writes nothing.
"""

from __future__ import annotations

import datetime
from typing import overload

from ..api import goodput as ledger_lib
from ..api.lifecycle import Progress
from ..api.status import TPUTrainingJobStatus
from .status import Sample


@overload
def seconds(at: datetime.datetime) -> float: ...
@overload
def seconds(at: None) -> None: ...
@overload
def seconds(at: datetime.datetime | None) -> float | None: ...


def seconds(at: datetime.datetime | None) -> float | None:
    """Epoch seconds, the ledger's unit (api/goodput.py)."""
    return at.timestamp() if at is not None else None


def ending(old: TPUTrainingJobStatus, new: TPUTrainingJobStatus) -> ledger_lib.Ending | None:
    """How the attempt in progress ended in this reconcile, if it did."""
    if new.last_restart is not None and new.last_restart != old.last_restart:
        return new.last_restart.cause
    replaces = new.slices.replaces if new.slices else None
    if replaces is not None and replaces != (old.slices.replaces if old.slices else None):
        return "preemption"  # a grow-back stops the smaller JobSet as a preemption does (growback.py)
    if new.phase != old.phase:
        if new.phase == "Succeeded":
            return "succeeded"
        if new.phase == "Failed":
            return "failed"
        if new.phase == "Suspended":
            return "suspended"
    return None


def resize(old: TPUTrainingJobStatus, new: TPUTrainingJobStatus) -> ledger_lib.ResizeKind | None:
    """The next attempt runs on fewer slices (an elastic restart, restarts.decide), or on all of them again by a
    grow-back (a restart back onto every slice is restarting, not growing)."""
    before = old.slices.running if old.slices is not None else None
    after = new.slices.running if new.slices is not None else None
    if not before or not after or before == after:
        return None
    if after < before:
        return "shrink"
    return "grow" if new.last_restart == old.last_restart else None


def _ledger(status: TPUTrainingJobStatus, sample: Sample | None, t: float, t0: float) -> ledger_lib.Ledger:
    ledger = status.accounting or ledger_lib.Ledger()
    if status.phase == "Running":
        ledger = ledger_lib.start_attempt(ledger, t, t0)
    if sample is not None and sample.progress is not None:
        ledger = ledger_lib.reported(ledger, sample.progress, t, t0)
    return ledger


def observed(
    status: TPUTrainingJobStatus, sample: Sample | None, created: datetime.datetime | None, now: datetime.datetime
) -> TPUTrainingJobStatus:
    """The ledger with the trainer's latest report in (before the hang check reads it)."""
    t, t0 = seconds(now), seconds(created)
    if t0 is None:
        return status
    ledger = _ledger(status, sample, t, t0)
    return status if ledger == status.accounting else status.model_copy(update=dict(accounting=ledger))


def settled(
    old: TPUTrainingJobStatus,
    new: TPUTrainingJobStatus,
    sample: Sample | None,
    final: Progress | None,
    created: datetime.datetime | None,
    now: datetime.datetime,
) -> TPUTrainingJobStatus:
    """The ledger after this reconcile's transitions, and the figures when it changed."""
    t, t0 = seconds(now), seconds(created)
    if t0 is None:
        return new
    ledger = _ledger(new, sample, t, t0)
    how = ending(old, new)
    if how is not None:
        ledger = ledger_lib.end_attempt(ledger, t, how, final, resize(old, new))
    if ledger == old.accounting or (old.accounting is None and ledger == ledger_lib.Ledger()):
        return new
    fraction, _, badput = ledger_lib.report(ledger, t0)
    return new.model_copy(update=dict(accounting=ledger, goodput=round(fraction, 4), badput=ledger_lib.rounded(badput)))

"""Goodput: how much of a job's wall time trained. Pure; the operator and the local runner share it.

    goodput = seconds on steps that survive ÷ seconds since the job was created

A step survives when no restart recomputes it: the steps an attempt completed up to the step the
next attempt resumed from (or, for the last attempt, all of them). The first step of each attempt
compiles and is counted as start-up. Everything else is badput, in seconds:

  bucket      what it is                                      ml-goodput-measurement BadputType
  queued      job created → its pods first run, and the time  (none: that library's clock starts
              a suspended job waits to run again              with the program; it would be OTHER)
  startup     pods running → the attempt's first step done:   TPU_INITIALIZATION + TRAINING_PREP +
              runtime and jax.distributed start-up, restore   PROGRAM_STARTUP + DATA_LOADING_SYNC +
              of the checkpoint, compilation, the first step  UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
  checkpoint  blocking checkpoint time (the device-to-host    UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
              part of each save, the final wait, the SIGTERM
              save)
  eval        evaluation (training.eval), which blocks the    CUSTOM_BADPUT_EVENTS (its example
              loop                                            event type is EVAL_STEP)
  data        the training loop blocked waiting for a step's  DATA_LOADING_SYNC (reading ahead in
              batch, after the attempt's first step (the      the background is that library's
              reads the worker threads did not finish ahead   DATA_LOADING_ASYNC, which it leaves
              of time)                                        out of badput, as this does)
  lost        steps a restart recomputed, and the part of a   WASTED_PROGRESS_FROM_DISRUPTION
              step in flight when a pod failed
  restarting  an attempt's failure seen → the next attempt's  INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION
              pods running (backoff, deletion, scheduling)
  shrinking   instead of restarting when the next attempt     INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION
              runs on fewer slices (elastic: a slice lost →   (the library has no resize type)
              running on the slices left)
  growing     a grow-back's stop (SIGTERM after a checkpoint) (none: no resize type there; OTHER
              → the attempt on every slice running again     at most)
  hung        the last completed step → the restart of a      (none: it lands in OTHER there)
              hung attempt
  other       the rest: what no bucket above explains (the    OTHER
              trainer's logging between steps, exit)

How it is measured: the trainer reports its own clock (`lifecycle.Progress`: process start, first
and latest step, step, blocking-checkpoint, evaluation and data-wait seconds, the step it started from) in /status, in
every JSON step line and in its termination record; the reader (operator or local runner) adds
what only it sees: when pods ran, when an attempt ended and how. A `Ledger`, kept in the job's
status, folds each attempt in as it ends, so the figures survive restarts of the pods, of the
JobSet and of the operator.

The badput types are those of ml-goodput-measurement's `BadputType` (AI-Hypercomputer/
ml-goodput-measurement, ml_goodput_measurement/src/goodput_utils.py: TPU_INITIALIZATION, TRAINING_PREP,
PROGRAM_STARTUP, DATA_LOADING_SYNC, DATA_LOADING_ASYNC, UNPRODUCTIVE_CHECKPOINT_SAVE_TIME,
UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME, WASTED_PROGRESS_FROM_DISRUPTION,
INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION, CUSTOM_BADPUT_EVENTS, OTHER). It has no elastic or resize type,
so `shrinking` and `growing` are this project's own: the time a resize costs, kept apart from
`restarting` so the price of elasticity can be read. Steps trained on fewer slices are goodput (they
survive); `tpujob report` shows when they ran.
"""

from __future__ import annotations

from typing import Any, Literal

from .contract import Recorded, _desc
from .lifecycle import Progress

BUCKETS = (
    "queued",
    "startup",
    "checkpoint",
    "eval",
    "data",
    "lost",
    "restarting",
    "shrinking",
    "growing",
    "hung",
    "other",
)
# How an attempt ended. The first three are final; after the others the job runs again.
Ending = Literal["succeeded", "failed", "user", "failure", "preemption", "hang", "hardware", "diverged", "suspended"]
ResizeKind = Literal["shrink", "grow"]  # the next attempt runs on fewer slices, or on every slice again
FINAL = ("succeeded", "failed", "user")


class Badput(Recorded):
    """Seconds of the job's wall time that did not train, by cause (docs/failures.md: Goodput)."""

    queued: float = _desc("Created → pods first running, and suspended time.", default=0.0, ge=0)
    startup: float = _desc(
        "Pods running → first step done, per attempt (start-up, restore, compile).", default=0.0, ge=0
    )
    checkpoint: float = _desc("Blocking checkpoint saves.", default=0.0, ge=0)
    eval: float = _desc("Evaluation on held-out data (training.eval).", default=0.0, ge=0)
    data: float = _desc(
        "The training loop waiting for a step's batch (after each attempt's first step).", default=0.0, ge=0
    )
    lost: float = _desc("Steps recomputed after a restart, and steps in flight at a failure.", default=0.0, ge=0)
    restarting: float = _desc("A failure seen → the next attempt's pods running.", default=0.0, ge=0)
    shrinking: float = _desc(
        "A slice lost → the next attempt's pods running on the slices left (elastic).", default=0.0, ge=0
    )
    growing: float = _desc("A grow-back's stop → the attempt on every slice running (elastic).", default=0.0, ge=0)
    hung: float = _desc("The last completed step → the restart of a hung attempt.", default=0.0, ge=0)
    other: float = _desc("Wall time no other bucket explains.", default=0.0, ge=0)

    def add(self, **seconds: float) -> Badput:
        return self.model_copy(update={k: getattr(self, k) + max(0.0, v) for k, v in seconds.items()})

    def named(self) -> float:
        """Every bucket but `other`."""
        total: float = sum(getattr(self, b) for b in BUCKETS if b != "other")
        return total


class Attempt(Recorded):
    """The attempt in progress: when its pods ran, and the latest its trainer said."""

    running_since: float = _desc("Epoch seconds its pods were running (the trainer's own start once known).")
    progress: Progress | None = _desc("The trainer's latest report in this attempt.", default=None)


class Unsettled(Recorded):
    """An ended attempt whose surviving steps are known once the next attempt says where it resumed."""

    first_step: int = _desc("Its first step (counted as start-up).")
    step: int = _desc("Its last completed step.")
    seconds_per_step: float = _desc("Its mean step time.", ge=0)
    last_checkpoint_step: int = _desc("Its latest complete checkpoint (where a resume is expected).")

    def split(self, resumed_at: int) -> tuple[float, float]:
        """(productive, lost) seconds, the steps up to `resumed_at` surviving."""
        kept = min(max(resumed_at, self.first_step), self.step)
        return self.seconds_per_step * (kept - self.first_step), self.seconds_per_step * (self.step - kept)


class Ledger(Recorded):
    """The goodput bookkeeping of one job, kept in its status (epoch seconds)."""

    productive: float = _desc("Seconds of surviving steps of attempts already settled.", default=0.0, ge=0)
    badput: Badput = _desc("Badput of ended attempts and the gaps between them.", default_factory=Badput)
    attempt: Attempt | None = _desc("The attempt in progress.", default=None)
    unsettled: Unsettled | None = _desc(
        "The latest ended attempt, until the next one says where it resumed.", default=None
    )
    ended_at: float | None = _desc("When the latest attempt ended.", default=None)
    ended_by: Ending | None = _desc("How it ended.", default=None)
    resize: ResizeKind | None = _desc(
        "The next attempt runs on another slice count: its gap is shrinking or growing, not restarting.", default=None
    )
    as_of: float | None = _desc("When the ledger last changed: the figures are as of then.", default=None)


def start_attempt(ledger: Ledger, at: float, created: float) -> Ledger:
    """Pods of a new attempt are running (seen at `at`); the gap before it is queued or restarting."""
    if ledger.attempt is not None or ledger.ended_by in FINAL:
        return ledger
    badput = _add_gap(ledger, at - (created if ledger.ended_at is None else ledger.ended_at))
    return ledger.model_copy(update=dict(attempt=Attempt(running_since=at), badput=badput, as_of=at))


def _add_gap(ledger: Ledger, seconds: float) -> Badput:
    """The time between attempts: queued before the first and after a suspension, shrinking or growing
    before an attempt on another slice count, else restarting."""
    if ledger.ended_at is None or ledger.ended_by == "suspended":
        bucket = "queued"
    else:
        bucket = {"shrink": "shrinking", "grow": "growing"}.get(ledger.resize or "", "restarting")
    return ledger.badput.model_copy(update={bucket: max(0.0, getattr(ledger.badput, bucket) + seconds)})


def reported(ledger: Ledger, progress: Progress, at: float, created: float) -> Ledger:
    """The trainer's latest report. The first of an attempt moves the attempt's start to the trainer's
    own, and settles the attempt before it (the step it resumed from is where the last one's steps
    survive). A report from a process older than the attempt (a stale pod) is ignored."""
    a = ledger.attempt
    if a is None or progress == a.progress or progress.started_at < (ledger.ended_at or created):
        return ledger
    update: dict[str, Any] = {"as_of": at, "badput": ledger.badput, "productive": ledger.productive}
    if a.progress is None:  # the trainer's start is this attempt's start
        update["badput"] = _add_gap(ledger, progress.started_at - a.running_since)
        a = a.model_copy(update=dict(running_since=progress.started_at))
    if ledger.unsettled is not None and progress.start_step is not None:
        kept, lost = ledger.unsettled.split(progress.start_step)
        update.update(productive=ledger.productive + kept, unsettled=None, badput=update["badput"].add(lost=lost))
    return ledger.model_copy(update=dict(update, attempt=a.model_copy(update=dict(progress=progress))))


def resized(ledger: Ledger, resize: ResizeKind | None) -> Ledger:
    """The attempt that just ended is followed by one on another slice count (or not: None)."""
    return ledger if ledger.resize == resize else ledger.model_copy(update=dict(resize=resize))


def end_attempt(
    ledger: Ledger, at: float, how: Ending, final: Progress | None = None, resize: ResizeKind | None = None
) -> Ledger:
    """The attempt ended at `at`: fold its start-up, checkpoint and data time and steps into the ledger. Its
    steps are settled now when the job is over, else when the next attempt reports. `resize`: the next
    attempt runs on fewer slices (shrink) or on every slice again (grow)."""
    a = ledger.attempt
    if a is None:
        return ledger.model_copy(update=dict(ended_by=how if how in FINAL else ledger.ended_by, as_of=at))
    p = max((x for x in (final, a.progress) if x is not None), key=lambda x: x.step or -1, default=None)
    badput, productive, unsettled = ledger.badput, ledger.productive, ledger.unsettled
    if unsettled is not None:  # the attempt never said where it resumed: assume its checkpoint
        kept, lost = unsettled.split(unsettled.last_checkpoint_step)
        productive, badput, unsettled = productive + kept, badput.add(lost=lost), None
    if p is None or p.first_step_at is None or p.start_step is None or p.step is None:
        badput = badput.add(**{"hung" if how == "hang" else "startup": at - a.running_since})
    else:
        badput = badput.add(
            startup=p.first_step_at - a.running_since,
            checkpoint=p.checkpoint_seconds,
            eval=p.eval_seconds,
            data=p.data_wait_seconds,
        )
        per = p.step_seconds / p.steps_timed if p.steps_timed else 0.0
        unsettled = Unsettled(
            first_step=p.start_step + 1,
            step=p.step,
            seconds_per_step=per,
            last_checkpoint_step=max(p.last_checkpoint_step or 0, p.start_step),
        )
        tail = at - (p.last_step_at or at)
        if how == "hang":
            badput = badput.add(hung=tail)
        elif how in ("failure", "user"):
            badput = badput.add(lost=tail)  # the step in flight, and any the reader had not seen yet
        if how in FINAL:
            kept, lost = unsettled.split(p.step if how == "succeeded" else unsettled.last_checkpoint_step)
            productive, badput, unsettled = productive + kept, badput.add(lost=lost), None
    return Ledger(
        productive=productive,
        badput=badput,
        attempt=None,
        unsettled=unsettled,
        ended_at=at,
        ended_by=how,
        resize=resize,
        as_of=at,
    )


def report(ledger: Ledger, created: float, as_of: float | None = None) -> tuple[float, float, Badput]:
    """(goodput 0..1, productive seconds, badput seconds) as of `as_of` (default: the ledger's own
    last change, so that reading it again changes nothing)."""
    now = as_of if as_of is not None else (ledger.as_of if ledger.as_of is not None else created)
    productive, badput = ledger.productive, ledger.badput
    if ledger.unsettled is not None:
        kept, lost = ledger.unsettled.split(ledger.unsettled.last_checkpoint_step)
        productive, badput = productive + kept, badput.add(lost=lost)
    a = ledger.attempt
    if a is not None:
        p = a.progress
        if p is not None and p.first_step_at is not None:
            badput = badput.add(
                startup=p.first_step_at - a.running_since,
                checkpoint=p.checkpoint_seconds,
                eval=p.eval_seconds,
                data=p.data_wait_seconds,
            )
            productive += p.step_seconds
        else:
            badput = badput.add(startup=now - a.running_since)
    elif ledger.ended_by not in FINAL:
        gap = now - (created if ledger.ended_at is None else ledger.ended_at)
        badput = _add_gap(ledger.model_copy(update=dict(badput=badput)), gap)
    wall = max(now - created, 1e-9)
    badput = badput.model_copy(update=dict(other=max(0.0, wall - productive - badput.named())))
    return min(1.0, productive / wall), productive, badput


def rounded(badput: Badput, ndigits: int = 1) -> Badput:
    return Badput(**{b: round(getattr(badput, b), ndigits) for b in BUCKETS})

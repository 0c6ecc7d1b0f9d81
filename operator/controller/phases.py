"""JobSet status -> TPUTrainingJob phase, counters and conditions. Pure: no I/O, the time is passed in.

The phase rule, first match wins (`phase_of`):

1. Succeeded and Failed are sticky: a finished job never goes back (a JobSet deleted after it
   finished, e.g. by its TTL, does not make the job Pending again).
2. Succeeded: the JobSet has condition Completed=True, or terminalState Completed.
3. Failed: the restart policy gave up on the JobSet's failure (`restart` is "given-up": a user
   error, an exit code not restarted, the restart budget spent; or "diverged": a non-finite loss or
   gradient norm with onDivergence Fail or its budget spent; restarts.py, api/failures.py), or
   the JobSet failed and no restart decision was taken about it.
4. Suspended: the JobSet is suspended (condition Suspended=True, or spec.suspend is true) and the
   job has no queue or its user suspended it (the job's spec.suspend).
5. Queued: the job has a queue (spec.queueName) and its JobSet is suspended: Kueue holds it until
   it admits the job, and again after an eviction. The message is Kueue's (condition Admitted).
6. Restarting: the JobSet is one a restart replaces (`restart` is "replaced": it failed or hung, and
   the operator deletes it and creates it again after a backoff), or the job is already Restarting;
   it stays Restarting until a Job of the new JobSet is *ready* (sum of replicatedJobsStatus[].ready
   > 0), then it is Running. Active alone does not end Restarting: new Jobs count their pending
   pods as active at once.
7. Pending: no Job is ready and the last look at the pods found one that cannot be scheduled or
   whose container cannot start (diagnosis.py); the message says which and why.
8. Running: some Job is active or ready (sum of active + ready > 0).
9. Pending: otherwise (no JobSet status yet, pods not created).

`Invalid` is decided before any JobSet exists (reconcile.py), never here. The counts are JobSet's:
replicatedJobsStatus counts Jobs (one per slice), and a Job is active while any of its pods is
pending or running, ready once all of them are. JobSet's own `restarts` is not read: the rendered
JobSet never restarts itself (maxRestarts 0); the operator does.

Conditions follow Kubernetes: `lastTransitionTime` changes only when a condition's status does
(conditions.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any, Literal

from ..api.status import TERMINAL_PHASES as TERMINAL
from ..api.status import Condition, TPUTrainingJobStatus
from .conditions import set_condition


@dataclasses.dataclass(frozen=True)
class JobSetView:
    """What the phase rule reads of a JobSet."""

    true_conditions: dict[str, dict[str, Any]]  # type -> condition, only those with status True
    terminal_state: str | None
    active: int
    ready: int
    succeeded: int
    failed: int
    suspend: bool
    jobs: int = 0  # Jobs the JobSet makes: the sum of spec.replicatedJobs[].replicas

    @classmethod
    def of(cls, jobset: dict[str, Any]) -> JobSetView:
        status = jobset.get("status") or {}
        replicated = status.get("replicatedJobsStatus") or []

        def total(key: str) -> int:
            return sum(int(r.get(key) or 0) for r in replicated)

        return cls(
            true_conditions={c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"},
            terminal_state=status.get("terminalState"),
            active=total("active"),
            ready=total("ready"),
            succeeded=total("succeeded"),
            failed=total("failed"),
            suspend=bool((jobset.get("spec") or {}).get("suspend")),
            jobs=sum(int(r.get("replicas") or 0) for r in (jobset.get("spec") or {}).get("replicatedJobs") or []),
        )

    def condition_message(self, type_: str) -> str:
        return (self.true_conditions.get(type_) or {}).get("message") or ""


@dataclasses.dataclass(frozen=True)
class Intent:
    """What the job asks for, as the phase rule reads it."""

    suspend: bool = False  # the job's spec.suspend
    queued: bool = False  # the job names a Kueue queue: Kueue decides when its JobSet runs


Restart = Literal["replaced", "given-up", "diverged"] | None  # diverged: given up after a divergence


def phase_of(
    previous_phase: str | None,
    js: JobSetView,
    intent: Intent = Intent(),
    restart: Restart = None,
    trouble: bool = False,
) -> str:
    """The rule in the module docstring (`restart`: the restart policy's decision about this JobSet;
    `trouble`: the pods' diagnosis found a problem)."""
    suspended = "Suspended" in js.true_conditions or js.suspend
    if previous_phase in TERMINAL:
        return previous_phase
    if "Completed" in js.true_conditions or js.terminal_state == "Completed":
        return "Succeeded"
    failed = "Failed" in js.true_conditions or js.terminal_state == "Failed"
    if restart in ("given-up", "diverged") or (failed and restart is None):
        return "Failed"
    if suspended and (not intent.queued or intent.suspend):
        return "Suspended"
    if suspended:
        return "Queued"
    if restart == "replaced" or previous_phase == "Restarting":
        return "Running" if js.ready > 0 and restart is None else "Restarting"
    if trouble and js.ready == 0:
        return "Pending"
    if js.active + js.ready > 0:
        return "Running"
    return "Pending"


def _message(phase: str, js: JobSetView, status: TPUTrainingJobStatus, trouble: Condition | None) -> str:
    if phase == "Succeeded":
        return js.condition_message("Completed") or "the JobSet completed"
    if phase == "Failed":
        return js.condition_message("Failed") or "the JobSet failed"
    if phase == "Suspended":
        return "suspended: the JobSet's pods are deleted; set spec.suspend to false to resume"
    if phase == "Queued":
        admitted = status.condition("Admitted")
        if admitted is None:
            return "queued: waiting for Kueue"
        if admitted.status != "True":
            return admitted.message
        return f"{admitted.message}; waiting for the JobSet to resume"
    if phase == "Pending" and trouble is not None:
        return trouble.message
    if phase == "Restarting":
        base = "restarting: waiting for the recreated pods to be ready"
    elif phase == "Running":
        base = f"{js.ready} of {js.jobs or js.active} slice(s) ready"
    else:
        base = "waiting for the JobSet's pods"
    return f"{base}; {trouble.message}" if trouble is not None else base


@dataclasses.dataclass(frozen=True)
class Notice:
    """A Kubernetes Event to post after the status carrying this transition is written."""

    type: str  # Normal | Warning
    reason: str
    message: str


# A status computation: (the job's status as last known, its metadata.generation) -> the new status and
# the Events its transitions deserve. The reconcile writes what one returns (reconcile.write_status).
Compute = Callable[[TPUTrainingJobStatus, "int | None"], "tuple[TPUTrainingJobStatus, list[Notice]]"]


RUNNING = {
    "Running": "SlicesActive",
    "Pending": "NotStarted",
    "Queued": "NotStarted",
    "Suspended": "Suspended",
    "Restarting": "Restarting",
    "Succeeded": "Completed",
    "Failed": "Failed",
}  # phase -> Running's reason


def follow(
    status: TPUTrainingJobStatus,
    jobset: JobSetView | dict[str, Any],
    now: datetime.datetime,
    intent: Intent = Intent(),
    trouble: Condition | None = None,
    restart: Restart = None,
    generation: int | None = None,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The job status after seeing `jobset` (the reconcile's view of it; a JobSet object is wrapped here),
    and the Events its transitions deserve. `restart` is the decision about it, `trouble` the problem the
    last look at the pods found (diagnosis.trouble), if any. A restart decision's message, set before, is
    kept while it applies."""
    js = jobset if isinstance(jobset, JobSetView) else JobSetView.of(jobset)
    before = status.phase
    phase = phase_of(before, js, intent, restart, trouble is not None)
    keep = (phase in TERMINAL and before in TERMINAL) or restart is not None
    message = status.message if keep and status.message else _message(phase, js, status, trouble)
    started = phase in ("Running", "Restarting", *TERMINAL)
    conds = set_condition(
        status.conditions,
        "Running",
        "True" if phase == "Running" else "False",
        RUNNING[phase],
        message,
        now,
        generation,
    )
    if phase == "Succeeded":
        conds = set_condition(conds, "Succeeded", "True", "JobSetCompleted", message, now, generation)
    if phase == "Failed":
        conds = set_condition(
            conds,
            "Failed",
            "True",
            "Diverged" if restart == "diverged" else "RestartPolicy" if restart else "JobSetFailed",
            message,
            now,
            generation,
        )
    new = status.model_copy(
        update=dict(
            phase=phase,
            message=message,
            conditions=conds,
            start_time=status.start_time or (now if started else None),
            completion_time=status.completion_time or (now if phase in TERMINAL else None),
        )
    )

    notices = []
    if phase != before:
        if phase == "Succeeded":
            notices.append(Notice("Normal", "Succeeded", message))
        elif phase == "Failed":
            notices.append(Notice("Warning", "Failed", message))
        elif phase == "Suspended" and before is not None:  # made suspended: the Created Event is its one Event
            notices.append(Notice("Normal", "Suspended", "the JobSet is suspended"))
        elif before == "Suspended":
            notices.append(Notice("Normal", "Resumed", f"the JobSet is resumed ({phase})"))
    return new, notices

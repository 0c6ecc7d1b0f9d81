"""JobSet status -> TPUTrainingJob phase, counters and conditions. Pure: no I/O, the time is passed in.

The phase rule, first match wins (`phase_of`):

1. Succeeded and Failed are sticky: a finished job never goes back (a JobSet deleted after it
   finished, e.g. by its TTL, does not make the job Pending again).
2. Succeeded: the JobSet has condition Completed=True, or terminalState Completed.
3. Failed: the JobSet has condition Failed=True, or terminalState Failed.
4. Suspended: the JobSet has condition Suspended=True, or spec.suspend is true.
5. Restarting: the JobSet's status.restarts is above the restarts the job last recorded (a restart
   the operator has not seen yet), or the job is already Restarting; it stays Restarting until a
   pod is *ready* again (sum of replicatedJobsStatus[].ready > 0), then it is Running. Active
   alone does not end Restarting: the recreated Jobs count their pending pods as active at once.
6. Running: some pod is active or ready (sum of active + ready > 0).
7. Pending: otherwise (no JobSet status yet, pods not created).

`Invalid` is decided before any JobSet exists (reconcile.py), never here.

Conditions follow Kubernetes: `lastTransitionTime` changes only when a condition's status does
(conditions.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..api.models import TERMINAL_PHASES as TERMINAL
from ..api.models import TPUTrainingJobStatus
from .conditions import set_condition


@dataclasses.dataclass(frozen=True)
class JobSetView:
    """What the phase rule reads of a JobSet."""

    true_conditions: dict[str, dict[str, Any]]  # type -> condition, only those with status True
    restarts: int
    terminal_state: str | None
    active: int
    ready: int
    succeeded: int
    failed: int
    suspend: bool

    @classmethod
    def of(cls, jobset: dict[str, Any]) -> "JobSetView":
        status = jobset.get("status") or {}
        replicated = status.get("replicatedJobsStatus") or []

        def total(key: str) -> int:
            return sum(int(r.get(key) or 0) for r in replicated)

        return cls(
            true_conditions={c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"},
            restarts=int(status.get("restarts") or 0),
            terminal_state=status.get("terminalState"),
            active=total("active"), ready=total("ready"), succeeded=total("succeeded"), failed=total("failed"),
            suspend=bool((jobset.get("spec") or {}).get("suspend")),
        )

    def condition_message(self, type_: str) -> str:
        return (self.true_conditions.get(type_) or {}).get("message") or ""


def phase_of(previous_phase: str | None, previous_restarts: int, js: JobSetView) -> str:
    """The rule in the module docstring."""
    if previous_phase in TERMINAL:
        return previous_phase
    if "Completed" in js.true_conditions or js.terminal_state == "Completed":
        return "Succeeded"
    if "Failed" in js.true_conditions or js.terminal_state == "Failed":
        return "Failed"
    if "Suspended" in js.true_conditions or js.suspend:
        return "Suspended"
    if js.restarts > previous_restarts or previous_phase == "Restarting":
        return "Running" if js.ready > 0 else "Restarting"
    if js.active + js.ready > 0:
        return "Running"
    return "Pending"


def _message(phase: str, js: JobSetView) -> str:
    if phase == "Succeeded":
        return js.condition_message("Completed") or "the JobSet completed"
    if phase == "Failed":
        return js.condition_message("Failed") or "the JobSet failed"
    if phase == "Suspended":
        return "suspended: the JobSet's pods are deleted; set spec.suspend to false to resume"
    if phase == "Restarting":
        return f"restart {js.restarts}: waiting for the recreated pods to be ready"
    if phase == "Running":
        return f"{js.active} pod(s) active, {js.ready} ready"
    return "waiting for the JobSet's pods"


@dataclasses.dataclass(frozen=True)
class Notice:
    """A Kubernetes Event to post after the status carrying this transition is written."""

    type: str  # Normal | Warning
    reason: str
    message: str


def follow(status: TPUTrainingJobStatus, jobset: dict[str, Any],
           now: str) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The job status after seeing `jobset`, and the Events its transitions deserve."""
    js = JobSetView.of(jobset)
    before, seen_restarts = status.phase, status.restarts or 0
    phase = phase_of(before, seen_restarts, js)
    message = status.message if phase in TERMINAL and before in TERMINAL else _message(phase, js)
    started = phase in ("Running", "Restarting", *TERMINAL)
    conds = set_condition(status.conditions, "Running", "True" if phase == "Running" else "False", phase, message,
                          now)
    if phase == "Succeeded":
        conds = set_condition(conds, "Succeeded", "True", "JobSetCompleted", message, now)
    if phase == "Failed":
        conds = set_condition(conds, "Failed", "True", "JobSetFailed", message, now)
    new = status.model_copy(update=dict(
        phase=phase, restarts=max(js.restarts, seen_restarts), message=message, conditions=conds,
        start_time=status.start_time or (now if started else None),
        completion_time=status.completion_time or (now if phase in TERMINAL else None)))

    notices = []
    if js.restarts > seen_restarts and before not in TERMINAL:
        notices.append(Notice("Warning", "Restarted", f"the JobSet restarted all slices (restart {js.restarts})"))
    if phase != before:
        if phase == "Succeeded":
            notices.append(Notice("Normal", "Succeeded", message))
        elif phase == "Failed":
            notices.append(Notice("Warning", "Failed", message))
        elif phase == "Suspended":
            notices.append(Notice("Normal", "Suspended", "the JobSet is suspended"))
        elif before == "Suspended":
            notices.append(Notice("Normal", "Resumed", f"the JobSet is resumed ({phase})"))
    return new, notices

"""The restart policy of a job, as the operator and the local runner apply it. Pure.

Who restarts: the operator, not JobSet. The rendered JobSet has `failurePolicy.maxRestarts: 0`, so
the first failed pod fails it; the operator then reads why (each pod's exit code and termination
message), decides, and restarts by deleting that JobSet and creating it again after a backoff. The
budget, the counts by cause and the backoff live in the job's status, so they survive the JobSet
being deleted and re-created (by the operator, by a user, or by anything else), and every restart
gets fresh pods, whose coordinator and MEGASCALE_* environment is derived anew. The local runner
applies the same rule to its processes.

The rule (`verdict`), first match wins:
1. A user error (exit code 3) anywhere fails the job at once: retrying cannot fix it.
2. SIGTERM (143, or a pod the cluster marked as disrupted) is a preemption: restarted, counted
   under `preemption`, and not charged against `maxRestarts` (Kubernetes' pod failure policy
   `Ignore` on DisruptionTarget does the same: a preempted job is not at fault). A node of a running
   slice that GKE says is unhealthy (controller/health.py) is likewise restarted, counted under
   `hardware`, and not charged: the operator stopped the job with SIGTERM to save the step in flight.
3. An exit code outside `restartOnExitCodes` fails the job at once (the default list is the
   retryable classes: 42, 137, 143; an empty list restarts every code but 3).
4. A failure or a hang when `failure + hang` restarts already reach `maxRestarts` fails the job.
5. Otherwise: restart after `backoffSeconds * 2^(restarts so far)`, at most `maxBackoffSeconds`.

Which pod speaks for a failed attempt (`root_cause`): once one pod fails, the others are stopped
(SIGTERM, so they exit 143, or 137 past their grace period), or fail in their next collective
(42: "connection reset by peer"); those codes are collateral. The root cause is the first pod with
a user error, else the earliest to finish with a code other than 143, else the earliest (every pod
was stopped: a preemption). Pods that finished at the same time (the kubelet's finishedAt has 1 s
resolution) are ranked: a process killed from outside (137) before one that failed on its own, as
the peers of a lost host fail right after it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from .backoff import exponential
from .contract import Base, _desc
from .lifecycle import NEVER_RESTARTED, ExitCode, Progress, TerminationRecord
from .spec import FailurePolicySpec
from .timestamps import Timestamp

Cause = Literal["failure", "preemption", "hang", "hardware"]
CLASSES = {
    int(ExitCode.OK): "finished",
    int(ExitCode.UNEXPECTED): "unexpected error",
    int(ExitCode.USER): "user or configuration error",
    int(ExitCode.RETRYABLE): "retryable infrastructure failure",
    int(ExitCode.KILLED): "killed",
    int(ExitCode.STOPPED): "stopped by SIGTERM",
}


class RestartCounts(Base):
    """Restarts of the whole job by cause; `total` is their sum."""

    failure: int = _desc("Restarts after a failed pod (an exit code in restartOnExitCodes).", default=0, ge=0)
    preemption: int = _desc(
        "Restarts after SIGTERM (preemption, maintenance, eviction); not charged against maxRestarts.", default=0, ge=0
    )
    hang: int = _desc("Restarts after no step completed within the hang timeout.", default=0, ge=0)
    hardware: int = _desc(
        "Restarts after a node of a running slice turned unhealthy (GKE's TPU partition-state "
        "label or the node's Ready condition); the step in flight was saved first; not "
        "charged against maxRestarts.",
        default=0,
        ge=0,
    )
    total: int = _desc("All restarts.", default=0, ge=0)

    @property
    def charged(self) -> int:
        """The restarts `maxRestarts` is enforced against."""
        return self.failure + self.hang

    def plus(self, cause: Cause) -> RestartCounts:
        return self.model_copy(update={cause: getattr(self, cause) + 1, "total": self.total + 1})


class LastRestart(Base):
    """The latest restart the operator decided: why, and which JobSet it replaced."""

    cause: Cause = _desc("failure, preemption, hang or hardware.")
    exit_code: int | None = _desc("Exit code of the pod that failed first, if one did.", default=None)
    message: str = _desc("What happened, with the trainer's last error line.", default="")
    job_set_uid: str | None = _desc(
        "uid of the JobSet that was replaced (a restart is counted once per JobSet).", default=None
    )
    time: Timestamp | None = _desc("When the restart was decided.", default=None)


@dataclasses.dataclass(frozen=True)
class PodExit:
    """One terminated pod (or local process) of an attempt."""

    pod: str
    code: int | None  # None: terminated with no exit code known (a node lost)
    record: TerminationRecord | None = None
    finished_at: str | float | None = None  # ordering only
    disrupted: bool = False  # the cluster marked it (DisruptionTarget): a preemption whatever its code
    slice_index: int | None = None  # its slice (JobSet's job index): an elastic job drops that slice (elastic.py)

    @property
    def error(self) -> str:
        return self.record.error if self.record else ""


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt failed: the pod that speaks for it, and every pod's progress it could give."""

    cause: Cause | Literal["user"]  # hardware: an unhealthy node, before any pod failed
    code: int | None
    pod: str
    error: str
    progress: Progress | None = None
    slice_index: int | None = None  # the slice of `pod`, when known

    def describe(self) -> str:
        if self.cause == "hardware":  # no pod failed: the operator stops the job (controller/health.py)
            return self.error
        code = (
            f"exited with code {self.code} ({CLASSES.get(self.code, 'unclassified')})"
            if self.code is not None
            else "was lost (no exit code)"
        )
        return f"{self.pod} {code}" + (f": {self.error}" if self.error else "")


def root_cause(exits: list[PodExit]) -> Failure | None:
    """The pod that speaks for a failed attempt (rule in the module docstring); None if none failed."""
    failed = sorted(
        (e for e in exits if e.code != 0 or e.disrupted),
        key=lambda e: (e.finished_at is None, e.finished_at or 0, e.code != ExitCode.KILLED),
    )
    if not failed:
        return None
    user = [e for e in failed if e.code in NEVER_RESTARTED]
    first = (user or [e for e in failed if e.code != ExitCode.STOPPED and not e.disrupted] or failed)[0]
    cause: Cause | Literal["user"]
    if first.code in NEVER_RESTARTED:
        cause = "user"
    elif first.code == ExitCode.STOPPED or first.disrupted:
        cause = "preemption"
    else:
        cause = "failure"
    progress = next((e.record.progress for e in [first, *failed] if e.record and e.record.progress), None)
    return Failure(
        cause=cause, code=first.code, pod=first.pod, error=first.error, progress=progress, slice_index=first.slice_index
    )


@dataclasses.dataclass(frozen=True)
class Verdict:
    restart: bool
    cause: Cause | None  # None when not restarted
    delay_s: float
    message: str


def backoff_s(policy: FailurePolicySpec, restarts: RestartCounts) -> float:
    return exponential(policy.backoff_seconds, policy.max_backoff_seconds, restarts.total)


def verdict(
    policy: FailurePolicySpec, restarts: RestartCounts, failure: Failure | None, hang: str | None = None
) -> Verdict:
    """Restart or fail, after `failure` (a failed attempt) or `hang` (why the job is hung)."""
    cause: Cause
    if hang is not None:
        cause, what = "hang", hang
    else:
        assert failure is not None
        what = failure.describe()
        if failure.cause == "user":
            return Verdict(False, None, 0, f"{what}; a user error is never retried")
        cause = failure.cause
        if cause == "hardware":  # the operator stopped it (controller/health.py): no exit code to judge
            delay = backoff_s(policy, restarts)
            return Verdict(True, cause, delay, f"{what}; restart {restarts.total + 1} ({cause}) in {delay:g} s")
        listed = policy.restart_on_exit_codes
        if cause == "failure" and listed and failure.code not in listed:
            return Verdict(False, None, 0, f"{what}; not in restartOnExitCodes {sorted(listed)}")
    if cause != "preemption" and restarts.charged >= policy.max_restarts:
        return Verdict(
            False,
            None,
            0,
            f"{what}; restart budget spent ({restarts.charged} of maxRestarts {policy.max_restarts} used)",
        )
    delay = backoff_s(policy, restarts)
    return Verdict(True, cause, delay, f"{what}; restart {restarts.total + 1} ({cause}) in {delay:g} s")

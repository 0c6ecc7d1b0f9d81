"""The restart policy of a job, as the operator and the local runner apply it. Pure.

Who restarts: the operator, not JobSet. The rendered JobSet has `failurePolicy.maxRestarts: 0`, so
the first failed pod fails it; the operator then reads why (each pod's exit code and termination
message), decides, and restarts by deleting that JobSet and creating it again after a backoff. The
budget, the counts by cause and the backoff live in the job's status, so they survive the JobSet
being deleted and re-created (by the operator, by a user, or by anything else), and every restart
gets fresh pods, whose coordinator and MEGASCALE_* environment is derived anew. The local runner
applies the same rule to its processes.

The causes: `failure` (a pod failed with an exit code in restartOnExitCodes), `hang` (controller/restarts.py),
`diverged` (exit code 43: a non-finite loss or gradient norm), `hardware` (a node of a running slice
turned unhealthy, controller/health.py, or a pod was lost with its node: DisruptionTarget
`DeletionByPodGC`, or no pod left to say why) and `preemption` (SIGTERM, 143, or another DisruptionTarget).
`failure`, `hang` and `diverged` are the job's own faults: `maxRestarts` is their total. `hardware` and
`preemption` are the infrastructure's: each has only its own budget (`restartBudgets`; preemption has
none by default, hardware 10).

The rule (`verdict`), first match wins:
1. A user error (exit code 3) anywhere fails the job at once: retrying cannot fix it.
2. A divergence fails the job when `onDivergence` is Fail (the default): a rerun of the same steps
   from the same checkpoint diverges again. With Rewind it is restarted (the trainer restores the
   latest checkpoint, all written from finite state, and skips `skipBatches` batches).
3. An exit code outside `restartOnExitCodes` fails the job at once (the default list is the
   retryable classes: 42, 137, 143; an empty list restarts every code but 3). Exit code 43 and the
   operator's own stops (hardware, hang) are judged by their cause, not by this list.
4. A cause whose own budget (`restartBudgets.<cause>`; None: none) is used up fails the job.
5. A failure, hang or divergence when `failure + hang + diverged` restarts reach `maxRestarts` fails
   the job.
6. Otherwise: restart after `backoffSeconds * 2^(restarts so far)`, at most `maxBackoffSeconds`.

"Used" counts every restart of the job's life, or with `restartWindowSeconds` only those decided within
that many seconds before now (as Kubernetes forgets a container's crash back-off after 10 minutes of
running): the times are kept in `restarts.recent` (`record`), per cause, no more of them than the largest
budget that reads them (so at most 1,000 per cause, the CRD's bound on a budget), and none without a
window.

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
import datetime
from typing import Any, Literal

from .backoff import exponential
from .contract import Recorded, _desc
from .lifecycle import NEVER_RESTARTED, Divergence, ExitCode, Progress, TerminationRecord
from .spec import FailurePolicySpec
from .timestamps import Timestamp

Cause = Literal["failure", "preemption", "hang", "hardware", "diverged"]
CAUSES: tuple[Cause, ...] = ("failure", "preemption", "hang", "hardware", "diverged")
CHARGED: tuple[Cause, ...] = ("failure", "hang", "diverged")  # the job's own faults: maxRestarts is their total
MAX_RECENT = 1000  # restart times kept per cause: the CRD's bound on any budget (spec.RestartBudgetsSpec)
CLASSES = {
    int(ExitCode.OK): "finished",
    int(ExitCode.UNEXPECTED): "unexpected error",
    int(ExitCode.USER): "user or configuration error",
    int(ExitCode.RETRYABLE): "retryable infrastructure failure",
    int(ExitCode.DIVERGED): "diverged: a non-finite loss or gradient norm",
    int(ExitCode.KILLED): "killed",
    int(ExitCode.STOPPED): "stopped by SIGTERM",
}


def _recent(cause: str) -> Any:
    return _desc(
        f"When the {cause} restarts within restartWindowSeconds were decided (newest last).",
        default=(),
        max_length=MAX_RECENT,
    )


class RecentRestarts(Recorded):
    """When each cause's recent restarts were decided: only kept with spec.failurePolicy.restartWindowSeconds,
    and only as many per cause as the largest budget that reads them."""

    failure: tuple[Timestamp, ...] = _recent("failure")
    preemption: tuple[Timestamp, ...] = _recent("preemption")
    hang: tuple[Timestamp, ...] = _recent("hang")
    hardware: tuple[Timestamp, ...] = _recent("hardware")
    diverged: tuple[Timestamp, ...] = _recent("diverged")


class RestartCounts(Recorded):
    """Restarts of the whole job by cause; `total` is their sum."""

    failure: int = _desc("Restarts after a failed pod (an exit code in restartOnExitCodes).", default=0, ge=0)
    preemption: int = _desc(
        "Restarts after SIGTERM (preemption, maintenance, eviction); not charged against maxRestarts.", default=0, ge=0
    )
    hang: int = _desc("Restarts after no step completed within the hang timeout.", default=0, ge=0)
    hardware: int = _desc(
        "Restarts after a node of a running slice turned unhealthy (GKE's TPU partition-state "
        "label, or the node's Ready condition past nodeUnhealthyGraceSeconds) or a pod was lost with "
        "its node; charged against restartBudgets.hardware, not maxRestarts.",
        default=0,
        ge=0,
    )
    # Absent until the first rewind, with no default in the CRD: the previous release's operator reads
    # status.restarts with its own fields only, and a field it never wrote would stop it (an upgrade's roll,
    # a rollback; tests/cluster/test_upgrade.py). `count` reads it as 0.
    diverged: int | None = _desc(
        "Rewinds after a non-finite loss or gradient norm (exit code 43, onDivergence Rewind); charged "
        "against maxRestarts and restartBudgets.diverged. Absent: none.",
        default=None,
        ge=0,
    )
    total: int = _desc("All restarts.", default=0, ge=0)
    recent: RecentRestarts | None = _desc(
        "When the restarts that still count were decided (only with restartWindowSeconds).", default=None
    )

    @property
    def charged(self) -> int:
        """The restarts `maxRestarts` is enforced against (over the job's life)."""
        return sum(self.count(c) for c in CHARGED)

    def count(self, cause: Cause) -> int:
        return getattr(self, cause) or 0

    def plus(self, cause: Cause) -> RestartCounts:
        return self.model_copy(update={cause: self.count(cause) + 1, "total": self.total + 1})


class LastRestart(Recorded):
    """The latest restart the operator decided: why, and which JobSet it replaced."""

    cause: Cause = _desc("failure, preemption, hang, hardware or diverged.")
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
    lost: str | None = None  # lost with its node (why: DisruptionTarget DeletionByPodGC...): hardware, not preemption

    @property
    def error(self) -> str:
        return self.record.error if self.record else ""


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why an attempt failed: the pod that speaks for it, and every pod's progress it could give."""

    cause: Cause | Literal["user"]  # hardware: an unhealthy node before any pod failed, or a pod lost with its node
    code: int | None
    pod: str
    error: str
    progress: Progress | None = None
    slice_index: int | None = None  # the slice of `pod`, when known
    divergence: Divergence | None = None  # exit code 43: where the trainer saw a non-finite value

    def describe(self) -> str:
        if self.cause == "hardware":  # no exit code to speak of: the error says what happened to the node
            return self.error
        code = (
            f"exited with code {self.code} ({CLASSES.get(self.code, 'unclassified')})"
            if self.code is not None
            else "was lost (no exit code)"
        )
        where = ""
        if self.divergence is not None:
            d = self.divergence
            where = f" at step {d.step}: {d.metric} {d.value}"
        return f"{self.pod} {code}{where}" + (f": {self.error}" if self.error else "")


def root_cause(exits: list[PodExit]) -> Failure | None:
    """The pod that speaks for a failed attempt (rule in the module docstring); None if none failed.
    A pod lost with its node speaks before any code: its peers fail because it went."""
    failed = sorted(
        (e for e in exits if e.code != 0 or e.disrupted or e.lost),
        key=lambda e: (e.finished_at is None, e.finished_at or 0, e.code != ExitCode.KILLED),
    )
    if not failed:
        return None
    user = [e for e in failed if e.code in NEVER_RESTARTED]
    lost = [e for e in failed if e.lost]
    first = (user or lost or [e for e in failed if e.code != ExitCode.STOPPED and not e.disrupted] or failed)[0]
    progress = next((e.record.progress for e in [first, *failed] if e.record and e.record.progress), None)
    if first.lost and first.code not in NEVER_RESTARTED:
        return Failure(
            cause="hardware",
            code=first.code,
            pod=first.pod,
            error=f"pod {first.pod} was lost with its node ({first.lost})",
            progress=progress,
            slice_index=first.slice_index,
        )
    cause: Cause | Literal["user"]
    if first.code in NEVER_RESTARTED:
        cause = "user"
    elif first.code == ExitCode.STOPPED or first.disrupted:
        cause = "preemption"
    elif first.code == ExitCode.DIVERGED:
        cause = "diverged"
    else:
        cause = "failure"
    return Failure(
        cause=cause,
        code=first.code,
        pod=first.pod,
        error=first.error,
        progress=progress,
        slice_index=first.slice_index,
        divergence=first.record.diverged if first.record and cause == "diverged" else None,
    )


@dataclasses.dataclass(frozen=True)
class Verdict:
    restart: bool
    cause: Cause | None  # None when not restarted
    delay_s: float
    message: str


def budget(policy: FailurePolicySpec, cause: Cause) -> int | None:
    """The cause's own limit (restartBudgets), None: none."""
    limit: int | None = getattr(policy.restart_budgets, cause)
    return limit


def used(
    policy: FailurePolicySpec, restarts: RestartCounts, causes: tuple[Cause, ...], now: datetime.datetime | None
) -> int:
    """Restarts of `causes` that still count: all of them, or with restartWindowSeconds (and a time) those
    decided within the window before `now` (a time after `now`, a clock that moved back, still counts)."""
    window = policy.restart_window_seconds
    if window is None or now is None:
        return sum(restarts.count(c) for c in causes)
    since = now - datetime.timedelta(seconds=window)
    recent = restarts.recent or RecentRestarts()
    return sum(1 for c in causes for t in getattr(recent, c) if t is not None and t > since)


def keep(policy: FailurePolicySpec, cause: Cause) -> int:
    """How many of a cause's restart times any rule reads: its own budget, maxRestarts for the job's own faults,
    and enough for the backoff's exponent (at most MAX_RECENT); none without a window."""
    if policy.restart_window_seconds is None:
        return 0
    own = budget(policy, cause) or 0
    return min(MAX_RECENT, max(own, policy.max_restarts if cause in CHARGED else 0, 64))


def record(policy: FailurePolicySpec, restarts: RestartCounts, cause: Cause, now: datetime.datetime) -> RestartCounts:
    """`restarts` with one more of `cause`, decided at `now`: the counts, and its time in `recent` (with a window:
    the times outside it dropped, and no more per cause than `keep`)."""
    counts = restarts.plus(cause)
    window = policy.restart_window_seconds
    if window is None:
        return counts
    since = now - datetime.timedelta(seconds=window)
    old = restarts.recent or RecentRestarts()
    times: dict[str, tuple[datetime.datetime, ...]] = {}
    for c in CAUSES:
        kept = [t for t in getattr(old, c) if t is not None and t > since] + ([now] if c == cause else [])
        n = keep(policy, c)
        times[c] = tuple(kept[-n:]) if n else ()
    return counts.model_copy(update={"recent": RecentRestarts(**times)})


def backoff_s(policy: FailurePolicySpec, restarts: RestartCounts, now: datetime.datetime | None = None) -> float:
    """The delay before the next restart: doubled for each restart so far (within the window, if one is set)."""
    n = restarts.total if policy.restart_window_seconds is None or now is None else used(policy, restarts, CAUSES, now)
    return exponential(policy.backoff_seconds, policy.max_backoff_seconds, n)


def _spent(
    policy: FailurePolicySpec, restarts: RestartCounts, cause: Cause, now: datetime.datetime | None
) -> str | None:
    """Why `cause` may not restart again (rules 4 and 5), or None."""
    within = f" within restartWindowSeconds {policy.restart_window_seconds}" if policy.restart_window_seconds else ""
    limit = budget(policy, cause)
    if limit is not None and (n := used(policy, restarts, (cause,), now)) >= limit:
        return f"{cause} restart budget spent ({n} of restartBudgets.{cause} {limit} used{within})"
    if cause in CHARGED and (n := used(policy, restarts, CHARGED, now)) >= policy.max_restarts:
        return f"restart budget spent ({n} of maxRestarts {policy.max_restarts} used{within})"
    return None


def verdict(
    policy: FailurePolicySpec,
    restarts: RestartCounts,
    failure: Failure | None,
    hang: str | None = None,
    now: datetime.datetime | None = None,
) -> Verdict:
    """Restart or fail, after `failure` (a failed attempt) or `hang` (why the job is hung), decided at `now`
    (None: the restart window is not applied)."""
    cause: Cause
    if hang is not None:
        cause, what = "hang", hang
    else:
        assert failure is not None
        what = failure.describe()
        if failure.cause == "user":
            return Verdict(False, None, 0, f"{what}; a user error is never retried")
        cause = failure.cause
        if cause == "diverged" and policy.on_divergence == "Fail":
            return Verdict(False, None, 0, f"{what}; onDivergence is Fail (Rewind restarts from the last checkpoint)")
        listed = policy.restart_on_exit_codes
        if cause == "failure" and listed and failure.code not in listed:
            return Verdict(False, None, 0, f"{what}; not in restartOnExitCodes {sorted(listed)}")
    spent = _spent(policy, restarts, cause, now)
    if spent is not None:
        return Verdict(False, None, 0, f"{what}; {spent}")
    delay = backoff_s(policy, restarts, now)
    return Verdict(True, cause, delay, f"{what}; restart {restarts.total + 1} ({cause}) in {delay:g} s")

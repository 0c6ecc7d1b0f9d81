"""Restarts and hangs as the operator sees them (the rule itself is api/failures.py). Pure.

- `pod_exits`: the pods of a failed JobSet as the kubelet reports them: container `trainer`'s
  `state.terminated` (exitCode, finishedAt, and `message`: the trainer's termination record, or
  the tail of its log when it died before writing one, by `FallbackToLogsOnError`), and the pod
  condition `DisruptionTarget=True` the cluster sets on a pod it stops (preemption, eviction, a
  node taint), which makes it a preemption whatever the code; but with reason `DeletionByPodGC`
  (the pod garbage collector deletes the pods of a node that is gone: GKE's node repair and upgrades
  delete nodes) the pod was lost with its node: a hardware failure of its slice.
- `failure_of`: the root cause (api/failures.py); a failed JobSet with no pod left to say why lost its
  pods with their node (deleted and garbage-collected before the list): hardware, never a terminal failure.
- `hang`: why a running attempt is hung, or None. It is judged only on a read of the trainer's
  /status that succeeded (`answered`): a trainer that answers and says no step completed for
  `hangTimeoutSeconds` (default the larger of 600 s and 20 x the median step time), or, before its
  first step, for `startupTimeoutSeconds` since it started. Stored progress alone never restarts a
  job (an operator back from an outage would find every job's last step old), and a trainer the
  operator cannot reach is `Metrics=False`, never restarted for it; the trainer's own start-up
  watchdog covers a process stuck before it serves /status.
- `decide`: the status after a failed or hung attempt: counts by cause, `lastRestart` (with the uid
  of the JobSet it replaces, so that a JobSet is counted once however often it is seen), and
  `nextRestartTime` after the backoff, or the job given up; a `Hung` condition; the Events.
"""

from __future__ import annotations

import datetime
from typing import Any

from ..api import elastic, names
from ..api.failures import Failure, LastRestart, PodExit, RestartCounts, Verdict, record, root_cause, verdict
from ..api.lifecycle import TerminationRecord
from ..api.spec import FailurePolicySpec, TPUSpec
from ..api.status import ConditionStatus, SliceStatus, TPUTrainingJobStatus
from .conditions import set_condition
from .phases import Notice
from .status import Sample

CONTAINER = "trainer"
# DisruptionTarget reasons of a pod lost with its node (k8s.io/api core/v1 PodReasonDeletionByPodGC: the pod GC
# deletes the pods bound to a node that no longer exists). DeletionByTaintManager, EvictionByEvictionAPI,
# PreemptionByScheduler and TerminationByKubelet stay preemptions: the pod was stopped, its node is there.
LOST_WITH_NODE = ("DeletionByPodGC",)
MIN_HANG_TIMEOUT_S = 600
HANG_STEP_FACTOR = 20


def pod_exits(pods: list[dict[str, Any]]) -> list[PodExit]:
    exits = []
    for pod in pods:
        status = pod.get("status") or {}
        container: dict[str, Any] = next(
            (c for c in status.get("containerStatuses") or [] if c.get("name") == CONTAINER), {}
        )
        terminated = (container.get("state") or {}).get("terminated") or (container.get("lastState") or {}).get(
            "terminated"
        )
        disruption = next(
            (
                c
                for c in status.get("conditions") or []
                if isinstance(c, dict) and c.get("type") == "DisruptionTarget" and c.get("status") == "True"
            ),
            None,
        )
        disrupted = disruption is not None
        why = str((disruption or {}).get("reason") or "")[:64]
        lost = f"DisruptionTarget {why}" if why in LOST_WITH_NODE else None
        if terminated is None and not disrupted and status.get("phase") != "Failed":
            continue
        code = terminated.get("exitCode") if terminated else None
        exits.append(
            PodExit(
                pod=pod["metadata"]["name"],
                code=code,
                disrupted=disrupted,
                slice_index=names.slice_index(pod),
                record=TerminationRecord.parse((terminated or {}).get("message"), code),
                finished_at=(terminated or {}).get("finishedAt"),
                lost=lost,
            )
        )
    return exits


def failure_of(pods: list[dict[str, Any]], jobset_message: str) -> Failure:
    """Why the JobSet failed: its root-cause pod, or (no pod says why: they were lost with their node and
    garbage-collected) a hardware failure, with the JobSet's own message."""
    return root_cause(pod_exits(pods)) or Failure(
        cause="hardware",
        code=None,
        pod="a pod",
        error="no pod of the failed JobSet is left to say why (lost with its node, deleted or garbage-collected)"
        + (f"; the JobSet says: {jobset_message[:512]}" if jobset_message else ""),
    )


def answered(sample: Sample | None) -> bool:
    """A read of the trainer's /status succeeded and brought its clock."""
    return sample is not None and sample.error is None and sample.progress is not None


def hang_timeout_s(policy: FailurePolicySpec, median_step_s: float | None) -> float:
    if policy.hang_timeout_seconds is not None:
        return float(policy.hang_timeout_seconds)
    return max(float(MIN_HANG_TIMEOUT_S), HANG_STEP_FACTOR * (median_step_s or 0.0))


def hang(
    status: TPUTrainingJobStatus, policy: FailurePolicySpec, total_steps: int, now: datetime.datetime
) -> str | None:
    attempt = status.accounting.attempt if status.accounting else None
    p = attempt.progress if attempt else None
    if status.phase != "Running" or p is None or (p.step or 0) >= total_steps:
        return None
    t = now.timestamp()
    if p.last_step_at is None:
        idle, limit = t - p.started_at, float(policy.startup_timeout_seconds)
        what = "no first step"
    else:
        idle, limit = t - p.last_step_at, hang_timeout_s(policy, p.median_step_seconds)
        what = f"no step completed after step {p.step}"
    if idle <= limit:
        return None
    return f"hung: {what} for {idle:.0f} s (limit {limit:.0f} s)"


def decide(
    status: TPUTrainingJobStatus,
    jobset_uid: str | None,
    failure: Failure | None,
    hung: str | None,
    policy: FailurePolicySpec,
    now: datetime.datetime,
    generation: int | None = None,
    tpu: TPUSpec | None = None,
) -> tuple[TPUTrainingJobStatus, Verdict, list[Notice]]:
    """The status after a failed (`failure`) or hung (`hung`) attempt of the JobSet `jobset_uid`; for an elastic
    job (`tpu`), also the slices the next JobSet runs on (api/elastic.py), in status.slices."""
    counts = status.restarts or RestartCounts()
    v = verdict(policy, counts, failure, hung, now)
    conds, notices = status.conditions, []
    divergence = failure.divergence if failure is not None and failure.cause == "diverged" else None
    if failure is not None and failure.cause == "diverged":
        notices.append(Notice("Warning", "Diverged", v.message))
        status = status.model_copy(update=dict(divergence=divergence or status.divergence))
    if hung is not None:
        conds = set_condition(conds, "Hung", "True", "NoProgress", hung, now, generation)
        notices.append(Notice("Warning", "Hung", hung))
    code = failure.code if failure else None
    if not v.restart:
        return status.model_copy(update=dict(conditions=conds, message=v.message)), v, notices
    assert v.cause is not None  # a restart always has its cause (api/failures.py verdict)
    last = LastRestart(cause=v.cause, exit_code=code, message=v.message, job_set_uid=jobset_uid, time=now)
    notices.append(Notice("Warning", "Restarted", v.message))
    slices = status.slices
    if tpu is not None and tpu.elastic is not None:
        running = slices.running if slices is not None and slices.running else tpu.slices
        resize = elastic.after_failure(tpu, running, failure.slice_index if failure else None)
        slices = SliceStatus(desired=tpu.slices, running=resize.slices)
        if resize.reason is not None:
            resized: ConditionStatus = "True" if resize.slices < tpu.slices else "False"
            conds = set_condition(conds, "Resized", resized, resize.reason, resize.message, now, generation)
            notices.append(Notice("Warning" if resized == "True" else "Normal", "Resized", resize.message))
    return (
        status.model_copy(
            update=dict(
                conditions=conds,
                restarts=record(policy, counts, v.cause, now),
                last_restart=last,
                slices=slices,
                next_restart_time=now + datetime.timedelta(seconds=v.delay_s),
                message=v.message,
            )
        ),
        v,
        notices,
    )


def replaced(status: TPUTrainingJobStatus, uid: str | None) -> bool:
    """The JobSet of this uid is one a restart (counted already) or a grow-back (growback.py, never counted)
    replaces: to be deleted, never followed."""
    if not uid:
        return False
    return (status.last_restart is not None and status.last_restart.job_set_uid == uid) or (
        status.slices is not None and status.slices.replaces == uid
    )


def wait_s(status: TPUTrainingJobStatus, now: datetime.datetime) -> float:
    """Seconds until the pending restart may create the JobSet again (0: now)."""
    if not status.next_restart_time:
        return 0.0
    return max(0.0, (status.next_restart_time - now).total_seconds())


def recovered(
    status: TPUTrainingJobStatus, now: datetime.datetime, generation: int | None = None
) -> TPUTrainingJobStatus:
    """Hung=False once a later attempt completes a step."""
    hung = status.condition("Hung")
    attempt = status.accounting.attempt if status.accounting else None
    if (
        hung is None
        or hung.status != "True"
        or attempt is None
        or attempt.progress is None
        or attempt.progress.last_step_at is None
    ):
        return status
    conds = set_condition(status.conditions, "Hung", "False", "Progressing", "steps complete again", now, generation)
    return status.model_copy(update=dict(conditions=conds))

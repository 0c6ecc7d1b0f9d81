"""Why a job's pods are not running, read from the pods themselves. Pure: no I/O, the time is passed in.

The operator lists a JobSet's pods (one list, selected by the label `jobset.sigs.k8s.io/jobset-name`)
only when the JobSet has a Job whose pods are not all ready (`needs_pods`), and only on a JobSet event
or a resync (manager.py): never in a loop, never for a job that runs, waits in a queue or is suspended.
From the pods it sets two conditions, named after the pods' own:

- `Scheduled`: False, reason Unschedulable, with the scheduler's words (the pod's `PodScheduled=False`
  message, e.g. "0/12 nodes are available: 12 Insufficient google.com/tpu."); False, reason
  SchedulingGated, while a gate holds a pod (Kueue's topology-aware scheduling uses them); False,
  reason Pending, until the scheduler has looked at every pod; True once every pod is on a node.
- `ContainersReady`: False with the kubelet's reason when a container cannot start or keeps failing
  (ErrImagePull and ImagePullBackOff with the image, CreateContainerConfigError, CrashLoopBackOff, a
  non-zero exit with its code); False, reason Starting, otherwise until every pod is ready; True then.

When the JobSet counts every Job ready, both are True without a list (`all_ready`). The most telling
problem (`trouble`: a container's before a scheduling one, each the first pod by name) is the job's
message and one Warning Event each time it changes, not on every resync.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from ..api.status import Condition, ConditionStatus, TPUTrainingJobStatus
from .conditions import set_condition
from .phases import JobSetView, Notice

Finding = tuple[ConditionStatus, str, str]  # (condition status, reason, message)
Pod = dict[str, Any]
# Waiting reasons of a container that will not start by itself (kubelet pkg/kubelet/images/types.go,
# pkg/kubelet/container/sync_result.go), image problems first: they name what to fix.
IMAGE_REASONS = (
    "InvalidImageName",
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "RegistryUnavailable",
    "SignatureValidationFailed",
    "ImageInspectError",
)
START_REASONS = (
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "PreStartHookError",
    "PostStartHookError",
    "CrashLoopBackOff",
)
STARTING = "Starting"  # ContainersReady=False without a problem: the containers are on their way


def needs_pods(js: JobSetView) -> bool:
    """Whether the JobSet has a Job with pods that exist (active) but are not all ready."""
    running = not js.suspend and "Suspended" not in js.true_conditions and js.terminal_state is None
    return running and js.active > js.ready


def all_ready(js: JobSetView) -> bool:
    return js.jobs > 0 and js.ready >= js.jobs


def _name(pod: Pod) -> str:
    name: str = (pod.get("metadata") or {}).get("name", "?")
    return name


def _live(pods: Iterable[Pod]) -> list[Pod]:
    """The pods that count, by name: not being deleted, not done."""
    live = [
        p
        for p in pods
        if not (p.get("metadata") or {}).get("deletionTimestamp")
        and (p.get("status") or {}).get("phase") != "Succeeded"
    ]
    return sorted(live, key=_name)


def _condition(pod: Pod, type_: str) -> dict[str, Any]:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def scheduled(pods: Iterable[Pod]) -> Finding:
    live = _live(pods)
    for reason in ("Unschedulable", "SchedulingGated"):
        for pod in live:
            c = _condition(pod, "PodScheduled")
            if c.get("status") == "False" and c.get("reason") == reason:
                if reason == "SchedulingGated":
                    gates = ", ".join(g.get("name", "?") for g in (pod.get("spec") or {}).get("schedulingGates") or [])
                    return "False", reason, f"pod {_name(pod)} waits for its scheduling gates: {gates or '?'}"
                return "False", reason, f"pod {_name(pod)} cannot be scheduled: {c.get('message') or 'no reason given'}"
    if not live:
        return "False", "Pending", "the JobSet's pods are not created yet"
    if all(_condition(p, "PodScheduled").get("status") == "True" for p in live):
        return "True", "Scheduled", "every pod is on a node"
    return "False", "Pending", "waiting for the scheduler"


def _container_problem(pod: Pod, status: dict[str, Any]) -> tuple[int, str, str] | None:
    """(rank, reason, message) of one container that cannot start or failed; None if it is fine."""
    name, image = status.get("name", "?"), status.get("image") or ""
    where = f"pod {_name(pod)}: container {name}"
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason, text = waiting.get("reason"), waiting.get("message") or ""
    if reason in IMAGE_REASONS:
        shown = text if image and image in text else f"{text} (image {image})".strip()
        return 0, reason, f"{where}: {reason}: {shown}"
    if reason in START_REASONS:
        last = (status.get("lastState") or {}).get("terminated") or {}
        exit_code = f" (last exit code {last['exitCode']})" if "exitCode" in last else ""
        return 1, reason, f"{where}: {reason}{exit_code}" + (f": {text}" if text else "")
    ended = (status.get("state") or {}).get("terminated") or {}
    if ended.get("exitCode"):  # restartPolicy Never: a failed trainer stays terminated until JobSet restarts
        why = ended.get("reason") or "Error"
        return (
            1,
            why,
            f"{where} exited with code {ended['exitCode']} ({why})"
            + (f": {ended['message']}" if ended.get("message") else ""),
        )
    return None


def _container_statuses(pod: Pod) -> list[dict[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def containers(pods: Iterable[Pod]) -> Finding:
    live = _live(pods)
    problems = [p for pod in live for s in _container_statuses(pod) if (p := _container_problem(pod, s)) is not None]
    if problems:
        _, reason, message = min(problems, key=lambda p: p[0])  # stable: pods are in name order
        return "False", reason, message
    if live and all(_condition(p, "Ready").get("status") == "True" for p in live):
        return "True", "Ready", "every pod is ready"
    return "False", STARTING, "waiting for the containers to be ready"


def trouble(status: TPUTrainingJobStatus) -> Condition | None:
    """The most telling problem the last look at the pods found: the job's message while it lasts."""
    ready, placed = status.condition("ContainersReady"), status.condition("Scheduled")
    if ready is not None and ready.status == "False" and ready.reason != STARTING:
        return ready
    if placed is not None and placed.status == "False" and placed.reason == "Unschedulable":
        return placed
    return None


def follow(
    status: TPUTrainingJobStatus,
    js: JobSetView,
    pods: list[Pod] | None,
    now: datetime.datetime,
    generation: int | None = None,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The status after a look at the pods (None: not looked at this time), and an Event when the
    problem it shows is new."""
    if pods is not None:
        verdicts = {"Scheduled": scheduled(pods), "ContainersReady": containers(pods)}
    elif all_ready(js):
        verdicts = {
            "Scheduled": ("True", "Scheduled", "every pod is on a node"),
            "ContainersReady": ("True", "Ready", "every pod is ready"),
        }
    else:
        return status, []
    conds = status.conditions
    for type_, (state, reason, message) in verdicts.items():
        conds = set_condition(conds, type_, state, reason, message, now, generation)
    new = status.model_copy(update=dict(conditions=conds))
    before, after = trouble(status), trouble(new)
    if after is not None and (before is None or (before.reason, before.message) != (after.reason, after.message)):
        return new, [Notice("Warning", after.reason, after.message)]
    return new, []

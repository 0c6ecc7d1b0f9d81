"""A queued job as Kueue sees it, read from the JobSet's Kueue Workload. Pure: no I/O, the time is passed in.

Kueue (`kueue.x-k8s.io`, v0.15 and later) makes one Workload for each JobSet labelled
`kueue.x-k8s.io/queue-name`, owned by the JobSet (a controller owner reference; Kueue
`pkg/controller/jobframework/reconciler.go`). The Workload's conditions (`apis/kueue/v1beta2/
workload_types.go`; the same in v1beta1) say whether the job holds quota (`QuotaReserved`), has
passed its admission checks as well (`Admitted`; flex-start's ProvisioningRequest is one), and
whether it was evicted (`Evicted`: reason `Preempted`, `PodsReadyTimeout`, `NodeFailures`,
`Deactivated`...). Kueue suspends the JobSet until admission and again on an eviction; the operator
never touches the JobSet's `spec.suspend` for a queued job (Kueue would undo it), and carries the
user's `spec.suspend` to the Workload's `spec.active` instead, Kueue's own switch.

- `trim`: the part of a Workload the operator keeps in its index (what the functions below read).
- `pick`: the Workload of a JobSet among those the watch saw under its name.
- `admission`: the job's `Admitted` condition from the Workload, with Kueue's own words.
- `follow`: the status after seeing the Workload: `Admitted`, `workloadName`, and a restart with cause
  `preemption` (`restarts.preemption`, the job's restart counter, not charged against maxRestarts),
  counted once per eviction (keyed on the Evicted condition's lastTransitionTime), with its Events.
- `activation_patch`: the Workload patch that carries `spec.suspend`, if one is needed.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from ..api import names, timestamps
from ..api.failures import RestartCounts
from ..api.status import ConditionStatus, TPUTrainingJobStatus
from ..rendering.placement import KUEUE_QUEUE_LABEL
from .conditions import set_condition
from .phases import Notice

GROUP = "kueue.x-k8s.io"
PLURAL = "workloads"
# Reasons of a Workload waiting for something the job's owner can fix (a missing LocalQueue, no flavor
# matching the pods, a request beyond the queue's maximum): Warning Events, not Normal ones.
MISCONFIGURED = ("Inadmissible", "Misconfigured", "NoMatchingFlavor", "ExceedsMaxQuota")
# Evictions the user asked for (spec.suspend, or an administrator's kueuectl stop): not preemptions.
DEACTIVATED = "Deactivated"


def jobset_owner(workload: Mapping[str, Any]) -> str | None:
    """The name of the JobSet that controls this Workload, if one does."""
    ref = next(
        (
            r
            for r in (workload.get("metadata") or {}).get("ownerReferences") or []
            if r.get("kind") == "JobSet"
            and str(r.get("apiVersion", "")).startswith("jobset.x-k8s.io/")
            and r.get("controller")
        ),
        None,
    )
    return ref.get("name") if ref else None


def trim(workload: dict[str, Any]) -> dict[str, Any]:
    """What the index keeps of a Workload: a Workload carries the JobSet's whole pod templates."""
    meta, spec, status = workload.get("metadata") or {}, workload.get("spec") or {}, workload.get("status") or {}
    return {
        "apiVersion": workload.get("apiVersion"),
        "metadata": {
            k: meta[k]
            for k in (
                "name",
                "namespace",
                "uid",
                "resourceVersion",
                "creationTimestamp",
                "deletionTimestamp",
                "ownerReferences",
            )
            if k in meta
        }
        | {
            "annotations": {
                k: v for k, v in (meta.get("annotations") or {}).items() if k == names.DEACTIVATED_FOR_SUSPEND
            }
        },
        "spec": {k: spec[k] for k in ("active", "queueName") if k in spec},
        "status": {
            "conditions": status.get("conditions") or [],
            "admission": {"clusterQueue": (status.get("admission") or {}).get("clusterQueue")},
            "admissionChecks": [
                {k: c.get(k) for k in ("name", "state", "message")} for c in status.get("admissionChecks") or []
            ],
        },
    }


@dataclasses.dataclass(frozen=True)
class WorkloadView:
    """What the operator reads of a Workload."""

    name: str
    api_version: str
    conditions: dict[str, dict[str, Any]]  # type -> condition
    active: bool
    deactivated_for_suspend: bool
    cluster_queue: str | None
    checks: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, workload: dict[str, Any]) -> WorkloadView:
        meta, status = workload.get("metadata") or {}, workload.get("status") or {}
        return cls(
            name=meta.get("name", ""),
            api_version=workload.get("apiVersion") or f"{GROUP}/v1beta2",
            conditions={c.get("type"): c for c in status.get("conditions") or []},
            active=(workload.get("spec") or {}).get("active") is not False,
            deactivated_for_suspend=names.DEACTIVATED_FOR_SUSPEND in (meta.get("annotations") or {}),
            cluster_queue=(status.get("admission") or {}).get("clusterQueue"),
            checks=tuple(status.get("admissionChecks") or ()),
        )

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    def true(self, type_: str) -> dict[str, Any] | None:
        c = self.conditions.get(type_)
        return c if c is not None and c.get("status") == "True" else None


def pick(workloads: list[dict[str, Any]], jobset_uid: str | None) -> WorkloadView | None:
    """The Workload of the JobSet with this uid: owned by it, not being deleted, the newest."""
    mine = [
        w
        for w in workloads
        if any(r.get("uid") == jobset_uid for r in (w.get("metadata") or {}).get("ownerReferences") or [])
    ]
    mine.sort(key=lambda w: (not w["metadata"].get("deletionTimestamp"), w["metadata"].get("creationTimestamp", "")))
    return WorkloadView.of(mine[-1]) if mine else None


def admission(wl: WorkloadView | None, queue: str, jobset: str) -> tuple[ConditionStatus, str, str]:
    """(status, reason, message) of the job's `Admitted` condition."""
    if wl is None:
        return (
            "False",
            "NoWorkload",
            f"waiting for Kueue to create the Workload of JobSet {jobset} "
            f"({KUEUE_QUEUE_LABEL}={queue}); if none comes, check that Kueue runs with its JobSet integration",
        )
    quota = wl.conditions.get("QuotaReserved")
    evicted, admitted = wl.true("Evicted"), wl.true("Admitted")
    if evicted is not None:  # before Admitted: Kueue clears that only once the pods are gone
        now = (quota or {}).get("message") if not wl.true("QuotaReserved") else None
        message = f"evicted by Kueue ({evicted.get('reason')}): {evicted.get('message') or 'no message'}"
        return (
            "False",
            evicted.get("reason") or "Evicted",
            message + (f"; now: {now}" if now and now != evicted.get("message") else ""),
        )
    if admitted is not None:
        where = f"ClusterQueue {wl.cluster_queue}" if wl.cluster_queue else f"LocalQueue {queue}"
        return "True", "Admitted", f"admitted by {where}"
    if wl.true("QuotaReserved"):  # quota held; admission checks (e.g. a ProvisioningRequest) still pending
        checks = (
            "; ".join(
                f"{c.get('name')}: {c.get('state')}" + (f" ({c['message']})" if c.get("message") else "")
                for c in wl.checks
            )
            or (wl.conditions.get("Admitted") or {}).get("message")
            or "pending"
        )
        return (
            "False",
            (wl.conditions.get("Admitted") or {}).get("reason") or "AdmissionChecks",
            f"quota reserved in ClusterQueue {wl.cluster_queue or '?'}; waiting for admission checks: {checks}",
        )
    if quota is not None:
        return (
            "False",
            quota.get("reason") or "Pending",
            quota.get("message") or f"waiting for quota in LocalQueue {queue}",
        )
    return "False", "Unattempted", f"Kueue has not tried to admit Workload {wl.name} (LocalQueue {queue}) yet"


def follow(
    status: TPUTrainingJobStatus,
    wl: WorkloadView | None,
    queue: str,
    jobset: str,
    now: datetime.datetime,
    generation: int | None = None,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The job status after seeing its Workload (None: none yet), and the Events of what changed."""
    before = status.condition("Admitted")
    state, reason, message = admission(wl, queue, jobset)
    conds = set_condition(status.conditions, "Admitted", state, reason, message, now, generation)
    update: dict[str, Any] = dict(conditions=conds, workload_name=wl.name if wl else status.workload_name)
    notices = []
    evicted = wl.true("Evicted") if wl else None
    # An eviction is counted once: by its time (Kueue's metav1.Condition always has one; without it, the
    # first eviction seen is the only one counted).
    at = evicted and (timestamps.parse_or_none(evicted.get("lastTransitionTime")) or status.last_eviction_time or now)
    if evicted is not None and evicted.get("reason") != DEACTIVATED and at != status.last_eviction_time:
        update.update(restarts=(status.restarts or RestartCounts()).plus("preemption"), last_eviction_time=at)
        notices.append(Notice("Warning", "Evicted", f"{message}; queued again in LocalQueue {queue}"))
    elif state == "True" and (before is None or before.status != "True"):
        notices.append(Notice("Normal", "Admitted", message))
    elif (
        state == "False"
        and evicted is None
        and reason not in ("NoWorkload", "Unattempted", DEACTIVATED)
        and (before is None or before.reason != reason)
    ):
        notices.append(Notice("Warning" if reason in MISCONFIGURED else "Normal", "Queued", message))
    return status.model_copy(update=update), notices


def activation_patch(wl: WorkloadView, suspend: bool) -> dict[str, Any] | None:
    """The merge patch of the Workload that makes it follow the job's `spec.suspend`: deactivate it
    (Kueue evicts and suspends the JobSet, and does not requeue it), or reactivate one the operator
    deactivated; None when it already follows."""
    if suspend and wl.active:
        return {"metadata": {"annotations": {names.DEACTIVATED_FOR_SUSPEND: "true"}}, "spec": {"active": False}}
    if not suspend and not wl.active and wl.deactivated_for_suspend:
        return {"metadata": {"annotations": {names.DEACTIVATED_FOR_SUSPEND: None}}, "spec": {"active": True}}
    return None

"""The job's conditions: every type and reason the operator writes, in one table (`TYPES`), and
`set_condition`. Pure.

By the Kubernetes API conventions: each type means one thing, stated with its polarity (`normal`:
the status a healthy job shows, "True" for most; `Hung` and `Failed` are abnormal-true); every
condition carries the `observedGeneration` it was computed for; `lastTransitionTime` moves only when
`status` does; reasons are CamelCase. Reasons another component chose (the kubelet's, Kueue's, the
TPU compiler's verdicts) are passed through as they are and named in `passed_through`.

Iterate the table to document it: `for t in TYPES: t.name, t.normal, t.meaning, [(r.name, r.meaning)
for r in t.reasons], t.passed_through`; `REASONS` maps each constant name to its meaning.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence

from ..api.status import Condition, ConditionStatus


@dataclasses.dataclass(frozen=True)
class Reason:
    name: str  # CamelCase, as written
    meaning: str  # one line


@dataclasses.dataclass(frozen=True)
class ConditionType:
    name: str
    normal: ConditionStatus  # the status of a healthy job ("True": normal-true; "False": abnormal-true)
    meaning: str  # what True means, one line
    reasons: tuple[Reason, ...]
    passed_through: str = ""  # where other reasons come from, if any


def _r(name: str, meaning: str) -> Reason:
    return Reason(name, meaning)


TYPES: tuple[ConditionType, ...] = (
    ConditionType(
        "Ready",
        "True",
        "training is progressing (phase Running), or the job has succeeded",
        (
            _r("Progressing", "True: the job's slices are running"),
            _r("Completed", "True: the job succeeded"),
            _r(
                "InvalidSpec",
                "False: the spec does not validate (the message names the fields), or the API server "
                "refuses, in a dry run, what it renders (the message is the API's)",
            ),
            _r("DoesNotFit", "False: the pre-flight compile says the job cannot run as written"),
            _r("Planning", "False: the pre-flight compile is running; the JobSet is created after it"),
            _r("NameConflict", "False: a child's name is taken by an object this job does not own"),
            _r("PodsPending", "False: the JobSet exists and its pods are not running yet"),
            _r("Queued", "False: Kueue holds the job until it admits it"),
            _r("Suspended", "False: spec.suspend is true"),
            _r("Restarting", "False: a restart replaces the JobSet"),
            _r("Failed", "False: the job failed"),
        ),
    ),
    ConditionType(
        "Running",
        "True",
        "some slice's pods are active or ready, outside a restart",
        (
            _r("SlicesActive", "True: some of the JobSet's Jobs are active or ready"),
            _r("NotStarted", "False: no pod runs yet (pending or queued)"),
            _r("Suspended", "False: the job is suspended"),
            _r("Restarting", "False: a restart replaces the JobSet"),
            _r("Completed", "False: the job succeeded"),
            _r("Failed", "False: the job failed"),
        ),
    ),
    ConditionType(
        "Planned",
        "True",
        "the pre-flight compile found that the train step fits the slice",
        (
            _r("Fits", "True: it fits, with the headroom asked for"),
            _r("Compiling", "Unknown: the pre-flight Job is compiling"),
            _r("DeadlineExceeded", "Unknown: the pre-flight did not finish in time; the JobSet is created"),
            _r("PreflightFailed", "Unknown: the pre-flight left no result; the JobSet is created"),
            _r("PreflightNotStarted", "Unknown: the pre-flight pod did not start; the JobSet is created"),
        ),
        "False: the compiler's verdict (DoesNotFit, VmemOverflow, RejectedFlags); Unknown: its other "
        "verdicts (api/contract.py PlanVerdict)",
    ),
    ConditionType(
        "SpecChange",
        "True",
        "the JobSet was made from the job's current spec",
        (
            _r("Applied", "True: the JobSet matches the spec"),
            _r("Immutable", "False: fields other than spec.suspend changed; the JobSet is kept as it is"),
            _r("InvalidSpec", "False: the edited spec does not validate; the JobSet runs on"),
        ),
    ),
    ConditionType(
        "ChildrenAsMade",
        "True",
        "the labels and annotations the operator renders on the JobSet and ConfigMap are as it made them, and the "
        "ConfigMap the JobSet mounts exists (set once a hand edit is found: controller/drift.py)",
        (
            _r("Reverted", "True: a hand edit was put back (the message names the object and fields)"),
            _r(
                "Edited",
                "False: a hand edit is left as found: the applied-spec annotation after a refused spec change (it "
                "cannot be known), or a restore the API refused",
            ),
            _r("ConfigMapLost", "False: the ConfigMap was deleted and the current spec no longer renders it"),
            _r("AsMade", "True: the JobSet's edit was undone by hand"),
        ),
    ),
    ConditionType(
        "Resized",
        "False",
        "an elastic job runs on fewer slices than spec.tpu.slices (docs/elastic.md)",
        (
            _r(
                "SliceLost",
                "True: a slice was lost; the JobSet was re-created on the slices left, the global batch kept",
            ),
            _r("Restarted", "False: restarted on every slice (fewer than elastic.minSlices were left)"),
            _r("GrewBack", "False: back on every slice after a checkpoint"),
        ),
    ),
    ConditionType(
        "Admitted",
        "True",
        "Kueue admitted the job's Workload (jobs with a queueName)",
        (
            _r("Admitted", "True: admitted by its ClusterQueue"),
            _r("NoWorkload", "False: Kueue has not made the JobSet's Workload yet"),
            _r("Unattempted", "False: Kueue has not tried to admit the Workload yet"),
            _r("AdmissionChecks", "False: quota reserved, admission checks pending"),
            _r("Pending", "False: waiting for quota"),
        ),
        "False: the Workload's own QuotaReserved, Admitted or Evicted reason (Kueue)",
    ),
    ConditionType(
        "Scheduled",
        "True",
        "every pod of the JobSet is on a node",
        (
            _r("Scheduled", "True: every pod is on a node"),
            _r("Pending", "False: pods not created yet, or the scheduler has not looked at all of them"),
            _r("Unschedulable", "False: the scheduler cannot place a pod; its words are the message"),
            _r("SchedulingGated", "False: a pod waits for its scheduling gates"),
        ),
    ),
    ConditionType(
        "ContainersReady",
        "True",
        "every pod of the JobSet is ready",
        (
            _r("Ready", "True: every pod is ready"),
            _r("Starting", "False: the containers are on their way"),
        ),
        "False: the kubelet's reason for a container that cannot start or failed (diagnosis.py)",
    ),
    ConditionType(
        "Metrics",
        "True",
        "the trainer's /status was read on the last try",
        (
            _r("Read", "True: read from pod 0 of slice 0"),
            _r(
                "NonFinite",
                "True: read, and a value was not finite (nan, inf): status.nonFinite names it, its field is left out",
            ),
            _r("Unreachable", "False: the read failed; the values in the status are the last ones read"),
        ),
    ),
    ConditionType(
        "Hung",
        "False",
        "the trainer answered but completed no step within its timeout",
        (
            _r("NoProgress", "True: no step for longer than the hang or start-up timeout; the job restarts"),
            _r("Progressing", "False: steps complete again"),
        ),
    ),
    ConditionType(
        "NodesHeld",
        "False",
        "a node under the job is NotReady while so many TPU nodes are that the operator holds its stop "
        "(docs/failures.md#unhealthy-tpu-nodes)",
        (
            _r(
                "ClusterDisrupted",
                "True: most TPU nodes are NotReady together; stops on Ready wait 5 x nodeUnhealthyGraceSeconds",
            ),
            _r("Released", "False: the hold is over, or a restart replaced the job"),
        ),
    ),
    ConditionType(
        "Succeeded",
        "True",
        "the job completed (set once, when it does)",
        (_r("JobSetCompleted", "True: the JobSet completed"),),
    ),
    ConditionType(
        "Failed",
        "False",
        "the job failed for good (set once, when it does)",
        (
            _r("JobSetFailed", "True: the JobSet failed and no restart was decided"),
            _r("RestartPolicy", "True: the restart policy gave up (a user error, an exit code, the budget)"),
            _r(
                "Diverged",
                "True: the loss or gradient norm was not finite and onDivergence is Fail, or its budget is spent "
                "(status.divergence says where)",
            ),
        ),
    ),
    ConditionType(
        "Reconciled",
        "True",
        "the API accepted the operator's last requests for this job",
        (
            _r("Reconciled", "True: the last reconcile went through (set after a refusal)"),
            _r("Forbidden", "False: HTTP 403: the operator's RBAC lacks a verb; the message is the API's"),
            _r("Invalid", "False: HTTP 422: the API refused an object the operator made"),
            _r("BadRequest", "False: HTTP 400: the API refused a request"),
            _r("NotFound", "False: HTTP 404 on a create: the namespace or resource type does not exist"),
        ),
    ),
)

BY_TYPE = {t.name: t for t in TYPES}
REASONS = {r.name: r.meaning for t in TYPES for r in t.reasons}  # every reason constant, one meaning each


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int | None = None,
) -> tuple[Condition, ...]:
    """`conditions` with `type_` set; its lastTransitionTime moves only if `status` changes."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else None
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since or now,
        observed_generation=generation,
    )
    if old is None:
        return (*conditions, new)
    return tuple(new if c is old else c for c in conditions)

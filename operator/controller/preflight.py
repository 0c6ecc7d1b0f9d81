"""The pre-flight: before a job's JobSet is created, its train step is compiled for its slice by the TPU
compiler on a CPU node, and a job the compiler says cannot fit never gets a JobSet.

The pre-flight is a batch/v1 Job (rendering/preflight.py: the workload image running
`python -m tpu_workload.performance.plan` on the job's ConfigMap and flags, no TPU, `backoffLimit: 0`, a deadline,
owned by the job) named `<job>-plan-<generation>`; its pod leaves the plan's JSON as its termination
message. Level-triggered like the rest of the reconcile: what happens is decided from the job's status,
the pre-flight Job as the watch last saw it (a kopf index, like the JobSets), and, once it has finished
or while its pod is late, one list of its pods (`decide`, pure):

1. No pre-flight for this job (spec.plan.preflight skip, its own command, or its JobSet exists and is not
   gated, below): the reconcile goes on as without one.
2. The `Planned` condition already decided this generation: follow it (False: the job stays Invalid;
   True or Unknown: the JobSet is made, e.g. again after it was deleted).
3. No pre-flight Job for this generation: the ConfigMap (its pod mounts it) and the Job are created,
   Planned=Unknown reason Compiling. An operator restarted mid-way finds the Job in its index, or in the
   status it wrote (Compiling), and never creates a second.
4. The Job finished: the result is its pod's termination message. Fits: Planned=True, `status.plan`, the
   JobSet is created. DoesNotFit, VmemOverflow, RejectedFlags: phase Invalid with the fields to change,
   Planned=False, a Warning Event, no JobSet. Anything else (no libtpu, a generation it cannot target, a
   crash, the deadline): Planned=Unknown with why, a Warning Event, and the JobSet is created as without
   a pre-flight: a pre-flight that cannot run never holds a job back.
5. Still going: a pod not started after `start_s` (an image that cannot be pulled, no CPU node with
   room) is looked at once and the pre-flight given up with the kubelet's or scheduler's words; past
   the Job's deadline plus `grace_s`, given up too. Otherwise the job is looked at again when the next
   of those moments comes (the work queue's timer, no polling of the API).

A job with a Kueue queue does not wait for its compile to join the queue (`overlaps`): its JobSet is
created at once, suspended as every queued JobSet is, with Kueue's admission gate
(`kueue.x-k8s.io/admission-gated-by: training.tpu-operator.dev/preflight`), which Kueue copies to the
JobSet's Workload when it makes it (jobframework's prepareWorkload) and which holds the Workload's
admission. The steps above then run with that JobSet `gated`: Fits or could not be checked, the gate is
lifted (Kueue copies its removal to the Workload, which then competes for quota); does not fit, the
JobSet is deleted before it ever ran and the job is Invalid as above. A gated JobSet whose spec is no
longer the job's (an edit while it compiled: the spec is still open then) is deleted and made again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from ..api import names, timestamps
from ..api.contract import JOB_MUST_CHANGE, PlanResult
from ..api.derived import Plan
from ..api.models import TPUTrainingJob
from ..api.status import PlanStatus, TPUTrainingJobStatus
from ..rendering.manifests import render
from ..rendering.plan_report import plan_problems
from ..rendering.preflight import (
    DEADLINE_S,
    LABEL_GENERATION,
    LABEL_ROLE,
    ROLE,
    preflight_labels,
    preflight_name,
    render_preflight,
)
from . import children, diagnosis
from .conditions import set_condition
from .kube import BATCH_JOBS, CONFIGMAPS, JOBSETS, PODS, Kube, Obj
from .phases import Compute, Notice

COMPILING = "Compiling"


@dataclasses.dataclass(frozen=True)
class Timing:
    start_s: float = 300.0  # the pod must be running by then (a CPU node may have to be added first)
    deadline_s: int = DEADLINE_S  # the Job's activeDeadlineSeconds
    grace_s: float = 60.0  # after the deadline, for a Job controller that never says it failed


def wanted(job: TPUTrainingJob) -> bool:
    """The job is pre-flighted: planning is on and the pods run our trainer (a command of its own is not
    the step the plan compiles)."""
    return job.spec.plan.preflight == "compile" and not job.spec.command


# Kueue's admission gate (constants.AdmissionGatedByAnnotation; beta and on by default since Kueue 0.19): a
# Workload carrying it is not admitted until the gate is gone. Kueue's Workload webhook refuses a gate added
# after creation, so the JobSet carries it from the start.
ADMISSION_GATE = "kueue.x-k8s.io/admission-gated-by"
GATE = "training.tpu-operator.dev/preflight"


def overlaps(job: TPUTrainingJob) -> bool:
    """The job's JobSet joins its Kueue queue while the pre-flight compiles, held by the admission gate."""
    return wanted(job) and job.spec.queue_name is not None


def gated(jobset: Obj | None) -> bool:
    """The JobSet still carries our admission gate (a queued job whose pre-flight has not said yes)."""
    gates = ((jobset or {}).get("metadata") or {}).get("annotations", {}).get(ADMISSION_GATE) or ""
    return GATE in [g.strip() for g in gates.split(",")]


def with_gate(jobset: Obj) -> Obj:
    """The rendered JobSet, created with our admission gate."""
    meta = jobset["metadata"]
    return {**jobset, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}), ADMISSION_GATE: GATE}}}


def lift_patch(jobset: Obj) -> Obj:
    """The merge patch that takes our gate off the JobSet (another controller's gates stay)."""
    gates = [g.strip() for g in jobset["metadata"]["annotations"][ADMISSION_GATE].split(",") if g.strip() != GATE]
    return {"metadata": {"annotations": {ADMISSION_GATE: ",".join(gates) or None}}}


def trim(job: Obj) -> Obj:
    """What the index keeps of a pre-flight Job."""
    meta = job.get("metadata") or {}
    return {
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "labels", "creationTimestamp", "deletionTimestamp", "ownerReferences")
            if k in meta
        },
        "status": job.get("status") or {},
    }


def job_key(job: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, TPUTrainingJob name) of one of our pre-flight Jobs."""
    meta = job.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_ROLE) != ROLE or not labels.get(names.LABEL_JOB):
        return None
    return meta.get("namespace", "default"), labels[names.LABEL_JOB]


def of_generation(found: Sequence[Obj], generation: int) -> Obj | None:
    return next(
        (
            j
            for j in found
            if ((j.get("metadata") or {}).get("labels") or {}).get(LABEL_GENERATION) == str(generation)
            and not j["metadata"].get("deletionTimestamp")
        ),
        None,
    )


# --- the decision (pure) ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Decision:
    kind: Literal["create", "wait", "list_pods", "fits", "invalid", "unknown"]
    reason: str = ""
    message: str = ""
    result: PlanResult | None = None
    requeue_after_s: float | None = None


def _state(job: Obj) -> tuple[str, str]:
    """(succeeded | failed | running | pending, the Job's failure reason) from a batch Job's status."""
    status = job.get("status") or {}
    true = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if status.get("succeeded") or "Complete" in true or "SuccessCriteriaMet" in true:
        return "succeeded", ""
    failed = true.get("Failed") or true.get("FailureTarget")
    if status.get("failed") or failed:
        return "failed", (failed or {}).get("reason", "")
    return ("running" if status.get("ready") else "pending"), ""


def read_result(pods: Sequence[Obj]) -> tuple[PlanResult | None, str]:
    """The plan's result from the pod's termination message, or why there is none."""
    for pod in sorted(pods, key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "", reverse=True):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
            if not ended:
                continue
            message = (ended.get("message") or "").strip()
            try:
                return PlanResult.model_validate_json(message), ""
            except ValidationError:
                why = f"the plan exited with code {ended.get('exitCode')} ({ended.get('reason') or 'Error'})"
                return None, why + (f": {message[-600:]}" if message else " without a result")
    return None, "its pod left no result"


def decide(found: Obj | None, pods: Sequence[Obj] | None, age_s: float, timing: Timing, compiling: bool) -> Decision:
    """What to do about a pre-flight Job (`found`, None if none is known for this generation) that is
    `age_s` old; `pods`: its pods when listed (None: not listed yet); `compiling`: the status says this
    generation's Job was created (the watch may not have delivered it yet)."""
    if found is None:
        if compiling and age_s < timing.start_s:
            return Decision("wait", requeue_after_s=timing.start_s - age_s)
        return Decision("create", requeue_after_s=timing.start_s)
    state, failure = _state(found)
    name = found["metadata"]["name"]
    if state in ("succeeded", "failed"):
        if pods is None:
            return Decision("list_pods")
        result, why = read_result(pods)
        if result is None:
            reason = "DeadlineExceeded" if failure == "DeadlineExceeded" else "PreflightFailed"
            return Decision("unknown", reason, f"pre-flight Job {name} {failure or 'failed'}: {why}")
        if result.verdict == "Fits":
            return Decision("fits", "Fits", result.message, result)
        if result.verdict in JOB_MUST_CHANGE:
            return Decision("invalid", result.verdict, result.message, result)
        return Decision("unknown", result.verdict, result.message, result)
    end = timing.deadline_s + timing.grace_s
    if age_s >= end:
        return Decision("unknown", "DeadlineExceeded", f"pre-flight Job {name} did not finish in {end:.0f} s")
    if state == "pending" and age_s >= timing.start_s:
        if pods is None:
            return Decision("list_pods")
        if not pods:
            return Decision(
                "unknown",
                "PreflightNotStarted",
                f"no pod of pre-flight Job {name} after {age_s:.0f} s (is a Job controller running?)",
            )
        for verdict in (diagnosis.containers(pods), diagnosis.scheduled(pods)):
            if verdict[0] == "False" and verdict[1] not in (diagnosis.STARTING, "Pending"):
                return Decision(
                    "unknown", "PreflightNotStarted", f"the pre-flight pod did not start in {age_s:.0f} s: {verdict[2]}"
                )
        if not any((p.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed") for p in pods):
            return Decision(
                "unknown",
                "PreflightNotStarted",
                f"the pre-flight pod did not start in {age_s:.0f} s: {diagnosis.scheduled(pods)[2]}",
            )
        return Decision("wait", requeue_after_s=end - age_s)  # it runs; the Job's status lags
    return Decision("wait", requeue_after_s=(timing.start_s if state == "pending" else end) - age_s)


# --- the status (pure) --------------------------------------------------------------------------------


def plan_status(result: PlanResult | None, capacity: float, now: datetime.datetime) -> PlanStatus:
    r = result or PlanResult(verdict="CompileError", message="")
    return PlanStatus(
        hbm_per_device_gib=r.hbm_per_device_gib,
        hbm_capacity_gib=r.hbm_capacity_gib or capacity,
        host_per_device_gib=r.host_per_device_gib or None,
        fits=r.fits,
        compile_seconds=r.compile_seconds,
        libtpu_version=r.libtpu_version,
        slices=r.slices,
        hbm_by_slices=r.hbm_by_slices or None,
        resources=r.resources,
        checked_at=now,
    )


def compiling(
    status: TPUTrainingJobStatus, name: str, where: str, generation: int | None, now: datetime.datetime
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    message = f"compiling the train step for {where} on a CPU node (pre-flight Job {name})"
    conds = set_condition(status.conditions, "Planned", "Unknown", COMPILING, message, now, generation)
    conds = set_condition(
        conds,
        "Ready",
        "False",
        "Planning",
        "the JobSet is created once the pre-flight says the step fits",
        now,
        generation,
    )
    return status.model_copy(
        update=dict(phase="Pending", message=message, conditions=conds, plan=None, observed_generation=generation)
    ), []


def planned(
    status: TPUTrainingJobStatus, decision: Decision, capacity: float, generation: int | None, now: datetime.datetime
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """Fits (True) or could not be checked (Unknown): the JobSet is created next, in the same write."""
    before = status.condition("Planned")
    if decision.kind == "fits":
        conds = set_condition(status.conditions, "Planned", "True", "Fits", decision.message, now, generation)
        notice = Notice("Normal", "Planned", decision.message)
    else:
        message = f"{decision.message}; the JobSet is created without the check"
        conds = set_condition(status.conditions, "Planned", "Unknown", decision.reason, message, now, generation)
        notice = Notice("Warning", decision.reason, message)
    fresh = before is None or before.reason != decision.reason or before.observed_generation != generation
    new = status.model_copy(update=dict(conditions=conds, plan=plan_status(decision.result, capacity, now)))
    return new, [notice] if fresh else []


def does_not_fit(
    status: TPUTrainingJobStatus,
    decision: Decision,
    found: list[str],
    capacity: float,
    generation: int | None,
    now: datetime.datetime,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The compiler says the job cannot run as written: Invalid, naming what to change; no JobSet."""
    message = "; ".join(found)
    reason = "DoesNotFit"  # every verdict that makes a job Invalid: HBM, VMEM, or flags libtpu refuses
    before = status.condition("Planned")
    conds = set_condition(status.conditions, "Planned", "False", decision.reason, message, now, generation)
    conds = set_condition(conds, "Ready", "False", reason, message, now, generation)
    new = status.model_copy(
        update=dict(
            phase="Invalid",
            message=message,
            conditions=conds,
            observed_generation=generation,
            plan=plan_status(decision.result, capacity, now),
        )
    )
    fresh = before is None or before.status != "False" or before.observed_generation != generation
    return new, [Notice("Warning", reason, message)] if fresh else []


# --- the gate (I/O) -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gate:
    """What the reconcile does next: make the JobSet (`proceed`) or not; what to write (`compute`, applied
    before the reconcile's own), when to look again, and whether the ConfigMap is known to exist."""

    proceed: bool
    compute: Compute | None = None
    result: str = "planning"
    requeue_after_s: float | None = None
    config_map_exists: bool = False


async def gate(
    kube: Kube,
    job: TPUTrainingJob,
    job_obj: Obj,
    found: Sequence[Obj],
    timing: Timing,
    default_image: str | None,
    now: datetime.datetime,
) -> Gate:
    """The pre-flight's part of a reconcile of a job that wants one and has no JobSet, or a gated one (see
    the module docstring); `found` are the job's pre-flight Jobs as the watch saw them."""
    status = TPUTrainingJobStatus.model_validate(job_obj.get("status") or {})
    generation = job_obj["metadata"].get("generation") or 1
    namespace, name = job.metadata.namespace, job.metadata.name
    capacity = Plan(job).hbm_gib_per_device
    current = of_generation(found, generation)
    mark = status.condition("Planned")
    if mark is not None and mark.observed_generation == generation and mark.reason != COMPILING:
        if mark.status == "False":
            return Gate(False, result="invalid")
        return Gate(True, config_map_exists=current is not None)
    is_compiling = mark is not None and mark.observed_generation == generation and mark.reason == COMPILING
    since = timestamps.parse_or_none((current or {}).get("metadata", {}).get("creationTimestamp")) or (
        mark.last_transition_time if is_compiling and mark is not None else None
    )
    age = (now - since).total_seconds() if since is not None else 0.0
    decision = decide(current, None, age, timing, is_compiling)
    if decision.kind == "list_pods":
        selector = ",".join(
            f"{k}={v}" for k, v in preflight_labels(name, generation).items() if k != names.LABEL_MANAGED_BY
        )
        decision = decide(current, await kube.list(PODS, namespace, selector), age, timing, is_compiling)
    pf_name = preflight_name(name, generation)
    if decision.result is not None:  # the step's time bounds need the generation's peaks (api/roofline.py)
        decision = dataclasses.replace(decision, result=Plan(job).bounded(decision.result))
    where = f"{job.spec.tpu.generation} {job.spec.tpu.topology} x {job.spec.tpu.slices}"
    if decision.kind in ("create", "wait"):
        if decision.kind == "create":
            await _create(kube, job, generation, timing, default_image)
        return Gate(False, lambda s, g: compiling(s, pf_name, where, g, now), requeue_after_s=decision.requeue_after_s)
    if decision.kind == "invalid":
        assert decision.result is not None  # decide(): an invalid plan carries the result that says why
        found_problems = plan_problems(decision.result, job)
        return Gate(False, lambda s, g: does_not_fit(s, decision, found_problems, capacity, g, now), result="invalid")
    return Gate(True, lambda s, g: planned(s, decision, capacity, g, now), config_map_exists=True)


async def _create(kube: Kube, job: TPUTrainingJob, generation: int, timing: Timing, default_image: str | None) -> None:
    """The ConfigMap and the pre-flight Job, side by side (a pod waits for its ConfigMap volume), once the
    API server has admitted, in a dry run, the ConfigMap and the JobSet with its pods: a job it would refuse
    later is Invalid before a CPU node compiles anything (children.Inadmissible)."""
    config_map, jobset = await asyncio.to_thread(render, job, default_image)  # off the event loop
    await children.dry_run(
        kube,
        job.metadata.namespace,
        (CONFIGMAPS, config_map),
        (JOBSETS, jobset),
        *((PODS, p) for p in children.pods_of(jobset)),
    )
    await children.ensure_all(
        kube,
        job.metadata.uid or "",
        (CONFIGMAPS, config_map),
        (BATCH_JOBS, render_preflight(job, generation, default_image, timing.deadline_s)),
    )

"""The reconcile logic: plain async functions over the `Kube` protocol, so a test can call them.

Level-triggered: `reconcile` looks at a job as it is (the object kopf's watch delivered), its JobSet
as the watch last saw it (or as a resync GET found it) and the trainer's latest metrics, makes the
children exist, and writes the status once, as a merge patch of the fields that changed (nothing
when nothing changed). An operator killed at any point and restarted neither creates anything twice
(deterministic names; a 409 AlreadyExists adopts the object when this job owns it) nor loses
anything. The operator is the single writer of `.status`; the write carries the resourceVersion it
was computed from, and a conflict re-reads and recomputes once, then leaves it to the next event or
the resync (a conflict means the object changed, and that change is an event of its own).

Spec changes: `spec.suspend` is patched into the JobSet, or, for a job with a Kueue queue, into its
Workload's `spec.active` (kueue.py: Kueue owns a queued JobSet's suspension and would undo a patch of
it); any other change to a job whose JobSet exists is refused: the JobSet stays as it is, condition
SpecChange=False (reason Immutable) names the changed fields and a Warning Event says so. To apply
such a change, delete the job and create it again (a checkpointed job resumes from its checkpoint
directory). The spec a JobSet was made from is rendered into its annotation
`training.tpu-operator.dev/applied-spec`.

Restarts (the rule: api/failures.py; the pure steps: restarts.py): a JobSet that failed and was not
counted yet has its pods listed once (exit codes, termination messages); a running one may be hung
(the trainer's clock in the ledger). The decision is written with the status, restart counts and the
replaced JobSet's uid first; only then is that JobSet deleted (`replace_jobset`), so an operator
killed in between finds the decision and deletes it, never counting it twice. While the backoff
runs (`nextRestartTime`) a missing JobSet is not created; after it, it is created under the same
name, so two never exist. The goodput ledger moves with the same reconcile (accounting.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..api import names
from ..api.models import KIND, TPUTrainingJob, TPUTrainingJobStatus
from ..api.validation import InvalidJob, parse_job
from ..rendering.manifests import applied_spec, render
from . import accounting, diagnosis, kueue, phases, preflight, restarts, status as status_lib
from .kube import CONFIGMAPS, JOBS, JOBSETS, PODS, ApiError, Kube, Obj, Resource
from .metrics_reader import LABEL_JOBSET, MetricsReader
from .phases import Compute, Notice

log = logging.getLogger("tpu_operator")
Emit = Callable[[Obj, Notice], None]  # post an Event about an object


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    default_image: str | None = None
    metrics_access: Literal["proxy", "direct"] = "proxy"
    metrics_interval_s: float = 10.0
    metrics_timeout_s: float = 3.0
    resync_interval_s: float = 60.0
    conflict_retry_s: float = 30.0
    preflight: preflight.Timing = preflight.Timing()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a reconcile did (`result`, counted in the operator's metrics), the job as it is now (after
    the status write, for the caller's cache), and when to look again if no event will say."""

    result: str  # created | adopted | followed | invalid | conflict | finished | deleting | gone
    job: Obj | None = None
    requeue_after_s: float | None = None
    jobset: Obj | None = None  # the JobSet this reconcile created or adopted (the watch may not have it yet)


class NameConflict(Exception):
    pass


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- children ----------------------------------------------------------------------------------------


def owner_uids(obj: Obj) -> list[str]:
    return [ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []]


def owner_of(jobset: Obj) -> tuple[str, str, str] | None:
    """(namespace, job name, job uid) of the TPUTrainingJob that controls this JobSet."""
    meta = jobset.get("metadata") or {}
    name = (meta.get("labels") or {}).get(names.LABEL_JOB)
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND and r.get("controller")), None)
    if not name or ref is None or ref.get("name") != name:
        return None
    return meta.get("namespace", "default"), name, ref["uid"]


async def ensure_child(kube: Kube, resource: Any, manifest: Obj, owner_uid: str) -> tuple[Obj, bool]:
    """Create `manifest`, or adopt the object of that name if this job owns it: (object, created)."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        return await kube.create(resource, namespace, manifest), True
    except ApiError as exc:
        if exc.status != 409:
            raise
    existing = await kube.get(resource, namespace, name)
    if owner_uid in owner_uids(existing):
        return existing, False
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in existing["metadata"].get("ownerReferences") or [])
    raise NameConflict(f"{manifest['kind']} {name} already exists and is "
                       f"{'owned by ' + owners if owners else 'not owned by any object'}, not by this job; "
                       "delete or rename it")


async def ensure_children(kube: Kube, job: TPUTrainingJob, default_image: str | None,
                          config_map_exists: bool = False, gated: bool = False) -> tuple[Obj, bool]:
    """The ConfigMap (unless known to exist: the pre-flight made it) and the JobSet, created side by side
    (a pod waits for its ConfigMap volume), the JobSet with Kueue's admission gate if `gated`: (the JobSet,
    whether it was created now)."""
    config_map, jobset = render(job, default_image)
    if gated:
        jobset = preflight.with_gate(jobset)
    uid = job.metadata.uid or ""
    results = await asyncio.gather(*([] if config_map_exists else [ensure_child(kube, CONFIGMAPS, config_map, uid)]),
                                   ensure_child(kube, JOBSETS, jobset, uid), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results[-1]


def changed_fields(before: Any, after: Any, path: str = "spec") -> list[str]:
    """Dotted paths where two specs differ (lists compare whole)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [p for key in sorted(set(before) | set(after))
                for p in changed_fields(before.get(key), after.get(key), f"{path}.{key}")]
    return [] if before == after else [path]


def refused_changes(jobset: Obj, job: TPUTrainingJob) -> list[str]:
    applied = ((jobset.get("metadata") or {}).get("annotations") or {}).get(names.APPLIED_SPEC)
    return changed_fields(json.loads(applied), applied_spec(job)) if applied else []


def jobset_completed(jobset: Obj) -> bool:
    return phases.phase_of(None, phases.JobSetView.of(jobset)) == "Succeeded"


def jobset_failed(jobset: Obj) -> bool:
    js = phases.JobSetView.of(jobset)
    return "Failed" in js.true_conditions or js.terminal_state == "Failed"


async def failure_of(kube: Kube, namespace: str, jobset: Obj) -> restarts.Failure:
    """Why a JobSet failed, from its pods (one LIST, only when a JobSet fails)."""
    name = jobset["metadata"]["name"]
    pods = await kube.list(PODS, namespace, f"{LABEL_JOBSET}={name}")
    return restarts.failure_of(pods, phases.JobSetView.of(jobset).condition_message("Failed"))


async def replace_jobset(kube: Kube, namespace: str, jobset: Obj, cause: str) -> None:
    """Delete a JobSet a restart replaces (foreground: its pods go first; only this uid). Its DELETED
    event brings the job back, and the reconcile creates the JobSet again once the backoff is over.
    Unless the restart is for a preemption (its pods are saving the step in flight), the pods go at
    once (gracePeriodSeconds 0): a JAX process cannot save without all of its peers, so a failed or
    hung attempt's survivors would only sit out their grace period in a collective."""
    meta = jobset["metadata"]
    if meta.get("deletionTimestamp"):
        return
    try:
        if cause != "preemption":
            await kube.delete_all(PODS, namespace, f"{LABEL_JOBSET}={meta['name']}",
                                  {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        await kube.delete(JOBSETS, namespace, meta["name"], {
            "apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground",
            "preconditions": {"uid": meta["uid"]}})
    except ApiError as exc:
        if exc.status not in (404, 409):  # gone already, or another JobSet of that name: not ours to delete
            raise


# --- status ------------------------------------------------------------------------------------------


async def write_status(kube: Kube, job_obj: Obj, compute: Compute, emit: Emit) -> Obj | None:
    """Compute the new status from the job's and write what changed, with the resourceVersion it was
    computed from; post the Events of its transitions once it is written. On a conflict, read the job
    and compute once more. Returns the job as it is now; None if it is gone or was replaced, or if the
    second write conflicted too (the change behind the conflict is an event: it comes back)."""
    meta = job_obj["metadata"]
    namespace, name, uid = meta.get("namespace", "default"), meta["name"], meta.get("uid")
    for attempt in (1, 2):
        old = TPUTrainingJobStatus.model_validate(job_obj.get("status") or {})
        new, notices = compute(old, job_obj["metadata"].get("generation"))
        patch = status_lib.merge_patch(old.to_wire(), new.to_wire())
        if not patch:
            return job_obj
        body = {"metadata": {"resourceVersion": job_obj["metadata"]["resourceVersion"]}, "status": patch}
        try:
            written = await kube.patch(JOBS, namespace, name, body, sub="status")
        except ApiError as exc:
            if exc.status == 404:
                return None
            if exc.status != 409:
                raise
            if attempt == 2:
                log.info("the status write of %s/%s conflicted twice; leaving it to the next event or resync",
                         namespace, name)
                return None
            try:
                job_obj = await kube.get(JOBS, namespace, name)
            except ApiError as exc2:
                if exc2.status == 404:
                    return None
                raise
            if job_obj["metadata"].get("uid") != uid:
                return None  # deleted and created again: the new job is not ours to describe
            continue
        for notice in notices:
            emit(written, notice)
        return written
    return None


# --- the reconcile -----------------------------------------------------------------------------------


async def apply_suspend(kube: Kube, job: TPUTrainingJob, jobset: Obj, workload: kueue.WorkloadView | None) -> Obj:
    """Make the JobSet (no queue) or the Kueue Workload (a queue) follow spec.suspend; the JobSet."""
    namespace, name = job.metadata.namespace, jobset["metadata"]["name"]
    if job.spec.queue_name is None:
        if bool((jobset.get("spec") or {}).get("suspend")) != job.spec.suspend:
            return await kube.patch(JOBSETS, namespace, name, {"spec": {"suspend": job.spec.suspend}})
        return jobset
    patch = kueue.activation_patch(workload, job.spec.suspend) if workload is not None else None
    if patch is not None:
        try:
            await kube.patch(Resource(kueue.GROUP, workload.version, kueue.PLURAL), namespace, workload.name, patch)
        except ApiError as exc:
            if exc.status != 404:  # a Workload gone is replaced by a new one, whose event comes
                raise
    return jobset


async def reconcile(kube: Kube, job_obj: Obj, jobset: Obj | None, sample: status_lib.Sample | None,
                    config: OperatorConfig, emit: Emit, reader: MetricsReader | None = None,
                    now: Callable[[], str] = utcnow, *, workloads: Sequence[Obj] = (),
                    look_at_pods: bool = False, preflights: Sequence[Obj] = ()) -> Outcome:
    """Converge one job: validate, make its ConfigMap and JobSet exist (`jobset` is the JobSet as last
    seen, None when none is known), apply suspend, refuse other changes, map the JobSet's status, its
    Kueue Workload (among `workloads`, those seen under the JobSet's name), the trainer's `sample`, the
    restart policy's decision and, when `look_at_pods` (a JobSet event or a resync) and some pods are
    not ready, the pods' state into the job's, and write it."""
    meta = job_obj["metadata"]
    namespace, uid = meta.get("namespace", "default"), meta.get("uid")
    if meta.get("deletionTimestamp"):
        return Outcome("deleting")
    before = TPUTrainingJobStatus.model_validate(job_obj.get("status") or {})
    if before.finished:
        return Outcome("finished")  # never re-run a finished job, e.g. when its JobSet was deleted by a TTL
    try:
        job = parse_job({k: job_obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in job_obj})
    except InvalidJob as exc:
        problems = exc.problems
        done = await write_status(kube, job_obj, lambda s, g: status_lib.invalid(s, problems, g, now()), emit)
        return Outcome("invalid" if done else "gone", done)

    created, ensured = False, jobset is None or owner_of(jobset) != (namespace, job.metadata.name, uid)
    gated = not ensured and preflight.gated(jobset)  # queued while its pre-flight compiles (preflight.py)
    if gated and refused_changes(jobset, job):  # edited while it compiled: that JobSet never ran
        await kube.delete(JOBSETS, namespace, jobset["metadata"]["name"], {
            "apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": jobset["metadata"]["uid"]}})
        return Outcome("replacing", None, 1.0)
    planned: preflight.Gate | None = None
    if ensured or gated:
        wait = restarts.wait_s(before, now()) if ensured else 0
        if wait > 0:  # a restart's backoff: the JobSet is created again once it is over
            return Outcome("waiting", None, wait)
        try:
            if preflight.wanted(job):  # no running JobSet before the compiler says the step fits (preflight.py)
                planned = await preflight.gate(kube, job, job_obj, preflights, config.preflight, config.default_image,
                                               now())
                if not planned.proceed:
                    if gated and planned.result == "invalid":  # it does not fit: its held JobSet goes
                        await kube.delete(JOBSETS, namespace, jobset["metadata"]["name"], {
                            "apiVersion": "v1", "kind": "DeleteOptions",
                            "preconditions": {"uid": jobset["metadata"]["uid"]}})
                    elif ensured and planned.result == "planning" and preflight.overlaps(job):
                        await ensure_children(kube, job, config.default_image, True, gated=True)
                    done = await write_status(kube, job_obj, planned.compute or (lambda s, g: (s, [])), emit)
                    return Outcome(planned.result if done else "gone", done, planned.requeue_after_s)
            if gated:  # it fits, or could not be checked: Kueue may admit it now
                jobset = await kube.patch(JOBSETS, namespace, jobset["metadata"]["name"], preflight.lift_patch(jobset))
            else:
                jobset, created = await ensure_children(kube, job, config.default_image,
                                                        planned is not None and planned.config_map_exists)
        except NameConflict as exc:
            message = str(exc)
            done = await write_status(kube, job_obj, lambda s, g: status_lib.conflicted(s, message, g, now()), emit)
            return Outcome("conflict", done, config.conflict_retry_s)
    refused = [] if created else refused_changes(jobset, job)
    queue = job.spec.queue_name
    workload = kueue.pick(list(workloads), jobset["metadata"].get("uid")) if queue else None
    jobset = await apply_suspend(kube, job, jobset, workload)
    if sample is None and reader is not None and jobset_completed(jobset):
        # A completed JobSet's pods have exited and serve nothing: the final step and checkpoint come from
        # process 0's termination record.
        sample = await reader.final(namespace, jobset["metadata"]["name"])
    failure = None
    if jobset_failed(jobset) and not restarts.replaced(before, jobset):
        failure = await failure_of(kube, namespace, jobset)
    jobset_name, config_map = jobset["metadata"]["name"], names.config_map_name(job.metadata.name)
    view = phases.JobSetView.of(jobset)
    pods = None
    if look_at_pods and diagnosis.needs_pods(view):  # one list per JobSet event or resync, never per pod
        pods = await kube.list(PODS, namespace, f"{LABEL_JOBSET}={jobset_name}")
    intent = phases.Intent(suspend=job.spec.suspend, queued=queue is not None)
    policy, total_steps, created_at = job.spec.failure_policy, job.spec.training.steps, meta.get("creationTimestamp")

    def compute(old: TPUTrainingJobStatus, generation: int | None) -> tuple[TPUTrainingJobStatus, list[Notice]]:
        t = now()
        old, notices = planned.compute(old, generation) if planned and planned.compute else (old, [])
        new, made = status_lib.reconciled(old, jobset_name, config_map, created, refused, generation, t)
        notices += made
        if queue is not None:
            new, queued = kueue.follow(new, workload, queue, jobset_name, t)
            notices += queued
        new, diagnosed = diagnosis.follow(new, view, pods, t)
        notices += diagnosed
        new = accounting.observed(new, sample, created_at, t)
        restart: phases.Restart = "replaced" if restarts.replaced(new, jobset) else None
        hung = restarts.hang(new, policy, total_steps, t) \
            if restart is None and failure is None and restarts.answered(sample) else None
        if restart is None and (failure is not None or hung is not None):
            new, verdict, more = restarts.decide(new, jobset["metadata"].get("uid"), failure, hung, policy, t)
            restart, notices = ("replaced" if verdict.restart else "given-up"), notices + more
        new, followed = phases.follow(new, jobset, t, intent, diagnosis.trouble(new), restart)
        if sample is not None:
            new = status_lib.with_sample(new, sample, t)
        new = accounting.settled(old, new, sample, failure.progress if failure else None, created_at, t)
        return restarts.recovered(new, t), notices + followed

    done = await write_status(kube, job_obj, compute, emit)
    written = TPUTrainingJobStatus.model_validate((done or {}).get("status") or {})
    if done is not None and restarts.replaced(written, jobset):
        await replace_jobset(kube, namespace, jobset, written.last_restart.cause)
    return Outcome("created" if created else "adopted" if ensured else "followed", done,
                   jobset=jobset if ensured else None)

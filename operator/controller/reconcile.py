"""The reconcile logic: plain async functions over a small API-client protocol, so a test can call them.

Level-based: every call reads what exists and converges, so an operator killed at any point and
restarted neither creates anything twice (deterministic names; 409 AlreadyExists adopts the object
when this job owns it) nor loses anything. The operator is the single writer of `.status`; every
write goes through `update_status`, a read-compute-write with the resourceVersion as precondition.

Spec changes: `spec.suspend` is patched into the JobSet; any other change to a job whose JobSet
exists is refused: the JobSet stays as it is, condition SpecChange=False (reason Immutable) names
the changed fields and a Warning Event says so. To apply such a change, delete the job and create
it again (a checkpointed job resumes from its checkpoint directory). The spec a JobSet was made
from is rendered into its annotation `training.tpu-operator.dev/applied-spec`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ..api import names
from ..api.models import GROUP, KIND, PLURAL, VERSION
from ..api.validation import InvalidJob, parse_job
from ..rendering.manifests import applied_spec, render
from . import phases
from .metrics_reader import MetricsReader, Unreachable, apply_sample

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
Obj = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    default_image: str | None = None
    metrics_access: Literal["proxy", "direct"] = "proxy"
    metrics_interval_s: float = 10.0
    metrics_timeout_s: float = 3.0
    resync_interval_s: float = 60.0
    conflict_retry_s: float = 30.0


# --- the API client the functions here need --------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str = ""):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Kube(Protocol):
    async def get(self, path: str) -> Obj: ...
    async def get_text(self, path: str) -> str: ...
    async def post(self, path: str, body: Obj) -> Obj: ...
    async def patch(self, path: str, body: Obj) -> Obj: ...  # JSON merge patch


Emit = Callable[[Obj, phases.Notice], None]  # post an Event about an object


class RetryLater(Exception):
    """Not done yet, and not the user's fault alone: try again after `delay` seconds."""

    def __init__(self, message: str, delay: float):
        super().__init__(message)
        self.delay = delay


class NameConflict(Exception):
    pass


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return "/".join(p for p in (f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", name, sub) if p)


def jobset_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{JOBSET_GROUP}/{JOBSET_VERSION}/namespaces/{namespace}/{JOBSET_PLURAL}"
    return f"{base}/{name}" if name else base


def config_map_path(namespace: str, name: str | None = None) -> str:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    return f"{base}/{name}" if name else base


# --- children ----------------------------------------------------------------------------------------


def owner_uids(obj: Obj) -> list[str]:
    return [ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []]


async def ensure_child(kube: Kube, collection: str, manifest: Obj, owner_uid: str) -> tuple[Obj, bool]:
    """Create `manifest`, or adopt the object of that name if this job owns it: (object, created)."""
    try:
        return await kube.post(collection, manifest), True
    except ApiError as exc:
        if exc.status != 409:
            raise
    name = manifest["metadata"]["name"]
    existing = await kube.get(f"{collection}/{name}")
    if owner_uid in owner_uids(existing):
        return existing, False
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in existing["metadata"].get("ownerReferences") or [])
    raise NameConflict(f"{manifest['kind']} {name} already exists and is "
                       f"{'owned by ' + owners if owners else 'not owned by any object'}, not by this job; "
                       "delete or rename it")


def changed_fields(before: Any, after: Any, path: str = "spec") -> list[str]:
    """Dotted paths where two specs differ (lists compare whole)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [p for key in sorted(set(before) | set(after))
                for p in changed_fields(before.get(key), after.get(key), f"{path}.{key}")]
    return [] if before == after else [path]


# --- status ------------------------------------------------------------------------------------------


def _merge_patch(old: Obj, new: Obj) -> Obj:
    return {k: new.get(k) for k in set(old) | set(new) if old.get(k) != new.get(k)}


async def update_status(kube: Kube, namespace: str, name: str, uid: str | None,
                        compute: Callable[[Obj], tuple[Obj, list[phases.Notice]]], emit: Emit,
                        attempts: int = 8) -> Obj | None:
    """Read the job, compute its new status, write it with the read resourceVersion as precondition
    (re-read on 409), then post the Events of the transitions. None if the job is gone or replaced."""
    for _ in range(attempts):
        try:
            obj = await kube.get(job_path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        if uid and obj["metadata"].get("uid") != uid:
            return None  # deleted and created again: the new job is not ours to describe
        old = obj.get("status") or {}
        new, notices = compute(obj)
        new = {k: v for k, v in new.items() if v is not None}
        if new != old:
            patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                     "status": _merge_patch(old, new)}
            try:
                await kube.patch(job_path(namespace, name, "status"), patch)
            except ApiError as exc:
                if exc.status == 409:
                    continue
                raise
            for notice in notices:
                emit(obj, notice)
        return new
    raise RetryLater(f"the status of {namespace}/{name} kept changing under this operator", 1.0)


def _invalid_status(obj: Obj, problems: list[str], now: str) -> tuple[Obj, list[phases.Notice]]:
    status = dict(obj.get("status") or {})
    message = "invalid spec: " + "; ".join(problems)
    notices = []
    generation = obj["metadata"].get("generation")
    if status.get("jobSetName"):
        # The JobSet runs on from the last valid spec: an invalid edit is a refused change.
        before = phases.condition(status.get("conditions") or [], "SpecChange")
        status["conditions"] = phases.set_condition(status.get("conditions") or [], "SpecChange", "False",
                                                    "InvalidSpec", message, now, generation)
        if not before or before.get("message") != message:
            notices.append(phases.Notice("Warning", "SpecChangeRefused", message))
    else:
        if status.get("phase") != "Invalid" or status.get("message") != message:
            notices.append(phases.Notice("Warning", "Invalid", message))
        status.update(phase="Invalid", message=message)
        status["conditions"] = phases.set_condition(status.get("conditions") or [], "Ready", "False",
                                                    "InvalidSpec", message, now, generation)
    status["observedGeneration"] = generation
    return status, notices


def _reconciled_status(obj: Obj, jobset: Obj, created: bool, refused: list[str],
                       now: str) -> tuple[Obj, list[phases.Notice]]:
    status = dict(obj.get("status") or {})
    generation = obj["metadata"].get("generation")
    name = jobset["metadata"]["name"]
    config_map = names.config_map_name(obj["metadata"]["name"])
    notices = [phases.Notice("Normal", "Created", f"created ConfigMap {config_map} and JobSet {name}")] if created else []
    conds = phases.set_condition(status.get("conditions") or [], "Ready", "True", "JobSetCreated",
                                 f"JobSet {name} exists", now, generation)
    before = phases.condition(conds, "SpecChange")
    if refused:
        message = (f"changed on a job whose JobSet exists: {', '.join(refused)}; the JobSet is kept as it is. "
                   "Only spec.suspend can change; delete and re-create the job to apply other changes")
        conds = phases.set_condition(conds, "SpecChange", "False", "Immutable", message, now, generation)
        if not before or before.get("message") != message:
            notices.append(phases.Notice("Warning", "SpecChangeRefused", message))
    else:
        conds = phases.set_condition(conds, "SpecChange", "True", "Applied",
                                     "the JobSet matches the spec", now, generation)
    status.update(conditions=conds, jobSetName=name, observedGeneration=generation)
    if status.get("phase") == "Invalid":
        status.pop("phase")
    status, followed = phases.follow(status, jobset, now)
    return status, notices + followed


async def reconcile_job(kube: Kube, job_obj: Obj, config: OperatorConfig, emit: Emit,
                        now: Callable[[], str] = utcnow) -> str:
    """Converge one job: validate, create or adopt its ConfigMap and JobSet, apply suspend, refuse other
    changes, write status. Returns what happened: created | adopted | invalid | finished | deleting | gone."""
    meta = job_obj["metadata"]
    namespace, name, uid = meta.get("namespace", "default"), meta["name"], meta.get("uid")
    if meta.get("deletionTimestamp"):
        return "deleting"
    if (job_obj.get("status") or {}).get("phase") in phases.TERMINAL:
        return "finished"  # never re-run a finished job, e.g. when its JobSet was deleted by a TTL
    try:
        job = parse_job({k: job_obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in job_obj})
    except InvalidJob as exc:
        problems = exc.problems
        done = await update_status(kube, namespace, name, uid, lambda o: _invalid_status(o, problems, now()), emit)
        return "invalid" if done is not None else "gone"
    config_map, jobset = render(job, config.default_image)
    try:
        await ensure_child(kube, config_map_path(namespace), config_map, uid)
        live, created = await ensure_child(kube, jobset_path(namespace), jobset, uid)
    except NameConflict as exc:
        message = str(exc)

        def conflicted(o: Obj) -> tuple[Obj, list[phases.Notice]]:
            status = dict(o.get("status") or {})
            before = phases.condition(status.get("conditions") or [], "Ready")
            status["conditions"] = phases.set_condition(status.get("conditions") or [], "Ready", "False",
                                                        "NameConflict", message, now(), o["metadata"].get("generation"))
            status.setdefault("phase", "Pending")
            status["message"] = message
            fresh = not before or before.get("reason") != "NameConflict"
            return status, [phases.Notice("Warning", "NameConflict", message)] if fresh else []

        await update_status(kube, namespace, name, uid, conflicted, emit)
        raise RetryLater(message, config.conflict_retry_s) from None
    refused: list[str] = []
    if not created:
        applied = (live["metadata"].get("annotations") or {}).get(names.APPLIED_SPEC)
        refused = changed_fields(json.loads(applied), applied_spec(job)) if applied else []
        phase = (job_obj.get("status") or {}).get("phase")
        if bool((live.get("spec") or {}).get("suspend")) != job.spec.suspend and phase not in phases.TERMINAL:
            live = await kube.patch(jobset_path(namespace, live["metadata"]["name"]),
                                    {"spec": {"suspend": job.spec.suspend}})
    done = await update_status(kube, namespace, name, uid,
                               lambda o: _reconciled_status(o, live, created, refused, now()), emit)
    if done is None:
        return "gone"
    return "created" if created else "adopted"


# --- following the JobSet ------------------------------------------------------------------------------


def owner_of(jobset: Obj) -> tuple[str, str, str] | None:
    """(namespace, job name, job uid) of the TPUTrainingJob that controls this JobSet."""
    meta = jobset.get("metadata") or {}
    name = (meta.get("labels") or {}).get(names.LABEL_JOB)
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND and r.get("controller")), None)
    if not name or ref is None or ref.get("name") != name:
        return None
    return meta.get("namespace", "default"), name, ref["uid"]


def _final_read_due(jobset: Obj, job_status: Obj) -> bool:
    js = phases.JobSetView.of(jobset)
    terminal = phases.phase_of(None, 0, js) in phases.TERMINAL
    return terminal and job_status.get("phase") not in phases.TERMINAL


async def follow_jobset(kube: Kube, jobset: Obj, event_type: str | None, config: OperatorConfig, emit: Emit,
                        reader: MetricsReader | None = None, now: Callable[[], str] = utcnow) -> str:
    """Map a JobSet's status onto its job's. A JobSet deleted under a live, unfinished job is re-created."""
    owner = owner_of(jobset)
    if owner is None:
        return "unowned"
    namespace, name, uid = owner
    try:
        job_obj = await kube.get(job_path(namespace, name))
    except ApiError as exc:
        if exc.status == 404:
            return "gone"
        raise
    if job_obj["metadata"].get("uid") != uid or job_obj["metadata"].get("deletionTimestamp"):
        return "gone"
    job_status = job_obj.get("status") or {}
    if event_type == "DELETED":
        if job_status.get("phase") in (*phases.TERMINAL, "Invalid"):
            return "finished"
        return await reconcile_job(kube, job_obj, config, emit, now)
    sample: Obj | None = None
    if reader is not None and _final_read_due(jobset, job_status):
        port = ((job_obj.get("spec") or {}).get("runtime") or {}).get("metricsPort") or 9431
        try:  # the trainer lingers a few seconds after the end, serving its final values
            sample = await reader.read(namespace, name, port, jobset["metadata"]["name"])
        except Unreachable:
            sample = None

    def compute(o: Obj) -> tuple[Obj, list[phases.Notice]]:
        status, notices = phases.follow(o.get("status") or {}, jobset, now())
        status["jobSetName"] = jobset["metadata"]["name"]
        if sample is not None:
            status = apply_sample(status, sample, None, now())
        return status, notices

    done = await update_status(kube, namespace, name, uid, compute, emit)
    return "followed" if done is not None else "gone"


# --- the periodic resync -------------------------------------------------------------------------------


def resync_due(job_status: Obj) -> bool:
    """Whether a job's status still follows a JobSet: it has one and has not finished."""
    return bool(job_status.get("jobSetName")) and job_status.get("phase") not in (*phases.TERMINAL, "Invalid")


async def resync_job(kube: Kube, job_obj: Obj, config: OperatorConfig, emit: Emit,
                     reader: MetricsReader | None = None, now: Callable[[], str] = utcnow) -> str:
    """Re-derive a job's status from its JobSet as it is now. The JobSet's events drive the status; this
    catches up when one was missed or its handling gave up (kopf never calls an event handler twice for
    one event). A JobSet that is gone, or no longer this job's, is handed to `reconcile_job`, as its
    DELETED event would be. Returns skipped | unchanged | followed | gone, or reconcile_job's result."""
    meta, status = job_obj["metadata"], job_obj.get("status") or {}
    if meta.get("deletionTimestamp") or not resync_due(status):
        return "skipped"
    namespace = meta.get("namespace", "default")
    try:
        jobset: Obj | None = await kube.get(jobset_path(namespace, status["jobSetName"]))
    except ApiError as exc:
        if exc.status != 404:
            raise
        jobset = None
    if jobset is None or owner_of(jobset) != (namespace, meta["name"], meta.get("uid")):
        return await reconcile_job(kube, job_obj, config, emit, now)
    if phases.follow(status, jobset, now())[0] == status:
        return "unchanged"  # the usual case: one GET, no write
    return await follow_jobset(kube, jobset, None, config, emit, reader, now)


# --- training metrics -------------------------------------------------------------------------------------


async def refresh_metrics(kube: Kube, reader: MetricsReader, job_obj: Obj, emit: Emit,
                          now: Callable[[], str] = utcnow) -> str:
    """Read the trainer's metrics into status; an unreachable trainer leaves stale values and Metrics=False."""
    meta, status = job_obj["metadata"], job_obj.get("status") or {}
    if status.get("phase") != "Running":
        return "skipped"
    namespace, name = meta.get("namespace", "default"), meta["name"]
    port = ((job_obj.get("spec") or {}).get("runtime") or {}).get("metricsPort") or 9431
    try:
        sample, error = await reader.read(namespace, name, port, status.get("jobSetName")), None
    except Unreachable as exc:
        sample, error = None, str(exc)
    await update_status(kube, namespace, name, meta.get("uid"),
                        lambda o: (apply_sample(o.get("status") or {}, sample, error, now()), []), emit)
    return "read" if error is None else "unreachable"

"""The reconcile logic: plain async functions over the `Kube` protocol, so a test can call them.

Level-triggered: `reconcile` looks at a job as it is (the object kopf's watch delivered), its JobSet
as the watch last saw it (or as a resync GET found it) and the trainer's latest metrics. It runs in
three parts: `converge` makes the children exist and follow the spec (children.py, preflight.py);
`observe` reads what else the status needs into one frozen value (steps.Observed); `act` writes the
status computed from it (steps.compute, pure; the order of its steps is stated there) once, as a merge
patch of the fields that changed (nothing when nothing changed). An operator killed at any point and restarted neither creates anything twice
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

Hand edits (drift.py): the labels and annotations the operator renders on the JobSet, checked on every
reconcile that has it in hand without rendering it, and the ConfigMap's, as its watch saw them, are put back
(one patch each, none when nothing drifted) or reported (ChildrenAsMade, one Event each).

Restarts (the rule: api/failures.py; the pure steps: restarts.py): a JobSet that failed and was not
counted yet has its pods listed once (exit codes, termination messages); a running one may be hung
(the trainer's clock in the ledger). The decision is written with the status, restart counts and the
replaced JobSet's uid first; only then is that JobSet deleted (`children.replace_jobset`), so an operator
killed in between finds the decision and deletes it, never counting it twice. While the backoff
runs (`nextRestartTime`) a missing JobSet is not created; after it, it is created under the same
name, so two never exist. The goodput ledger moves with the same reconcile (accounting.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from ..api import timestamps
from ..api.models import TPUTrainingJob
from ..api.names import LABEL_JOBSET
from ..api.status import TPUTrainingJobStatus
from ..api.timestamps import Clock
from ..api.validation import InvalidJob, parse_job
from . import (
    children,
    diagnosis,
    drift,
    growback,
    health,
    kueue,
    phases,
    preflight,
    profiles,
    restarts,
    steps,
)
from . import (
    status as status_lib,
)
from .admitted import AdmittedShapes
from .children import Inadmissible, NameConflict, owner_of
from .kube import JOBS, JOBSETS, PODS, ApiError, Kube, Obj, Resource
from .metrics_reader import MetricsReader
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
    refused_retry_s: float = 600.0  # a request the API refused is tried again after this, or on a spec change
    preflight: preflight.Timing = preflight.Timing()


@dataclasses.dataclass(frozen=True)
class ReconcileResult:
    """What a reconcile did (`result`, counted in the operator's metrics), the job as it is now (after
    the status write, for the caller's cache), and when to look again if no event will say."""

    result: str  # created | adopted | followed | invalid | conflict | finished | deleting | gone | ...
    job: Obj | None = None
    requeue_after_s: float | None = None
    jobset: Obj | None = None  # the JobSet this reconcile created or adopted (the watch may not have it yet)
    nodes_after_s: float | None = None  # look at the job's nodes again then: an unhealthy node's grace ends


@dataclasses.dataclass(frozen=True)
class Means:
    """What a reconcile works with: the API, the operator's settings, the Event poster, the trainer's
    reader (None: no final read of a completed job) and the clock."""

    kube: Kube
    config: OperatorConfig
    emit: Emit
    reader: MetricsReader | None = None
    clock: Clock = timestamps.utc_now
    shapes: AdmittedShapes = dataclasses.field(default_factory=AdmittedShapes)  # pods admitted lately (admitted.py)


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the manager's caches know of a job besides the job itself."""

    jobset: Obj | None = None  # its JobSet as last seen (None: none known)
    sample: status_lib.Sample | None = None  # the trainer's latest read, not applied yet
    workloads: Sequence[Obj] = ()  # the Kueue Workloads seen under the JobSet's name
    preflights: Sequence[Obj] = ()  # its pre-flight Jobs as the watch saw them
    look_at_pods: bool = False  # a JobSet event or a resync: the pods may be listed once
    probe: Obj | None = None  # the job's grow-back probe JobSet as watched (growback.py), None: none known
    unhealthy: Mapping[str, health.Unhealthy] | None = None  # TPU node -> why and since when it is unhealthy
    look_at_nodes: bool = False  # a node event, a JobSet event or a resync: a Running job's pods may be listed once
    hold: str | None = None  # why Ready-based stops are held (health.holding), None: they are not
    config_map: drift.ConfigMapEdit | None = None  # a hand edit of its ConfigMap the watch saw (drift.py)


@dataclasses.dataclass(frozen=True)
class Converged:
    """The children as `converge` left them."""

    jobset: Obj
    created: bool  # the JobSet was created now
    ensured: bool  # it was created or adopted now (the watch may not have it yet)
    planned: Compute | None  # the pre-flight's status change, when it decided now


def status_of(job_obj: Obj) -> TPUTrainingJobStatus:
    return TPUTrainingJobStatus.model_validate(job_obj.get("status") or {})


def jobset_completed(view: phases.JobSetView) -> bool:
    return phases.phase_of(None, view) == "Succeeded"


def jobset_failed(view: phases.JobSetView) -> bool:
    return "Failed" in view.true_conditions or view.terminal_state == "Failed"


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
                log.info(
                    "the status write of %s/%s conflicted twice; leaving it to the next event or resync",
                    namespace,
                    name,
                )
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


async def write_change(
    kube: Kube,
    job_obj: Obj,
    change: Callable[..., tuple[TPUTrainingJobStatus, list[Notice]]],
    now: datetime.datetime,
    emit: Emit,
) -> Obj | None:
    """`write_status` of a change that needs only the generation and the time (invalid, conflict, refused)."""
    return await write_status(kube, job_obj, lambda s, g: change(s, g, now), emit)


async def show_refusal(kube: Kube, job_obj: Obj, exc: ApiError, now: datetime.datetime, emit: Emit) -> Obj | None:
    """Show a request the API refused for good on the job (Reconciled=False, the API's words, one Event)."""
    message = f"the API refused a request ({exc.verb or 'HTTP'} {exc.status}): {exc.message}"
    return await write_change(
        kube, job_obj, lambda s, g, t: status_lib.refused(s, exc.reason, message, g, t), now, emit
    )


# --- converge: the children --------------------------------------------------------------------------


async def apply_suspend(kube: Kube, job: TPUTrainingJob, jobset: Obj, workload: kueue.WorkloadView | None) -> Obj:
    """Make the JobSet (no queue) or the Kueue Workload (a queue) follow spec.suspend; the JobSet."""
    namespace, name = job.metadata.namespace, jobset["metadata"]["name"]
    if job.spec.queue_name is None:
        if bool((jobset.get("spec") or {}).get("suspend")) != job.spec.suspend:
            return await kube.patch(JOBSETS, namespace, name, {"spec": {"suspend": job.spec.suspend}})
        return jobset
    patch = kueue.activation_patch(workload, job.spec.suspend) if workload is not None else None
    if workload is not None and patch is not None:
        try:
            await kube.patch(Resource(kueue.GROUP, workload.version, kueue.PLURAL), namespace, workload.name, patch)
        except ApiError as exc:
            if exc.status != 404:  # a Workload gone is replaced by a new one, whose event comes
                raise
    return jobset


def pod_digest(means: Means, job: TPUTrainingJob) -> str | None:
    """What the job's pods hold of its control token (control.py), from the reader's key; None without a reader."""
    if means.reader is None:
        return None
    return means.reader.tokens.digest(job.metadata.namespace, job.metadata.name, job.metadata.uid or "")


async def run_preflight(
    means: Means,
    job: TPUTrainingJob,
    job_obj: Obj,
    jobset: Obj | None,
    gated: bool,
    preflights: Sequence[Obj],
    now: datetime.datetime,
) -> preflight.Gate | ReconcileResult:
    """The pre-flight's part (preflight.py): its gate when it lets the JobSet be made, else what it did."""
    kube, config = means.kube, means.config
    planned = await preflight.gate(kube, job, job_obj, preflights, config.preflight, config.default_image, now)
    if planned.proceed:
        return planned
    if gated and planned.result == "invalid":  # it does not fit: its held JobSet goes
        assert jobset is not None  # gated: the JobSet seen holds the gate
        await children.delete_unstarted(kube, jobset)
    elif not gated and planned.result == "planning" and preflight.overlaps(job):
        await children.ensure_children(
            kube, job, config.default_image, True, gate=preflight.with_gate, control_digest=pod_digest(means, job)
        )
    done = await write_status(kube, job_obj, planned.compute or (lambda s, g: (s, [])), means.emit)
    return ReconcileResult(planned.result if done else "gone", done, planned.requeue_after_s)


async def converge(
    means: Means, job: TPUTrainingJob, job_obj: Obj, seen: Seen, now: datetime.datetime
) -> Converged | ReconcileResult:
    """Make the ConfigMap and the JobSet exist (`seen.jobset`: as last seen, None when none is known),
    through the pre-flight and a restart's backoff; or the ReconcileResult of a reconcile that stops here."""
    kube, jobset, meta = means.kube, seen.jobset, job_obj["metadata"]
    ensured = jobset is None or owner_of(jobset) != (meta.get("namespace", "default"), meta["name"], meta.get("uid"))
    gated = not ensured and preflight.gated(jobset)  # queued while its pre-flight compiles (preflight.py)
    # Not ensured (and so gated) only with a JobSet known; the `jobset is not None` below tell mypy as much.
    if gated and jobset is not None and children.refused_changes(jobset, job):  # edited while it compiled:
        await children.delete_unstarted(kube, jobset)  # that JobSet never ran
        return ReconcileResult("replacing", None, 1.0)
    if not (ensured or gated) and jobset is not None:
        if status_of(job_obj).job_set_name or preflight.wanted(job):
            return Converged(jobset, False, False, None)
        # Made beside its ConfigMap by an operator stopped before the status said so (children.ensure_children):
        # both are made sure of once, a 409 adopting what exists. (A pre-flight's ConfigMap came before.)
        ensured = True
    wait = restarts.wait_s(status_of(job_obj), now) if ensured else 0
    if wait > 0:  # a restart's backoff: the JobSet is created again once it is over
        return ReconcileResult("waiting", None, wait)
    try:
        planned: preflight.Gate | None = None
        if preflight.wanted(job):  # no running JobSet before the compiler says the step fits (preflight.py)
            gate = await run_preflight(means, job, job_obj, jobset, gated, seen.preflights, now)
            if isinstance(gate, ReconcileResult):
                return gate
            planned = gate
        if gated and jobset is not None:  # it fits, or could not be checked: Kueue may admit it now
            lifted = await kube.patch(
                JOBSETS, job.metadata.namespace, jobset["metadata"]["name"], preflight.lift_patch(jobset)
            )
            return Converged(lifted, False, False, planned.compute if planned else None)
        slices = status_of(job_obj).slices  # an elastic job re-created on the slices left (restarts.decide)
        made, created = await children.ensure_children(
            kube,
            job,
            means.config.default_image,
            planned is not None and planned.config_map_exists,
            running=slices.running if slices and slices.running else None,
            shapes=means.shapes,
            control_digest=pod_digest(means, job),
        )
        return Converged(made, created, True, planned.compute if planned else None)
    except NameConflict as exc:
        message = str(exc)
        done = await write_change(
            kube, job_obj, lambda s, g, t: status_lib.conflicted(s, message, g, t), now, means.emit
        )
        return ReconcileResult("conflict", done, means.config.conflict_retry_s)
    except Inadmissible as exc:  # the API's own words, before anything of the job was created
        problems = [str(exc)]
        done = await write_change(kube, job_obj, lambda s, g, t: status_lib.invalid(s, problems, g, t), now, means.emit)
        return ReconcileResult("invalid" if done else "gone", done)


# --- observe -----------------------------------------------------------------------------------------


async def observe(
    means: Means,
    job: TPUTrainingJob,
    job_obj: Obj,
    made: Converged,
    seen: Seen,
    workload: kueue.WorkloadView | None,
    now: datetime.datetime,
) -> steps.Observed:
    """What the status is computed from: the JobSet (wrapped once), and the reads it may call for: the final
    sample of a completed JobSet, the pods of a failed one not counted yet, the pods of one not ready."""
    kube, reader, sample, jobset, namespace = means.kube, means.reader, seen.sample, made.jobset, job.metadata.namespace
    name, uid = jobset["metadata"]["name"], jobset["metadata"].get("uid")
    view = phases.JobSetView.of(jobset)
    if sample is None and reader is not None and jobset_completed(view):
        # A completed JobSet's pods have exited and serve nothing: the final step and checkpoint come from
        # process 0's termination record.
        sample = await reader.final(namespace, name)
    failure = pods = None
    if jobset_failed(view) and not restarts.replaced(status_of(job_obj), uid):  # one LIST, only when it fails
        failure = restarts.failure_of(
            await kube.list(PODS, namespace, f"{LABEL_JOBSET}={name}"), view.condition_message("Failed")
        )
    if seen.look_at_pods and diagnosis.needs_pods(view):  # one list per JobSet event or resync, never per pod
        pods = await kube.list(PODS, namespace, f"{LABEL_JOBSET}={name}")
    nodes = None  # only while some TPU node is unhealthy: then a Running job's pods say which nodes it is on
    if (
        seen.look_at_nodes
        and failure is None
        and status_of(job_obj).phase == "Running"
        and not restarts.replaced(status_of(job_obj), uid)
    ):
        nodes = health.Judged()  # every TPU node healthy: nothing to list
        if seen.unhealthy:
            pods = pods if pods is not None else await kube.list(PODS, namespace, f"{LABEL_JOBSET}={name}")
            grace = float(job.spec.failure_policy.node_unhealthy_grace_seconds)
            nodes = health.judged(pods, seen.unhealthy, grace, seen.hold is not None, now)
    profile, old = None, status_of(job_obj)
    request = profiles.requested(job_obj["metadata"].get("annotations"))
    read = sample is not None and sample.error is None
    if reader is not None and profiles.to_send(
        request, old, sample.profile if sample is not None and read else None, read
    ):
        assert request is not None  # to_send: never without one
        profile = await profiles.send(
            reader,
            namespace,
            name,
            job.spec.runtime.metrics_port,
            request,
            job.spec.training.steps,
            old.phase == "Running",
            job.metadata.uid or "",
        )
    return steps.Observed(
        now=now,
        generation=job_obj["metadata"].get("generation"),
        jobset_name=name,
        # Named only in the Created Event of a JobSet rendered here, which always mounts its config.
        config_map=children.config_map_of(jobset) or "(none)",
        jobset_uid=uid,
        view=view,
        intent=phases.Intent(suspend=job.spec.suspend, queued=job.spec.queue_name is not None),
        policy=job.spec.failure_policy,
        total_steps=job.spec.training.steps,
        created_at=timestamps.parse_or_none(job_obj["metadata"].get("creationTimestamp")),
        created=made.created,
        refused=() if made.created else tuple(children.refused_changes(jobset, job)),
        queue=job.spec.queue_name,
        workload=workload,
        pods=pods,
        sample=sample,
        failure=failure,
        planned=made.planned,
        profile=profile,
        tpu=job.spec.tpu,
        jobset_created=timestamps.parse_or_none(jobset["metadata"].get("creationTimestamp")),
        probe_ready=growback.probe_placed(seen.probe),
        hardware=nodes.loss if nodes is not None else None,
        nodes=nodes,
        hold=seen.hold,
    )


# --- act ---------------------------------------------------------------------------------------------


async def act(
    means: Means, job: TPUTrainingJob, job_obj: Obj, observed: steps.Observed, made: Converged, probe: Obj | None = None
) -> ReconcileResult:
    """Write the status computed from `observed`; then delete the JobSet if a restart or a grow-back replaces
    it, and make the grow-back probe (`probe`: as seen) exist exactly while the status wants it."""
    kube = means.kube
    done = await write_status(
        kube, job_obj, lambda s, g: steps.compute(s, dataclasses.replace(observed, generation=g)), means.emit
    )
    written = status_of(done or {})
    if done is not None and restarts.replaced(written, observed.jobset_uid):
        # A grow-back stops the smaller JobSet as a preemption does: its trainers save the step in flight.
        if growback.replacing(written, observed.jobset_uid):
            cause = "preemption"
        else:
            assert written.last_restart is not None  # replaced, and not by a grow-back: by a restart
            cause = written.last_restart.cause
        lost = observed.hardware.selector if observed.hardware is not None and cause == "hardware" else None
        await children.replace_jobset(kube, job_obj["metadata"].get("namespace", "default"), made.jobset, cause, lost)
    if done is not None and (probe is not None or written.slices is not None):
        await growback.follow(kube, job, means.config.default_image, written, observed.jobset_created, probe)
    return ReconcileResult(
        "created" if made.created else "adopted" if made.ensured else "followed",
        done,
        jobset=made.jobset if made.ensured else None,
        nodes_after_s=observed.nodes.next_s if observed.nodes is not None and observed.nodes.loss is None else None,
    )


# --- the reconcile -----------------------------------------------------------------------------------


async def reconcile(means: Means, job_obj: Obj, seen: Seen = Seen()) -> ReconcileResult:
    """Converge one job: validate; make its ConfigMap and JobSet exist and follow spec.suspend (`converge`,
    `apply_suspend`); `observe` what its status needs; `act`: write the status computed from that."""
    if job_obj["metadata"].get("deletionTimestamp"):
        return ReconcileResult("deleting")
    if status_of(job_obj).finished:
        return ReconcileResult("finished")  # never re-run a finished job, e.g. when its JobSet was deleted by a TTL
    t = means.clock()
    try:
        # Off the event loop: a spec at the CRD's bounds takes milliseconds to validate, and every tenant's
        # reconciles and metrics reads share the loop (the thread gives the GIL back every few ms).
        job = await asyncio.to_thread(
            parse_job,
            {k: job_obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in job_obj},
            needs_image=True,
            default_image=means.config.default_image,
        )
    except InvalidJob as exc:
        problems = exc.problems
        done = await write_change(
            means.kube, job_obj, lambda s, g, at: status_lib.invalid(s, problems, g, at), t, means.emit
        )
        return ReconcileResult("invalid" if done else "gone", done)
    made = await converge(means, job, job_obj, seen, t)
    if isinstance(made, ReconcileResult):
        return made
    jobset, found = await drift.follow(  # hand edits put back or reported; a JobSet relabelled is adopted again
        means.kube, job, made.jobset, status_of(job_obj), made.created, seen.config_map, means.config.default_image
    )
    made = dataclasses.replace(made, jobset=jobset, ensured=made.ensured or found.relabelled)
    workload = kueue.pick(list(seen.workloads), made.jobset["metadata"].get("uid")) if job.spec.queue_name else None
    made = dataclasses.replace(made, jobset=await apply_suspend(means.kube, job, made.jobset, workload))
    observed = dataclasses.replace(await observe(means, job, job_obj, made, seen, workload, t), hand_edits=found)
    return await act(means, job, job_obj, observed, made, seen.probe)

"""Growing an elastic job back to every slice on a cluster (docs/elastic.md; the rule: api/elastic.py).

The invariant: the smaller JobSet, which trains, is never given up before the larger one can be placed.
A cluster says whether something can be placed only by placing it, so the operator asks it with a
*probe*: a JobSet named `<job>-grow` with one replicated Job per missing slice, rendered exactly as the
job's slices are placed (node selector, tolerations, affinity, `google.com/tpu` requests, priority,
JobSet's exclusive placement per node pool, the Kueue queue label) but whose pods only sleep. The real
scheduler places it only where free hosts of the right slice shape exist, and Kueue admits it only where
the queue has quota for the missing slices beside what the smaller job already holds. While it is not
ready, the smaller job trains on: capacity that never returns costs nothing but a pending probe.

Once every probe pod is ready, one reconcile writes the decision to the status first (status.slices
running back to desired, `replaces`: the smaller JobSet's uid, condition Resized False GrewBack, Event
Resized), then deletes the smaller JobSet the way a preemption stops it (no grace-period override: its
trainers get SIGTERM and save the step in flight) and the probe, whose hosts are now the larger JobSet's.
That JobSet is created under the job's name once the smaller one is gone (reconcile.converge), so two
never exist, and its trainers resume from the SIGTERM checkpoint. A grow-back is not a restart.

Idempotent across operator restarts: the probe has a deterministic name (a 409 adopts it), the decision
is in the status before anything is deleted, and the probe's presence is a pure function of the status.

`due` and `decide` are pure; `probe`, `follow` do the I/O.
"""

from __future__ import annotations

import datetime

from ..api import elastic, names
from ..api.models import TPUTrainingJob
from ..api.spec import TPUSpec
from ..api.status import SliceStatus, TPUTrainingJobStatus
from ..rendering.manifests import render
from .children import ensure_child
from .conditions import set_condition
from .kube import JOBSETS, ApiError, Kube, Obj
from .phases import JobSetView, Notice

# What of a slice's pod spec decides where it can be placed; the rest (env, ports, host network, volumes)
# belongs to the trainer, which the probe does not run.
PLACEMENT = (
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "schedulerName",
    "schedulingGates",
    "topologySpreadConstraints",
)
SLEEP = ["sleep", "infinity"]
PROBE_JOB = "g"


def due(status: TPUTrainingJobStatus, tpu: TPUSpec | None, jobset_created: datetime.datetime | None) -> bool:
    """A Running job on fewer slices than desired, with growBack, whose current attempt has checkpointed
    since the step it resumed from. The attempt must be this JobSet's (its trainer started after the JobSet
    was made): the ledger still holds the previous attempt's report until the new trainer's first one."""
    slices = status.slices
    if tpu is None or slices is None or status.phase != "Running" or slices.running >= slices.desired:
        return False
    attempt = status.accounting.attempt if status.accounting else None
    progress = attempt.progress if attempt else None
    if progress is None or progress.start_step is None:
        return False
    if jobset_created is not None and progress.started_at < jobset_created.timestamp():
        return False
    checkpoint = (
        progress.last_checkpoint_step if progress.last_checkpoint_step is not None else status.last_checkpoint_step
    )
    return elastic.grow_back_due(tpu, slices.running, progress.start_step, checkpoint)


def probe_placed(probe: Obj | None) -> bool:
    """Every probe pod placed and running: its hosts are held, so the larger JobSet fits there."""
    if probe is None or (probe.get("metadata") or {}).get("deletionTimestamp"):
        return False
    view = JobSetView.of(probe)
    return not view.suspend and view.jobs > 0 and view.ready >= view.jobs


def replacing(status: TPUTrainingJobStatus, jobset_uid: str | None) -> bool:
    """This JobSet is the smaller one a grow-back decided to replace."""
    return bool(jobset_uid) and status.slices is not None and status.slices.replaces == jobset_uid


def decide(
    status: TPUTrainingJobStatus,
    tpu: TPUSpec,
    jobset_uid: str | None,
    now: datetime.datetime,
    generation: int | None = None,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The grow-back decision, written before the smaller JobSet is deleted."""
    assert status.slices is not None  # due(): decided only for a job on fewer slices than desired
    resize = elastic.grow_back(tpu, status.slices.running)
    assert resize.reason is not None  # a grow-back always says why (GrewBack)
    conds = set_condition(status.conditions, "Resized", "False", resize.reason, resize.message, now, generation)
    slices = SliceStatus(desired=tpu.slices, running=resize.slices, replaces=jobset_uid)
    return status.model_copy(update=dict(conditions=conds, slices=slices, message=resize.message)), [
        Notice("Normal", "Resized", resize.message)
    ]


def probe(job: TPUTrainingJob, default_image: str | None, extra: int) -> Obj:
    """The probe JobSet: `extra` slices placed as the job's are, each pod sleeping."""
    jobset = render(job, default_image, extra)[1]
    meta = jobset["metadata"]
    meta["name"] = names.growback_name(job.metadata.name)
    meta.get("annotations", {}).pop(names.APPLIED_SPEC, None)
    spec = jobset["spec"]
    spec["network"] = {"enableDNSHostnames": False}  # nothing connects to a probe (JobSet defaults it to true)
    for replicated in spec["replicatedJobs"]:
        replicated["name"] = PROBE_JOB  # short: `<job>-grow-g-<i>` is no longer than a slice's hostname
        pod = replicated["template"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        placed = {k: pod[k] for k in PLACEMENT if k in pod}
        replicated["template"]["spec"]["template"]["spec"] = {
            **placed,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
                    "command": SLEEP,
                    "resources": container.get("resources", {}),
                }
            ],
        }
    return jobset


async def follow(
    kube: Kube,
    job: TPUTrainingJob,
    default_image: str | None,
    status: TPUTrainingJobStatus,
    jobset_created: datetime.datetime | None,
    seen: Obj | None,
) -> None:
    """Make the probe exist exactly while a grow-back is due and not decided yet (after this reconcile's
    status write: a decided one has running == desired, so is no longer due)."""
    if due(status, job.spec.tpu, jobset_created):
        if seen is None:
            assert status.slices is not None  # due(): a job on fewer slices than desired
            extra = status.slices.desired - status.slices.running
            await ensure_child(kube, JOBSETS, probe(job, default_image, extra), job.metadata.uid or "")
        return
    if seen is not None and not (seen.get("metadata") or {}).get("deletionTimestamp"):
        meta = seen["metadata"]
        try:
            await kube.delete(
                JOBSETS,
                meta.get("namespace", "default"),
                meta["name"],
                {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "propagationPolicy": "Background",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": meta["uid"]},
                },
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

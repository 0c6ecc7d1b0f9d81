"""The status pipeline: `compute(old, observed)` is the job's new status and the Events its transitions
deserve, from what one reconcile observed (`Observed`). Pure: no I/O, the time is `observed.now`.

The steps, in order (`STEPS`); each reads the draft the ones before it left:

1. `preflight_decided`: the pre-flight's word for this generation, when it decided something now (preflight.py).
2. `children_reconciled`: the JobSet exists and matches the spec, or refuses changes (status.py).
2a. `as_made`: the JobSet's and ConfigMap's hand edits put back or reported, the applied spec's digest (drift.py).
2b. `sliced`: status.slices, desired and running (an elastic job's restart may run fewer: 6).
3. `queued`: the Kueue Workload's admission, for a job with a queue (kueue.py).
4. `diagnosed`: the pods as last listed, or all ready (diagnosis.py).
5. `ledger_observed`: the trainer's latest report into the goodput ledger, which 6 reads (accounting.py).
6. `restart`: a failed or hung attempt, or one on an unhealthy node, meets the restart policy (restarts.py).
6a. `nodes_held`: NodesHeld while a node under the job is NotReady and the cluster-wide hold delays its stop.
6b. `grown`: an elastic job on fewer slices goes back to all once its probe is placed (growback.py).
7. `phase`: the JobSet's status mapped onto the phase, with 6's decision (phases.py).
8. `metrics`: the trainer's sample (status.with_sample).
8b. `profiled`: a profile request sent now, or the trainer's word on it (profiles.py).
9. `ledger_settled`: the ledger after this reconcile's transitions (accounting.py).
10. `hang_cleared`: Hung=False once a later attempt completes a step (restarts.py).
11. `readiness`: the Ready condition, from the phase (`ready_of`).
12. `refusal_cleared`: Reconciled=True once the API accepts requests again after refusing some.

A new status field is one `Observed` field and one step, tested by calling `compute` with no client.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import TypedDict, Unpack

from ..api.failures import Failure
from ..api.spec import FailurePolicySpec, TPUSpec
from ..api.status import ConditionStatus, SliceStatus, TPUTrainingJobStatus
from . import accounting, diagnosis, drift, growback, health, kueue, phases, profiles, restarts
from . import status as status_lib
from .conditions import set_condition
from .phases import Compute, JobSetView, Notice


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything a reconcile knows about a job with a JobSet, read before the status is computed."""

    now: datetime.datetime
    generation: int | None
    jobset_name: str
    config_map: str
    jobset_uid: str | None
    view: JobSetView  # the JobSet, wrapped once
    intent: phases.Intent
    policy: FailurePolicySpec
    total_steps: int
    created_at: datetime.datetime | None  # the job's creationTimestamp
    created: bool = False  # the JobSet was created by this reconcile
    refused: tuple[str, ...] = ()  # spec fields changed since the JobSet was made
    queue: str | None = None
    workload: kueue.WorkloadView | None = None
    pods: list[diagnosis.Pod] | None = None  # the JobSet's pods, when listed this time
    sample: status_lib.Sample | None = None  # the trainer's latest read
    failure: Failure | None = None  # why the JobSet failed (its pods), when it failed and was not counted
    planned: Compute | None = None  # the pre-flight's status change, when it decided now
    profile: profiles.Answer | None = None  # the annotation's profile request, when sent (or refused) now
    tpu: TPUSpec | None = None  # spec.tpu: the slices asked for, and elastic (api/elastic.py)
    jobset_created: datetime.datetime | None = None  # the JobSet's creationTimestamp
    probe_ready: bool = False  # the grow-back probe's pods are all placed and running (growback.py)
    hardware: health.HardwareLoss | None = None  # a node of the running pods unhealthy past its grace (health.py)
    nodes: health.Judged | None = None  # what the job's nodes call for, when looked at now (None: not looked)
    hold: str | None = None  # why Ready-based stops are held cluster-wide (health.holding), None: they are not
    hand_edits: drift.Found | None = None  # hand edits of the JobSet or ConfigMap found now (None: not looked)


class _More(TypedDict, total=False):
    """What `Draft.then` may change besides the status and notices."""

    restart: phases.Restart


@dataclasses.dataclass(frozen=True)
class Draft:
    old: TPUTrainingJobStatus  # the status the reconcile started from (after the pre-flight's word)
    status: TPUTrainingJobStatus
    notices: tuple[Notice, ...] = ()
    restart: phases.Restart = None

    def then(
        self, status: TPUTrainingJobStatus, notices: list[Notice] | tuple[Notice, ...] = (), **more: Unpack[_More]
    ) -> Draft:
        return dataclasses.replace(self, status=status, notices=self.notices + tuple(notices), **more)


Step = Callable[[Draft, Observed], Draft]


def preflight_decided(d: Draft, o: Observed) -> Draft:
    if o.planned is None:
        return d
    new, notices = o.planned(d.status, o.generation)
    return dataclasses.replace(d.then(new, notices), old=new)


def children_reconciled(d: Draft, o: Observed) -> Draft:
    return d.then(
        *status_lib.reconciled(d.status, o.jobset_name, o.config_map, o.created, list(o.refused), o.generation, o.now)
    )


def as_made(d: Draft, o: Observed) -> Draft:
    return d.then(*drift.recorded(d.status, o.hand_edits, o.now, o.generation))


def sliced(d: Draft, o: Observed) -> Draft:
    """status.slices: every slice until an elastic restart decides fewer (restarts.decide)."""
    if o.tpu is None or (d.status.slices is not None and d.status.slices.desired == o.tpu.slices):
        return d
    return d.then(d.status.model_copy(update=dict(slices=SliceStatus(desired=o.tpu.slices, running=o.tpu.slices))))


def queued(d: Draft, o: Observed) -> Draft:
    if o.queue is None:
        return d
    return d.then(*kueue.follow(d.status, o.workload, o.queue, o.jobset_name, o.now, o.generation))


def diagnosed(d: Draft, o: Observed) -> Draft:
    return d.then(*diagnosis.follow(d.status, o.view, o.pods, o.now, o.generation))


def ledger_observed(d: Draft, o: Observed) -> Draft:
    return d.then(accounting.observed(d.status, o.sample, o.created_at, o.now))


def restart(d: Draft, o: Observed) -> Draft:
    if restarts.replaced(d.status, o.jobset_uid):
        return dataclasses.replace(d, restart="replaced")
    failure = o.failure or health.failure(o.hardware)  # an unhealthy node: stopped before any pod failed
    hung = (
        restarts.hang(d.status, o.policy, o.total_steps, o.now)
        if failure is None and restarts.answered(o.sample)
        else None
    )
    if failure is None and hung is None:
        return d
    new, verdict, notices = restarts.decide(d.status, o.jobset_uid, failure, hung, o.policy, o.now, o.generation, o.tpu)
    gave_up: phases.Restart = "diverged" if failure is not None and failure.cause == "diverged" else "given-up"
    return d.then(new, notices, restart="replaced" if verdict.restart else gave_up)


def nodes_held(d: Draft, o: Observed) -> Draft:
    return d.then(*health.follow(d.status, o.nodes, o.hold, d.restart is not None, o.now, o.generation))


def grown(d: Draft, o: Observed) -> Draft:
    if d.restart is not None or not o.probe_ready or not growback.due(d.status, o.tpu, o.jobset_created):
        return d
    assert o.tpu is not None  # growback.due() is False without one
    new, notices = growback.decide(d.status, o.tpu, o.jobset_uid, o.now, o.generation)
    return d.then(new, notices, restart="replaced")


def phase(d: Draft, o: Observed) -> Draft:
    return d.then(
        *phases.follow(d.status, o.view, o.now, o.intent, diagnosis.trouble(d.status), d.restart, o.generation)
    )


def metrics(d: Draft, o: Observed) -> Draft:
    return d if o.sample is None else d.then(status_lib.with_sample(d.status, o.sample, o.now, o.generation))


def profiled(d: Draft, o: Observed) -> Draft:
    trainer = o.sample.profile if o.sample is not None else None
    return d.then(*profiles.follow(d.status, o.profile, trainer))


def ledger_settled(d: Draft, o: Observed) -> Draft:
    final = o.failure.progress if o.failure else None
    return d.then(accounting.settled(d.old, d.status, o.sample, final, o.created_at, o.now))


def hang_cleared(d: Draft, o: Observed) -> Draft:
    return d.then(restarts.recovered(d.status, o.now, o.generation))


# phase -> (Ready, reason); Invalid is decided before any JobSet (status.invalid, preflight.py)
READY: dict[str, tuple[ConditionStatus, str]] = {
    "Running": ("True", "Progressing"),
    "Succeeded": ("True", "Completed"),
    "Pending": ("False", "PodsPending"),
    "Queued": ("False", "Queued"),
    "Suspended": ("False", "Suspended"),
    "Restarting": ("False", "Restarting"),
    "Failed": ("False", "Failed"),
}


def ready_of(status: TPUTrainingJobStatus, generation: int | None, now: datetime.datetime) -> TPUTrainingJobStatus:
    """Ready: training is progressing, or the job is done (succeeded); the phase's message says more."""
    state, reason = READY.get(status.phase or "Pending", ("False", "PodsPending"))
    conds = set_condition(status.conditions, "Ready", state, reason, status.message or "", now, generation)
    return status.model_copy(update=dict(conditions=conds))


def readiness(d: Draft, o: Observed) -> Draft:
    return d.then(ready_of(d.status, o.generation, o.now))


def refusal_cleared(d: Draft, o: Observed) -> Draft:
    return d.then(status_lib.accepted(d.status, o.generation, o.now))


STEPS: tuple[Step, ...] = (
    preflight_decided,
    children_reconciled,
    as_made,
    sliced,
    queued,
    diagnosed,
    ledger_observed,
    restart,
    nodes_held,
    grown,
    phase,
    metrics,
    profiled,
    ledger_settled,
    hang_cleared,
    readiness,
    refusal_cleared,
)


def compute(old: TPUTrainingJobStatus, observed: Observed) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The steps of the module docstring, in order."""
    draft = Draft(old, old)
    for step in STEPS:
        draft = step(draft, observed)
    return draft.status, list(draft.notices)

"""What the operator writes into a job's `.status`: the phase, the conditions, the slices, restarts,
the pre-flight's findings, the trainer's latest metrics, goodput, a profile. Built by the controller's
pure functions (controller/status.py, steps.py) and by the local runner; part of the CRD (`crd.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from .contract import Base, Recorded, StepResources, _desc
from .failures import LastRestart, RestartCounts
from .goodput import Badput, Ledger
from .lifecycle import Divergence
from .timestamps import Timestamp

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(Recorded):
    """A Kubernetes-shaped condition; `lastTransitionTime` moves only when `status` changes."""

    type: str = _desc(
        "Ready, Planned, SpecChange, Admitted, Scheduled, ContainersReady, Running, Succeeded, Failed, Metrics, Hung, "
        "NodesHeld, ChildrenAsMade."
    )
    status: ConditionStatus = _desc("True, False or Unknown.")
    reason: str = _desc("CamelCase reason.", default="")
    message: str = _desc("Human-readable detail.", default="")
    last_transition_time: Timestamp | None = _desc("When `status` last changed.", default=None)
    observed_generation: int | None = _desc("metadata.generation the condition describes.", default=None)


class PlanStatus(Recorded):
    """What the pre-flight compile found (spec.plan)."""

    hbm_per_device_gib: float | None = Field(
        default=None, alias="hbmPerDeviceGiB", description="HBM the compiled train step needs per device."
    )
    hbm_capacity_gib: float | None = Field(default=None, alias="hbmCapacityGiB", description="HBM of one device.")
    host_per_device_gib: float | None = Field(
        default=None, alias="hostPerDeviceGiB", description="Host memory per device of activations remat offloads."
    )
    fits: bool | None = _desc("Fits with the headroom asked for; unset when it could not be checked.", default=None)
    compile_seconds: float | None = _desc("Time in the TPU compiler.", default=None)
    libtpu_version: str | None = _desc("The libtpu that compiled it.", default=None)
    slices: int | None = _desc(
        "The slice count the figures are for: an elastic job is compiled at every count from "
        "spec.tpu.slices down to elastic.minSlices, and the worst is shown (the first that "
        "does not fit or could not be checked, else the most HBM per device).",
        default=None,
    )
    hbm_by_slices: dict[str, float] | None = Field(
        default=None,
        alias="hbmPerDeviceGiBBySlices",
        description="An elastic job: HBM per device at each slice count compiled (slice count -> GiB).",
    )
    resources: StepResources | None = _desc(
        "What one step costs per device (matmul FLOPs, collective bytes by kind, "
        "HBM traffic) and the least time that allows.",
        default=None,
    )
    checked_at: Timestamp | None = _desc("When the pre-flight finished.", default=None)


class ProfileStatus(Recorded):
    """A profile asked for with the annotation training.tpu-operator.dev/profile (api/profiling.py), as the
    trainer answered it."""

    request: str = _desc("The annotation's value this describes, e.g. steps:100-105.")
    steps: str | None = _desc("The steps the trainer traces (those asked for, less any already run).", default=None)
    state: Literal["pending", "capturing", "done", "failed"] = _desc(
        "pending (sent; its first step not reached), capturing, done (the trace is at path), or failed (message)."
    )
    path: str | None = _desc(
        "The trace file (.xplane.pb) under the job's TensorBoard directory, once written.", default=None
    )
    message: str | None = _desc("Why it failed, or what the trainer changed (steps already run).", default=None)


class SliceStatus(Recorded):
    """How many slices the job asks for and how many its JobSet runs (fewer after an elastic shrink)."""

    desired: int = _desc("spec.tpu.slices.", ge=1)
    running: int = _desc(
        "Slices of the current JobSet: spec.tpu.slices, or fewer after an elastic shrink (docs/elastic.md).", ge=0
    )
    shown: str = _desc("running/desired, for kubectl's Slices column (a printer column shows one field).", default="")
    replaces: str | None = _desc(
        "The uid of the smaller JobSet a grow-back replaces: it is being stopped as a "
        "preemption stops it, and the JobSet on every slice follows (docs/elastic.md).",
        default=None,
    )

    @model_validator(mode="after")
    def _shown(self) -> SliceStatus:
        object.__setattr__(self, "shown", f"{self.running}/{self.desired}")  # frozen; always derived
        return self


NonFinite = Literal["nan", "inf", "-inf"]


class NonFiniteMetrics(Recorded):
    """The trainer's values that were not finite at the latest read: JSON has no number for them, so the field
    of that name is left out of the status and this says what it was (never the last finite value)."""

    loss: NonFinite | None = _desc("status.loss was this.", default=None)
    eval_loss: NonFinite | None = _desc("status.evalLoss was this.", default=None)
    step_time_seconds: NonFinite | None = _desc("status.stepTimeSeconds was this.", default=None)
    tokens_per_second: NonFinite | None = _desc("status.tokensPerSecond was this.", default=None)
    mfu: NonFinite | None = _desc("status.mfu was this.", default=None)


class ChildrenStatus(Recorded):
    """What the operator keeps to tell its JobSet and ConfigMap as it made them from a hand edit of them
    (controller/drift.py, docs/operations.md#hand-edits-of-a-jobs-jobset-or-configmap)."""

    applied_spec_digest: str | None = _desc(
        "sha256 (16 hex digits) of the JobSet's applied-spec annotation as the operator made it, or as it first "
        "saw it (a JobSet made by an earlier version): the spec the JobSet was made from.",
        default=None,
        max_length=64,
    )
    edits: int | None = _desc(
        "Hand edits of the JobSet's or ConfigMap's labels or annotations, or deletions of the ConfigMap, found "
        "so far: each reverted or reported once (condition ChildrenAsMade, one Warning Event each).",
        default=None,
        ge=0,
    )


Phase = Literal["Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed", "Invalid"]
TERMINAL_PHASES = ("Succeeded", "Failed")


class TPUTrainingJobStatus(Base):
    """What the operator writes into `.status`: built by the controller's pure functions, written once
    per reconcile as a merge patch of the fields that changed. Fields it does not know (written by
    another version) are ignored when read."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)
    phase: Phase | None = _desc("Lifecycle phase.", default=None)
    conditions: tuple[Condition, ...] = _desc(
        "Kubernetes-shaped conditions (Ready, Admitted, Scheduled, Metrics...).", default=()
    )
    observed_generation: int | None = _desc("metadata.generation the status describes.", default=None)
    job_set_name: str | None = _desc("The JobSet running this job.", default=None)
    slices: SliceStatus | None = _desc("Slices asked for and running (an elastic job may run on fewer).", default=None)
    restarts: RestartCounts | None = _desc(
        "Whole-job restarts by cause; they survive JobSet re-creations. A Kueue eviction counts under preemption.",
        default=None,
    )
    last_restart: LastRestart | None = _desc(
        "The latest restart: its cause and the trainer's last error line.", default=None
    )
    next_restart_time: Timestamp | None = _desc(
        "When the pending restart creates the JobSet again (after its backoff).", default=None
    )
    last_eviction_time: Timestamp | None = _desc(
        "When Kueue last evicted the job (its Workload's Evicted condition); "
        "each eviction counts once under restarts.preemption.",
        default=None,
    )
    workload_name: str | None = _desc("The Kueue Workload of the JobSet (jobs with a queueName).", default=None)
    plan: PlanStatus | None = _desc("The pre-flight compile's findings (spec.plan.preflight compile).", default=None)
    step: int | None = _desc("Latest completed training step.", default=None)
    step_time_seconds: float | None = _desc("Latest step time in seconds.", default=None)
    loss: float | None = _desc(
        "Training loss of the latest read step (cross entropy plus the weighted aux and z-losses).", default=None
    )
    eval_loss: float | None = _desc(
        "Cross entropy on the held-out data at the latest evaluation (spec.training.eval).", default=None
    )
    tokens_per_second: float | None = _desc("Training throughput, tokens per second, all slices.", default=None)
    mfu: float | None = _desc("Model FLOPs utilisation, 0..1.", default=None)
    last_checkpoint_step: int | None = _desc("Step of the latest complete checkpoint.", default=None)
    non_finite: NonFiniteMetrics | None = _desc(
        "The values of the latest read that were not finite (nan, inf, -inf): their fields above are left out.",
        default=None,
    )
    divergence: Divergence | None = _desc(
        "Where the run last diverged (exit code 43): the step, the metric (loss or grad_norm), its value, and "
        "the latest checkpoint (all written from finite state).",
        default=None,
    )
    metrics_time: Timestamp | None = _desc("When the metrics above were read.", default=None)
    start_time: Timestamp | None = _desc("When the job first ran.", default=None)
    completion_time: Timestamp | None = _desc("When the job succeeded or failed.", default=None)
    message: str | None = _desc("Human-readable summary of the phase.", default=None)
    goodput: float | None = _desc(
        "Seconds on steps that survive / seconds since the job was created, as of the latest change (0..1).",
        default=None,
    )
    badput: Badput | None = _desc("The rest of the wall time, in seconds, by cause.", default=None)
    accounting: Ledger | None = _desc("The goodput ledger the figures above are computed from.", default=None)
    children: ChildrenStatus | None = _desc(
        "What the JobSet was made from, and the hand edits of it or of the ConfigMap found (condition ChildrenAsMade).",
        default=None,
    )
    profile: ProfileStatus | None = _desc(
        "The latest profile asked for with the annotation training.tpu-operator.dev/profile, and where its trace is.",
        default=None,
    )

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def to_wire(self) -> dict[str, Any]:
        """The status as the API stores it (camelCase, unset fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

"""How each thing the controller learns changes a job's status. Pure: the time is passed in, and every
function returns a new `TPUTrainingJobStatus` plus the Events its transitions deserve.

- `invalid`: the spec does not validate. Without a JobSet the job is Invalid (Ready=False); with one,
  the JobSet runs on from the last valid spec and the edit is a refused change (SpecChange=False).
- `conflicted`: a child's name is taken by an object this job does not own (Ready=False).
- `reconciled`: the JobSet exists (created or adopted) and reflects the spec, or refuses changes.
- `refused` / `accepted`: the API refused a request permanently (Reconciled=False), or accepts them again.
- `phases.follow`: the JobSet's status mapped onto the job's phase (phases.py).
- `with_sample`: the trainer's latest metrics, or Metrics=False with the last values kept.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from ..api.failures import RestartCounts
from ..api.lifecycle import Progress
from ..api.profiling import ProfileReport
from ..api.status import NonFiniteMetrics, TPUTrainingJobStatus
from .conditions import set_condition
from .phases import Notice


def invalid(
    status: TPUTrainingJobStatus, problems: list[str], generation: int | None, now: datetime.datetime
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    message = "invalid spec: " + "; ".join(problems)
    if status.job_set_name:
        before = status.condition("SpecChange")
        conds = set_condition(status.conditions, "SpecChange", "False", "InvalidSpec", message, now, generation)
        fresh = before is None or before.message != message
        notices = [Notice("Warning", "SpecChangeRefused", message)] if fresh else []
        return status.model_copy(update=dict(conditions=conds, observed_generation=generation)), notices
    fresh = status.phase != "Invalid" or status.message != message
    conds = set_condition(status.conditions, "Ready", "False", "InvalidSpec", message, now, generation)
    new = status.model_copy(
        update=dict(phase="Invalid", message=message, conditions=conds, observed_generation=generation)
    )
    return new, [Notice("Warning", "Invalid", message)] if fresh else []


def conflicted(
    status: TPUTrainingJobStatus, message: str, generation: int | None, now: datetime.datetime
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    before = status.condition("Ready")
    conds = set_condition(status.conditions, "Ready", "False", "NameConflict", message, now, generation)
    new = status.model_copy(update=dict(conditions=conds, phase=status.phase or "Pending", message=message))
    fresh = before is None or before.reason != "NameConflict"
    return new, [Notice("Warning", "NameConflict", message)] if fresh else []


def reconciled(
    status: TPUTrainingJobStatus,
    jobset_name: str,
    config_map_name: str,
    created: bool,
    refused: list[str],
    generation: int | None,
    now: datetime.datetime,
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    notices = (
        [Notice("Normal", "Created", f"created ConfigMap {config_map_name} and JobSet {jobset_name}")]
        if created
        else []
    )
    conds = status.conditions
    before = status.condition("SpecChange")
    if refused:
        message = (
            f"changed on a job whose JobSet exists: {', '.join(refused)}; the JobSet is kept as it is. "
            "Only spec.suspend can change; delete and re-create the job to apply other changes"
        )
        conds = set_condition(conds, "SpecChange", "False", "Immutable", message, now, generation)
        if before is None or before.message != message:
            notices.append(Notice("Warning", "SpecChangeRefused", message))
    else:
        conds = set_condition(conds, "SpecChange", "True", "Applied", "the JobSet matches the spec", now, generation)
    new = status.model_copy(
        update=dict(
            conditions=conds,
            job_set_name=jobset_name,
            observed_generation=generation,
            phase=None if status.phase == "Invalid" else status.phase,
            restarts=status.restarts or RestartCounts(),
            next_restart_time=None if created else status.next_restart_time,
        )
    )
    return new, notices


def refused(
    status: TPUTrainingJobStatus, reason: str, message: str, generation: int | None, now: datetime.datetime
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The API refused a request of this job's reconcile for good (403, 422...): said once, with its words."""
    before = status.condition("Reconciled")
    conds = set_condition(status.conditions, "Reconciled", "False", reason, message, now, generation)
    fresh = before is None or before.status != "False" or before.message != message
    new = status.model_copy(update=dict(conditions=conds))
    return new, [Notice("Warning", reason, message)] if fresh else []


def accepted(status: TPUTrainingJobStatus, generation: int | None, now: datetime.datetime) -> TPUTrainingJobStatus:
    """Reconciled=True again after a refusal (a job never refused has no Reconciled condition)."""
    before = status.condition("Reconciled")
    if before is None or before.status == "True":
        return status
    conds = set_condition(
        status.conditions,
        "Reconciled",
        "True",
        "Reconciled",
        "the API accepts the operator's requests for this job",
        now,
        generation,
    )
    return status.model_copy(update=dict(conditions=conds))


@dataclass(frozen=True)
class Sample:
    """One read of the trainer's /status: the values it had (None where it sent none), or why it
    could not be read."""

    step: int | None = None
    step_time_seconds: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    last_checkpoint_step: int | None = None
    progress: Progress | None = None  # the trainer's clock (goodput, hang detection: accounting.py)
    profile: ProfileReport | None = None  # the trainer's word on a profile asked for (profiles.py)
    error: str | None = None
    non_finite: tuple[tuple[str, str], ...] = ()  # (status field, "nan" | "inf" | "-inf"): read, not finite

    def values(self) -> dict[str, Any]:
        """The status fields it sets: its finite values, None for those it read as non-finite (left out of the
        status: never the last finite value), and `non_finite` saying what they were (None: all finite)."""
        values = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("error", "progress", "profile", "non_finite") and v is not None
        }
        odd = dict(self.non_finite)
        return {
            **values,
            **{k: None for k in odd},
            "non_finite": NonFiniteMetrics.model_validate(odd) if odd else None,
        }


def with_sample(
    status: TPUTrainingJobStatus, sample: Sample, now: datetime.datetime, generation: int | None = None
) -> TPUTrainingJobStatus:
    """Fresh values and Metrics=True, or the old (stale) values and Metrics=False reason Unreachable.
    A read that brings nothing new changes nothing, `metricsTime` included: it says when the values
    were read, so that the status is written only when something in it changed."""
    if sample.error is not None:
        conds = set_condition(status.conditions, "Metrics", "False", "Unreachable", sample.error, now, generation)
        return status.model_copy(update=dict(conditions=conds))
    metrics = status.condition("Metrics")
    values = sample.values()
    if metrics is not None and metrics.status == "True" and all(getattr(status, k) == v for k, v in values.items()):
        return status
    odd = ", ".join(f"{k} {v}" for k, v in sample.non_finite)
    conds = set_condition(
        status.conditions,
        "Metrics",
        "True",
        "NonFinite" if odd else "Read",
        f"read from pod 0 of slice 0: {odd} (not finite)" if odd else "read from pod 0 of slice 0",
        now,
        generation,
    )
    return status.model_copy(update=dict(**values, metrics_time=now, conditions=conds))


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) from `old` to `new`: changed fields, None for removed ones, and
    nested objects patched field by field (a merge patch merges objects: a field left out is kept)."""
    patch: dict[str, Any] = {}
    for k in old.keys() | new.keys():
        before, after = old.get(k), new.get(k)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            patch[k] = merge_patch(before, after)
        else:
            patch[k] = after
    return patch

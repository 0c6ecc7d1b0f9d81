"""Profiles on demand: the job's annotation `training.tpu-operator.dev/profile: steps:A-B` is sent to the
running trainer (`POST /profile` on process 0, the way its `/status` is read) and followed in
`.status.profile` until the trainer says where the trace is.

- `to_send`: what a reconcile must send, if anything: a valid annotation that the status does not record
  yet, or one the status records as pending or capturing while the trainer (read just now) no longer knows
  it (its slice restarted). A status that records the request means it was sent: an operator restarted
  finds it there and sends nothing again; and should a request be sent twice, the trainer answers the same
  request as before.
- `follow` (pure): the status after this reconcile's answer or the trainer's latest `/status`: the
  annotation's value, the steps traced, the state and, once done, the path; a Warning Event when the
  annotation or the trainer refuses, a Normal one when the trace is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..api import names
from ..api.profiling import ProfileReport, parse_annotation
from ..api.status import ProfileStatus, TPUTrainingJobStatus
from .metrics_reader import MetricsReader, Unreachable
from .phases import Notice


@dataclasses.dataclass(frozen=True)
class Answer:
    """What came of sending a request: the trainer's report (accepted or refused), or why it was not sent."""

    request: str  # the annotation's value
    report: ProfileReport | None = None
    invalid: str | None = None  # the annotation does not parse: not sent
    error: str | None = None  # the trainer could not be reached: sent again by a later reconcile


def requested(annotations: dict[str, Any] | None) -> str | None:
    value = (annotations or {}).get(names.PROFILE_ANNOTATION)
    return value.strip() if isinstance(value, str) and value.strip() else None


def _steps(request: str) -> str | None:
    try:
        return str(parse_annotation(request))
    except ValueError:
        return None


def to_send(
    request: str | None, status: TPUTrainingJobStatus, trainer: ProfileReport | None, trainer_read: bool
) -> bool:
    """The annotation's request must go to the trainer now (the job is Running: the caller checks)."""
    if request is None:
        return False
    recorded = status.profile
    if recorded is None or recorded.request != request:
        return True  # new: a bad value is "sent" too, to be refused here without a request
    lost = trainer_read and (trainer is None or trainer.requested != _steps(request))
    return recorded.state in ("pending", "capturing") and lost


def refusal(request: str, total_steps: int) -> str | None:
    """Why the annotation's value cannot be sent, naming the annotation; None if it can."""
    try:
        parse_annotation(request, total_steps)
    except ValueError as exc:
        return f"annotation {names.PROFILE_ANNOTATION}: {exc}"
    return None


def follow(
    status: TPUTrainingJobStatus, answer: Answer | None, trainer: ProfileReport | None
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """status.profile after sending a request (`answer`) or reading the trainer's `/status` (`trainer`)."""
    before = status.profile
    if answer is not None and answer.error is None:
        if answer.invalid is not None:
            new = ProfileStatus(request=answer.request, state="failed", message=answer.invalid)
        else:
            assert answer.report is not None  # send(): an answer neither refused nor unsent holds the report
            new = _from_report(answer.request, answer.report)
    elif before is not None and trainer is not None and trainer.requested == _steps(before.request):
        new = _from_report(before.request, trainer)
    else:
        return status, []
    if new == before:
        return status, []
    return status.model_copy(update=dict(profile=new)), _notices(before, new)


def _from_report(request: str, report: ProfileReport) -> ProfileStatus:
    return ProfileStatus(
        request=request, steps=report.steps, state=report.state, path=report.path, message=report.message or None
    )


def _notices(before: ProfileStatus | None, new: ProfileStatus) -> list[Notice]:
    if before is not None and before.request == new.request and before.state == new.state:
        return []
    if new.state == "failed":
        return [Notice("Warning", "ProfileRefused", f"profile {new.request}: {new.message}")]
    if new.state == "done":
        return [Notice("Normal", "Profiled", f"steps {new.steps} traced: {new.path}")]
    return []


async def send(
    reader: MetricsReader,
    namespace: str,
    jobset_name: str,
    port: int,
    request: str,
    total_steps: int,
    running: bool,
    uid: str,
) -> Answer | None:
    """Send the annotation's request to process 0 (a bad value is refused here, at any phase), with the control
    token of the job of that `uid`; None while the job is not Running (a later reconcile sends it)."""
    invalid = refusal(request, total_steps)
    if invalid is not None:
        return Answer(request, invalid=invalid)
    if not running:
        return None
    steps = _steps(request)
    assert steps is not None  # refusal() parsed it
    try:
        return Answer(request, report=await reader.post_profile(namespace, jobset_name, port, steps, uid))
    except Unreachable as exc:
        return Answer(request, error=str(exc))

"""Profiles on demand: the steps a user asks to trace, and what the trainer says about the trace.

One request has three spellings, all read here so they cannot disagree:
- the job's annotation `training.tpu-operator.dev/profile: steps:A-B` (names.PROFILE_ANNOTATION), which
  the operator sends to the trainer;
- `tpujob run --local --profile A-B` (TrainerConfig.profile_steps);
- the body of the trainer's `POST /profile`: `{"steps": "A-B"}`.

Steps are counted as the trainer reports them: step N is the N-th completed step (1-based), so
`2-3` traces the second and third steps. `A` alone is `A-A`.

The trainer answers a request, and reports it in `/status` under `profile`, as a `ProfileReport`. Shared by
the trainer (which imports this module and `contract`: pydantic only) and the operator.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from pydantic import ConfigDict

from .lifecycle import Untrusted

ANNOTATION_PREFIX = "steps:"
# digits bounded: int() of a 5000-digit string is slow, and no job has 10^12 steps
_RANGE = re.compile(r"^\s*(\d{1,12})\s*(?:-\s*(\d{1,12})\s*)?$")
# A trace holds every event of its steps in the host's memory until it is written: a few steps show
# what a step does, and a long range could take the trainer's host memory (and the disk) with it.
MAX_TRACE_STEPS = 50
# ... and however few its steps, a trace stops this long after it started (slow steps, a hang).
MAX_TRACE_SECONDS = 600
# The trainer's 401 to a control request without the job's credential (workload/process/serving.py), which the
# operator tells from the API server's own 401 (controller/metrics_reader.py) by its start: a trainer from before the
# control key went on "(the Secret <job>-control)".
CONTROL_REFUSED_START = "a control request needs the job's control credential"
CONTROL_REFUSED = f"{CONTROL_REFUSED_START} (its token, which the operator derives)"
# pending: asked for, its first step not reached yet; capturing: the trace is on; done: the trace is
# written (path); failed: it could not be captured (message).
ProfileState = Literal["pending", "capturing", "done", "failed"]


@dataclasses.dataclass(frozen=True)
class StepRange:
    first: int
    last: int

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def parse_steps(text: object, total_steps: int | None = None) -> StepRange:
    """`A-B` (or `A`) as a StepRange; ValueError saying what is wrong with it. With `total_steps`, the
    range must lie within the job's steps."""
    match = _RANGE.match(text) if isinstance(text, str) else None
    if match is None:
        shown = repr(text)[:40] + ("..." if len(repr(text)) > 40 else "")  # the request is anyone's: echo little
        raise ValueError(f"{shown} is not a step range: write FIRST-LAST, e.g. 100-105 (steps count from 1)")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if first < 1:
        raise ValueError(f"{text!r}: steps count from 1")
    if first > last:
        raise ValueError(f"{text!r}: the first step ({first}) is after the last ({last})")
    if last - first + 1 > MAX_TRACE_STEPS:
        raise ValueError(f"{text!r}: {last - first + 1} steps; a trace may hold at most {MAX_TRACE_STEPS} steps")
    if total_steps is not None and last > total_steps:
        raise ValueError(
            f"{text!r}: the job has {total_steps} steps; the last step to trace must be at most {total_steps}"
        )
    return StepRange(first, last)


def parse_annotation(value: object, total_steps: int | None = None) -> StepRange:
    """The annotation's value, `steps:A-B`; ValueError saying what is wrong with it."""
    if not isinstance(value, str) or not value.strip().startswith(ANNOTATION_PREFIX):
        raise ValueError(
            f"{repr(value)[:40]} does not start with {ANNOTATION_PREFIX!r}: write steps:FIRST-LAST, e.g. steps:100-105"
        )
    return parse_steps(value.strip()[len(ANNOTATION_PREFIX) :], total_steps)


class ProfileReport(Untrusted):
    """The trainer's word on the latest profile request: its answer to `POST /profile` and the `profile`
    object of `/status`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    requested: str  # the steps as asked for, e.g. "100-105"
    steps: str | None = None  # the steps it traces (the requested ones, less any already run); None if refused
    state: ProfileState
    directory: str | None = None  # the TensorBoard log directory the trace goes under
    path: str | None = None  # the trace file (.xplane.pb), once written
    message: str = ""

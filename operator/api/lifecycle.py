"""How a trainer process ends and what it says about its own time: the exit codes, the progress it
reports, and the record it leaves behind. Shared by the trainer (which imports this module and
`contract`, pydantic only) and by the operator and the local runner, which read them.

Exit codes (the trainer maps every failure to one of them in one place, `tpu_workload.process.exits`):

  code  class       meaning                                                          default policy
  0     finished    every step trained                                               -
  3     user        the job's config or code is wrong: an invalid config file or     fails the job at
                    environment contract, a model that does not fit the device       once; never
                    memory (RESOURCE_EXHAUSTED), an injected user fault              retried
  42    retryable   infrastructure: the coordinator / jax.distributed start-up or    restarted
                    the first collective timed out, TPU runtime or device errors,
                    checkpoint or data I/O that failed after its own retries
  43    diverged    a non-finite loss or gradient norm at a step: that step's state  fails the job
                    was never saved (the record's `diverged` says where)             (or Rewind)
  143   stopped     SIGTERM (preemption, maintenance, an eviction): the step in      restarted (cause
                    flight finished and was checkpointed first                       preemption)
  137   killed      SIGKILL from outside: a node lost, the grace period exceeded,    restarted
                    the kernel's OOM killer (the trainer cannot say which)
  1     unexpected  an exception nothing classified (a bug)                          fails unless listed

The termination record: on exit each process writes one JSON line (`TerminationRecord`) to
$TPUJOB_TERMINATION_LOG, default `/dev/termination-log`, the file Kubernetes turns into the
container's `state.terminated.message` (at most 4096 bytes). The pods run with
`terminationMessagePolicy: FallbackToLogsOnError`, so a process killed before it could write
leaves the tail of its log there instead; `TerminationRecord.parse` reads both.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
MAX_MESSAGE_BYTES = 4096  # what the kubelet keeps of a termination message


class ExitCode(enum.IntEnum):
    OK = 0
    UNEXPECTED = 1
    USER = 3
    RETRYABLE = 42
    DIVERGED = 43  # a non-finite loss or gradient norm: no state was saved after it (spec.failurePolicy.onDivergence)
    KILLED = 137  # 128 + SIGKILL
    STOPPED = 143  # 128 + SIGTERM


# The table's last column: the codes spec.failurePolicy.restartOnExitCodes lists by default, and the one no
# policy may list (api/failures.py applies them).
DEFAULT_RESTART_ON_EXIT_CODES = (int(ExitCode.RETRYABLE), int(ExitCode.KILLED), int(ExitCode.STOPPED))
NEVER_RESTARTED = (int(ExitCode.USER),)


def exit_code(returncode: int) -> int:
    """A process's exit status as Kubernetes reports it: death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


class Untrusted(BaseModel):
    """A model read from another process's JSON (a /status answer)."""

    @classmethod
    def lenient(cls, value: object) -> Self | None:
        """The model of `value`, or None where it is absent or malformed (never an error)."""
        try:
            return cls.model_validate(value) if isinstance(value, dict) else None
        except ValidationError:
            return None


class Progress(Untrusted):
    """What a trainer process knows of its own time (epoch seconds of its host's clock; GKE nodes
    are NTP-synchronised, so the operator compares them with its own as they are). Served under
    `progress` in /status, carried by every JSON step line and by the termination record."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)
    started_at: float = Field(description="The process started.")
    start_step: int | None = Field(None, description="The step this attempt started from (restored), once set up.")
    first_step_at: float | None = Field(
        None, description="This attempt's first step completed (start-up, restore and compilation came before it)."
    )
    last_step_at: float | None = Field(None, description="The latest step completed.")
    step: int | None = Field(None, description="Completed steps.")
    last_checkpoint_step: int | None = Field(None, description="The latest complete checkpoint.")
    step_seconds: float = Field(
        0.0,
        description="Time on this attempt's steps after its first (which counts "
        "as start-up), less blocking checkpoint and data-wait time.",
    )
    steps_timed: int = Field(0, description="The steps `stepSeconds` covers.")
    median_step_seconds: float | None = Field(None, description="Median step time over the latest 100 steps.")
    checkpoint_seconds: float = Field(
        0.0, description="Blocking checkpoint time: saves in the loop, the final wait, the SIGTERM save."
    )
    eval_seconds: float = Field(0.0, description="Blocking evaluation time (training.eval).")
    data_wait_seconds: float = Field(
        0.0,
        description="Time the training loop blocked waiting for a step's batch, "
        "after the first step (before it: start-up).",
    )


class Divergence(BaseModel):
    """Where a run diverged: the step whose loss or gradient norm was not finite, and the value as text
    ("nan", "inf", "-inf": JSON has no token for them). Carried by the termination record of exit code 43."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True, alias_generator=to_camel)
    step: int = Field(description="The step whose update was not applied (its state is never saved).")
    metric: Literal["loss", "grad_norm"] = Field(description="Which value was not finite (loss is checked first).")
    value: str = Field(max_length=32, description='"nan", "inf" or "-inf".')
    last_checkpoint_step: int | None = Field(None, description="The latest checkpoint, all written from finite state.")


class TerminationRecord(BaseModel):
    """The last thing a trainer process says: its exit code, its last error line, its progress, and the
    values its /status last served (`last`: loss, eval_loss, step_time_s, ...; the operator's last read of
    /status may have come a step or an evaluation before the end, and a finished job must not show those)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    code: int
    error: str = ""
    progress: Progress | None = None
    last: dict[str, Any] | None = None  # untrusted: the operator reads it as a /status answer (to_sample)
    diverged: Divergence | None = None  # exit code 43 only

    def message(self) -> str:
        """One JSON line that fits the kubelet's 4096 bytes (the error line is cut to fit)."""
        text = self.model_dump_json(exclude_none=True)
        over = len(text.encode()) - MAX_MESSAGE_BYTES
        if over > 0:
            error = self.error.encode()[: max(0, len(self.error.encode()) - over - 8)].decode(errors="ignore")
            text = self.model_copy(update={"error": error + " ..."}).model_dump_json(exclude_none=True)
        return text

    @classmethod
    def parse(cls, text: str | None, code: int | None = None) -> TerminationRecord | None:
        """The record in a termination message; for a message that is a log tail (the process died
        before writing one), a record whose error is the tail's last line."""
        if not text or not text.strip():
            return None
        try:
            return cls.model_validate(json.loads(text.strip().splitlines()[-1]))
        except (ValueError, ValidationError, RecursionError):  # the trainer's words: 4 KiB of `[` nest too deep
            pass
        last = next(line.strip() for line in reversed(text.strip().splitlines()) if line.strip())
        return cls(code=code if code is not None else int(ExitCode.UNEXPECTED), error=last)

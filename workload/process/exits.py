"""Every way the trainer ends, mapped to an exit code here and nowhere else (the table of codes is in
`tpu_operator.api.lifecycle`), with its last words written where the operator reads them.

`code_of` classifies an exception, first match wins (an unclassified exception is looked up again
through its cause, then its context):
  Stopped                                  143  SIGTERM handled after a checkpoint (preemption.py)
  Diverged                                 43   a step's loss or gradient norm was not finite; its
                                                state was never saved (loop/divergence.py)
  UserError, pydantic ValidationError      3    the job's config or environment contract is wrong
  FileNotFoundError, PermissionError,      3    a path the job names is missing or not ours to read
    NotADirectoryError, IsADirectoryError
  JAX runtime error RESOURCE_EXHAUSTED     3    the model does not fit the devices' memory
  Retryable                                42   infrastructure (raised by start-up: the coordinator,
                                                jax.distributed and the first collective)
  JAX runtime error DEADLINE_EXCEEDED,     42   the TPU runtime, a device or a peer failed
    UNAVAILABLE, INTERNAL, ABORTED,
    CANCELLED, DATA_LOSS, UNKNOWN
  any other OSError (TimeoutError,         42   I/O that failed after its library's own retries
    ConnectionError, ...)                       (gcsfs, Orbax)
  InjectedExit                             its code (faults.py, tests only)
  anything else                            1    unexpected: a bug, not retried by default

On exit (`finish`, `fail`, or the start-up `deadline` firing) the process writes its
`TerminationRecord` (code, last error line, progress, and for 43 where it diverged) to
$TPUJOB_TERMINATION_LOG, default /dev/termination-log; a file it cannot write there is skipped (a
laptop has none). Its `last` values are in /status's wire format (`wire`): a non-finite float is the
string "nan", "inf" or "-inf", since JSON has no token for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tpu_operator.api.lifecycle import TERMINATION_LOG, Divergence, ExitCode, Progress, TerminationRecord

log = logging.getLogger("tpu_workload")
RETRYABLE_STATUSES = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL", "ABORTED", "CANCELLED", "DATA_LOSS", "UNKNOWN")
USER_STATUSES = ("RESOURCE_EXHAUSTED",)
USER_OS_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)


class UserError(Exception):
    """The job's config is wrong: retrying cannot help."""


class Retryable(Exception):
    """Infrastructure that may work on the next attempt."""


class Stopped(Exception):
    """SIGTERM was handled: the step in flight finished and (with a checkpoint directory) was saved."""

    def __init__(self, step: int, saved: bool):
        super().__init__(
            f"stopped by SIGTERM at step {step}"
            + (f" after a checkpoint at step {step}" if saved else " (no checkpoint directory)")
        )
        self.step, self.saved = step, saved


class Diverged(Exception):
    """A step's loss or gradient norm was not finite: its update was not applied, and no state after
    the last checkpoint (`divergence.last_checkpoint_step`) was saved."""

    def __init__(self, divergence: Divergence):
        d = divergence
        saved = f"step {d.last_checkpoint_step}" if d.last_checkpoint_step is not None else "none"
        super().__init__(
            f"{d.metric} is {d.value} at step {d.step}: the update was not applied, and no state after it was "
            f"saved (latest checkpoint: {saved})"
        )
        self.divergence = d


class InjectedExit(Exception):
    """A test fault's exit code (faults.py)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _runtime_status(exc: BaseException) -> str | None:
    """The status code a JAX runtime error starts with ("INTERNAL: ..."), or None for other errors."""
    if not isinstance(exc, RuntimeError) or "jax" not in type(exc).__module__:
        return None
    head = str(exc).split(":", 1)[0].strip()
    return head if head.isupper() else None


def code_of(exc: BaseException) -> int:
    """The exit code of `exc` (the table in the module docstring)."""
    from pydantic import ValidationError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = _runtime_status(exc)
        if isinstance(exc, Stopped):
            return int(ExitCode.STOPPED)
        if isinstance(exc, Diverged):
            return int(ExitCode.DIVERGED)
        if isinstance(exc, InjectedExit):
            return exc.code
        if isinstance(exc, (UserError, ValidationError, *USER_OS_ERRORS)) or status in USER_STATUSES:
            return int(ExitCode.USER)
        if isinstance(exc, (Retryable, OSError)) or status in RETRYABLE_STATUSES:
            return int(ExitCode.RETRYABLE)
        exc = exc.__cause__ or exc.__context__
    return int(ExitCode.UNEXPECTED)


def error_line(exc: BaseException) -> str:
    """The line a human reads first: `Type: first line of the message`."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}"[:2000] if text else type(exc).__name__


def write_record(record: TerminationRecord, path: str | None = None) -> None:
    target = Path(path or os.environ.get("TPUJOB_TERMINATION_LOG") or TERMINATION_LOG)
    try:
        if target.parent.is_dir():
            target.write_text(record.message() + "\n")
    except OSError as exc:
        log.warning("could not write the termination record to %s: %s", target, exc)


def wire(value: Any) -> Any:
    """`value` as /status, the JSON lines and the termination record carry it: a finite float as a
    JSON number, a non-finite one as "nan", "inf" or "-inf" (json.dumps would write NaN, which is no
    JSON; pydantic would write null, a stale-looking gap), anything else as it is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _numbers(shown: Mapping[str, Any] | None) -> dict[str, float | int | str] | None:
    """The numeric values of a /status snapshot (a few keys, well inside the record's 4096 bytes),
    non-finite ones as their text (`wire`)."""
    if not shown:
        return None
    return {k: wire(v) for k, v in shown.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def finish(progress: Progress | None, shown: Mapping[str, Any] | None = None) -> int:
    """Write the record of a finished run: its progress and the values its /status last served."""
    write_record(TerminationRecord(code=0, progress=progress, last=_numbers(shown)))
    return 0


def fail(exc: BaseException, progress: Progress | None, shown: Mapping[str, Any] | None = None) -> int:
    """Log `exc`, write the record, and return the code to exit with."""
    code, line = code_of(exc), error_line(exc)
    if code == ExitCode.STOPPED:
        log.warning("%s; exiting %d", exc, code)
    else:
        log.error("training failed (exit %d): %s", code, line, exc_info=exc)
    error = str(exc) if code == ExitCode.STOPPED else line
    diverged = exc.divergence if isinstance(exc, Diverged) else None
    write_record(TerminationRecord(code=code, error=error, progress=progress, last=_numbers(shown), diverged=diverged))
    return code


@contextlib.contextmanager
def deadline(seconds: float, what: str, progress: Callable[[], Progress | None]) -> Iterator[None]:
    """Run the block with a watchdog: past `seconds` the process exits 42 with a message naming `what`
    (a blocked collective cannot be interrupted from Python; os._exit ends it anyway)."""

    def expire() -> None:
        message = f"Retryable: {what} did not complete within {seconds:g} s"
        log.error("%s; exiting %d", message, ExitCode.RETRYABLE)
        write_record(TerminationRecord(code=int(ExitCode.RETRYABLE), error=message, progress=progress()))
        logging.shutdown()
        os._exit(int(ExitCode.RETRYABLE))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()

"""Profiles on demand: a JAX profiler trace of the steps asked for, written where TensorBoard's profile
plugin finds it: `<tensorboard dir>/plugins/profile/<run>/<host>.xplane.pb`, the tensorboard dir being
`<checkpoint dir or run dir>/tensorboard`, beside the scalars.

Asked for by `TrainerConfig.profile_steps` (`tpujob run --local --profile A-B`) or, while the trainer
runs, by `POST /profile` with `{"steps": "A-B"}` (the operator sends the job's annotation there). Only
process 0 serves HTTP, so only process 0 traces: the trace holds its host and its devices.

The trace starts once step A-1 has completed, before step A is dispatched, and stops once step B has
completed: it holds steps A..B and nothing of the steps around them. Both waits for the device happen
only then; while nothing is asked for, the loop's hook reads one attribute per step.

A trace holds at most MAX_TRACE_STEPS steps (parse_steps refuses more) and is stopped at the first step
that completes MAX_TRACE_SECONDS after it started: the profiler holds every event in host memory until it
writes the file.

The answers (`ProfileReport`, api/profiling.py) also go to `/status` as `profile`: requested steps, the
steps traced, the state (pending, capturing, done, failed), the directory and, once written, the file.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import jax
from etils import epath

from tpu_operator.api.profiling import MAX_TRACE_SECONDS, ProfileReport, StepRange, parse_steps

from ..loop.hooks import Hook, Run
from ..process.metrics import Status

log = logging.getLogger(__name__)


class Profiler:
    """One request at a time: a new one replaces one still pending, waits for one being captured, and
    the same one asked for again is answered as before (the operator may send it again after a restart)."""

    def __init__(
        self,
        total_steps: int,
        logdir: str | None,
        status: Status | None = None,
        emit: Callable[[dict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.logdir, self.status, self.clock = total_steps, logdir, status, clock
        self.emit = emit  # process 0's JSON lines: a `{"profile": ...}` line once a trace is done or failed
        self._lock = threading.Lock()
        self._range: StepRange | None = None  # pending or being captured: what the loop's hook looks at
        self._report: ProfileReport | None = None
        self._dispatched: int | None = None  # the latest step the loop dispatched; None before the run starts
        self._capturing = False
        self._started = 0.0  # when the trace started (clock)
        self._before: set[str] = set()

    # --- requests (the HTTP thread, or the config at start-up) --------------------------------------

    def answer(self, body: bytes) -> tuple[int, dict]:
        """`POST /profile`: (HTTP status, JSON body). 200: the request's report; 400: a bad request, with
        the reason; 409: another profile is being captured."""
        try:
            steps = json.loads(body or b"null").get("steps")
        except (ValueError, AttributeError):
            return 400, {"error": 'the body must be a JSON object: {"steps": "FIRST-LAST"}'}
        if steps is None:
            return 400, {"error": 'steps: required, e.g. {"steps": "100-105"}'}
        code, report = self.request(steps)
        answer = report.model_dump(exclude_none=True)
        return code, answer if code == 200 else {"error": report.message, **answer}

    def request(self, steps: object) -> tuple[int, ProfileReport]:
        """Ask for a trace of `steps` (FIRST-LAST). A refusal is a report with state failed and the reason."""
        try:
            wanted = parse_steps(steps, self.total)
        except ValueError as exc:
            return 400, ProfileReport(requested=str(steps), state="failed", message=f"steps: {exc}")
        requested = str(wanted)
        with self._lock:
            if self._report is not None and self._report.requested == requested:
                return 200, self._report  # the same request again: the same answer
            if self._capturing:
                return 409, ProfileReport(
                    requested=requested,
                    state="failed",
                    message=f"steps {self._range} are being traced; ask again once done",
                )
            if self.logdir is None:
                return 400, ProfileReport(
                    requested=requested,
                    state="failed",
                    message=("this trainer has no directory to write a trace to: set spec.checkpoint.directory"),
                )
            # A trace starts after step FIRST-1 is dispatched: a range the loop has reached is moved on.
            earliest = 1 if self._dispatched is None else self._dispatched + 2
            if wanted.last < earliest:
                return 400, ProfileReport(
                    requested=requested,
                    state="failed",
                    message=(
                        f"steps {requested} have already run: the trainer is at step {self._dispatched}; the "
                        f"earliest step it can trace is {earliest}"
                    ),
                )
            traced = StepRange(max(wanted.first, earliest), wanted.last)
            message = "" if traced == wanted else f"steps {wanted.first}-{traced.first - 1} had already run"
            self._set(
                StepRange(traced.first, traced.last),
                ProfileReport(
                    requested=requested, steps=str(traced), state="pending", directory=self.logdir, message=message
                ),
            )
            log.info(
                "profile: steps %s will be traced into %s%s", traced, self.logdir, f" ({message})" if message else ""
            )
            return 200, self._report

    def report(self) -> ProfileReport | None:
        return self._report

    def _set(self, wanted: StepRange | None, report: ProfileReport) -> None:
        self._range, self._report = wanted, report
        if self.status is not None:
            self.status.update(profile=report.model_dump(exclude_none=True))
        if self.emit is not None and report.state in ("done", "failed"):
            self.emit({"profile": report.model_dump(exclude_none=True)})

    # --- the loop ---------------------------------------------------------------------------------------

    def hooks(self, run: Run) -> list[Hook]:
        """The loop's hook, for a run that starts after step `run.start`: a pending range that begins with
        the run's first step starts its trace now, before that step is dispatched."""
        with self._lock:
            self._dispatched = run.start
            if self._range is not None and self._range.first <= run.start:
                self._refit(run.start)
            if self._range is not None and self._range.first == run.start + 1:
                self._start()
        return [Hook(1, on_state=self.on_state)]

    def on_state(self, step: int, state: dict) -> None:
        """Right after step `step` is dispatched (`state` is its result, not computed yet)."""
        self._dispatched = step
        if self._range is None:  # the common case: nothing asked for
            return
        with self._lock:
            wanted = self._range
            if wanted is None:
                return
            if self._capturing and step >= wanted.last:
                jax.block_until_ready(state)  # the trace ends with step `last` completed
                self._stop(step)
            elif self._capturing and self.clock() - self._started > MAX_TRACE_SECONDS:
                jax.block_until_ready(state)  # slow steps: the trace ends here, its events held in memory so far
                self._stop(
                    step, why=f"the trace stopped after step {step}: a trace lasts at most {MAX_TRACE_SECONDS} s"
                )
            elif not self._capturing and step >= wanted.first - 1:
                jax.block_until_ready(state)  # and begins with nothing before step `first` in flight
                if step >= wanted.last:  # asked for while its last step was being dispatched
                    self._set(
                        None,
                        self._report.model_copy(
                            update=dict(
                                state="failed",
                                steps=None,
                                message=(f"asked for too late: step {step} was already dispatched"),
                            )
                        ),
                    )
                    return
                if step >= wanted.first:  # asked for during the step before: it starts one step late
                    self._range = StepRange(step + 1, wanted.last)
                    self._report = self._report.model_copy(update=dict(steps=str(self._range)))
                self._start()

    def close(self, step: int | None = None) -> None:
        """The run ended (finished, failed or stopped): a trace still on is stopped and kept, a pending
        request fails."""
        with self._lock:
            if self._capturing:
                self._stop(step, ended=True)
            elif self._range is not None:
                self._set(
                    None,
                    self._report.model_copy(
                        update=dict(
                            state="failed", message=f"the run ended at step {step} before step {self._range.first}"
                        )
                    ),
                )

    def _refit(self, start: int) -> None:
        """A range asked for before the run knew where it resumes from: the steps already run are left out."""
        wanted = self._range
        if wanted.last <= start:
            self._set(
                None,
                self._report.model_copy(
                    update=dict(
                        state="failed",
                        steps=None,
                        message=(f"steps {wanted} had already run: the run resumed after step {start}"),
                    )
                ),
            )
        else:
            self._range = StepRange(start + 1, wanted.last)
            self._set(
                self._range,
                self._report.model_copy(
                    update=dict(steps=str(self._range), message=f"the run resumed after step {start}")
                ),
            )

    def _start(self) -> None:
        self._before = set(_traces(self.logdir))
        try:
            jax.profiler.start_trace(self.logdir)
        except Exception as exc:  # a trace is never worth a run: say why and train on
            log.warning("profile: could not start the trace: %s", exc)
            self._set(None, self._report.model_copy(update=dict(state="failed", message=f"start_trace: {exc}")))
            return
        self._capturing, self._started = True, self.clock()
        log.info("profile: tracing steps %s", self._range)
        self._set(self._range, self._report.model_copy(update=dict(state="capturing")))

    def _stop(self, step: int | None, ended: bool = False, why: str = "") -> None:
        self._capturing = False
        try:
            jax.profiler.stop_trace()
        except Exception as exc:
            log.warning("profile: could not write the trace: %s", exc)
            self._set(None, self._report.model_copy(update=dict(state="failed", message=f"stop_trace: {exc}")))
            return
        new = sorted(set(_traces(self.logdir)) - self._before)
        if not new:
            self._set(
                None,
                self._report.model_copy(
                    update=dict(
                        state="failed", message=f"the profiler wrote no .xplane.pb under {self.logdir}/plugins/profile"
                    )
                ),
            )
            return
        update = dict(state="done", path=new[-1])
        if ended:
            update["message"] = f"the run ended at step {step}: the trace stops there"
        elif why:
            update.update(message=why, steps=f"{self._range.first}-{step}")
        log.info("profile: steps %s traced: %s", self._range, new[-1])
        self._set(None, self._report.model_copy(update=update))


def _traces(logdir: str) -> list[str]:
    """The profiler's files under `logdir` (local or gs://)."""
    root = epath.Path(logdir) / "plugins" / "profile"
    return [str(p) for p in root.glob("*/*.xplane.pb")] if root.exists() else []


def for_config(
    cfg, tensorboard_dir: str | None, status: Status | None, emit: Callable[[dict], None] | None = None
) -> Profiler:
    """The process's profiler; the config's `profile_steps` (a local run's --profile) already asked for."""
    profiler = Profiler(cfg.training.steps, tensorboard_dir, status, emit)
    if cfg.profile_steps:
        code, report = profiler.request(cfg.profile_steps)
        if code != 200:
            log.warning("profile: %s", report.message)
            profiler._set(None, report)  # shown like any other outcome: /status and the JSON line
    return profiler

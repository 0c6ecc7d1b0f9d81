"""Run a JobSet's pods as local processes under the job's restart policy: a failed process stops
every process of the attempt, the attempt's root cause is read from the processes' exit codes and
termination records (api/failures.py, as the operator reads pods), and `decide` says whether to
restart (after its backoff) or fail. `decide=None` never restarts, as a JobSet with maxRestarts 0.

Stopping an attempt sends SIGTERM to every process left and SIGKILL to any still there after a grace
period, as the kubelet does. After a preemption (the first exit was 143: every process is saving the
step in flight) that is the pod's full grace period; after any other failure it is
`FAILED_ATTEMPT_GRACE_S`: a JAX process cannot save without all of its peers, so the survivors of a
dead one have nothing to save and only sit in a collective that never returns (the operator deletes
such pods with gracePeriodSeconds 0). A process with no termination record leaves the tail of its
log of this attempt instead (`terminationMessagePolicy: FallbackToLogsOnError`).

An elastic job (`tpu`, api/elastic.py) runs each slice as its own group of processes: a failure whose
root cause is one slice's process restarts on the slices left when there are at least `minSlices`, and
with `growBack` the smaller attempt is stopped as a preemption is (SIGTERM: the step in flight is saved)
once it has written a checkpoint, and the next attempt runs on every slice again (on one machine the
larger job can always be placed). A resize is said with a `resized` event.

The caller sees what happens through `on_event(kind, **details)` calls, so the same supervisor
drives `tpujob run --local` (a progress line and the goodput ledger) and the end-to-end tests' node
agent (JobSet and pod status).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api import elastic
from ..api.failures import Failure, PodExit, RestartCounts, Verdict, root_cause
from ..api.lifecycle import ExitCode, TerminationRecord, exit_code
from ..api.spec import TPUSpec
from .pods import LocalPod

EventHandler = Callable[..., None]
Decide = Callable[[RestartCounts, Failure], Verdict]
LOG_TAIL_BYTES, LOG_TAIL_LINES = 2048, 80  # what the kubelet keeps of a log as a termination message
FAILED_ATTEMPT_GRACE_S = 2.0  # for the survivors of a failed process to flush their logs


@dataclass
class Outcome:
    phase: str  # Succeeded | Failed | Interrupted
    restarts: RestartCounts
    message: str
    last_metrics: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    failure: Failure | None = None  # the last attempt's, when one failed


class _Running:
    """One attempt: the pod processes, their log files and the coordinator's JSON lines."""

    def __init__(self, log_dir: Path, attempt: int, on_event: EventHandler):
        self.log_dir, self.attempt, self.on_event = log_dir, attempt, on_event
        self.pods: list[LocalPod] = []
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.metrics: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self.logs: list[tuple[Path, int]] = []  # each pod's log and where this attempt starts in it
        self.finished: dict[int, float] = {}  # pod index -> when it was seen to exit

    def start(self, pods: Sequence[LocalPod]) -> None:
        """Start the pods' processes; those started are in `procs` at every moment, for `stop`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for pod in pods:
            self.pods.append(pod)
            if pod.termination_log is not None:
                pod.termination_log.parent.mkdir(parents=True, exist_ok=True)
                pod.termination_log.unlink(missing_ok=True)
            path = self.log_dir / f"{pod.hostname}.log"
            log = open(path, "a", encoding="utf-8")
            log.write(f"--- attempt {self.attempt}\n")
            log.flush()
            self.logs.append((path, log.tell()))
            # A session of its own: signals to the group reach the trainer and any children it forks.
            proc = subprocess.Popen(
                pod.argv,
                env=pod.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
                bufsize=1,
            )
            self.procs.append(proc)
            reader = threading.Thread(target=self._pump, args=(pod, proc, log), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _pump(self, pod: LocalPod, proc: subprocess.Popen, log) -> None:
        with log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if pod.is_coordinator and line.startswith("{"):
                    self._metric(line)

    def _metric(self, line: str) -> None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return
        if record.get("summary"):
            self.summary = record
        elif "step" in record:
            self.metrics.append(record)
            self.on_event("metrics", record=record)
        elif isinstance(record.get("profile"), dict):  # a profile's outcome (tpu_workload.performance.profiling)
            self.on_event("profile", report=record["profile"])

    def resumed_from(self) -> int | None:
        """The step this attempt restored (its trainer's clock), once it has reported a step."""
        progress = self.metrics[0].get("progress") if self.metrics else None
        return progress.get("start_step") if progress else None

    def last_checkpoint(self) -> int | None:
        return self.metrics[-1].get("last_checkpoint_step") if self.metrics else None

    def poll(self) -> tuple[LocalPod, int] | None | bool:
        """(pod, code) of the first failed pod, True when all succeeded, None while running."""
        codes = [p.poll() for p in self.procs]
        now = time.time()
        for i, code in enumerate(codes):
            if code is not None:
                self.finished.setdefault(i, now)
        for pod, code in zip(self.pods, codes):
            if code not in (None, 0):
                return pod, exit_code(code)
        return all(c == 0 for c in codes) or None

    def stop(self, grace_s: float) -> None:
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            self.finished.setdefault(i, time.time())
        self.join()

    def join(self) -> None:
        for reader in self.readers:
            reader.join(timeout=5)

    def exits(self) -> list[PodExit]:
        """Every pod's exit as the kubelet would report it (call once they have all exited)."""
        found = []
        for i, (pod, proc) in enumerate(zip(self.pods, self.procs)):
            code = exit_code(proc.wait())
            text = pod.termination_log.read_text() if pod.termination_log and pod.termination_log.exists() else ""
            if not text and code != 0:
                text = self._log_tail(i)
            found.append(
                PodExit(
                    pod=pod.hostname,
                    code=code,
                    record=TerminationRecord.parse(text, code),
                    finished_at=self.finished.get(i),
                    slice_index=pod.slice_index,
                )
            )
        return found

    def _log_tail(self, i: int) -> str:
        path, start = self.logs[i]
        with open(path, "rb") as f:
            f.seek(start)
            tail = f.read()[-LOG_TAIL_BYTES:].decode(errors="replace")
        return "\n".join(tail.splitlines()[-LOG_TAIL_LINES:])


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def supervise(
    make_pods: Callable[[int, int | None], Sequence[LocalPod]],
    log_dir: Path,
    *,
    decide: Decide | None,
    grace_s: float,
    on_event: EventHandler = lambda kind, **_: None,
    poll_seconds: float = 0.1,
    tpu: TPUSpec | None = None,
) -> Outcome:
    """Run attempts until success, a failure `decide` does not restart, or Ctrl-C. `make_pods(attempt,
    slices)`; `tpu`, for an elastic job, decides the slices of each attempt (None: every attempt is whole)."""
    restarts, history, attempt = RestartCounts(), [], 0
    slices = tpu.slices if tpu is not None else None
    while True:
        running = _Running(log_dir, attempt, on_event)
        grew = False
        try:  # a Ctrl-C at any moment once a process may exist stops every one started
            running.start(make_pods(attempt, slices))
            on_event(
                "started",
                attempt=attempt,
                pods=running.pods,
                pids=[p.pid for p in running.procs],
                at=time.time(),
                slices=slices,
            )
            while (state := running.poll()) is None:
                if tpu is not None and elastic.grow_back_due(
                    tpu, slices, running.resumed_from(), running.last_checkpoint()
                ):
                    grew = True
                    break
                time.sleep(poll_seconds)
        except KeyboardInterrupt:
            running.stop(grace_s)
            history += running.metrics
            on_event("interrupted", at=time.time())
            return Outcome(
                "Interrupted",
                restarts,
                "interrupted by the user; every process was stopped",
                _last(history),
                None,
                history,
            )
        if grew:  # stopped as a preemption is, so the step in flight is saved; not a restart
            stopped_at = time.time()
            running.stop(grace_s)
            history += running.metrics
            resize = elastic.grow_back(tpu, slices)
            cause = root_cause(running.exits())
            on_event(
                "resized",
                at=stopped_at,
                resize=resize,
                progress=cause.progress if cause else None,
                message=resize.message,
            )
            slices, attempt = resize.slices, attempt + 1
            continue
        if state is True:
            running.join()
            history += running.metrics
            on_event("succeeded", at=time.time(), exits=running.exits())
            return Outcome(
                "Succeeded",
                restarts,
                f"all {len(running.pods)} processes completed",
                _last(history),
                running.summary,
                history,
            )
        failed_at = time.time()
        running.stop(grace_s if state[1] == ExitCode.STOPPED else min(grace_s, FAILED_ATTEMPT_GRACE_S))
        history += running.metrics
        exits = running.exits()
        failure = root_cause(exits)
        on_event("pod_failed", pod=state[0], code=state[1], failure=failure, exits=exits, at=failed_at)
        verdict = decide(restarts, failure) if decide else Verdict(False, None, 0, failure.describe())
        if not verdict.restart:
            on_event("failed", at=time.time(), message=verdict.message)
            return Outcome("Failed", restarts, verdict.message, _last(history), None, history, failure)
        restarts, attempt = restarts.plus(verdict.cause), attempt + 1
        on_event("restarting", restarts=restarts, cause=verdict.cause, delay_s=verdict.delay_s, message=verdict.message)
        if tpu is not None:
            resize = elastic.after_failure(tpu, slices, failure.slice_index)
            if resize.reason is not None:
                on_event("resized", at=failed_at, resize=resize, progress=None, message=resize.message)
            slices = resize.slices
        try:
            time.sleep(verdict.delay_s)
        except KeyboardInterrupt:
            on_event("interrupted", at=time.time())
            return Outcome(
                "Interrupted",
                restarts,
                "interrupted by the user during a restart's backoff",
                _last(history),
                None,
                history,
                failure,
            )


def _last(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    return history[-1] if history else None

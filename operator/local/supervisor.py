"""Run a JobSet's pods as local processes with the JobSet failure policy: a failed pod stops every
pod, and the whole set restarts (up to maxRestarts) unless its exit code is not restartable.

The caller sees what happens through `on_event(kind, **details)` calls, so the same supervisor
drives `tpujob run --local` (a progress line) and the end-to-end tests' node agent (JobSet status).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .pods import LocalPod

EventHandler = Callable[..., None]
GRACE_SECONDS = 10.0


@dataclass
class Outcome:
    phase: str  # Succeeded | Failed | Interrupted
    restarts: int
    message: str
    last_metrics: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)


class _Running:
    """One attempt: the pod processes, their log files and the coordinator's JSON lines."""

    def __init__(self, pods: Sequence[LocalPod], log_dir: Path, attempt: int, on_event: EventHandler):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.pods = list(pods)
        self.on_event = on_event
        self.procs: list[subprocess.Popen] = []
        self.readers: list[threading.Thread] = []
        self.metrics: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        for pod in self.pods:
            log = open(log_dir / f"{pod.hostname}.log", "a", encoding="utf-8")
            log.write(f"--- attempt {attempt}\n")
            log.flush()
            # A session of its own: signals to the group reach the trainer and any children it forks.
            proc = subprocess.Popen(pod.argv, env=pod.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1)
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

    def poll(self) -> tuple[LocalPod, int] | None | bool:
        """(pod, code) of the first failed pod, True when all succeeded, None while running."""
        codes = [p.poll() for p in self.procs]
        for pod, code in zip(self.pods, codes):
            if code not in (None, 0):
                return pod, code
        return all(c == 0 for c in codes) or None

    def stop(self) -> None:
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.join()

    def join(self) -> None:
        for reader in self.readers:
            reader.join(timeout=5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def supervise(make_pods: Callable[[int], Sequence[LocalPod]], log_dir: Path, *, max_restarts: int,
              restart_on_exit_codes: Sequence[int] = (), on_event: EventHandler = lambda kind, **_: None,
              poll_seconds: float = 0.1) -> Outcome:
    """Run attempts until success, a non-restartable failure, too many restarts, or Ctrl-C."""
    restarts, history = 0, []
    while True:
        running = _Running(make_pods(restarts), log_dir, restarts, on_event)
        on_event("started", attempt=restarts, pods=running.pods, pids=[p.pid for p in running.procs])
        try:
            while (state := running.poll()) is None:
                time.sleep(poll_seconds)
        except KeyboardInterrupt:
            running.stop()
            history += running.metrics
            return Outcome("Interrupted", restarts, "interrupted by the user; every process was stopped",
                           _last(history), None, history)
        if state is True:
            running.join()
            history += running.metrics
            on_event("succeeded")
            return Outcome("Succeeded", restarts, f"all {len(running.pods)} processes completed",
                           _last(history), running.summary, history)
        pod, code = state
        running.stop()
        history += running.metrics
        on_event("pod_failed", pod=pod, code=code)
        if restart_on_exit_codes and code not in restart_on_exit_codes:
            return Outcome("Failed", restarts, f"{pod.hostname} exited with code {code}, which is not in "
                           f"restartOnExitCodes {list(restart_on_exit_codes)}", _last(history), None, history)
        if restarts >= max_restarts:
            return Outcome("Failed", restarts, f"{pod.hostname} exited with code {code} after {restarts} "
                           f"restart(s) (maxRestarts {max_restarts})", _last(history), None, history)
        restarts += 1
        on_event("restarting", restarts=restarts, pod=pod, code=code)


def _last(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    return history[-1] if history else None

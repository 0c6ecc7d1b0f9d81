"""What process 0 reports: JSON lines on stdout, /status and /metrics over HTTP, TensorBoard.

The HTTP server (serving.py: stdlib, daemon threads, every request bounded in bytes, time and number)
serves the latest values until the process exits;
`TPUJOB_LINGER_SECONDS` keeps it up that long after training completes so the operator can read
the final values.

JSON has no token for a non-finite number: /status and the JSON lines carry one as the string "nan",
"inf" or "-inf" (exits.wire), so a diverged step shows its value, never null or the last finite one.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tpu_operator.api.profiling import CONTROL_REFUSED
from tpu_operator.api.trainer_metrics import PROMETHEUS

from .exits import wire
from .serving import Server, authorized, serve_http

log = logging.getLogger(__name__)

STEP_KEYS = ("step", "loss", "step_time_s", "global_tokens_per_s", "mfu", "last_checkpoint_step")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


class Status:
    """The latest values, shared between the training loop and the HTTP thread."""

    def __init__(self, total_steps: int, process_count: int, progress: Callable[[], dict] | None = None):
        self._lock = threading.Lock()
        self._progress = progress  # the trainer's clock, read fresh on every request (hang detection)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        self._values = {k: None for k in STEP_KEYS} | {
            "total_steps": total_steps,
            "state": "running",
            "time": _now(),
            "process_count": process_count,
        }

    def update(self, **values) -> None:
        with self._lock:
            self._values.update(values, time=_now())

    def snapshot(self) -> dict:
        with self._lock:
            values = dict(self._values)
        return values | {"progress": self._progress()} if self._progress else values

    def prometheus(self) -> bytes:
        """The latest values in the Prometheus text format (values not reported yet are left out)."""
        return generate_latest(self._registry)

    def collect(self):
        """prometheus_client's collector protocol: one gauge per reported value, read at scrape time."""
        values = self.snapshot()
        for name, key, help_ in PROMETHEUS:
            gauge = GaugeMetricFamily(name, help_)
            if values.get(key) is not None:
                gauge.add_metric([], float(values[key]))
            yield gauge


def serve(
    status: Status,
    port: int,
    profile: Callable[[bytes], tuple[int, dict]] | None = None,
    control_digest: str | None = None,
) -> Server | None:
    """Serve /status (JSON) and /metrics (Prometheus) on `port` (0 picks a free one), and `POST /profile`
    with `profile(body)` where given (profiling.py), to a request with the control token whose SHA-256 is
    `control_digest` (serving.control_digest; None: none needed)."""

    def respond(path: str) -> tuple[int, bytes, str]:
        if path == "/status":
            return 200, json.dumps(wired(status.snapshot())).encode(), "application/json"
        if path == "/metrics":
            return 200, status.prometheus(), CONTENT_TYPE_LATEST
        return 404, b"not found\n", "text/plain"

    def accept(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        if path == "/profile" and profile is not None:
            if not authorized(headers, control_digest):
                return 401, json.dumps({"error": CONTROL_REFUSED}).encode(), "application/json"
            code, answer = profile(body)
            return code, json.dumps(answer).encode(), "application/json"
        return 404, b"not found\n", "text/plain"

    try:
        server = serve_http(respond, port, accept=accept)
    except OSError as exc:
        # Training matters more than its metrics: carry on; the operator reports them unreachable.
        log.error("metrics: cannot serve on port %d (%s); training continues without /status", port, exc)
        return None
    log.info("metrics: serving /status and /metrics on port %d", server.server_address[1])
    return server


def wired(values: dict) -> dict:
    """`values` with each top-level float in the wire format (exits.wire)."""
    return {k: wire(v) for k, v in values.items()}


def emit(record: dict) -> None:
    """One JSON line on stdout (process 0 only; humans read stderr)."""
    sys.stdout.write(json.dumps(wired(record)) + "\n")
    sys.stdout.flush()


class TensorBoard:
    def __init__(self, logdir: str | None):
        self.writer = None
        if logdir:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(logdir)
            log.info("tensorboard: %s", logdir)

    def scalars(self, step: int, values: dict, group: str = "train") -> None:
        if self.writer is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):  # None (not reported yet) is skipped
                self.writer.add_scalar(f"{group}/{k}", v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

"""The operator's own Prometheus metrics (prometheus_client): reconciles by trigger and result, the
failed ones, and how long they took. Served at `--metrics-port` /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILED = ("error", "api_error")


class Stats:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("tpu_operator_reconciles", "Reconciles by what set them going (handler) and result.",
                                  ["handler", "result"], registry=self.registry)
        self.errors = Counter("tpu_operator_reconcile_errors", "Reconciles that failed and will be retried.",
                              ["handler"], registry=self.registry)
        self.duration = Histogram("tpu_operator_reconcile_duration_seconds", "Time spent in one reconcile.",
                                  ["handler"], buckets=BUCKETS, registry=self.registry)

    def observe(self, handler: str, result: str, seconds: float) -> None:
        self.reconciles.labels(handler, result).inc()
        errors = self.errors.labels(handler)  # the series exists from a handler's first reconcile on
        if result in FAILED:
            errors.inc()
        self.duration.labels(handler).observe(seconds)

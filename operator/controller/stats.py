"""The operator's own Prometheus metrics (prometheus_client): reconciles by trigger and result, the
failed ones, and how long they took; the event loop's lag; and per job its goodput, badput by bucket and restarts by
cause, as its status says (a deleted job's series are dropped). Served at
`--metrics-port` /metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..api.failures import CAUSES
from ..api.goodput import BUCKETS as BADPUT_BUCKETS
from ..api.status import TPUTrainingJobStatus

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILED = ("error", "api_error")


class Stats:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "tpu_operator_reconciles",
            "Reconciles by what set them going (handler) and result.",
            ["handler", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "tpu_operator_reconcile_errors",
            "Reconciles that failed and will be retried.",
            ["handler"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "tpu_operator_reconcile_duration_seconds",
            "Time spent in one reconcile.",
            ["handler"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "tpu_operator_event_loop_lag_seconds",
            "How much later than asked the event loop "
            "woke a timer due every 0.1 s: what every job waited behind the work in front of it "
            "(loop_lag.py).",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.metrics_reads_skipped = Counter(
            "tpu_operator_metrics_reads_skipped",
            "Trainer reads not started because the job's previous read was still pending (a slow or hostile trainer).",
            registry=self.registry,
        )

        self.jobs = JobFigures()
        self.registry.register(self.jobs)
        self.hold = Gauge(
            "tpu_operator_node_hold",
            "1 while so many TPU nodes are NotReady together that stops on a node's Ready wait (controller/health.py).",
            registry=self.registry,
        )
        self.tpu_nodes = Gauge(
            "tpu_operator_tpu_nodes",
            "GKE TPU nodes the operator sees, all of them (state total) and those whose Ready is False or Unknown.",
            ["state"],
            registry=self.registry,
        )

    def job(self, key: tuple[str, str], status: TPUTrainingJobStatus) -> None:
        """Publish a job's figures from its status (nothing until it has some)."""
        self.jobs.set(key, status)

    def forget_job(self, key: tuple[str, str]) -> None:
        self.jobs.figures.pop(key, None)

    def observe(self, handler: str, result: str, seconds: float) -> None:
        self.reconciles.labels(handler, result).inc()
        errors = self.errors.labels(handler)  # the series exists from a handler's first reconcile on
        if result in FAILED:
            errors.inc()
        self.duration.labels(handler).observe(seconds)

    def node_hold(self, held: bool, tpu_nodes: int, not_ready: int) -> None:
        self.hold.set(1 if held else 0)
        self.tpu_nodes.labels("total").set(tpu_nodes)
        self.tpu_nodes.labels("not_ready").set(not_ready)


class Leadership:
    """Which replica leads (leader.py): `tpu_operator_leader` is 1 on the replica that holds the Lease and 0 on a
    standby; `tpu_operator_leader_changes_total{change}` counts this process's `acquired` and `lost` (a replica
    that loses the Lease exits, so its `lost` is seldom scraped: the Lease's leaseTransitions is the record)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.leader = Gauge(
            "tpu_operator_leader", "1 while this replica holds the leader Lease and acts, else 0.", registry=registry
        )
        self.changes = Counter(
            "tpu_operator_leader_changes",
            "Leadership changes of this replica: acquired, lost (or released on a clean stop).",
            ["change"],
            registry=registry,
        )
        for change in ("acquired", "lost"):
            self.changes.labels(change)

    def changed(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)
        self.changes.labels("acquired" if leading else "lost").inc()


# A job's figures: goodput, badput by bucket (BADPUT_BUCKETS' order), restarts by cause (CAUSES' order).
Figures = tuple[float | None, tuple[float, ...] | None, tuple[int, ...] | None]


class JobFigures(Collector):
    """Each job's goodput, badput by bucket and restarts by cause, kept as one small tuple per job and turned
    into series when /metrics is read. A labelled Gauge child per series (prometheus_client's `labels()`)
    costs about 1 KiB with its lock, 11 per job: 5 MiB at 500 jobs (tracemalloc, benchmarks/operator_load.py);
    the tuple costs a fraction of that, and a scrape builds the series once."""

    def __init__(self) -> None:
        self.figures: dict[tuple[str, str], Figures] = {}

    def set(self, key: tuple[str, str], status: TPUTrainingJobStatus) -> None:
        badput = status.badput
        self.figures[key] = (
            status.goodput,
            None if badput is None else tuple(getattr(badput, b) for b in BADPUT_BUCKETS),
            None if status.restarts is None else tuple(status.restarts.count(c) for c in CAUSES),
        )

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "tpu_operator_job_goodput",
                "Seconds on steps that survive / seconds since the job was created (0..1).",
                labels=["namespace", "job"],
            ),
            GaugeMetricFamily(
                "tpu_operator_job_badput_seconds",
                "Wall time of a job that did not train, by bucket.",
                labels=["namespace", "job", "bucket"],
            ),
            GaugeMetricFamily(
                "tpu_operator_job_restarts", "Restarts of a job by cause.", labels=["namespace", "job", "cause"]
            ),
        )

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        goodput, badput, restarts = self._families()
        for (namespace, job), (good, bad, counts) in list(self.figures.items()):
            if good is not None:
                goodput.add_metric([namespace, job], good)
            for bucket, seconds in zip(BADPUT_BUCKETS, bad or ()):
                badput.add_metric([namespace, job, bucket], seconds)
            for cause, count in zip(CAUSES, counts or ()):
                restarts.add_metric([namespace, job, cause], count)
        return iter((goodput, badput, restarts))

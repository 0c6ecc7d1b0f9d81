"""`tpujob operator`: run the operator in this process.

kopf logs in from the kubeconfig ($KUBECONFIG or ~/.kube/config) or, inside a pod, from the
service account; logs are JSON lines; `--health-port` serves kopf's liveness endpoint at /healthz;
`--metrics-port` serves the operator's own Prometheus metrics at /metrics (text format 0.0.4,
written here: prometheus_client is not a dependency). $TPUJOB_LOG_LEVEL (DEBUG, INFO, WARNING,
ERROR) sets the log level; --verbose means DEBUG.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import sys
import threading
from typing import Any

from .rbac import RBAC_RULES, rbac_yaml


class Stats:
    """Reconcile counters and a latency histogram, rendered as Prometheus text. Thread-safe."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    ERRORS = ("error", "api_error", "retry")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.results: collections.Counter[tuple[str, str]] = collections.Counter()
        self.buckets: dict[str, list[int]] = collections.defaultdict(lambda: [0] * len(self.BUCKETS))
        self.sums: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()

    def observe(self, handler: str, result: str, seconds: float) -> None:
        with self._lock:
            self.results[(handler, result)] += 1
            self.sums[handler] += seconds
            self.counts[handler] += 1
            row = self.buckets[handler]
            for i, bound in enumerate(self.BUCKETS):
                if seconds <= bound:
                    row[i] += 1

    def exposition(self) -> str:
        with self._lock:
            out = ["# HELP tpu_operator_reconciles_total Reconciles by handler and result.",
                   "# TYPE tpu_operator_reconciles_total counter"]
            out += [f'tpu_operator_reconciles_total{{handler="{h}",result="{r}"}} {n}'
                    for (h, r), n in sorted(self.results.items())]
            out += ["# HELP tpu_operator_reconcile_errors_total Reconciles that failed or must be retried.",
                    "# TYPE tpu_operator_reconcile_errors_total counter"]
            errors: collections.Counter[str] = collections.Counter()
            for (h, r), n in self.results.items():
                errors[h] += n if r in self.ERRORS else 0
            out += [f'tpu_operator_reconcile_errors_total{{handler="{h}"}} {n}' for h, n in sorted(errors.items())]
            out += ["# HELP tpu_operator_reconcile_duration_seconds Time spent in one reconcile.",
                    "# TYPE tpu_operator_reconcile_duration_seconds histogram"]
            for h in sorted(self.counts):
                out += [f'tpu_operator_reconcile_duration_seconds_bucket{{handler="{h}",le="{b}"}} {c}'
                        for b, c in zip(self.BUCKETS, self.buckets[h])]
                out += [f'tpu_operator_reconcile_duration_seconds_bucket{{handler="{h}",le="+Inf"}} {self.counts[h]}',
                        f'tpu_operator_reconcile_duration_seconds_sum{{handler="{h}"}} {self.sums[h]:.6f}',
                        f'tpu_operator_reconcile_duration_seconds_count{{handler="{h}"}} {self.counts[h]}']
            return "\n".join(out) + "\n"


async def _serve_metrics(stats: Stats, host: str, port: int) -> Any:
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=stats.exposition(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _settings(args: argparse.Namespace) -> Any:
    import kopf

    settings = kopf.OperatorSettings()
    settings.peering.standalone = args.standalone
    settings.peering.clusterwide = args.all_namespaces
    # Progress in annotations, not in status.kopf: this operator is the only writer of .status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage()
    settings.posting.reporting_component = "tpu-operator"
    settings.watching.server_timeout = 300  # re-watch every 5 minutes even if nothing breaks
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    return settings


def run(args: argparse.Namespace) -> int:
    """Entry of `tpujob operator` (flags: see cli.py)."""
    if args.print_rbac:
        sys.stdout.write(rbac_yaml())
        return 0
    import kopf

    from . import handlers
    from .reconcile import OperatorConfig

    level = os.environ.get("TPUJOB_LOG_LEVEL", "DEBUG" if args.verbose else "INFO").upper()
    level = level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"
    kopf.configure(verbose=level == "DEBUG", log_format=kopf.LogFormat.JSON, log_refkey="object")
    logging.getLogger().setLevel(level)
    log = logging.getLogger("tpu_operator")
    config = OperatorConfig(default_image=args.default_image, metrics_access=args.metrics_access,
                            metrics_interval_s=args.metrics_interval, resync_interval_s=args.resync_interval)
    settings, registry, stats = _settings(args), kopf.OperatorRegistry(), Stats()
    if handlers.credentials(logger=log, settings=settings) is None:  # kopf would wait forever without them
        log.error(handlers.NO_CREDENTIALS)
        return 1
    handlers.register(registry, settings, config, stats)
    all_namespaces = args.all_namespaces or not args.namespace
    log.info("starting tpu-operator", extra={
        "namespaces": "*" if all_namespaces else args.namespace, "standalone": args.standalone,
        "metrics_access": config.metrics_access, "metrics_interval_s": config.metrics_interval_s,
        "resync_interval_s": config.resync_interval_s,
        "rbac": [f"{'/'.join(r['apiGroups'])}:{','.join(r['resources'])}:{','.join(r['verbs'])}" for r in RBAC_RULES]})

    async def main() -> None:
        runner = await _serve_metrics(stats, args.metrics_host, args.metrics_port) if args.metrics_port else None
        try:
            await kopf.operator(
                registry=registry, settings=settings, standalone=args.standalone,
                clusterwide=all_namespaces, namespaces=[] if all_namespaces else args.namespace,
                liveness_endpoint=f"http://{args.health_host}:{args.health_port}/healthz" if args.health_port else None)
        finally:
            if runner is not None:
                await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0

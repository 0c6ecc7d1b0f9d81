"""`tpujob operator`: run the operator in this process.

Credentials come from kubernetes_asyncio's loaders (in a pod the service account, else
$KUBECONFIG or ~/.kube/config, exec plugins included), for the controller's own client and, through
the login handler, for kopf's watches alike. Logs are JSON lines; `health_port` serves kopf's liveness
endpoint at /healthz; `metrics_port` serves the operator's Prometheus metrics at /metrics
(prometheus_client), the event loop's lag among them (loop_lag.py). $TPUJOB_LOG_LEVEL (DEBUG, INFO,
WARNING, ERROR) sets the log level; `verbose` means DEBUG.

With `leader_elect` (the chart's replicas) the process first waits to hold the Lease (leader.py), serving
/healthz and /metrics meanwhile and doing nothing else: kopf, its watches and the controller start only once
it leads, and the process ends when it no longer does (or hands the Lease back on a clean stop).

Then, before kopf starts (nothing reconciles yet), the process loads the installation's control key
(control.py: the Secret `tpu-operator-control-key` in --control-key-namespace, else $POD_NAMESPACE, else the
service account's namespace, else "default"; made on first start). Only a process that is to act loads it: a
standby needs no API server but the Lease's. A key it cannot read or make ends it with status 1 (the Lease
handed back), the log naming the Secret and the API's answer, never the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import sys
from typing import Any

from .leader import LeaseTiming
from .rbac import RBAC_RULES, rbac_yaml
from .reconcile import OperatorConfig

NO_CREDENTIALS = "no Kubernetes credentials: set KUBECONFIG, or run in a pod with a service account"


@dataclasses.dataclass(frozen=True)
class OperatorOptions:
    """What `tpujob operator`'s flags say (cli.py); a flag not given keeps the default here, or the
    controller's in OperatorConfig."""

    namespaces: tuple[str, ...] = ()  # empty: every namespace
    standalone: bool = False
    health_host: str = "0.0.0.0"
    health_port: int = 0  # 0: no liveness endpoint
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 0  # 0: no metrics endpoint
    controller: OperatorConfig = OperatorConfig()  # image, metrics access, intervals, pre-flight timing
    verbose: bool = False
    print_rbac: bool = False
    leader_elect: bool = False  # wait to hold the Lease before acting (two replicas or more)
    leader_timing: LeaseTiming = LeaseTiming()
    lease_name: str = "tpu-operator-leader"
    lease_namespace: str = ""  # empty: $POD_NAMESPACE, else "default"
    control_key_namespace: str = ""  # empty: $POD_NAMESPACE, else the service account's namespace, else "default"


def _settings(options: OperatorOptions) -> Any:  # kopf.OperatorSettings: kopf is imported lazily, never at module level
    import kopf

    from . import handlers

    settings = kopf.OperatorSettings()
    settings.peering.standalone = options.standalone
    settings.peering.clusterwide = not options.namespaces
    settings.posting.reporting_component = "tpu-operator"
    settings.posting.level = logging.WARNING  # kopf's own notes on an object: only problems become Events
    settings.watching.server_timeout = 300  # re-watch every 5 minutes even if nothing breaks
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.networking.connect_timeout = 10
    handlers.select_server_side(settings)
    settings.persistence.diffbase_storage = handlers.NoEssence()  # no change handlers: nothing to diff
    return settings


def _logging(options: OperatorOptions) -> logging.Logger:
    import kopf

    level = os.environ.get("TPUJOB_LOG_LEVEL", "DEBUG" if options.verbose else "INFO").upper()
    level = level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"
    kopf.configure(verbose=level == "DEBUG", log_format=kopf.LogFormat.JSON, log_refkey="object")
    logging.getLogger().setLevel(level)
    return logging.getLogger("tpu_operator")


async def _operate(options: OperatorOptions, log: logging.Logger) -> int:
    import kopf
    import prometheus_client

    from . import control, handlers, loop_lag
    from .events import EventPoster
    from .kube import AsyncKube, api_client, configuration
    from .manager import Manager
    from .metrics_reader import MetricsReader
    from .stats import Stats

    try:
        credentials = await configuration()
    except Exception as exc:  # noqa: BLE001 -- any loader failure means the same thing
        log.error(f"{NO_CREDENTIALS} ({type(exc).__name__}: {exc})")
        return 1
    config = options.controller
    kube = AsyncKube(api_client(credentials))
    key_namespace = control.key_namespace(options.control_key_namespace)
    stats, events = Stats(), EventPoster(kube)
    reader = MetricsReader(kube, config.metrics_access, config.metrics_timeout_s)  # its tokens: once it may act
    manager = Manager(kube, reader, config, events, stats)

    async def login() -> kopf.ConnectionInfo:
        if credentials.refresh_api_key_hook is not None:  # exec plugins and in-cluster tokens expire
            # kubernetes_asyncio's stub says Coroutine | Callable; it is a callable (its Configuration calls it)
            await credentials.refresh_api_key_hook(credentials)  # type: ignore[operator]
        token = (credentials.api_key.get("BearerToken") or "").removeprefix("Bearer ").strip()
        assert credentials.host is not None  # set by both loaders (and kubernetes_asyncio's default is localhost)
        return kopf.ConnectionInfo(
            server=credentials.host,
            ca_path=credentials.ssl_ca_cert,
            insecure=not credentials.verify_ssl,
            scheme="Bearer" if token else None,
            token=token or None,
            certificate_path=credentials.cert_file,
            private_key_path=credentials.key_file,
        )

    registry = kopf.OperatorRegistry()
    handlers.register(registry, manager, login)
    log.info(
        "starting tpu-operator",
        extra={
            "namespaces": list(options.namespaces) or "*",
            "standalone": options.standalone,
            "metrics_access": config.metrics_access,
            "metrics_interval_s": config.metrics_interval_s,
            "resync_interval_s": config.resync_interval_s,
            "control_key": f"{key_namespace}/{control.KEY_SECRET}",
            "rbac": [
                f"{'/'.join(r['apiGroups'])}:{','.join(r['resources'])}:{','.join(r['verbs'])}" for r in RBAC_RULES
            ],
        },
    )
    if options.metrics_port:
        prometheus_client.disable_created_metrics()
        prometheus_client.start_http_server(options.metrics_port, options.metrics_host, registry=stats.registry)
    liveness = f"http://{options.health_host}:{options.health_port}/healthz" if options.health_port else None
    lag = asyncio.create_task(loop_lag.watch(stats.loop_lag.observe), name="loop-lag")
    elector = None
    if options.leader_elect:
        elector = await _elect(options, credentials, stats, log)
        if elector is None:  # stopped while standing by: nothing was started, nothing to undo but the clients
            lag.cancel()
            await kube.close()
            return 0
    holding = asyncio.create_task(elector.hold(), name="leader") if elector is not None else None
    # Everything imported and set up so far lives as long as the process: out of the collector's reach, a full
    # collection no longer walks it (those walks held the loop for 60-90 ms of CPU; docs/operator.md).
    gc.collect()
    gc.freeze()
    try:
        reader.tokens = control.Tokens(await control.load_key(kube, key_namespace))
        await kopf.operator(
            registry=registry,
            settings=_settings(options),
            standalone=options.standalone,
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=liveness,
        )
    except control.KeyUnavailable as exc:  # its message names the Secret and the API's answer, never the key
        log.error(str(exc))
        return 1
    finally:
        lag.cancel()
        if holding is not None:
            holding.cancel()
        await events.drain()
        await kube.close()
        if elector is not None:  # last: nothing of the controller runs any more
            await elector.release()
            await elector.close()
    return 0


async def _elect(options: OperatorOptions, credentials: Any, stats: Any, log: logging.Logger) -> Any:
    """Stand by until this replica holds the Lease (its Elector), serving /healthz meanwhile (kopf's liveness
    endpoint exists only once kopf runs, and the kubelet would restart a standby whose probe fails); None when
    SIGTERM or SIGINT comes first."""
    import signal

    from aiohttp import web

    from .kube import api_client
    from .leader import ApiLeaseStore, Elector, identity
    from .stats import Leadership

    timing = options.leader_timing
    namespace = options.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
    store = ApiLeaseStore(api_client(credentials), namespace, options.lease_name, timing.renew_deadline_s / 2)
    leadership = Leadership(stats.registry)
    elector = Elector(store, identity(), timing, on_change=leadership.changed)
    log.info(
        "leader election",
        extra={
            "lease": f"{namespace}/{options.lease_name}",
            "identity": elector.identity,
            **dataclasses.asdict(timing),
        },
    )
    runner = None
    if options.health_port:
        app = web.Application()

        async def healthz(_: web.Request) -> web.StreamResponse:
            return web.json_response({"standby": elector.identity})

        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, options.health_host, options.health_port).start()
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    acquiring = asyncio.create_task(elector.acquire(), name="acquire")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        stopping.cancel()
        acquiring.cancel()
        if runner is not None:
            await runner.cleanup()
    if stop.is_set() or not acquiring.done() or acquiring.cancelled() or acquiring.exception() is not None:
        await elector.release()
        await elector.close()
        return None
    return elector


def _without_sync_client() -> None:
    """kopf imports every Kubernetes client it finds, only to recognise their objects (kopf's
    `_cogs.helpers.thirdparty`, `except ImportError` on each); the operator hands it plain dicts. Where the
    synchronous `kubernetes` client is installed (the tests' dependency, not the operator's), it alone
    would add about 30 MiB to the process: it is marked absent before kopf is imported, so the operator
    weighs the same wherever it runs."""
    if "kubernetes" not in sys.modules:
        sys.modules["kubernetes"] = None  # type: ignore[assignment]  # `import kubernetes` raises ImportError


def run_operator(options: OperatorOptions) -> int:
    """Entry of `tpujob operator`."""
    if options.print_rbac:
        sys.stdout.write(rbac_yaml())
        return 0
    log = _logging(options)
    _without_sync_client()
    try:
        return asyncio.run(_operate(options, log))
    except KeyboardInterrupt:
        return 0

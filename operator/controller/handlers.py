"""Every kopf handler of the operator, each a few lines that call reconcile.py.

- TPUTrainingJob created, resumed at start-up, or its spec changed: `reconcile.reconcile_job`.
- JobSet events (only JobSets labelled `training.tpu-operator.dev/job`): `reconcile.follow_jobset`.
  This is a watch, not polling: the status follows the JobSet as its controller updates it.
- Timer on Running jobs, every `--metrics-interval` seconds: `reconcile.refresh_metrics`.
- Timer on unfinished jobs that have a JobSet, every `--resync-interval` seconds:
  `reconcile.resync_job` re-derives the status from the JobSet as it is, should an event have been
  missed or its handling have given up (kopf calls an event handler once per event, never again).

No deletion handler: the ConfigMap and JobSet carry owner references and the garbage collector
deletes them with the job. kopf puts its own finalizer (kopf.zalando.org/KopfFinalizerMarker) on a
job while a timer runs for it (the resync timer: from the moment it has a JobSet until it has
finished) so that it can stop the timer; on deletion it stops the timer and removes the finalizer
at once, and it removes it from a job that finishes. With the operator down, deleting an
unfinished job waits for the operator (or for someone to remove that finalizer by hand).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import kopf
from kopf._cogs.clients import api as kopf_api  # kopf's authenticated client: re-login on 401, retries 5xx
from kopf._cogs.clients import errors as kopf_errors

from ..api import names
from ..api.models import GROUP, PLURAL, VERSION
from . import phases, reconcile
from .metrics_reader import MetricsReader
from .reconcile import ApiError, OperatorConfig, RetryLater

JOB = (GROUP, VERSION, PLURAL)
JOBSET = (reconcile.JOBSET_GROUP, reconcile.JOBSET_VERSION, reconcile.JOBSET_PLURAL)
TRANSIENT_DELAY_S = 5.0
log = logging.getLogger("tpu_operator")


class Stats(Protocol):
    def observe(self, handler: str, result: str, seconds: float) -> None: ...


class KopfKube:
    """reconcile.Kube over kopf's own API client (same credentials, re-login and 5xx retries)."""

    def __init__(self, settings: kopf.OperatorSettings):
        self.settings = settings

    async def _call(self, method: str, path: str, body: Any = None, *, text: bool = False, retry: bool = True,
                    content_type: str = "application/json") -> Any:
        try:
            response = await kopf_api.request(method, path, payload=body, headers={"Content-Type": content_type},
                                              settings=self.settings, logger=log, backoffs=None if retry else ())
            async with response:
                return await response.text() if text else await response.json()
        except kopf_errors.APIError as exc:
            raise ApiError(exc.status, exc.message or str(exc)) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(503, f"{type(exc).__name__}: {exc}") from None

    async def get(self, path: str) -> Any:
        return await self._call("get", path)

    async def get_once(self, path: str) -> Any:
        return await self._call("get", path, retry=False)

    async def get_text(self, path: str) -> str:
        return await self._call("get", path, text=True, retry=False)

    async def post(self, path: str, body: Any) -> Any:
        return await self._call("post", path, body)

    async def patch(self, path: str, body: Any) -> Any:
        return await self._call("patch", path, body, content_type="application/merge-patch+json")


NO_CREDENTIALS = "no Kubernetes credentials: set KUBECONFIG, or run in a pod with a service account"


def credentials(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The kubernetes client's config (kubeconfig incl. exec plugins, or in-cluster), else kopf's own readers."""
    try:
        info = kopf.login_via_client(**kwargs)
    except kopf.LoginError:
        info = None
    return info or kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def emit(obj: dict[str, Any], notice: phases.Notice) -> None:
    kopf.event(obj, type=notice.type, reason=notice.reason, message=notice.message[:1024])


async def _timed(stats: Stats, handler: str, work: Awaitable[str]) -> None:
    """Run one reconcile, count it by result, and turn API trouble into kopf's retry-later."""
    started, result = time.monotonic(), "error"
    try:
        result = await work
    except RetryLater as exc:
        result = "retry"
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from None
    except ApiError as exc:
        result = "api_error"
        raise kopf.TemporaryError(str(exc), delay=TRANSIENT_DELAY_S) from None
    finally:
        stats.observe(handler, result, time.monotonic() - started)


async def _retrying(work: Callable[[], Awaitable[str]], attempts: int = 6) -> str:
    """kopf never retries an event handler, and a JobSet's last event (Completed) may be the only one:
    retry API failures here, with backoff, beyond kopf's own request retries (the resync timer, and
    an operator restart, also catch up: both re-read the JobSet)."""
    for attempt in range(1, attempts + 1):
        try:
            return await work()
        except ApiError:
            if attempt == attempts:
                raise
            await asyncio.sleep(TRANSIENT_DELAY_S * attempt)
    raise AssertionError("unreachable")


def register(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings, config: OperatorConfig,
             stats: Stats) -> None:
    """Register the handlers on `registry`; `config` comes from the command line."""
    kube = KopfKube(settings)
    reader = MetricsReader(kube.get_once, kube.get_text, config.metrics_access, config.metrics_timeout_s)

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo:
        info = credentials(**kwargs)
        if info is None:
            raise kopf.PermanentError(NO_CREDENTIALS)
        return info

    @kopf.on.resume(*JOB, id="job", registry=registry)
    @kopf.on.create(*JOB, id="job", registry=registry)
    @kopf.on.update(*JOB, id="job", field="spec", registry=registry)
    async def job_changed(body: kopf.Body, **_: Any) -> None:
        await _timed(stats, "job", reconcile.reconcile_job(kube, _plain(body), config, emit))

    @kopf.on.event(*JOBSET, id="jobset", labels={names.LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def jobset_event(body: kopf.Body, type: str | None, **_: Any) -> None:
        jobset = _plain(body)
        follow = lambda: reconcile.follow_jobset(kube, jobset, type, config, emit, reader)  # noqa: E731
        await _timed(stats, "jobset", _retrying(follow))

    @kopf.timer(*JOB, id="metrics", interval=config.metrics_interval_s, registry=registry,
                when=lambda status, **_: status.get("phase") == "Running")
    async def metrics(body: kopf.Body, **_: Any) -> None:
        await _timed(stats, "metrics", reconcile.refresh_metrics(kube, reader, _plain(body), emit))

    @kopf.timer(*JOB, id="resync", interval=config.resync_interval_s, initial_delay=config.resync_interval_s,
                registry=registry, when=lambda status, **_: reconcile.resync_due(status))
    async def resync(body: kopf.Body, **_: Any) -> None:
        await _timed(stats, "resync", reconcile.resync_job(kube, _plain(body), config, emit, reader))

    @kopf.on.cleanup(registry=registry)
    async def close_reader(**_: Any) -> None:
        await reader.close()


def _plain(body: kopf.Body) -> dict[str, Any]:
    """kopf's live body view as a plain dict snapshot."""
    import copy

    return copy.deepcopy(dict(body))

"""Read the trainer's `GET /status` JSON from process 0 (pod 0 of slice 0) and map it into `.status`.

Two ways to reach the pod (`--metrics-access`):
- `direct`: http://<pod.status.podIP>:<port>/status, for an operator running in the cluster;
- `proxy`: the API server's pod proxy, GET /api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy/status,
  which works from outside the cluster (needs RBAC `get` on `pods/proxy`).

Any failure is an `Unreachable` with a message; the caller keeps the last values (stale metrics)
and sets condition Metrics=False, so a trainer that is slow to start never crashes the operator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import aiohttp

from ..api import names

DEFAULT_PORT = 9431
ACCESS_MODES = ("proxy", "direct")
# Labels JobSet and the Job controller put on every pod: pod 0 of slice 0 runs process 0.
LABEL_JOBSET = "jobset.sigs.k8s.io/jobset-name"
LABEL_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# Trainer key -> (status key, type). `state` and `total_steps` are not status fields.
FIELDS: dict[str, tuple[str, type]] = {
    "step": ("step", int),
    "step_time_s": ("stepTimeSeconds", float),
    "tokens_per_s": ("tokensPerSecond", float),
    "mfu": ("mfu", float),
    "last_checkpoint_step": ("lastCheckpointStep", int),
}


class Unreachable(Exception):
    """The trainer's status endpoint could not be read; the message says why."""


def pod0_selector(jobset_name: str) -> str:
    return f"{LABEL_JOBSET}={jobset_name},{LABEL_JOB_INDEX}=0,{LABEL_COMPLETION_INDEX}=0"


def pick_pod(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest pod with an IP that is running (a restart leaves failed pods of older attempts)."""
    live = [p for p in pods if (p.get("status") or {}).get("podIP")
            and (p.get("status") or {}).get("phase") in ("Running", "Succeeded", None)
            and not (p.get("metadata") or {}).get("deletionTimestamp")]
    return max(live, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


def to_status(sample: Any) -> dict[str, Any]:
    """The status fields of one trainer sample; missing, null or malformed values are left out."""
    if not isinstance(sample, dict):
        raise Unreachable(f"the status endpoint answered {type(sample).__name__}, not a JSON object")
    out: dict[str, Any] = {}
    for key, (field, kind) in FIELDS.items():
        value = sample.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is float and not math.isfinite(value):
            continue
        out[field] = int(value) if kind is int else round(float(value), 6)
    return out


GetJson = Callable[[str], Awaitable[Any]]  # an API-server GET returning the decoded body


class MetricsReader:
    """Find pod 0 of slice 0 and read its status endpoint, by proxy or directly."""

    def __init__(self, api_get: GetJson, api_get_text: Callable[[str], Awaitable[str]],
                 access: Literal["proxy", "direct"] = "direct", timeout_s: float = 3.0):
        if access not in ACCESS_MODES:
            raise ValueError(f"metrics access must be one of {ACCESS_MODES}, got {access!r}")
        self.api_get, self.api_get_text = api_get, api_get_text
        self.access, self.timeout_s = access, timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def find_pod(self, namespace: str, jobset_name: str) -> dict[str, Any]:
        from urllib.parse import quote

        path = f"/api/v1/namespaces/{namespace}/pods?labelSelector={quote(pod0_selector(jobset_name), safe='')}"
        try:
            pods = (await self.api_get(path)).get("items") or []
        except Exception as exc:  # noqa: BLE001 -- any API failure is "unreachable for now"
            raise Unreachable(f"cannot list the pods of JobSet {jobset_name}: {exc}") from None
        pod = pick_pod(pods)
        if pod is None:
            raise Unreachable(f"no running pod 0 of slice 0 of JobSet {jobset_name} "
                              f"(selector {pod0_selector(jobset_name)})")
        return pod

    async def read(self, namespace: str, job_name: str, port: int = DEFAULT_PORT,
                   jobset_name: str | None = None) -> dict[str, Any]:
        """The status fields read from the trainer now, or Unreachable."""
        pod = await self.find_pod(namespace, jobset_name or names.jobset_name(job_name))
        name = pod["metadata"]["name"]
        if self.access == "proxy":
            path = f"/api/v1/namespaces/{namespace}/pods/{name}:{port}/proxy/status"
            try:
                text = await self.api_get_text(path)
            except Exception as exc:  # noqa: BLE001
                raise Unreachable(f"pod proxy {path}: {exc}") from None
        else:
            url = f"http://{pod['status']['podIP']}:{port}/status"
            text = await self._get_direct(url)
        try:
            return to_status(json.loads(text))
        except ValueError:
            raise Unreachable(f"pod {name} answered something that is not JSON: {text[:120]!r}") from None

    async def _get_direct(self, url: str) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise Unreachable(f"{url} answered HTTP {response.status}")
                return await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise Unreachable(f"{url}: {type(exc).__name__}: {exc}") from None


def apply_sample(status: dict[str, Any], sample: dict[str, Any] | None, error: str | None,
                 now: str) -> dict[str, Any]:
    """The status after one read: fresh values and Metrics=True, or the old (stale) values and
    Metrics=False reason Unreachable. Pure."""
    from .phases import set_condition

    new = dict(status)
    conds = list(status.get("conditions") or [])
    if sample is not None:
        new.update(sample)
        new["metricsTime"] = now
        conds = set_condition(conds, "Metrics", "True", "Read", "read from pod 0 of slice 0", now)
    else:
        conds = set_condition(conds, "Metrics", "False", "Unreachable", error or "unreachable", now)
    new["conditions"] = conds
    return new

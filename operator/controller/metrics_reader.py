"""Read the trainer's `GET /status` JSON from process 0 (pod 0 of slice 0) as a `status.Sample`.

Two ways to reach the pod (`--metrics-access`):
- `direct`: http://<pod.status.podIP>:<port>/status, for an operator running in the cluster;
- `proxy`: the API server's pod proxy, GET /api/v1/namespaces/{ns}/pods/{pod}:{port}/proxy/status,
  which works from outside the cluster (needs RBAC `get` on `pods/proxy`; `create` for `post_profile`).

Pod 0 is found with one label-selected list and remembered per JobSet: a running job costs no
list per read. A read that fails forgets the pod and lists once more (a restarted slice has new
pods); `forget` drops it when the JobSet restarts. Any failure is a Sample with `error` set: the
caller keeps the last values and sets Metrics=False, so a trainer that is slow to start never
crashes the operator.

Every answer is the tenant's and untrusted: one deadline (`timeout_s`, 3 s) covers the whole exchange,
connect to last byte, and at most 64 KiB of the body is read (bounded.py), whatever it declares. The
manager keeps at most one read per job in flight (a read due while the last one is pending is skipped),
so a slow trainer costs one pending read, not a queue of them.

`final` reads what process 0 said as it ended, for a JobSet that completed: a completed pod's process
has exited, so nothing serves /status any more; its termination record (the trainer's last line,
api/lifecycle.py, kept by the kubelet as the container's `terminated.message`) carries the final step
and checkpoint. One pod list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, Literal

import aiohttp

from ..api.lifecycle import Progress, TerminationRecord
from ..api.names import LABEL_COMPLETION_INDEX, LABEL_JOB_INDEX, LABEL_JOBSET
from ..api.profiling import CONTROL_REFUSED_START, ProfileReport
from . import bounded, control
from .kube import PODS, ApiError, Kube
from .status import Sample

ACCESS_MODES = ("proxy", "direct")
# Trainer key -> (Sample field, type).
FIELDS: dict[str, tuple[str, type]] = {
    "step": ("step", int),
    "step_time_s": ("step_time_seconds", float),
    "loss": ("loss", float),
    "eval_loss": ("eval_loss", float),
    "global_tokens_per_s": ("tokens_per_second", float),
    "mfu": ("mfu", float),
    "last_checkpoint_step": ("last_checkpoint_step", int),
}


MAX_VALUE = 1e18  # larger readings are garbage (a step count, a rate): left out, as malformed ones are


class Unreachable(Exception):
    """The trainer's status endpoint could not be read; the message says why."""


class Refusal(Exception):
    """The trainer refused a control request (HTTP 400, 401 or 409); the message is its reason."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


REFUSALS = (400, 401, 409)  # a bad request, no or a wrong control credential, another profile being traced


def pod0_selector(jobset_name: str) -> str:
    return f"{LABEL_JOBSET}={jobset_name},{LABEL_JOB_INDEX}=0,{LABEL_COMPLETION_INDEX}=0"


def pick_pod(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest pod with an IP that is running (a restart leaves failed pods of older attempts)."""
    live = [
        p
        for p in pods
        if (p.get("status") or {}).get("podIP")
        and (p.get("status") or {}).get("phase") in ("Running", "Succeeded", None)
        and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    return max(live, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


NON_FINITE = {"nan": "nan", "inf": "inf", "+inf": "inf", "infinity": "inf", "-inf": "-inf", "-infinity": "-inf"}


def non_finite(value: Any) -> str | None:
    """ "nan", "inf" or "-inf" for a non-finite reading: a float (Python's json reads NaN and Infinity) or the
    trainer's text for one (its wire format: a number when finite, else one of those strings); None otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, str) and len(value) <= 16:
        return NON_FINITE.get(value.strip().lower())
    return None


def to_sample(body: Any) -> Sample:
    """The Sample of one /status answer; missing, null or malformed values are left out. A non-finite float value
    is a reading, not an error: it is kept in `non_finite` (a diverged run must never show its last finite loss)."""
    if not isinstance(body, dict):
        raise Unreachable(f"the status endpoint answered {type(body).__name__}, not a JSON object")
    values: dict[str, Any] = {}
    odd: list[tuple[str, str]] = []
    for key, (field, kind) in FIELDS.items():
        value = body.get(key)
        if kind is float and (text := non_finite(value)) is not None:
            odd.append((field, text))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or abs(value) > MAX_VALUE:
            continue
        values[field] = int(value) if kind is int else round(float(value), 6)
    return Sample(
        **values,
        non_finite=tuple(odd),
        progress=Progress.lenient(body.get("progress")),
        profile=ProfileReport.lenient(body.get("profile")),
    )


class MetricsReader:
    """Find pod 0 of slice 0 (remembered per JobSet) and read its status endpoint, by proxy or directly."""

    def __init__(
        self,
        kube: Kube,
        access: Literal["proxy", "direct"] = "direct",
        timeout_s: float = 3.0,
        tokens: control.Tokens | None = None,
    ):
        if access not in ACCESS_MODES:
            raise ValueError(f"metrics access must be one of {ACCESS_MODES}, got {access!r}")
        self.kube, self.access, self.timeout_s = kube, access, timeout_s
        self._pods: dict[tuple[str, str], tuple[str, str]] = {}  # (ns, jobset) -> (pod name, pod IP)
        self._session: aiohttp.ClientSession | None = None
        # The jobs' control tokens, for POST /profile (none without the key: the requests are refused).
        self.tokens = tokens if tokens is not None else control.Tokens()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def forget(self, namespace: str, jobset_name: str) -> None:
        self._pods.pop((namespace, jobset_name), None)

    async def read(self, namespace: str, jobset_name: str, port: int) -> Sample:
        """What the trainer says now, or a Sample with `error`: never raises."""
        key = (namespace, jobset_name)
        try:
            known = key in self._pods
            try:
                return await self._read(namespace, jobset_name, port)
            except Unreachable:
                if not known:
                    raise
                self.forget(namespace, jobset_name)  # maybe a new pod: look once more
                return await self._read(namespace, jobset_name, port)
        except Unreachable as exc:
            self.forget(namespace, jobset_name)
            return Sample(error=str(exc))

    async def final(self, namespace: str, jobset_name: str) -> Sample:
        """Process 0's last values from its pod's termination record, or a Sample with `error`: never raises."""
        self.forget(namespace, jobset_name)
        selector = pod0_selector(jobset_name)
        try:
            pods = await self.kube.list(PODS, namespace, selector)
        except ApiError as exc:
            return Sample(error=f"cannot list the pods of JobSet {jobset_name}: {exc}")
        for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True):
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                ended = (container.get("state") or {}).get("terminated") or {}
                record = TerminationRecord.parse(ended.get("message"), ended.get("exitCode"))
                if record is not None and record.progress is not None and record.progress.step is not None:
                    # The values /status served last (loss, evaluation, rates), checked as a /status answer
                    # is; the step and checkpoint from the trainer's own clock.
                    last = to_sample(record.last or {})
                    return dataclasses.replace(
                        last,
                        step=record.progress.step,
                        last_checkpoint_step=record.progress.last_checkpoint_step,
                        progress=record.progress,
                    )
        return Sample(
            error=f"pod 0 of JobSet {jobset_name} left no termination record with its progress (selector {selector})"
        )

    async def _read(self, namespace: str, jobset_name: str, port: int) -> Sample:
        return to_sample(await self._ask(namespace, jobset_name, port, "status"))

    async def post_profile(self, namespace: str, jobset_name: str, port: int, steps: str, uid: str) -> ProfileReport:
        """`POST /profile {"steps": steps}` to process 0, the way `/status` is read: the trainer's answer,
        accepted or refused (400, 401 without the job's control credential, 409: a report with state failed
        and its reason); Unreachable otherwise. The control token of the job (its name is its JobSet's, `uid`
        its own) goes with it (control.py)."""
        headers = {}
        token = self.tokens.token(namespace, jobset_name, uid)
        if token is not None:
            headers[control.HEADER] = token
        try:
            answer = await self._ask(namespace, jobset_name, port, "profile", {"steps": steps}, headers)
        except Refusal as exc:
            return ProfileReport(requested=steps, state="failed", message=str(exc))
        except Unreachable:
            self.forget(namespace, jobset_name)
            raise
        try:
            return ProfileReport.model_validate(answer)
        except ValueError:
            raise Unreachable(f"/profile answered {str(answer)[:200]!r}, not a profile report") from None

    async def _ask(
        self,
        namespace: str,
        jobset_name: str,
        port: int,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """GET (or, with a body, POST) `path` of process 0, by proxy or directly, within one deadline of
        `timeout_s` for the whole exchange: a trainer that trickles its answer is given up on like one that
        does not answer. Refusal: the trainer refused a POST (400, 401, 409)."""
        name, ip = await self._pod0(namespace, jobset_name)
        where = (
            f"pod proxy {namespace}/{name}:{port}/{path}" if self.access == "proxy" else f"http://{ip}:{port}/{path}"
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.access == "direct":
                    return await self._exchange(
                        "GET" if body is None else "POST",
                        f"http://{ip}:{port}/{path}",
                        (200,) if body is None else (200, 400, 409),
                        body,
                        headers,
                    )
                if body is None:
                    return await self.kube.proxy_get(namespace, name, port, path)
                return await self.kube.proxy_post(namespace, name, port, path, body, headers)
        except TimeoutError:
            raise Unreachable(f"{where}: no complete answer within {self.timeout_s:g} s") from None
        except ApiError as exc:
            # The trainer's refusal, passed on by the API server (a 401 of the API server's own, for the
            # operator's credential, is not the trainer's: Unreachable, tried again later).
            if (
                body is not None
                and exc.status in REFUSALS
                and (exc.status != 401 or CONTROL_REFUSED_START in exc.message)
            ):
                raise Refusal(exc.message, exc.status) from None
            raise Unreachable(f"{where}: {exc}") from None

    async def _pod0(self, namespace: str, jobset_name: str) -> tuple[str, str]:
        key = (namespace, jobset_name)
        if key not in self._pods:
            selector = pod0_selector(jobset_name)
            try:
                pods = await self.kube.list(PODS, namespace, selector)
            except ApiError as exc:
                raise Unreachable(f"cannot list the pods of JobSet {jobset_name}: {exc}") from None
            pod = pick_pod(pods)
            if pod is None:
                raise Unreachable(f"no running pod 0 of slice 0 of JobSet {jobset_name} (selector {selector})")
            self._pods[key] = (pod["metadata"]["name"], pod["status"]["podIP"])
        return self._pods[key]

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _exchange(
        self,
        method: str,
        url: str,
        answers: tuple[int, ...],
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One request to the trainer, its answer read as untrusted: at most bounded.LIMIT_BYTES of it."""
        try:
            async with self._client().request(method, url, json=body, headers=headers) as response:
                if response.status == 401 and body is not None:
                    raise Refusal(f"{url} refused the job's control credential (HTTP 401)", 401)
                if response.status not in answers:
                    raise Unreachable(f"{url} answered HTTP {response.status}")
                return await bounded.read_json(response)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise Unreachable(f"{url}: {type(exc).__name__}: {exc}") from None

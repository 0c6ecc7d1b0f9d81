"""The Kubernetes API as the controller uses it: seven calls over kubernetes_asyncio's public ApiClient.

`Kube` is the protocol the reconcile logic is written against (tests give it an in-memory fake);
`AsyncKube` implements it with kubernetes_asyncio, the maintained async sibling of the `kubernetes`
client: kubeconfig (exec plugins included) or in-cluster credentials, token refresh, TLS. Every
failure comes out as an `ApiError` with the HTTP status (0 for a network failure), so callers
decide on one thing: `permanent` errors (the request refused) are reported on the job and not retried;
the rest are transient and retried by the work queue with backoff.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException

from ..api import models
from . import bounded

Obj = dict[str, Any]
USER_AGENT = "tpu-operator"
REQUEST_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Resource:
    """A namespaced resource collection: its URL path and what RBAC calls it."""

    group: str
    version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        return "/".join(p for p in (f"{base}/namespaces/{namespace}/{self.plural}", name, sub) if p)


JOBS = Resource(models.GROUP, models.VERSION, models.PLURAL)
JOBSETS = Resource("jobset.x-k8s.io", "v1alpha2", "jobsets")
CONFIGMAPS = Resource("", "v1", "configmaps")
SECRETS = Resource("", "v1", "secrets")  # only the jobs' control credentials (control.py)
PODS = Resource("", "v1", "pods")
EVENTS = Resource("", "v1", "events")
BATCH_JOBS = Resource("batch", "v1", "jobs")  # the pre-flight (preflight.py)


class ApiError(Exception):
    def __init__(self, status: int, message: str = "", verb: str = ""):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status, self.message, self.verb = status, message, verb

    @property
    def permanent(self) -> bool:
        """The API refused the request itself (400 BadRequest, 403 Forbidden, 422 Invalid, or 404 on a
        create: no such namespace or resource type): sending it again changes nothing until the job, the
        RBAC or the cluster does. Everything else (0 for a timeout or a reset connection, 408, 429, 5xx,
        and a 404 or 409 the caller did not expect: the world moved) is transient."""
        return self.status in (400, 403, 422) or (self.status == 404 and self.verb == "POST")

    @property
    def reason(self) -> str:
        """The CamelCase reason of a permanent error (metav1.StatusReason's name for its code)."""
        return {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 422: "Invalid"}.get(self.status, "ApiError")


class Kube(Protocol):
    async def get(self, resource: Resource, namespace: str, name: str) -> Obj: ...
    async def create(self, resource: Resource, namespace: str, body: Obj, dry_run: bool = False) -> Obj: ...
    async def patch(
        self, resource: Resource, namespace: str, name: str, body: Obj, sub: str | None = None
    ) -> Obj: ...  # JSON merge patch
    async def list(self, resource: Resource, namespace: str, selector: str) -> list[Obj]: ...
    async def proxy_get(self, namespace: str, pod: str, port: int, path: str) -> Any: ...
    async def proxy_post(
        self, namespace: str, pod: str, port: int, path: str, body: Obj, headers: dict[str, str] | None = None
    ) -> Any: ...
    async def delete(self, resource: Resource, namespace: str, name: str, body: Obj) -> Obj: ...  # DeleteOptions
    async def delete_all(self, resource: Resource, namespace: str, selector: str, body: Obj) -> Obj: ...


class AsyncKube:
    """`Kube` over kubernetes_asyncio."""

    def __init__(self, api: k8s.ApiClient, timeout_s: float = REQUEST_TIMEOUT_S):
        self.api, self.timeout_s = api, timeout_s
        api.user_agent = USER_AGENT

    async def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Obj:
        try:
            found: Obj = await self.api.call_api(
                path,
                method,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body,
                auth_settings=["BearerToken"],
                response_types_map={200: "object", 201: "object", 202: "object"},
                _return_http_data_only=True,
                _request_timeout=self.timeout_s,
            )
            return found
        except ApiException as exc:
            raise ApiError(exc.status or 0, _reason(exc), method) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ApiError(0, f"{type(exc).__name__}: {exc}", method) from None

    async def get(self, resource: Resource, namespace: str, name: str) -> Obj:
        return await self._call("GET", resource.path(namespace, name))

    async def create(self, resource: Resource, namespace: str, body: Obj, dry_run: bool = False) -> Obj:
        """POST; `dry_run`: admission, validation and webhooks run, nothing is stored (`?dryRun=All`)."""
        return await self._call("POST", resource.path(namespace) + ("?dryRun=All" if dry_run else ""), body)

    async def patch(self, resource: Resource, namespace: str, name: str, body: Obj, sub: str | None = None) -> Obj:
        return await self._call("PATCH", resource.path(namespace, name, sub), body, "application/merge-patch+json")

    async def list(self, resource: Resource, namespace: str, selector: str) -> list[Obj]:
        found = await self._call("GET", f"{resource.path(namespace)}?labelSelector={quote(selector, safe='')}")
        items: list[Obj] = found.get("items") or []
        return items

    async def delete(self, resource: Resource, namespace: str, name: str, body: Obj) -> Obj:
        return await self._call("DELETE", resource.path(namespace, name), body)

    async def delete_all(self, resource: Resource, namespace: str, selector: str, body: Obj) -> Obj:
        """deletecollection of the objects `selector` matches."""
        return await self._call("DELETE", f"{resource.path(namespace)}?labelSelector={quote(selector, safe='')}", body)

    async def proxy_get(self, namespace: str, pod: str, port: int, path: str) -> Any:
        """GET through the API server's pod proxy; the decoded JSON body, read as untrusted (bounded.py)."""
        return await self._proxy("GET", f"{PODS.path(namespace, f'{pod}:{port}', 'proxy')}/{path.lstrip('/')}")

    async def proxy_post(
        self, namespace: str, pod: str, port: int, path: str, body: Obj, headers: dict[str, str] | None = None
    ) -> Any:
        """POST a JSON body through the API server's pod proxy (RBAC `create` on pods/proxy); `headers` go with
        it to the pod (the API server keeps its own `Authorization`)."""
        return await self._proxy(
            "POST", f"{PODS.path(namespace, f'{pod}:{port}', 'proxy')}/{path.lstrip('/')}", body, headers
        )

    async def _proxy(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        """A request whose answer comes from a pod (the tenant's trainer, passed on by the API server): its
        body is streamed and read only up to bounded.LIMIT_BYTES, never preloaded whole as `_call` does."""
        try:
            response = await self.api.call_api(
                path,
                method,
                header_params={"Content-Type": "application/json", "Accept": "application/json", **(headers or {})},
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=self.timeout_s,
            )
            async with response:
                if not 200 <= response.status <= 299:
                    raise ApiError(response.status, _message(await bounded.read_body(response)), method)
                return await bounded.read_json(response)
        except bounded.Refused as exc:
            raise ApiError(0, str(exc), method) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ApiError(0, f"{type(exc).__name__}: {exc}", method) from None

    async def close(self) -> None:
        await self.api.close()


def _reason(exc: ApiException) -> str:
    try:
        message: str = json.loads(exc.body or b"").get("message") or exc.reason or ""  # no body: ValueError
        return message
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason or exc.body or "")


def _message(body: bytes) -> str:
    """The `message` of a refusal's JSON body (a Status, or the trainer's own answer), else its first words."""
    try:
        found = bounded.parse_json(body)
        message = found.get("message") if isinstance(found, dict) else None
        if isinstance(message, str) and message:
            return message[:1000]
    except bounded.Refused:
        pass
    return body[:200].decode("utf-8", "replace")


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NETRC")


def api_client(credentials: k8s.Configuration) -> k8s.ApiClient:
    """kubernetes_asyncio's client, without the environment lookups it makes on every request when the
    environment has nothing to give. Its aiohttp session trusts the environment, so for each request
    aiohttp reads the proxy variables and looks for a ~/.netrc on a thread of the default executor:
    in a burst of 500 jobs that was a thread hop per request and create -> JobSet p50 1.4 s instead
    of 1.0 s (benchmarks/operator_load.py). Where a proxy variable or $NETRC is set, or a ~/.netrc
    exists, the session is left as it is (it honours them); otherwise it is swapped for one over the
    same connector (TLS settings and pool) that does not look."""
    api = k8s.ApiClient(credentials)
    if any(os.environ.get(name) for name in PROXY_VARIABLES) or os.path.exists(os.path.expanduser("~/.netrc")):
        return api
    trusting = api.rest_client.pool_manager
    api.rest_client.pool_manager = aiohttp.ClientSession(
        connector=trusting.connector, trust_env=False, read_bufsize=2**21
    )  # kubernetes_asyncio's: large watch events
    trusting.detach()  # the new session owns the connector now
    return api


async def configuration() -> k8s.Configuration:
    """In-cluster credentials inside a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = k8s.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=cfg)
    else:
        await k8s_config.load_kube_config(client_configuration=cfg, persist_config=False)
    return cfg

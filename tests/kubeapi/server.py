"""The HTTP face of the fake API server: a kmock handler that routes Kubernetes requests to the store.

kmock supplies the server plumbing (its aiohttp `Server`, request capture, response rendering
and streaming). Its own `KubernetesEmulator` lacks most API-server semantics (no uid or
resourceVersion, 200 on create, no PUT, no /status, no selectors, watches that ignore
resourceVersion, and a path parser that fails on /api/v1/namespaces), so this handler keeps
kmock's DSL on top — reactions added in-process with `api[...] << ...` still win — and answers
everything else from `Store`.
"""

import asyncio
import dataclasses
import json
import traceback
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import aiohttp.web_request
import aiohttp.web_server
import attrs
import kmock
import yaml
from kmock._internal import rendering

from . import discovery, errors, openapi, protobuf, selectors, table, watch
from .errors import ApiError
from .faults import ADMIN_PREFIX, Faults
from .resources import CRD_KEY, ResourceType
from .store import Obj, Store

# CRDs such as JobSet's are ~1 MB as JSON, twice that with kubectl's last-applied annotation.
MAX_BODY_BYTES = 64 * 1024 * 1024
JSON_TYPE = "application/json"


class BigBodyServer(aiohttp.test_utils.RawTestServer):
    """kmock's default aiohttp server, with a request size limit that fits big CRDs."""

    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        server = aiohttp.web_server.Server(self._handler, loop=self._loop, debug=debug, **kwargs)

        def make_request(message, payload, protocol, writer, task):  # noqa: ANN001 (aiohttp's factory protocol)
            return aiohttp.web_request.BaseRequest(message, payload, protocol, writer, task, server._loop,
                                                   client_max_size=MAX_BODY_BYTES)

        server.request_factory = make_request
        return aiohttp.web.ServerRunner(server, debug=debug, **kwargs)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a /api or /apis path addresses."""
    group: str
    version: str
    plural: str | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    legacy_watch: bool = False  # the old /api/v1/watch/... form


def _json_body(body: bytes) -> Any:
    if not body:
        return None
    if body.startswith(protobuf.MAGIC):
        # kubectl's typed generators (`kubectl create configmap ...`) send protobuf; -f files go as JSON.
        return protobuf.decode(body)
    try:
        return json.loads(body)
    except ValueError:
        try:
            return yaml.safe_load(body)  # server-side apply sends YAML
        except yaml.YAMLError:
            raise errors.bad_request("the request body is neither JSON nor YAML") from None


def _reply(status: int, payload: Any, content_type: str = JSON_TYPE) -> rendering.Response:
    # A fresh kmock Response per request: kmock mutates a Response while rendering it.
    return rendering.Response(status=status, payload=payload, headers={"Content-Type": content_type})


def _error(exc: ApiError) -> rendering.Response:
    return _reply(exc.code, exc.status())


@attrs.define(kw_only=True)
class KubeApi(kmock.RawHandler):
    store: Store = attrs.field(factory=Store)
    faults: Faults = attrs.field(factory=Faults)
    log: list[dict[str, Any]] = attrs.field(factory=list)

    # --- plumbing ------------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's own request parser cannot parse /api/v1/namespaces, so requests are built here.
        body = await raw.read()
        target = self._parse(raw.path)
        request = rendering.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method, params=dict(raw.query),
            headers=dict(raw.headers), body=body, text=body.decode("utf-8", "replace"),
            resource=None if target is None or target.plural is None else
            kmock.resource(group=target.group, version=target.version, plural=target.plural),
            namespace=None if target is None else target.namespace,
            name=None if target is None else target.name,
            subresource=None if target is None else target.subresource,
        )
        self._requests.append(request)
        entry = {"method": raw.method, "path": raw.path, "query": dict(raw.query), "status": None,
                 "userAgent": raw.headers.get("User-Agent", "")}
        if not raw.path.startswith(ADMIN_PREFIX):
            self.log.append(entry)
        try:
            response = await self._handle(request, target)
        except asyncio.CancelledError:  # the client went away first: a watch it ended, or an abandoned call
            entry["status"] = 200 if request.params.get("watch") in ("true", "1") else 499
            raise
        except rendering.StreamingError as exc:  # a stream broke after its headers went out
            response = exc.args[0]
        except Exception as exc:  # a bug here must reach the test as a 500, not a hung client
            response = await _error(ApiError(500, f"{exc!r}\n{traceback.format_exc()}"))(request)
        entry["status"] = response.status
        return response

    async def _handle(self, request: rendering.Request, target: Target | None = None) -> aiohttp.web.StreamResponse:
        if self._payloads:  # reactions added with kmock's DSL come first
            try:
                return await super()._handle(request)
            except NotImplementedError:
                pass
        if (target is not None and target.group == "" and target.plural == "pods" and target.name
                and (target.subresource or "").split("/")[0] == "proxy"):
            try:
                return await self._proxy(request, target)
            except ApiError as exc:
                return await _error(exc)(request)
        try:
            reply = self._route(request, target)
        except ApiError as exc:
            reply = _error(exc)
        return await reply(request)

    async def _proxy(self, request: rendering.Request, target: Target) -> aiohttp.web.StreamResponse:
        """pods/NAME[:PORT]/proxy/PATH, forwarded to the pod's status.podIP as the API server does."""
        fault = self.faults.take(request._raw_request.method, request._raw_request.path_qs)
        if fault is not None:
            raise ApiError(fault.status, fault.message)
        name, _, port = target.name.partition(":")
        pod = self.store.get(self.store.lookup("", "v1", "pods"), target.namespace, name)
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            raise ApiError(503, f"pod {name} has no IP address yet", "ServiceUnavailable")
        path = target.subresource[len("proxy"):] or "/"
        url = f"http://{ip}:{port or 80}{path}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                async with session.request(request._raw_request.method, url, params=request.params,
                                           data=request.body or None) as upstream:
                    body = await upstream.read()
                    return aiohttp.web.Response(status=upstream.status, body=body, headers={
                        "Content-Type": upstream.headers.get("Content-Type", "application/octet-stream")})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # What kube-apiserver answers when the pod does not answer.
            raise ApiError(503, f"error trying to reach service: {exc!r}", "ServiceUnavailable") from None

    def _parse(self, path: str) -> Target | None:
        parts = [part for part in path.split("/") if part]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        legacy_watch = bool(rest) and rest[0] == "watch"
        rest = rest[1:] if legacy_watch else rest
        if not rest:
            return Target(group, version)
        namespace = None
        # /api/v1/namespaces/NAME/status is the namespace's own subresource, not a namespaced list.
        if len(rest) >= 3 and rest[0] == "namespaces" and self.store.lookup(group, version, rest[2]):
            namespace, rest = rest[1], rest[2:]
        return Target(group, version, rest[0], namespace, rest[1] if len(rest) > 1 else None,
                      "/".join(rest[2:]) or None, legacy_watch)

    # --- routing -------------------------------------------------------------------------------

    def _route(self, request: rendering.Request, target: Target | None) -> rendering.Response:
        raw = request._raw_request
        path, method = raw.path, raw.method
        if path.startswith(ADMIN_PREFIX):
            return self._admin(method, path[len(ADMIN_PREFIX):], request)
        fault = self.faults.take(method, raw.path_qs)
        if fault is not None:
            return _error(ApiError(fault.status, fault.message))
        types = list(self.store.types.values())
        if method == "GET":
            static = {
                "/": discovery.root_paths(types),
                "/version": discovery.VERSION,
                "/api": discovery.api_versions(),
                "/apis": discovery.api_group_list(types),
            }
            if (key := path.rstrip("/") or "/") in static:
                return _reply(200, static[key])
            if path in ("/healthz", "/readyz", "/livez"):
                return _reply(200, b"ok", "text/plain")
            if path == "/openapi/v2":
                return self._openapi_v2(request)
        if target is None:
            parts = [part for part in path.split("/") if part]
            if method == "GET" and len(parts) == 2 and parts[0] == "apis":
                group = discovery.api_group(types, parts[1])
                if group is not None:
                    return _reply(200, group)
            # /openapi/v3 included: kubectl and helm fall back to /openapi/v2.
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if target.plural is None:
            listing = discovery.api_resource_list(types, target.group, target.version)
            if listing is None or method != "GET":
                raise ApiError(404, "the server could not find the requested resource", "NotFound")
            return _reply(200, listing)
        rt = self.store.lookup(target.group, target.version, target.plural)
        if rt is None or (target.namespace is not None and not rt.namespaced):
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if target.subresource is not None and target.subresource not in rt.subresources:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if "dryRun" in request.params:
            raise errors.bad_request("dryRun is not supported by this test server")
        if target.name is None:
            return self._collection(rt, target, request)
        return self._object(rt, target, request)

    def _openapi_v2(self, request: rendering.Request) -> rendering.Response:
        media = openapi.negotiate(request.headers.get("Accept", ""))
        doc = openapi.document(self.store.types.values(), discovery.VERSION["gitVersion"])
        if media == openapi.PROTOBUF:
            return _reply(200, openapi.document_message(doc), openapi.PROTOBUF_RETURNED)
        return _reply(200, doc)

    def _render(self, rt: ResourceType, obj: Obj) -> Obj:
        # One stored form per group+plural; each served version only relabels it (no conversion).
        return {"apiVersion": rt.api_version, "kind": obj["kind"],
                **{key: value for key, value in obj.items() if key not in ("apiVersion", "kind")}}

    def _collection(self, rt: ResourceType, target: Target, request: rendering.Request) -> rendering.Response:
        method, params = request._raw_request.method, request.params
        if method == "GET" and (target.legacy_watch or params.get("watch") in ("true", "1")):
            return self._watch(rt, target.namespace, selectors.selector(params), request)
        if method == "GET":
            items = [self._render(rt, obj) for obj in self.store.list_objects(rt, target.namespace, selectors.selector(params))]
            if table.wants_table(request.headers.get("Accept", "")):
                return _reply(200, table.table(rt, items, str(self.store.rv), params.get("includeObject")))
            return _reply(200, {"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                                "metadata": {"resourceVersion": str(self.store.rv)}, "items": items})
        if method == "POST":
            created = self.store.create(rt, target.namespace, _json_body(request.body))
            return _reply(201, self._render(rt, created))
        if method == "DELETE":  # deletecollection
            options = _json_body(request.body) or {}
            doomed = self.store.list_objects(rt, target.namespace, selectors.selector(params))
            gone = [self.store.delete(rt, o["metadata"].get("namespace"), o["metadata"]["name"], options) for o in doomed]
            return _reply(200, {"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                                "metadata": {"resourceVersion": str(self.store.rv)},
                                "items": [self._render(rt, obj) for obj in gone]})
        raise ApiError(405, f"the server does not allow the method {method} on this resource", "MethodNotAllowed")

    def _object(self, rt: ResourceType, target: Target, request: rendering.Request) -> rendering.Response:
        method, params = request._raw_request.method, request.params
        ns, name, sub = target.namespace, target.name, target.subresource
        if rt.namespaced and ns is None:
            raise ApiError(404, "the server could not find the requested resource", "NotFound")
        if method == "GET" and (target.legacy_watch or params.get("watch") in ("true", "1")):
            by_name = selectors.field_selector(f"metadata.name={name}")
            rest = selectors.selector(params)
            return self._watch(rt, ns, lambda obj: by_name(obj) and rest(obj), request)
        if method == "GET":
            obj = self._render(rt, self.store.get(rt, ns, name))
            if table.wants_table(request.headers.get("Accept", "")):
                return _reply(200, table.table(rt, [obj], obj["metadata"]["resourceVersion"], params.get("includeObject")))
            return _reply(200, obj)
        if method == "PUT":
            return _reply(200, self._render(rt, self.store.update(rt, ns, name, _json_body(request.body), sub)))
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "")
            if content_type.startswith("application/apply-patch"):
                return self._server_side_apply(rt, ns, name, _json_body(request.body), sub)
            patched = self.store.patch(rt, ns, name, content_type, _json_body(request.body), sub)
            return _reply(200, self._render(rt, patched))
        if method == "DELETE" and sub is None:
            options = _json_body(request.body) or {}
            if "propagationPolicy" in params:
                options["propagationPolicy"] = params["propagationPolicy"]
            return _reply(200, self._render(rt, self.store.delete(rt, ns, name, options)))
        raise ApiError(405, f"the server does not allow the method {method} on this resource", "MethodNotAllowed")

    def _server_side_apply(self, rt: ResourceType, ns: str | None, name: str, body: Any, sub: str | None) -> rendering.Response:
        # Approximated as create-or-merge-patch: no field managers, no conflicts between appliers.
        try:
            self.store.get(rt, ns, name)
        except ApiError:
            return _reply(201, self._render(rt, self.store.create(rt, ns, body)))
        patched = self.store.patch(rt, ns, name, "application/merge-patch+json", body, sub)
        return _reply(200, self._render(rt, patched))

    def _watch(self, rt: ResourceType, namespace: str | None, predicate: Any, request: rendering.Request) -> rendering.Response:
        params, raw = request.params, request._raw_request
        as_table = table.wants_table(request.headers.get("Accept", ""))
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None

        def render(obj: Obj) -> Obj:
            shown = self._render(rt, obj)
            if as_table:
                return table.table(rt, [shown], obj["metadata"]["resourceVersion"], params.get("includeObject"))
            return shown

        def connected() -> bool:
            return raw.transport is not None and not raw.transport.is_closing()

        events = watch.stream(self.store, rt, namespace, predicate, params.get("resourceVersion"), timeout,
                              render, connected)
        # kubectl decodes a watch only when it is served as JSON (not octet-stream).
        return _reply(200, events)

    # --- test administration -----------------------------------------------------------------------

    def _admin(self, method: str, what: str, request: rendering.Request) -> rendering.Response:
        match method, what.rstrip("/"):
            case "GET", "requests":
                return _reply(200, {"items": self.log})
            case "DELETE", "requests":
                self.log.clear()
                return _reply(200, {"items": []})
            case "GET", "faults":
                return _reply(200, {"items": self.faults.describe()})
            case "POST", "faults":
                fault = self.faults.add(_json_body(request.body))
                return _reply(201, dataclasses.asdict(fault))
            case "DELETE", "faults":
                self.faults.pending.clear()
                return _reply(200, {"items": []})
            case "POST", "watches/drop":
                return _reply(200, {"dropped": self.store.drop_watches()})
        raise ApiError(404, f"no test endpoint {method} {ADMIN_PREFIX}{what}", "NotFound")

    # --- start-up --------------------------------------------------------------------------------

    def load_crds(self, text: str) -> list[str]:
        """Create every CustomResourceDefinition in a YAML text; returns their names."""
        crd_type = next(rt for rt in self.store.types.values() if rt.storage_key == CRD_KEY)
        names = []
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                names.append(self.store.create(crd_type, None, doc)["metadata"]["name"])
        return names

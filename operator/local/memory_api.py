"""An API server in memory: the controller's `Kube` protocol (controller/kube.py) over a dict, for the local
run, where the operator's own Manager runs against it, and for the operator's unit tests (tests/fakes.py).

What it keeps of the real API server, because the controller depends on it:
- objects by path (`Resource.path(namespace, name)`), each with a uid, a resourceVersion bumped on every
  write, a creationTimestamp and, for objects with a spec, `metadata.generation`, bumped when the spec
  changes;
- create: 409 on a taken name, `generateName`; `dry_run` (dryRun=All) stores nothing and notifies no one;
  a Secret's `stringData` stored as base64 `data`;
- JSON merge patch (RFC 7386) with the `metadata.resourceVersion` precondition (409); the status
  subresource: a patch of the object leaves `.status` alone, a patch of `/status` changes only `.status`;
- delete with the uid precondition; garbage collection by owner references: `Foreground` keeps the
  owner (with a deletionTimestamp) until its dependents are gone, otherwise the owner goes at once and
  its dependents (those with no other owner left) after it. A pod bound to a node (`spec.nodeName`) and deleted with a grace period is
  only marked (deletionTimestamp, deletionGracePeriodSeconds): its kubelet stops the process and makes
  the final delete with grace 0, as on a cluster;
- label-selected lists (`k=v`, `k==v`, `k!=v`, `k`, `!k`) and deletecollection;
- watches: `watch(resource, callback)` calls back with ("ADDED" | "MODIFIED" | "DELETED", object) after
  every change, as kopf's watches feed the operator (controller/handlers.py);
- the pod proxy: `proxy_get`/`proxy_post` reach a pod's port on this machine through the port the
  kubelet registered for it (`serve`), as the API server's proxy reaches the pod's IP.
Every object handed out is a copy: a caller never changes what is stored.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ..api import timestamps
from ..controller.kube import PODS, ApiError, Obj, Resource

Watcher = Callable[[str, Obj], None]  # (event type, the object as it now is, or was when deleted)
PROXY_TIMEOUT_S = 3.0
PROXY_LIMIT_BYTES = 1 << 16  # as controller/bounded.py reads a pod's answer


def merge(target: Obj, patch: Obj) -> None:
    """RFC 7386: None removes, objects merge field by field, anything else replaces."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Whether an equality-based label selector matches `labels` (an empty selector matches all)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class MemoryApi:
    """The `Kube` protocol in memory (this module's docstring says what it keeps of the API server)."""

    def __init__(self, now: timestamps.Clock = timestamps.utc_now) -> None:
        self.objects: dict[str, Obj] = {}  # path -> object
        self.resources: dict[str, Resource] = {}  # path -> its resource, for whoever watches it
        self.rv = 0
        self.now = now
        self.uids = itertools.count(1)
        self.watchers: list[tuple[Resource, Watcher]] = []
        self.ports: dict[tuple[str, str, int], int] = {}  # (namespace, pod, port) -> the port on this machine

    # --- watches ------------------------------------------------------------------------------------

    def watch(self, resource: Resource, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher` after every change of a `resource` object; returns what stops it."""
        entry = (resource, watcher)
        self.watchers.append(entry)
        return lambda: self.watchers.remove(entry) if entry in self.watchers else None

    def _notify(self, kind: str, path: str, obj: Obj) -> None:
        resource = self.resources.get(path)
        for watched, watcher in list(self.watchers):
            if watched == resource:
                watcher(kind, copy.deepcopy(obj))

    def _stored(self, resource: Resource, path: str, obj: Obj) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        new = path not in self.objects
        self.objects[path], self.resources[path] = obj, resource
        self._notify("ADDED" if new else "MODIFIED", path, obj)

    def _stamp(self) -> str:
        return timestamps.format(self.now())

    # --- the Kube protocol --------------------------------------------------------------------------

    async def get(self, resource: Resource, namespace: str, name: str) -> Obj:
        found = self.objects.get(resource.path(namespace, name))
        if found is None:
            raise ApiError(404, f'{resource.plural} "{name}" not found', "GET")
        return copy.deepcopy(found)

    async def create(self, resource: Resource, namespace: str, body: Obj, dry_run: bool = False) -> Obj:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "name or generateName is required", "POST")
            meta["name"] = f"{meta['generateName']}{self.rv + 1:05d}"
        path = resource.path(namespace, meta["name"])
        if path in self.objects:
            raise ApiError(409, f'{resource.plural} "{meta["name"]}" already exists', "POST")
        meta["namespace"] = namespace
        if "stringData" in obj:  # as the API server stores a Secret
            data = obj.setdefault("data", {})
            data.update({k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()})
        if dry_run:  # dryRun=All: everything a create checks, nothing stored
            return obj
        meta.setdefault("uid", f"uid-{next(self.uids)}")
        meta.setdefault("creationTimestamp", self._stamp())
        if "spec" in obj:
            meta["generation"] = 1
        self._stored(resource, path, obj)
        return copy.deepcopy(obj)

    async def patch(self, resource: Resource, namespace: str, name: str, body: Obj, sub: str | None = None) -> Obj:
        path = resource.path(namespace, name)
        obj = self.objects.get(path)
        if obj is None:
            raise ApiError(404, f'{resource.plural} "{name}" not found', "PATCH")
        meta = body.get("metadata") or {}
        wanted = meta.get("resourceVersion")
        if wanted and wanted != obj["metadata"]["resourceVersion"]:
            raise ApiError(
                409, "the object has been modified; please apply your changes to the latest version", "PATCH"
            )
        if sub == "status":  # the status subresource changes only .status
            merge(obj.setdefault("status", {}), body.get("status") or {})
        else:  # the object itself: everything but .status and what the server owns
            spec = copy.deepcopy(obj.get("spec"))
            changes = {k: v for k, v in body.items() if k not in ("status", "metadata", "apiVersion", "kind")}
            merge(obj, changes)
            kept = ("labels", "annotations", "ownerReferences", "finalizers")
            merge(obj["metadata"], {k: v for k, v in meta.items() if k in kept})
            if "generation" in obj["metadata"] and obj.get("spec") != spec:
                obj["metadata"]["generation"] += 1
        self.resources.setdefault(path, resource)
        self._stored(resource, path, obj)
        self._collect()
        return copy.deepcopy(obj)

    async def list(self, resource: Resource, namespace: str, selector: str) -> list[Obj]:
        return [copy.deepcopy(self.objects[path]) for path in self._selected(resource, namespace, selector)]

    def _selected(self, resource: Resource, namespace: str, selector: str) -> list[str]:
        prefix = resource.path(namespace) + "/"
        return [
            path
            for path, o in self.objects.items()
            if path.startswith(prefix)
            and "/" not in path[len(prefix) :]
            and selects(selector, o["metadata"].get("labels") or {})
        ]

    async def delete(self, resource: Resource, namespace: str, name: str, body: Obj) -> Obj:
        path = resource.path(namespace, name)
        obj = self.objects.get(path)
        if obj is None:
            raise ApiError(404, f'{resource.plural} "{name}" not found', "DELETE")
        if (body.get("preconditions") or {}).get("uid") not in (None, obj["metadata"].get("uid")):
            raise ApiError(409, "Precondition failed: UID in precondition does not match", "DELETE")
        self.resources.setdefault(path, resource)
        self._delete(path, body)
        self._collect()
        return copy.deepcopy(self.objects.get(path, obj))

    async def delete_all(self, resource: Resource, namespace: str, selector: str, body: Obj) -> Obj:
        """deletecollection of the objects `selector` matches."""
        for path in self._selected(resource, namespace, selector):
            self.resources.setdefault(path, resource)
            self._delete(path, body)
        self._collect()
        return {"kind": "Status", "status": "Success"}

    async def proxy_get(self, namespace: str, pod: str, port: int, path: str) -> Any:
        return await self._proxy("GET", namespace, pod, port, path, None, None)

    async def proxy_post(
        self, namespace: str, pod: str, port: int, path: str, body: Obj, headers: dict[str, str] | None = None
    ) -> Any:
        return await self._proxy("POST", namespace, pod, port, path, body, headers)

    # --- deletion and garbage collection ------------------------------------------------------------

    def _delete(self, path: str, body: Obj) -> None:
        obj = self.objects.get(path)
        if obj is None:
            return
        meta = obj["metadata"]
        grace = body.get("gracePeriodSeconds")
        if grace is None:
            grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        if self.resources.get(path) == PODS and (obj.get("spec") or {}).get("nodeName") and grace:
            if not meta.get("deletionTimestamp"):  # a running pod: its kubelet stops it, then deletes it
                meta.update(deletionTimestamp=self._stamp(), deletionGracePeriodSeconds=int(grace))
                self._stored(self.resources[path], path, obj)
            return
        dependents = self._dependents(meta.get("uid"))
        if body.get("propagationPolicy") == "Foreground" and dependents:
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = self._stamp()
                meta["finalizers"] = [*(meta.get("finalizers") or []), "foregroundDeletion"]
                self._stored(self.resources[path], path, obj)
            for child in dependents:
                self._delete(child, {"propagationPolicy": "Foreground"})
            return
        self._remove(path)
        for child in dependents:  # background: the owner first, then what it owned
            if not any(ref.get("uid") in self._uids() for ref in self.objects[child]["metadata"]["ownerReferences"]):
                self._delete(child, {"propagationPolicy": "Background"})

    def _remove(self, path: str) -> None:
        obj = self.objects.pop(path)
        self.rv += 1
        self._notify("DELETED", path, obj)
        self.resources.pop(path, None)

    def _uids(self) -> set[str]:
        return {o["metadata"].get("uid") for o in self.objects.values()}

    def _dependents(self, uid: str | None) -> list[str]:
        return [
            path
            for path, o in self.objects.items()
            if uid and any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
        ]

    def _collect(self) -> None:
        """The garbage collector's other half: an owner in foreground deletion goes once its dependents have."""
        waiting = [
            p for p, o in self.objects.items() if "foregroundDeletion" in (o["metadata"].get("finalizers") or [])
        ]
        for path in waiting:
            if path in self.objects and not self._dependents(self.objects[path]["metadata"].get("uid")):
                self._remove(path)
                self._collect()  # its own owner may be waiting for it
                return

    # --- the pod proxy ------------------------------------------------------------------------------

    def serve(self, namespace: str, pod: str, port: int, local_port: int) -> None:
        """The kubelet says where on this machine a pod's `port` is served."""
        self.ports[(namespace, pod, port)] = local_port

    async def _proxy(
        self, method: str, namespace: str, pod: str, port: int, path: str, body: Obj | None, headers: Any
    ) -> Any:
        local = self.ports.get((namespace, pod, port))
        if local is None or PODS.path(namespace, pod) not in self.objects:
            raise ApiError(503, f"no endpoint for pod {pod}:{port}", method)
        url = f"http://127.0.0.1:{local}/{path.lstrip('/')}"
        return await asyncio.to_thread(_http, method, url, body, headers or {})


def _http(method: str, url: str, body: Obj | None, headers: dict[str, str]) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=PROXY_TIMEOUT_S) as response:
            return json.loads(response.read(PROXY_LIMIT_BYTES) or b"null")
    except urllib.error.HTTPError as exc:
        raise ApiError(exc.code, exc.read(2000).decode(errors="replace"), method) from None
    except (OSError, ValueError) as exc:
        raise ApiError(0, f"{type(exc).__name__}: {exc}", method) from None

"""The in-memory object store with the API server's write semantics.

All methods are synchronous and run on the server's event loop, so each write is atomic
with respect to watches: an event is recorded in the history and pushed to the open
watches in the same step that changes the object.
"""

import asyncio
import collections
import copy
import dataclasses
import datetime
import random
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from . import errors, metadata as metadata_checks
from .patch import apply_patch
from .resources import BUILTINS, CRD_KEY, ResourceType, check_crd, types_from_crd

Obj = dict[str, Any]
StorageKey = tuple[str, str]  # (group, plural)
ObjKey = tuple[str, str]  # (namespace or "", name)

INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # as the real generateName suffix: no vowels, no look-alikes


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def meta(obj: Obj) -> dict[str, Any]:
    return obj.setdefault("metadata", {})


@dataclasses.dataclass(frozen=True)
class Event:
    rv: int
    key: StorageKey
    type: str  # ADDED | MODIFIED | DELETED
    old: Obj | None
    new: Obj | None  # for DELETED: the last state, stamped with the deletion's resourceVersion


class Watcher:
    """One open watch: a queue of (type, object) pairs already filtered for it.

    `None` in the queue means "the server closed this watch" (fault injection or shutdown).
    """

    def __init__(self, key: StorageKey, namespace: str | None, predicate: Callable[[Obj], bool]):
        self.key = key
        self.namespace = namespace
        self.predicate = predicate
        self.queue: asyncio.Queue[tuple[str, Obj] | None] = asyncio.Queue()

    def _visible(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return self.predicate(obj)

    def translate(self, event: Event) -> tuple[str, Obj] | None:
        """What this watch sees of an event; objects moving in/out of a selector become ADDED/DELETED."""
        if event.key != self.key:
            return None
        was, now_ = self._visible(event.old), self._visible(event.new)
        if event.type == "DELETED":
            return ("DELETED", event.new) if was else None
        if was and now_:
            return ("MODIFIED", event.new)
        if now_:
            return ("ADDED", event.new)
        if was:
            return ("DELETED", event.new)
        return None

    def offer(self, event: Event) -> None:
        seen = self.translate(event)
        if seen is not None:
            self.queue.put_nowait(seen)

    def close(self) -> None:
        self.queue.put_nowait(None)


class Store:
    def __init__(self, history: int = 10000):
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.objects: dict[StorageKey, dict[ObjKey, Obj]] = collections.defaultdict(dict)
        self.rv = 0
        self.history: collections.deque[Event] = collections.deque(maxlen=history)
        self.history_floor = 0  # watches from before this resourceVersion get 410 Gone
        self.watchers: set[Watcher] = set()
        for rt in BUILTINS:
            self.register(rt)
        namespaces = self.lookup("", "v1", "namespaces")
        for name in INITIAL_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})

    # --- types -------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self.types[(rt.group, rt.version, rt.plural)] = rt

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        return self.types.get((group, version, plural))

    def _any_type(self, key: StorageKey) -> ResourceType:
        return next(rt for rt in self.types.values() if rt.storage_key == key)

    # --- reading -----------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self.objects[rt.storage_key].get((namespace or "", name))
        if obj is None:
            raise errors.not_found(rt.plural, rt.group, name)
        return obj

    def list_objects(self, rt: ResourceType, namespace: str | None, predicate: Callable[[Obj], bool]) -> list[Obj]:
        objs = self.objects[rt.storage_key].values()
        return [
            obj for obj in sorted(objs, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
            if (namespace is None or obj["metadata"].get("namespace") == namespace) and predicate(obj)
        ]

    def watch(self, rt: ResourceType, namespace: str | None, predicate: Callable[[Obj], bool],
              since: str | None) -> tuple[list[tuple[str, Obj]], Watcher]:
        """Start a watch: the events to send first, and the watcher for what comes later.

        Without a resourceVersion (or with "0"), the current state is sent as ADDED events;
        with one, the recorded history after it is replayed, or 410 Gone if it is too old.
        """
        watcher = Watcher(rt.storage_key, namespace, predicate)
        if since in (None, "", "0"):
            first = [("ADDED", obj) for obj in self.list_objects(rt, namespace, predicate)]
        else:
            try:
                since_rv = int(since)
            except ValueError:
                raise errors.bad_request(f"invalid resourceVersion: {since!r}") from None
            if since_rv < self.history_floor:
                raise errors.ApiError(410, f"too old resource version: {since_rv} ({self.history_floor})", "Expired")
            first = [seen for event in self.history if event.rv > since_rv
                     if (seen := watcher.translate(event)) is not None]
        self.watchers.add(watcher)
        return first, watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def drop_watches(self) -> int:
        dropped = list(self.watchers)
        for watcher in dropped:
            watcher.close()
        self.watchers.clear()
        return len(dropped)

    # --- writing -----------------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, key: StorageKey, type_: str, old: Obj | None, new: Obj | None) -> None:
        if len(self.history) == self.history.maxlen:
            self.history_floor = self.history[0].rv
        event = Event(self.rv, key, type_, copy.deepcopy(old), copy.deepcopy(new))
        self.history.append(event)
        for watcher in list(self.watchers):
            watcher.offer(event)

    def _namespace_of(self, rt: ResourceType, namespace: str | None, obj: Obj) -> str:
        if not rt.namespaced:
            meta(obj).pop("namespace", None)
            return ""
        body_ns = meta(obj).get("namespace")
        if namespace and body_ns and body_ns != namespace:
            raise errors.bad_request("the namespace of the provided object does not match the namespace sent on the request")
        namespace = namespace or body_ns
        if not namespace:
            raise errors.bad_request("a namespaced object needs a namespace")
        if ("", namespace) not in self.objects[("", "namespaces")]:
            raise errors.not_found("namespaces", "", namespace)
        meta(obj)["namespace"] = namespace
        return namespace

    @staticmethod
    def _check_type(rt: ResourceType, body: Any) -> None:
        if not isinstance(body, dict):
            raise errors.bad_request("the body must be a JSON object")
        for field, expected in (("apiVersion", rt.api_version), ("kind", rt.kind)):
            if body.get(field) not in (None, "", expected):
                raise errors.bad_request(f"the {field} in the data ({body[field]}) does not match "
                                         f"the expected {field} ({expected})")

    def create(self, rt: ResourceType, namespace: str | None, body: Obj) -> Obj:
        self._check_type(rt, body)
        obj = copy.deepcopy(body)
        metadata = meta(obj)
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = metadata["generateName"] + "".join(random.choices(_NAME_CHARS, k=5))
        name = metadata.get("name")
        if not name:
            raise errors.invalid(rt.kind, rt.group, "", [
                {"reason": "FieldValueRequired", "message": "Required value: name or generateName is required",
                 "field": "metadata.name"}])
        if causes := metadata_checks.problems(rt.kind, metadata):
            raise errors.invalid(rt.kind, rt.group, name, causes)
        ns = self._namespace_of(rt, namespace, obj)
        if (ns, name) in self.objects[rt.storage_key]:
            raise errors.already_exists(rt.plural, rt.group, name)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        if rt.from_crd and rt.has_status:
            obj.pop("status", None)  # the status subresource owns it: a create cannot set it
        if rt.schema is not None:
            obj = rt.schema.admit(obj, rt.kind, rt.group)
        if rt.storage_key == CRD_KEY:
            self._admit_crd(obj)
        elif rt.storage_key == ("", "namespaces"):
            obj["status"] = {"phase": "Active"}
        elif rt.storage_key == ("", "secrets"):
            obj.setdefault("type", "Opaque")  # the one built-in default clients commonly read back
        metadata = meta(obj)
        for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            metadata.pop(server_owned, None)
        metadata.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1,
                        creationTimestamp=now())
        self.objects[rt.storage_key][(ns, name)] = obj
        self._emit(rt.storage_key, "ADDED", None, obj)
        return obj

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: Obj, subresource: str | None = None) -> Obj:
        old = self.get(rt, namespace, name)
        self._check_type(rt, body)
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise errors.bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
        return self._replace(rt, old, body, subresource)

    def patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, patch: Any,
              subresource: str | None = None) -> Obj:
        old = self.get(rt, namespace, name)
        return self._replace(rt, old, apply_patch(content_type, old, patch), subresource)

    def _replace(self, rt: ResourceType, old: Obj, body: Obj, subresource: str | None) -> Obj:
        old_meta = old["metadata"]
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old_meta["resourceVersion"]:
            raise errors.conflict(rt.plural, rt.group, old_meta["name"])
        if subresource == "status":
            # Writes to /status change only .status: metadata and spec stay as they were.
            new = copy.deepcopy(old)
            if body.get("status") is None:
                new.pop("status", None)
            else:
                new["status"] = copy.deepcopy(body["status"])
        else:
            new = copy.deepcopy(body)
            if rt.has_status:  # ... and writes to the main resource leave .status alone.
                new.pop("status", None)
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
            new_meta = meta(new)
            for server_owned in ("uid", "creationTimestamp", "deletionTimestamp", "namespace", "name",
                                 "generation", "deletionGracePeriodSeconds"):
                new_meta.pop(server_owned, None)
                if server_owned in old_meta:
                    new_meta[server_owned] = old_meta[server_owned]
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if causes := metadata_checks.problems(rt.kind, meta(new)):
            raise errors.invalid(rt.kind, rt.group, old_meta["name"], causes)
        if rt.schema is not None:
            new = rt.schema.admit(new, rt.kind, rt.group)
        if rt.storage_key == CRD_KEY:
            self._admit_crd(new)
        meta(new)["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return old  # a no-op write: no new resourceVersion, no event (kopf relies on this)
        if self._spec_of(rt, new) != self._spec_of(rt, old):
            meta(new)["generation"] = old_meta.get("generation", 1) + 1
        meta(new)["resourceVersion"] = self._next_rv()
        ns = old_meta.get("namespace", "")
        self.objects[rt.storage_key][(ns, old_meta["name"])] = new
        self._emit(rt.storage_key, "MODIFIED", old, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self._remove(rt.storage_key, new)  # the last finalizer is gone: deletion completes
        return new

    @staticmethod
    def _spec_of(rt: ResourceType, obj: Obj) -> Obj:
        """What generation tracks: everything but metadata (and status, when it is a subresource)."""
        ignored = {"metadata", "status"} if rt.has_status else {"metadata"}
        return {key: value for key, value in obj.items() if key not in ignored}

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: Obj | None = None) -> Obj:
        options = options or {}
        obj = self.get(rt, namespace, name)
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != obj["metadata"]["uid"]:
            raise errors.conflict(rt.plural, rt.group, name)
        if preconditions.get("resourceVersion") and preconditions["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise errors.conflict(rt.plural, rt.group, name)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj  # already waiting for its finalizers
            new = copy.deepcopy(obj)
            new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0,
                                   resourceVersion=self._next_rv())
            self.objects[rt.storage_key][(obj["metadata"].get("namespace", ""), name)] = new
            self._emit(rt.storage_key, "MODIFIED", obj, new)
            return new
        return self._remove(rt.storage_key, obj, options.get("propagationPolicy") or "Background")

    def _remove(self, key: StorageKey, obj: Obj, propagation: str = "Background") -> Obj:
        metadata = obj["metadata"]
        del self.objects[key][(metadata.get("namespace", ""), metadata["name"])]
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(key, "DELETED", obj, gone)
        if key == CRD_KEY:
            self._forget_crd(obj)
        elif key == ("", "namespaces"):
            self._empty_namespace(metadata["name"])
        self._collect_dependents(metadata["uid"], orphan=propagation == "Orphan")
        return gone

    # --- garbage collection ------------------------------------------------------------------

    def _all_objects(self) -> Iterable[tuple[StorageKey, Obj]]:
        return [(key, obj) for key, objs in self.objects.items() for obj in list(objs.values())]

    def _collect_dependents(self, owner_uid: str, orphan: bool) -> None:
        """Delete (or orphan) every object whose ownerReferences name the deleted owner."""
        for key, obj in self._all_objects():
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in refs):
                continue
            rt = self._any_type(key)
            namespace, name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
            if (namespace or "", name) not in self.objects[key]:
                continue  # already collected through another path of the cascade
            if orphan:
                kept = [ref for ref in refs if ref.get("uid") != owner_uid]
                body = copy.deepcopy(obj)
                body["metadata"]["ownerReferences"] = kept
                self._replace(rt, obj, body, None)
            else:
                self.delete(rt, namespace, name)

    def _empty_namespace(self, namespace: str) -> None:
        for key, obj in self._all_objects():
            if obj["metadata"].get("namespace") == namespace and (namespace, obj["metadata"]["name"]) in self.objects[key]:
                self.delete(self._any_type(key), namespace, obj["metadata"]["name"])

    # --- CRDs ----------------------------------------------------------------------------------

    def _admit_crd(self, crd: Obj) -> None:
        causes = check_crd(crd)
        if causes:
            raise errors.invalid("CustomResourceDefinition", "apiextensions.k8s.io",
                                 (crd.get("metadata") or {}).get("name", ""), causes)
        new_types = types_from_crd(crd)  # also compiles the schemas: a broken one fails here
        for rt in [rt for rt in self.types.values() if rt.from_crd and rt.storage_key == new_types[0].storage_key]:
            del self.types[(rt.group, rt.version, rt.plural)]
        for rt in new_types:
            self.register(rt)
        # There is no CRD controller, so the CRD is Established the moment it is stored.
        spec = crd["spec"]
        # Keep the transition times of a re-admitted CRD, or every no-op write would look like a change.
        since = {c["type"]: c.get("lastTransitionTime") for c in (crd.get("status") or {}).get("conditions") or []}
        crd["status"] = {
            "acceptedNames": dict(spec["names"]),
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage", True)],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": since.get(t) or now()}
                for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                ("Established", "InitialNamesAccepted", "the initial names have been accepted"))
            ],
        }

    def _forget_crd(self, crd: Obj) -> None:
        key = (crd["spec"]["group"], crd["spec"]["names"]["plural"])
        for _, obj in [(k, o) for k, o in self._all_objects() if k == key]:
            self._remove(key, obj)
        for rt in [rt for rt in self.types.values() if rt.from_crd and rt.storage_key == key]:
            del self.types[(rt.group, rt.version, rt.plural)]

"""What the watches' indices keep of a job and of a JobSet: the fields the reconcile reads, nothing else.

The indices (handlers.py) hold one entry per job and per JobSet for as long as they exist, and every
watch event of them is copied in: what is kept sets both the operator's memory per job and the time each
event holds the event loop. A JobSet as the API serves it carries its whole pod template and the
server's `managedFields` (tens of kilobytes as Python objects); the reconcile reads its metadata, its
`spec.suspend`, each replicated Job's name, replica count and config volume, and its status. A job keeps
everything but `managedFields` and `kubectl apply`'s copy of itself (`last-applied-configuration`), which
nothing reads and which can be as large as the spec again. A JobSet the operator creates or patches
is trimmed the same way before any cache keeps it (manager.py `made`).

Kept values are fresh copies: kopf's body views are never held.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
JOBSET_METADATA = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "labels",
    "annotations",
    "ownerReferences",
)
CONFIG_VOLUME = "config"  # rendering/manifests.py: the pods' config (children.config_map_of)


def _metadata(meta: Mapping[str, Any], keys: tuple[str, ...] | None = None) -> Obj:
    kept = {k: copy.deepcopy(v) for k, v in meta.items() if k != "managedFields" and (keys is None or k in keys)}
    annotations = kept.get("annotations")
    if isinstance(annotations, dict) and LAST_APPLIED in annotations:
        kept["annotations"] = {k: v for k, v in annotations.items() if k != LAST_APPLIED}
    return kept


def job(body: Mapping[str, Any]) -> Obj:
    """A TPUTrainingJob as the jobs index keeps it."""
    return {
        k: _metadata(v) if k == "metadata" and isinstance(v, Mapping) else copy.deepcopy(v) for k, v in body.items()
    }


def _replicated(replicated: Mapping[str, Any]) -> Obj:
    pod = ((replicated.get("template") or {}).get("spec") or {}).get("template") or {}
    volumes = [
        copy.deepcopy(v)
        for v in (pod.get("spec") or {}).get("volumes") or []
        if isinstance(v, Mapping) and v.get("name") == CONFIG_VOLUME
    ]
    return {
        "name": replicated.get("name"),
        "replicas": replicated.get("replicas"),
        "template": {"spec": {"template": {"spec": {"volumes": volumes}}}},
    }


def jobset(body: Mapping[str, Any]) -> Obj:
    """A JobSet as the jobsets index (and the manager's `made`) keeps it."""
    spec = body.get("spec") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": _metadata(body.get("metadata") or {}, JOBSET_METADATA),
        "spec": {
            "suspend": spec.get("suspend"),
            "replicatedJobs": [_replicated(r) for r in spec.get("replicatedJobs") or [] if isinstance(r, Mapping)],
        },
        "status": copy.deepcopy(body.get("status") or {}),
    }

"""Owned objects stay as the operator made them: a hand edit of the labels or annotations the operator renders on
a job's JobSet or ConfigMap, or a deletion of the ConfigMap, is put back, or reported where it cannot be.

What is compared: only the keys the operator renders (rendering/manifests.jobset_metadata for the JobSet,
names.labels for the ConfigMap), never what other controllers or users add, nor the pre-flight's admission gate
(added and lifted by the operator itself, preflight.py). The expected values are computed from the job, not by
rendering the JobSet (`compare`, pure), and a JobSet that drifted gets ONE merge patch of its metadata; nothing
is sent when nothing drifted (`follow`). A JobSet's owner is its controller ownerReference (children.owner_of),
so a JobSet whose job label was removed or changed is still the job's: the label is drift, restored for its
true owner, never adopted by the job the label names.

The applied-spec annotation is the spec the JobSet was made from, which differs from the current spec after a
refused edit (SpecChange=False). Its digest is recorded in `status.children.appliedSpecDigest` when the JobSet
is created, or, for a JobSet made by an earlier version, when first seen (trust on first use, only a JSON
object). An annotation that no longer has that digest is restored from the current spec only when the current
spec has it; otherwise it is reported, never invented. Likewise the labels and annotations that follow the spec
(Kueue's queue and priority labels, the ProvisioningRequest's annotation) are compared only while the current
spec is the one the JobSet was made from; the others (the job and managed-by labels, the exclusive placement)
always.

ConfigMaps are not read or cached for this: the manager's ConfigMap watch hands over what it saw
(`config_map_edit`, O(1) per event: labels not as made, or a deletion, of the ConfigMap the JobSet mounts), and
the reconcile puts its labels back (one patch) or makes it again from the current spec when the name it would
have is the one the JobSet mounts (`follow_config_map`); otherwise it is reported (`ConfigMapLost`).

What was found becomes condition ChildrenAsMade and one Warning Event per edit (`recorded`, pure, a status step:
steps.py), carried by the status write. Every string echoed is ours or bounded: field names are the operator's
own keys, object names are cut, the API's words too; no edited value is ever echoed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..api import names
from ..api.models import TPUTrainingJob
from ..api.status import ChildrenStatus, ConditionStatus, TPUTrainingJobStatus
from ..rendering.manifests import EXCLUSIVE_TOPOLOGY, jobset_metadata, render
from .children import config_map_of, ensure_child, owner_of
from .conditions import set_condition
from .kube import CONFIGMAPS, JOBSETS, ApiError, Kube, Obj
from .phases import Notice
from .restarts import replaced

CONDITION = "ChildrenAsMade"
DELETED = ("(deleted)",)  # a ConfigMap edit that is its deletion
# Kept whatever the spec says: they do not follow it (the others are compared only while the spec is the JobSet's).
FIXED = frozenset({names.LABEL_JOB, names.LABEL_MANAGED_BY, EXCLUSIVE_TOPOLOGY})
MAX_NAME = 80  # characters of an object's name, or of the API's words, echoed into the status
MAX_ITEMS = 8  # items named in one message; the rest are counted
ConfigMapEdit = tuple[str, tuple[str, ...]]  # (ConfigMap name, its fields not as made, or DELETED)


@dataclasses.dataclass(frozen=True)
class Found:
    """What one reconcile found: the applied spec's digest to record, what it put back and what it left."""

    digest: str | None = None  # of the spec the JobSet was made from (None: not known)
    reverted: tuple[str, ...] = ()  # "<Kind> <name> <field>", each put back as the operator made it
    edited: tuple[str, ...] = ()  # the JobSet's fields left as found, and why
    lost: tuple[str, ...] = ()  # a ConfigMap deleted that could not be made again, and why
    relabelled: bool = False  # the job label was put back: the JobSet is back in the watch's selector


def spec_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cut(text: str, limit: int = MAX_NAME) -> str:
    """An untrusted string, bounded, on one line."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def field(part: str, key: str) -> str:
    return f"metadata.{part}[{key}]"


def _json_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text or ""), dict)
    except ValueError:
        return False


def trusted_digest(recorded: str | None, annotations: Mapping[str, Any]) -> str | None:
    """The recorded digest, or, for a JobSet made by an earlier version, that of its annotation (a JSON object)."""
    if recorded is not None:
        return recorded
    text = annotations.get(names.APPLIED_SPEC)
    return spec_digest(text) if isinstance(text, str) and _json_object(text) else None


def compare(
    meta: Mapping[str, Any], labels: Mapping[str, str], annotations: Mapping[str, str], recorded: str | None
) -> tuple[dict[str, dict[str, str]], list[str], list[str], str | None]:
    """The JobSet's metadata against what the job renders (`labels`, `annotations`: manifests.jobset_metadata):
    (the merge patch of what to put back, {} if nothing; the fields in it; the fields left as found, with why;
    the digest of the spec the JobSet was made from). Pure."""
    have = {"labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}
    recorded = trusted_digest(recorded, have["annotations"])
    wanted = annotations[names.APPLIED_SPEC]
    same_spec = recorded == spec_digest(wanted)
    patch: dict[str, dict[str, str]] = {}
    restored: list[str] = []
    left: list[str] = []
    for part, expected in (("labels", labels), ("annotations", annotations)):
        for key, value in expected.items():
            if key == names.APPLIED_SPEC or not (same_spec or key in FIXED) or have[part].get(key) == value:
                continue
            patch.setdefault(part, {})[key] = value
            restored.append(field(part, key))
    actual = have["annotations"].get(names.APPLIED_SPEC)
    if recorded is None:
        left.append(f"{field('annotations', names.APPLIED_SPEC)} (not a spec, and no record of the JobSet's)")
    elif not isinstance(actual, str) or spec_digest(actual) != recorded:
        if same_spec:
            patch.setdefault("annotations", {})[names.APPLIED_SPEC] = wanted
            restored.append(field("annotations", names.APPLIED_SPEC))
        else:
            left.append(f"{field('annotations', names.APPLIED_SPEC)} (the spec changed since the JobSet was made)")
    return patch, restored, left, recorded


async def follow(
    kube: Kube,
    job: TPUTrainingJob,
    jobset: Obj,
    status: TPUTrainingJobStatus,
    created: bool,
    config_map: ConfigMapEdit | None = None,
    default_image: str | None = None,
) -> tuple[Obj, Found]:
    """`follow_jobset`, then `follow_config_map` of what the ConfigMap watch saw: the JobSet, and all found."""
    jobset, found = await follow_jobset(kube, job, jobset, status, created)
    more = await follow_config_map(kube, job, jobset, config_map, default_image)
    return jobset, dataclasses.replace(found, reverted=found.reverted + more.reverted, lost=more.lost)


async def follow_jobset(
    kube: Kube, job: TPUTrainingJob, jobset: Obj, status: TPUTrainingJobStatus, created: bool
) -> tuple[Obj, Found]:
    """Put the JobSet's rendered labels and annotations back where they drifted (one patch, none if nothing
    did): the JobSet as it is now, and what was found. A patch the API refuses (a webhook) is reported."""
    meta = jobset.get("metadata") or {}
    recorded = (status.children or ChildrenStatus()).applied_spec_digest
    if meta.get("deletionTimestamp") or replaced(status, meta.get("uid")):  # going: nothing to keep
        return jobset, Found(recorded)
    labels, annotations = await asyncio.to_thread(jobset_metadata, job)  # the spec's JSON: off the loop, as parsing
    if created:  # rendered from the current spec just now
        return jobset, Found(spec_digest(annotations[names.APPLIED_SPEC]))
    patch, restored, left, recorded = compare(meta, labels, annotations, recorded)
    where = f"JobSet {cut(meta.get('name', ''))}"
    edited = tuple(f"{where} {f}" for f in left)
    if not patch:
        return jobset, Found(recorded, edited=edited)
    try:
        patched = await kube.patch(JOBSETS, job.metadata.namespace, meta["name"], {"metadata": patch})
    except ApiError as exc:
        if exc.status == 404:  # gone: its DELETED event brings the job back
            return jobset, Found(recorded)
        if not exc.permanent:
            raise
        refused = tuple(f"{where} {f} (the API refused the restore: {cut(exc.message)})" for f in restored)
        return jobset, Found(recorded, edited=edited + refused)
    relabelled = names.LABEL_JOB in patch.get("labels", {})
    return patched, Found(recorded, tuple(f"{where} {f}" for f in restored), edited, relabelled=relabelled)


def config_map_edit(config_map: Mapping[str, Any], deleted: bool) -> tuple[tuple[str, str], ConfigMapEdit] | None:
    """What a ConfigMap watch event says (O(1)): (the job's key, (the ConfigMap's name, the fields of its labels
    not as made, or DELETED)); None when it is as made, or not a job's. A deletion's body still carries the
    labels (the watch's selector); one without them left the selector: its labels were edited."""
    owner = owner_of(config_map)
    if owner is None:
        return None
    namespace, job, _ = owner
    labels = (config_map.get("metadata") or {}).get("labels") or {}
    fields = tuple(field("labels", k) for k, v in names.labels(job).items() if labels.get(k) != v)
    if not fields and not deleted:
        return None
    return (namespace, job), (str(config_map["metadata"].get("name", "")), fields or DELETED)


async def follow_config_map(
    kube: Kube, job: TPUTrainingJob, jobset: Obj, edit: ConfigMapEdit | None, default_image: str | None
) -> Found:
    """Put back the labels of the ConfigMap the JobSet mounts (one patch), or make it again if it was deleted,
    from the current spec when that renders the same name (its contents' hash); otherwise report it lost."""
    name = config_map_of(jobset)
    if edit is None or edit[0] != name:  # an earlier config's, or none: no pod mounts it
        return Found()
    namespace, where = job.metadata.namespace, f"ConfigMap {cut(name)}"
    if edit[1] != DELETED:
        try:
            await kube.patch(CONFIGMAPS, namespace, name, {"metadata": {"labels": names.labels(job.metadata.name)}})
            return Found(reverted=tuple(f"{where} {f}" for f in edit[1]))
        except ApiError as exc:
            if exc.status != 404:
                raise
    made = (await asyncio.to_thread(render, job, default_image))[0]  # rare: a ConfigMap deleted by hand
    if made["metadata"]["name"] != name:
        return Found(lost=(f"{where} deleted; not made again: the spec changed since the JobSet was made",))
    await ensure_child(kube, CONFIGMAPS, made, job.metadata.uid or "")
    return Found(reverted=(f"{where} (deleted: made again)",))


def _listed(items: tuple[str, ...]) -> str:
    named = ", ".join(items[:MAX_ITEMS])
    return named + (f" and {len(items) - MAX_ITEMS} more" if len(items) > MAX_ITEMS else "")


def recorded(
    status: TPUTrainingJobStatus, found: Found | None, now: datetime.datetime, generation: int | None
) -> tuple[TPUTrainingJobStatus, list[Notice]]:
    """The status with what `found` says: the digest recorded; ChildrenAsMade and one Warning Event for each
    edit found now (a reverted one each time, one left as found once, while it stays). Pure."""
    if found is None:
        return status, []
    children = status.children or ChildrenStatus()
    before = status.condition(CONDITION)
    conds, notices, edits = status.conditions, [], children.edits
    parts = [f"put back as the operator made them: {_listed(found.reverted)}"] if found.reverted else []
    parts += [f"edited by hand, left as found: {_listed(found.edited)}"] if found.edited else []
    parts += [f"lost: {_listed(found.lost)}"] if found.lost else []
    if parts:
        message = "; ".join(parts)
        state: ConditionStatus
        if found.edited:
            state, reason = "False", "Edited"
        elif found.lost:
            state, reason = "False", "ConfigMapLost"
        else:
            state, reason = "True", "Reverted"
        conds = set_condition(conds, CONDITION, state, reason, message, now, generation)
        if found.reverted or before is None or (before.status, before.message) != (state, message):
            notices.append(Notice("Warning", "ChildEdited", message))
            edits = (edits or 0) + 1
    elif before is not None and before.reason == "Edited":  # the JobSet is as made again
        message = "the JobSet's labels and annotations are as the operator made them"
        conds = set_condition(conds, CONDITION, "True", "AsMade", message, now, generation)
    digest_ = found.digest or children.applied_spec_digest
    new = ChildrenStatus(applied_spec_digest=digest_, edits=edits)
    if new == children and conds == status.conditions:
        return status, notices
    return status.model_copy(update=dict(children=new, conditions=conds)), notices

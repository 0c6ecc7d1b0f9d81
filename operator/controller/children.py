"""A job's children (its ConfigMap, its JobSet, its pre-flight Job): made to exist, adopted, replaced.

Names are deterministic, so an operator killed at any point and restarted creates nothing twice: a
409 AlreadyExists adopts the object when this job owns it (its uid among the object's owner
references), and is a `NameConflict` otherwise (the user's to resolve). A ConfigMap is adopted only
with the contents its name stands for (`<job>-config-<hash of config.json>`, rendering/manifests.py);
one with other contents is replaced, never trusted. ConfigMaps of earlier configs (edits before the
JobSet existed) are owned by the job and go with it. A child's owner is its controller ownerReference, not its
labels (`owner_of`). I/O only; what to do is
decided by the reconcile (reconcile.py) and the pre-flight (preflight.py), which both import this
module and nothing imports back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from ..api import names
from ..api.models import KIND, TPUTrainingJob
from ..rendering.manifests import applied_spec, render
from . import admitted
from .admitted import AdmittedShapes
from .kube import CONFIGMAPS, JOBSETS, PODS, ApiError, Kube, Obj, Resource


class NameConflict(Exception):
    pass


class Inadmissible(Exception):
    """The API server, or an admission webhook, refuses what the job renders: the job's to change. The
    message is the API's."""


def owner_uids(obj: Obj) -> list[str]:
    return [ref.get("uid") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []]


def owner_of(child: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, job name, job uid) of the TPUTrainingJob that controls this JobSet (or ConfigMap): its
    controller ownerReference, which the operator set when it made it. Not its job label: a label anyone may
    edit is drift (drift.py), and a JobSet relabelled stays its true owner's, never the labelled job's."""
    meta = child.get("metadata") or {}
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND and r.get("controller")), None)
    if ref is None or not ref.get("name") or not ref.get("uid"):
        return None
    return meta.get("namespace", "default"), str(ref["name"]), str(ref["uid"])


async def ensure_child(kube: Kube, resource: Resource, manifest: Obj, owner_uid: str) -> tuple[Obj, bool]:
    """Create `manifest`, or adopt the object of that name if this job owns it: (object, created)."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        return await kube.create(resource, namespace, manifest), True
    except ApiError as exc:
        if exc.status != 409:
            raise
    existing = await kube.get(resource, namespace, name)
    if owner_uid in owner_uids(existing):
        if resource == CONFIGMAPS and existing.get("data") != manifest.get("data"):
            return await _replace(kube, resource, existing, manifest), True
        return existing, False
    owners = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in existing["metadata"].get("ownerReferences") or [])
    raise NameConflict(
        f"{manifest['kind']} {name} already exists and is "
        f"{'owned by ' + owners if owners else 'not owned by any object'}, not by this job; "
        "delete or rename it"
    )


async def _replace(kube: Kube, resource: Resource, existing: Obj, manifest: Obj) -> Obj:
    """A ConfigMap of ours whose contents are not what its name (their hash) says: it was not made by this
    rendering, so it is not trusted. Immutable, it cannot be updated: it is deleted (that uid only) and
    made again. A pod that mounted it has not started training on it: the JobSet is made after this."""
    await delete_this(kube, resource, existing, gone=(404,))  # gone already: make it
    return await kube.create(resource, manifest["metadata"]["namespace"], manifest)


async def delete_this(kube: Kube, resource: Resource, obj: Obj, gone: tuple[int, ...]) -> None:
    """Delete this object and no other (a uid precondition); the statuses in `gone` mean there is nothing to."""
    meta = obj["metadata"]
    try:
        await kube.delete(
            resource,
            meta.get("namespace", "default"),
            meta["name"],
            {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": meta.get("uid")}},
        )
    except ApiError as exc:
        if exc.status not in gone:
            raise


def config_map_of(jobset: Obj) -> str | None:
    """The ConfigMap the JobSet's pods mount as their config (its name carries the config's hash)."""
    for replicated in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        pod = (((replicated.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        for volume in pod.get("volumes") or []:
            if volume.get("name") == "config" and volume.get("configMap"):
                name: str | None = volume["configMap"].get("name")
                return name
    return None


async def ensure_all(kube: Kube, owner_uid: str, *children: tuple[Resource, Obj]) -> list[tuple[Obj, bool]]:
    """`ensure_child` of each, side by side (a pod waits for its ConfigMap volume); the first error raised."""
    results = await asyncio.gather(*(ensure_child(kube, r, m, owner_uid) for r, m in children), return_exceptions=True)
    ensured: list[tuple[Obj, bool]] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        ensured.append(result)
    return ensured


async def ensure_children(
    kube: Kube,
    job: TPUTrainingJob,
    default_image: str | None,
    config_map_exists: bool = False,
    gate: Any = None,
    running: int | None = None,
    control_digest: str | None = None,
    shapes: AdmittedShapes | None = None,
) -> tuple[Obj, bool]:
    """The ConfigMap (unless known to exist: the pre-flight made it) and the JobSet, its pods given
    `control_digest` (through `gate`, e.g. the pre-flight's admission gate, when given), side by side: (the
    JobSet, whether it was created now). Side by side saves the JobSet an API round trip; the pods wait for
    their ConfigMap volume as for any volume, and the Job controller makes them long after both requests
    are answered. An operator killed between the two finds the JobSet but no record of it in the job's
    status (`jobSetName`, written once both are made) and makes both again (reconcile.converge: a 409 adopts
    what exists), so a ConfigMap never sent is made then.

    Nothing is left half-made by a refusal: the pods, which the API server sees only long after, are
    admitted first in a dry run (once per shape among `shapes`, admitted.py); a refusal of the ConfigMap or
    the JobSet themselves (or a name taken by another object) comes from their own create, and the other
    one, if this call created it, is deleted."""
    if running is not None and running not in job.spec.tpu.slice_counts:  # the spec changed under it: all slices
        running = None
    # off the loop, as parsing
    made_config_map, jobset = await asyncio.to_thread(render, job, default_image, running, control_digest)
    if gate is not None:
        jobset = gate(jobset)
    shape = admitted.shape(job, default_image, running)
    if shapes is None or shape not in shapes:
        await dry_run(kube, job.metadata.namespace, *((PODS, p) for p in pods_of(jobset)))
        if shapes is not None:
            shapes.add(shape)
    wanted = [*([] if config_map_exists else [(CONFIGMAPS, made_config_map)]), (JOBSETS, jobset)]
    uid = job.metadata.uid or ""
    results = await asyncio.gather(*(ensure_child(kube, r, m, uid) for r, m in wanted), return_exceptions=True)
    failed = [(m, _refused(m, e)) for (_, m), e in zip(wanted, results) if isinstance(e, BaseException)]
    if failed:
        final = next((e for _, e in failed if isinstance(e, (Inadmissible, NameConflict))), None)
        if final is not None:  # the job's to change: what was made beside it goes
            await _undo(kube, [(r, e[0]) for (r, _), e in zip(wanted, results) if isinstance(e, tuple) and e[1]])
            raise final
        raise failed[0][1]  # transient: the next reconcile makes what is missing (a 409 adopts the rest)
    made = results[-1]
    assert isinstance(made, tuple)  # no failure: each result is (object, created)
    return made


def _refused(manifest: Obj, exc: BaseException) -> BaseException:
    """A create's error as the job shows it: Inadmissible, in the API's words, when the object is refused."""
    if isinstance(exc, ApiError) and inadmissible(exc):
        return Inadmissible(f"the API server refuses {manifest['kind']} {manifest['metadata']['name']}: {exc.message}")
    return exc


async def _undo(kube: Kube, made: list[tuple[Resource, Obj]]) -> None:
    """Delete the children just created (only those uids) when a sibling was refused: nothing half-made."""
    for resource, obj in made:
        await delete_this(kube, resource, obj, gone=(404, 409))  # gone, or no longer that object: not ours


def pods_of(jobset: Obj) -> list[Obj]:
    """One Pod per distinct pod template of the JobSet (pod 0 of each replicated Job), as the Job controller
    would make it: what the API server validates only once pods are created, long after the JobSet was
    accepted (tolerations, resource names, env, mounts), and what pod webhooks (GKE's TPU one) see."""
    seen: list[Obj] = []
    pods = []
    for replicated in jobset["spec"].get("replicatedJobs") or []:
        template = replicated["template"]["spec"]["template"]
        if template in seen:
            continue
        seen.append(template)
        meta = template.get("metadata") or {}
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    **meta,
                    "generateName": f"{jobset['metadata']['name']}-{replicated['name']}-",  # a dry run: never taken
                    "namespace": jobset["metadata"]["namespace"],
                },
                "spec": template["spec"],
            }
        )
    return pods


DENIALS = ("admission webhook", "violates PodSecurity")  # a webhook's or Pod Security admission's 403


def inadmissible(exc: ApiError) -> bool:
    """A refusal of the object itself: invalid (400, 422), or denied by an admission webhook or the
    namespace's Pod Security level (403 with their words). Anything else (RBAC, quota, a missing service
    account, a namespace being deleted, the network) says nothing about the job and is left to the real
    request."""
    return exc.status in (400, 422) or (exc.status == 403 and any(d in exc.message for d in DENIALS))


async def dry_run(kube: Kube, namespace: str, *children: tuple[Resource, Obj], strict: bool = False) -> None:
    """Ask the API server to admit each child without storing it (`dryRun=All`: validation, defaulting and
    webhooks run); Inadmissible with the API's words if it refuses one, before anything is created. Any
    other ApiError (the network, RBAC, no JobSet CRD) is left to the real request, or raised when `strict`
    (`tpujob validate --server`: then nothing was checked)."""
    results = await asyncio.gather(
        *(kube.create(r, namespace, m, dry_run=True) for r, m in children), return_exceptions=True
    )
    for (_, manifest), result in zip(children, results):
        if isinstance(result, ApiError) and inadmissible(result):
            meta = manifest["metadata"]
            what = meta.get("name") or f"{meta['generateName']}* (its pods)"
            raise Inadmissible(f"the API server refuses {manifest['kind']} {what}: {result.message}")
    for result in results:
        if isinstance(result, BaseException) and (strict or not isinstance(result, ApiError)):
            raise result


def changed_fields(before: Any, after: Any, path: str = "spec") -> list[str]:
    """Dotted paths where two specs differ (lists compare whole)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            p
            for key in sorted(set(before) | set(after))
            for p in changed_fields(before.get(key), after.get(key), f"{path}.{key}")
        ]
    return [] if before == after else [path]


def refused_changes(jobset: Obj, job: TPUTrainingJob) -> list[str]:
    """The spec fields changed since the JobSet was made (its applied-spec annotation). One edited into what is
    not a spec (reported by drift.py, which puts it back unless the spec changed) names the whole spec."""
    applied = ((jobset.get("metadata") or {}).get("annotations") or {}).get(names.APPLIED_SPEC)
    if not applied:
        return []
    try:
        made = json.loads(applied)
    except ValueError:
        made = None
    return changed_fields(made, applied_spec(job)) if isinstance(made, dict) else ["spec"]


async def delete_unstarted(kube: Kube, jobset: Obj) -> None:
    """Delete a JobSet that never ran (held by the pre-flight's gate): only this uid."""
    meta = jobset["metadata"]
    await kube.delete(
        JOBSETS,
        meta.get("namespace", "default"),
        meta["name"],
        {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": meta["uid"]}},
    )


async def replace_jobset(kube: Kube, namespace: str, jobset: Obj, cause: str, lost: str | None = None) -> None:
    """Delete a JobSet a restart replaces (foreground: its pods go first; only this uid). Its DELETED
    event brings the job back, and the reconcile creates the JobSet again once the backoff is over.
    Unless the restart is for a preemption or an unhealthy node (its pods are saving the step in flight), the pods go at
    once (gracePeriodSeconds 0): a JAX process cannot save without all of its peers, so a failed or
    hung attempt's survivors would only sit out their grace period in a collective. The pod on an unhealthy node
    (`lost`: the labels that select it) goes at once too: a silent host's kubelet never confirms its deletion, and
    the foreground deletion would wait for it until the node itself is deleted."""
    meta = jobset["metadata"]
    if meta.get("deletionTimestamp"):
        return
    try:
        if cause not in ("preemption", "hardware"):  # hardware: stopped to save the step in flight (health.py)
            await kube.delete_all(
                PODS,
                namespace,
                f"{names.LABEL_JOBSET}={meta['name']}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )
        elif lost is not None:  # the pod on the unhealthy node: no kubelet may be left to end it, which would hold
            await kube.delete_all(  # the foreground deletion (and the restart) until GKE replaced the node
                PODS,
                namespace,
                f"{names.LABEL_JOBSET}={meta['name']},{lost}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )
        await kube.delete(
            JOBSETS,
            namespace,
            meta["name"],
            {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "propagationPolicy": "Foreground",
                "preconditions": {"uid": meta["uid"]},
            },
        )
    except ApiError as exc:
        if exc.status not in (404, 409):  # gone already, or another JobSet of that name: not ours to delete
            raise

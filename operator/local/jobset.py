"""JobSet, the Job controller and the scheduler, as far as the operator sees them, over the in-memory API
(memory_api.py): the stand-in that turns the JobSets the operator creates into pods, and the pods' states
into the JobSet's status, for the local run.

For each JobSet (not suspended, not being deleted, not finished):
- each replicated Job's `replicas` Jobs of `completions` indexed pods are created once per restart attempt,
  named `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<5 random>` with hostname
  `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>` and the JobSet's subdomain, the labels and annotations
  JobSet and the Job controller put on them (api/names.py LABEL_*), owned by the JobSet (there are no Job
  objects: nothing of the operator's reads them) and bound to this machine's node (the scheduler's part);
- a Job fails when one of its pods fails or disappears (the rendered Jobs have backoffLimit 0); its pods
  still running are then deleted with their grace period, as the Job controller does; it succeeds when every
  completion index has succeeded;
- status.replicatedJobsStatus counts the Jobs: active (a pod pending or running), ready (every pod ready),
  succeeded, failed; when every Job has succeeded, condition Completed (AllJobsCompleted) and terminalState
  Completed; when one has failed: a restart if `failurePolicy.maxRestarts` allows (every pod deleted,
  `restarts` + 1, new pods), else condition Failed (ReachedMaxRestarts, or FailedJobs without a failure
  policy) and terminalState Failed; a suspended JobSet has its pods deleted and condition Suspended.
What the operator itself deletes (pods, a JobSet it restarts or shrinks) is followed, never undone: a pod
the operator deleted is a failed Job, a JobSet deleted is left to the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from ..api import names, timestamps
from ..controller.kube import JOBSETS, PODS, ApiError, Obj
from .memory_api import MemoryApi

log = logging.getLogger("tpu_operator.local.jobset")
PREFIX = "jobset.sigs.k8s.io/"
LABEL_REPLICATED_JOB = PREFIX + "replicatedjob-name"
LABEL_JOBSET_UID = PREFIX + "jobset-uid"
LABEL_RESTART_ATTEMPT = PREFIX + "restart-attempt"
LABEL_JOB_NAME = "batch.kubernetes.io/job-name"
# JobSet's condition reasons and messages (its pkg/constants).
COMPLETED = ("Completed", "AllJobsCompleted", "jobset completed successfully")
FAILED_JOBS = ("Failed", "FailedJobs", "jobset failed due to one or more job failures")
MAX_RESTARTS = ("Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
SUSPENDED = ("Suspended", "SuspendedJobs", "jobset is suspended")
Key = tuple[str, str]


def pod_manifests(jobset: Obj, attempt: int, node: str) -> list[Obj]:
    """The pods of restart attempt `attempt` of `jobset`, as JobSet and the Job controller make them, bound to
    `node`."""
    meta, spec = jobset["metadata"], jobset["spec"]
    name, uid = meta["name"], meta["uid"]
    subdomain = (spec.get("network") or {}).get("subdomain") or name
    dns = (spec.get("network") or {}).get("enableDNSHostnames", True)
    pods, global_index = [], 0
    for replicated in spec["replicatedJobs"]:
        job_spec = replicated["template"]["spec"]
        template = job_spec["template"]
        for job_index in range(replicated.get("replicas", 1)):
            job_name = f"{name}-{replicated['name']}-{job_index}"
            for pod_index in range(job_spec.get("completions", 1)):
                marks = {
                    names.LABEL_JOBSET: name,
                    LABEL_JOBSET_UID: uid,
                    LABEL_REPLICATED_JOB: replicated["name"],
                    names.LABEL_JOB_INDEX: str(job_index),
                    PREFIX + "job-global-index": str(global_index),
                    LABEL_RESTART_ATTEMPT: str(attempt),
                    LABEL_JOB_NAME: job_name,
                    names.LABEL_COMPLETION_INDEX: str(pod_index),
                }
                pod_spec = {**template["spec"], "nodeName": node}
                if dns:
                    pod_spec.update(hostname=f"{job_name}-{pod_index}", subdomain=subdomain)
                pods.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": f"{job_name}-{pod_index}-{secrets.token_hex(3)[:5]}",
                            "labels": {**((template.get("metadata") or {}).get("labels") or {}), **marks},
                            "annotations": {**((template.get("metadata") or {}).get("annotations") or {}), **marks},
                            "ownerReferences": [
                                {"apiVersion": jobset["apiVersion"], "kind": "JobSet", "name": name, "uid": uid}
                            ],
                        },
                        "spec": pod_spec,
                        "status": {"phase": "Pending"},
                    }
                )
            global_index += 1
    return pods


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _phase(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _condition(kind: tuple[str, str, str], now: str, first_failed: str | None = None) -> Obj:
    type_, reason, message = kind
    if first_failed is not None:  # as JobSet words it (messageWithFirstFailedJob)
        message = f"{message} (first failed job: {first_failed})"
    return {"type": type_, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}


def _failed_at(pods: list[Obj]) -> str:
    """When a Job's first pod ended (RFC 3339, which sorts as time does); a pod deleted: after any of those."""
    ended = [
        ((c.get("state") or {}).get("terminated") or {}).get("finishedAt") or "~"
        for p in pods
        if _phase(p) == "Failed"
        for c in (p.get("status") or {}).get("containerStatuses") or [{}]
    ]
    return min(ended, default="~")


class JobSetStandIn:
    """Follows the JobSets and pods of a MemoryApi (the module's docstring says how); pods go to `node`."""

    def __init__(self, api: MemoryApi, node: str, now: timestamps.Clock = timestamps.utc_now):
        self.api, self.node, self.now = api, node, now
        self.queue: asyncio.Queue[Key] = asyncio.Queue()
        self.made: set[tuple[str, int]] = set()  # (JobSet uid, restart attempt) whose pods were created
        self.stops = [api.watch(JOBSETS, self._seen), api.watch(PODS, self._pod_seen)]

    def _seen(self, kind: str, jobset: Obj) -> None:
        self.queue.put_nowait((jobset["metadata"]["namespace"], jobset["metadata"]["name"]))

    def _pod_seen(self, kind: str, pod: Obj) -> None:
        name = (pod["metadata"].get("labels") or {}).get(names.LABEL_JOBSET)
        if name:
            self.queue.put_nowait((pod["metadata"]["namespace"], name))

    async def run(self) -> None:
        """Sync every JobSet that changed or whose pods did, one at a time, until cancelled."""
        try:
            while True:
                key = await self.queue.get()
                try:
                    await self.sync(*key)
                except ApiError as exc:  # the world moved between a read and a write: the next event syncs again
                    log.debug("sync of JobSet %s/%s: %s", *key, exc)
        finally:
            for stop in self.stops:
                stop()

    async def sync(self, namespace: str, name: str) -> None:
        try:
            jobset = await self.api.get(JOBSETS, namespace, name)
        except ApiError as exc:
            if exc.status == 404:
                return
            raise
        meta, spec, status = jobset["metadata"], jobset["spec"], jobset.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("terminalState"):
            return
        attempt = int(status.get("restarts") or 0)
        pods = [
            p
            for p in await self.api.list(PODS, namespace, f"{names.LABEL_JOBSET}={name}")
            if (p["metadata"].get("labels") or {}).get(LABEL_JOBSET_UID) == meta["uid"]
        ]
        now = timestamps.format(self.now())
        if spec.get("suspend"):
            for pod in pods:
                await self._delete(pod)
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Suspended"]
            await self._write(jobset, {"conditions": [*conditions, _condition(SUSPENDED, now)]})
            return
        current = [p for p in pods if p["metadata"]["labels"].get(LABEL_RESTART_ATTEMPT) == str(attempt)]
        if (meta["uid"], attempt) not in self.made:
            self.made.add((meta["uid"], attempt))
            for pod in pod_manifests(jobset, attempt, self.node):
                current.append(await self.api.create(PODS, namespace, pod))
        jobs, failed = await self._jobs(jobset, current)
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Suspended"]
        update: Obj = {
            "replicatedJobsStatus": jobs,
            "restarts": attempt,
            "restartsCountTowardsMax": attempt,
            "conditions": conditions,
        }
        if failed:
            policy = spec.get("failurePolicy")
            if policy is not None and attempt < int(policy.get("maxRestarts") or 0):
                for pod in current:
                    await self._delete(pod)
                update["restarts"] = update["restartsCountTowardsMax"] = attempt + 1
                await self._write(jobset, update)
                self.queue.put_nowait((namespace, name))  # the next attempt's pods
                return
            first = min(failed)[1]  # the Job that failed first
            kind = MAX_RESTARTS if policy is not None else FAILED_JOBS
            update["conditions"] = [*conditions, _condition(kind, now, first)]
            update["terminalState"] = "Failed"
        elif jobs and all(j["succeeded"] == j["_jobs"] for j in jobs):
            update["conditions"] = [*conditions, _condition(COMPLETED, now)]
            update["terminalState"] = "Completed"
        await self._write(jobset, update)

    async def _jobs(self, jobset: Obj, pods: list[Obj]) -> tuple[list[Obj], list[tuple[str, str]]]:
        """replicatedJobsStatus of the JobSet's attempt, and (when, name) of each Job that failed; a failed
        Job's pods still running are deleted (the Job controller's part)."""
        by_job: dict[str, list[Obj]] = {}
        for pod in pods:
            by_job.setdefault(pod["metadata"]["labels"][LABEL_JOB_NAME], []).append(pod)
        rows: list[Obj] = []
        failed: list[tuple[str, str]] = []
        for replicated in jobset["spec"]["replicatedJobs"]:
            completions = replicated["template"]["spec"].get("completions", 1)
            row = {"name": replicated["name"], "ready": 0, "succeeded": 0, "failed": 0, "active": 0, "suspended": 0}
            for job_index in range(replicated.get("replicas", 1)):
                job_name = f"{jobset['metadata']['name']}-{replicated['name']}-{job_index}"
                mine = by_job.get(job_name, [])
                phases = [_phase(p) for p in mine]
                if "Failed" in phases or len(mine) < completions:  # a pod failed, or was deleted: backoffLimit 0
                    row["failed"] += 1
                    failed.append((_failed_at(mine), job_name))
                    for pod in mine:
                        if _phase(pod) not in ("Succeeded", "Failed"):
                            await self._delete(pod)
                elif phases.count("Succeeded") == completions:
                    row["succeeded"] += 1
                else:
                    row["active"] += 1
                    if all(_ready(p) or _phase(p) == "Succeeded" for p in mine):
                        row["ready"] += 1
            rows.append({**row, "_jobs": replicated.get("replicas", 1)})
        return rows, failed

    async def _delete(self, pod: Obj) -> None:
        if pod["metadata"].get("deletionTimestamp"):
            return
        try:
            await self.api.delete(
                PODS,
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                {"preconditions": {"uid": pod["metadata"]["uid"]}},
            )
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    async def _write(self, jobset: Obj, status: Obj) -> None:
        """Write the JobSet's status where it changed; a condition keeps its time while its status does."""
        old = jobset.get("status") or {}
        rows = [{k: v for k, v in r.items() if k != "_jobs"} for r in status.get("replicatedJobsStatus") or []]
        kept = {c["type"]: c for c in old.get("conditions") or []}
        conditions = [
            kept[c["type"]] if kept.get(c["type"], {}).get("status") == c["status"] else c
            for c in status.get("conditions") or []
        ]
        status = {**status, "replicatedJobsStatus": rows, "conditions": conditions}
        if all(old.get(k) == v for k, v in status.items()):
            return
        meta = jobset["metadata"]
        await self.api.patch(JOBSETS, meta["namespace"], meta["name"], {"status": status}, sub="status")

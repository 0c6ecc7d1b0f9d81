"""What the operator's unit tests share (a helper module, not a test module): the in-memory API server
(`FakeKube`: the local run's, local/memory_api.py, recording its calls), the fake clock's times, builders of JobSets and pods as JobSet and the kubelet leave them, and
ways to run one reconcile or the manager's queue over the fake API. No processes."""

from __future__ import annotations

import asyncio
import copy
import datetime
from typing import Any

from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.api.timestamps import format as rfc3339
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import phases, preflight, reconcile
from tpu_operator.controller.admitted import AdmittedShapes
from tpu_operator.controller.kube import BATCH_JOBS, JOBS, JOBSETS, PODS, ApiError, Resource
from tpu_operator.controller.manager import Manager
from tpu_operator.controller.metrics_reader import MetricsReader
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.stats import Stats
from tpu_operator.local.memory_api import MemoryApi

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)  # the fake clock's times
LATER = NOW + datetime.timedelta(minutes=5)


# --- builders ---------------------------------------------------------------------------------------------


def jobset(
    active: int = 0,
    ready: int = 0,
    conditions: tuple[str, ...] = (),
    terminal: str | None = None,
    suspend: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "replicatedJobsStatus": [{"name": "slice", "active": active, "ready": ready}],
        "conditions": [{"type": t, "status": "True", "message": f"{t} msg"} for t in conditions],
    }
    if terminal:
        status["terminalState"] = terminal
    return {"metadata": {"name": "js"}, "spec": {"suspend": suspend}, "status": status}


# --- an in-memory API -------------------------------------------------------------------------------------


class FakeKube(MemoryApi):
    """The product's in-memory API server (local/memory_api.py) on the fake clock, which also records every
    call (`calls`), refuses status writes with 409 as if someone else had written (`conflicts`), refuses
    creates of chosen resources (`refuse`), and answers the pod proxy as a trainer would."""

    def __init__(self) -> None:
        super().__init__(now=lambda: NOW)
        self.calls: list[tuple[str, str]] = []
        self.conflicts = 0  # status writes to refuse with 409, as if someone else had written
        self.refuse: dict[Resource, ApiError] = {}  # creates of these refused, as the API server would

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append(("GET", resource.path(namespace, name)))
        return await super().get(resource, namespace, name)

    async def create(
        self, resource: Resource, namespace: str, body: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        self.calls.append(("DRYRUN" if dry_run else "POST", resource.path(namespace)))
        if resource in self.refuse:  # the API server's validation or a webhook says no, dry run or not
            raise self.refuse[resource]
        return await super().create(resource, namespace, body, dry_run)

    async def patch(
        self, resource: Resource, namespace: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        self.calls.append(("PATCH", resource.path(namespace, name, sub)))
        if sub == "status" and self.conflicts:
            self.conflicts -= 1
            raise ApiError(409, "conflict")
        return await super().patch(resource, namespace, name, body, sub)

    async def list(self, resource: Resource, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(("LIST", resource.path(namespace)))
        return await super().list(resource, namespace, selector)

    async def proxy_get(self, namespace: str, pod: str, port: int, path: str) -> Any:
        self.calls.append(("PROXY", f"{pod}:{port}/{path}"))
        return {"step": 9, "mfu": 0.25}

    async def delete(self, resource: Resource, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("DELETE", resource.path(namespace, name)))
        return await super().delete(resource, namespace, name, body)

    async def delete_all(
        self, resource: Resource, namespace: str, selector: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls.append(("DELETECOLLECTION", resource.path(namespace)))
        return await super().delete_all(resource, namespace, selector, body)

    def add_job(self, doc: dict[str, Any], uid: str = "job-uid") -> dict[str, Any]:
        obj = copy.deepcopy(doc)
        obj["metadata"].update(namespace="default", uid=uid, generation=1)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[JOBS.path("default", obj["metadata"]["name"])] = obj
        self.resources[JOBS.path("default", obj["metadata"]["name"])] = JOBS
        return copy.deepcopy(obj)

    def job(self, name: str = "tiny") -> dict[str, Any]:
        return copy.deepcopy(self.objects[JOBS.path("default", name)])

    def jobset(self, name: str = "tiny") -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get(JOBSETS.path("default", name)))


def run_reconcile(
    kube: FakeKube,
    obj: dict[str, Any],
    jobset_seen: dict[str, Any] | None = None,
    config: OperatorConfig | None = None,
    shapes: AdmittedShapes | None = None,
) -> tuple[reconcile.ReconcileResult, list[phases.Notice]]:
    config = config or OperatorConfig()
    notices: list[phases.Notice] = []
    means = reconcile.Means(
        kube, config, lambda o, n: notices.append(n), clock=lambda: NOW, shapes=shapes or AdmittedShapes()
    )
    outcome = asyncio.run(reconcile.reconcile(means, obj, reconcile.Seen(jobset_seen)))
    return outcome, notices


def job_status(kube: FakeKube, name: str = "tiny") -> TPUTrainingJobStatus:
    return TPUTrainingJobStatus.model_validate(kube.objects[JOBS.path("default", name)].get("status") or {})


def writes(kube: FakeKube) -> list[tuple[str, str]]:
    return [c for c in kube.calls if c[0] in ("POST", "PATCH")]


# The pre-flight's timing in the unit tests: started within 120 s, 300 s to compile, 60 s of grace.
PREFLIGHT_TIMING = preflight.Timing(start_s=120, deadline_s=300, grace_s=60)


def run_with_preflights(kube: FakeKube, now: str) -> tuple[reconcile.ReconcileResult, list[Any]]:
    """One reconcile at `now` (RFC 3339) with the pre-flight Jobs the fake API holds as the index's, and
    PREFLIGHT_TIMING."""
    notices: list[Any] = []
    found = [o for path, o in kube.objects.items() if path.startswith(BATCH_JOBS.path("default") + "/")]
    means = reconcile.Means(
        kube, OperatorConfig(preflight=PREFLIGHT_TIMING), lambda o, n: notices.append(n), clock=lambda: parse(now)
    )
    outcome = asyncio.run(
        reconcile.reconcile(means, kube.job(), reconcile.Seen(kube.jobset(), preflights=copy.deepcopy(found)))
    )
    return outcome, notices


# --- the manager over it ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager_for(kube: FakeKube, **config: Any) -> tuple[Manager, Clock, list[phases.Notice]]:
    notices: list[phases.Notice] = []
    clock = Clock()
    cfg = OperatorConfig(metrics_access="proxy", **config)
    manager = Manager(
        kube, MetricsReader(kube, "proxy"), cfg, lambda o, n: notices.append(n), Stats(), now=lambda: LATER, clock=clock
    )
    return manager, clock, notices


async def drain(manager: Manager, index: dict[Any, list[dict[str, Any]]], jobset_index: dict[Any, Any]) -> list[str]:
    """Run the queued reconciles (and the ones they queue) to the end; their results."""
    manager.jobs, manager.jobsets = index, jobset_index
    results = []
    while len(manager.queue):
        key, reasons = await manager.queue.get()
        results.append(await manager._reconcile(key, reasons))
        manager.queue.done(key)
    return results


# --- what JobSet and the kubelet leave behind ------------------------------------------------------------


def add_pod0(kube: FakeKube, jobset_name: str = "job", ip: str = "10.1.2.3") -> None:
    labels = {
        "jobset.sigs.k8s.io/jobset-name": jobset_name,
        "jobset.sigs.k8s.io/job-index": "0",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    kube.objects[PODS.path("ml", f"{jobset_name}-slice-0-0-x")] = {
        "metadata": {"name": f"{jobset_name}-slice-0-0-x", "creationTimestamp": rfc3339(NOW), "labels": labels},
        "status": {"phase": "Running", "podIP": ip},
    }


T0 = "2026-01-01T00:00:00Z"  # a job's creation in the restart tests; at(s) is s seconds later


def at(seconds: int) -> str:
    return f"2026-01-01T00:{seconds // 60:02d}:{seconds % 60:02d}Z"


def fail_slices(kube: FakeKube, *slices_and_codes: tuple[int, int], jobset: str = "tiny", start: int = 10) -> None:
    """Stand in for JobSet and the kubelet: host 0 of each slice terminated with its code, in this order,
    `start` seconds after T0 onwards (the first one is the root cause)."""
    js = failed_jobset(kube, jobset)
    for i, (slice_id, code) in enumerate(slices_and_codes):
        failed_pod(
            kube,
            js,
            f"tiny-slice-{slice_id}-0",
            code,
            "",
            at(start + i),
            {"jobset.sigs.k8s.io/job-index": str(slice_id)},
        )


def failed_jobset(kube: FakeKube, jobset: str, message: str | None = None) -> dict:
    """Stand in for JobSet: the stored JobSet `jobset` failed (terminalState Failed)."""
    js = kube.objects[JOBSETS.path("default", jobset)]
    condition = {"type": "Failed", "status": "True", **({"message": message} if message else {})}
    js["status"] = {"terminalState": "Failed", "conditions": [condition]}
    return js


def failed_pod(
    kube: FakeKube, js: dict, pod: str, code: int, message: str, finished: str, labels: dict | None = None
) -> None:
    """Stand in for the kubelet: a failed pod of JobSet `js` (its name carries the JobSet's uid)."""
    name = f"{pod}-{js['metadata']['uid']}"
    kube.objects[PODS.path("default", name)] = {
        "metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/jobset-name": "tiny", **(labels or {})}},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {"terminated": {"exitCode": code, "message": message, "finishedAt": finished}},
                }
            ],
        },
    }


def running(kube: FakeKube) -> None:
    """Stand in for JobSet: the stored JobSet `tiny` has its one slice active and ready."""
    kube.objects[JOBSETS.path("default", "tiny")]["status"] = {
        "replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 1}]
    }

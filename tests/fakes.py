"""What the operator's unit tests share (a helper module, not a test module): an in-memory API server
(`FakeKube`), the fake clock's times, builders of JobSets and pods as JobSet and the kubelet leave them, and
ways to run one reconcile or the manager's queue over the fake API. No processes."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
from typing import Any

from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.api.timestamps import format as rfc3339
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import phases, preflight, reconcile
from tpu_operator.controller.kube import BATCH_JOBS, JOBS, JOBSETS, PODS, ApiError, Resource
from tpu_operator.controller.manager import Manager
from tpu_operator.controller.metrics_reader import MetricsReader
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.stats import Stats

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


class FakeKube:
    """Just enough API server: create (409 on a taken name), get (404), merge patch with the
    resourceVersion precondition, /status writes that change only .status, label-selected lists."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.calls: list[tuple[str, str]] = []
        self.conflicts = 0  # status writes to refuse with 409, as if someone else had written
        self.refuse: dict[Resource, ApiError] = {}  # creates of these refused, as the API server would

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    async def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        path = resource.path(namespace, name)
        self.calls.append(("GET", path))
        if path not in self.objects:
            raise ApiError(404, "not found")
        return copy.deepcopy(self.objects[path])

    async def create(
        self, resource: Resource, namespace: str, body: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        self.calls.append(("DRYRUN" if dry_run else "POST", resource.path(namespace)))
        if resource in self.refuse:  # the API server's validation or a webhook says no, dry run or not
            raise self.refuse[resource]
        key = resource.path(namespace, body["metadata"].get("name") or f"gen-{self.rv}")
        if key in self.objects:
            raise ApiError(409, "already exists")
        if dry_run:
            return copy.deepcopy(body)
        obj = copy.deepcopy(body)
        if "stringData" in obj:  # as the API server stores a Secret
            obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
        obj["metadata"].setdefault("uid", f"uid-{self.rv + 1}")  # never reused
        self._bump(obj)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    async def patch(
        self, resource: Resource, namespace: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        self.calls.append(("PATCH", resource.path(namespace, name, sub)))
        obj = self.objects[resource.path(namespace, name)]
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if sub == "status" and self.conflicts:
            self.conflicts -= 1
            raise ApiError(409, "conflict")
        if wanted and wanted != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        _merge(obj.setdefault(sub or "spec", {}), body.get(sub or "spec", {}))
        _merge(obj["metadata"].setdefault("annotations", {}), (body.get("metadata") or {}).get("annotations") or {})
        self._bump(obj)
        return copy.deepcopy(obj)

    async def list(self, resource: Resource, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(("LIST", resource.path(namespace)))
        wanted = dict(term.split("=") for term in selector.split(","))
        return [
            copy.deepcopy(o)
            for path, o in self.objects.items()
            if path.startswith(resource.path(namespace) + "/")
            and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
        ]

    async def proxy_get(self, namespace: str, pod: str, port: int, path: str) -> Any:
        self.calls.append(("PROXY", f"{pod}:{port}/{path}"))
        return {"step": 9, "mfu": 0.25}

    async def delete(self, resource: Resource, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        path = resource.path(namespace, name)
        self.calls.append(("DELETE", path))
        if path not in self.objects:
            raise ApiError(404, "not found")
        if (body.get("preconditions") or {}).get("uid") not in (None, self.objects[path]["metadata"]["uid"]):
            raise ApiError(409, "uid precondition failed")
        return self.objects.pop(path)

    async def delete_all(
        self, resource: Resource, namespace: str, selector: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        doomed = await self.list(resource, namespace, selector)
        self.calls[-1] = ("DELETECOLLECTION", resource.path(namespace))  # the list above is part of this call
        for o in doomed:
            self.objects.pop(resource.path(namespace, o["metadata"]["name"]), None)
        return {"kind": "Status", "status": "Success"}

    def add_job(self, doc: dict[str, Any], uid: str = "job-uid") -> dict[str, Any]:
        obj = copy.deepcopy(doc)
        obj["metadata"].update(namespace="default", uid=uid, generation=1)
        self._bump(obj)
        self.objects[JOBS.path("default", obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    def job(self, name: str = "tiny") -> dict[str, Any]:
        return copy.deepcopy(self.objects[JOBS.path("default", name)])

    def jobset(self, name: str = "tiny") -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get(JOBSETS.path("default", name)))


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386: None removes, objects merge field by field, anything else replaces."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def run_reconcile(
    kube: FakeKube,
    obj: dict[str, Any],
    jobset_seen: dict[str, Any] | None = None,
    config: OperatorConfig | None = None,
) -> tuple[reconcile.ReconcileResult, list[phases.Notice]]:
    config = config or OperatorConfig()
    notices: list[phases.Notice] = []
    means = reconcile.Means(kube, config, lambda o, n: notices.append(n), clock=lambda: NOW)
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

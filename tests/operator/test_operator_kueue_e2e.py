"""Black-box tests of queued jobs: the test API server serves Kueue Workloads (from our own minimal
CRD, tests/kubeapi/workload-crd.yaml) and `tpujob operator` runs as a real process.

There is no Kueue here: the tests stand in for it, as Kueue's JobSet integration behaves (kubernetes-sigs/
kueue pkg/controller/jobframework/reconciler.go): for a JobSet labelled kueue.x-k8s.io/queue-name it creates
a Workload owned by the JobSet, keeps it unadmitted with a message while quota is short, then admits it
and unsuspends the JobSet; on an eviction it marks the Workload Evicted and suspends the JobSet again; a
Workload with spec.active=false is evicted with reason Deactivated. Those tests are marked
`fake_controller` and named `test_fake_kueue_...`; the JobSet controller's and scheduler's parts are stood
in for as in test_operator_e2e.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import JOBSET_CRD, WORKLOAD_CRD
from tests.kubeapi.harness import Server, kubectl, running_apiserver, wait_for
from tests.operator.test_operator_e2e import (JOBS, JOBSETS, TPUJOB_CRD, _operator_requests, _rbac_of, condition,
                                              create_job, events, get, job_doc, jobset, jobset_condition,
                                              make_namespace, operator, patch_jobset_status, replicated, server,
                                              wait_event, wait_status, wait_watching)
from tests.operator_process import Operator, running_operator

pytestmark = pytest.mark.e2e

WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads"
QUOTA = ("couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor "
         "tpu7x-2x2x1, 4 more needed")
PREEMPTED = ("Preempted to accommodate a workload (UID: 1234, JobUID: 5678) due to prioritization in the "
             "ClusterQueue; preemptor path: /tpu-cq; preemptee path: /tpu-cq")


__all__ = ["server", "operator"]  # the e2e module's fixtures, over this module's `cluster`


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Operator]]:
    workdir = tmp_path_factory.mktemp("operator-kueue-e2e")
    with running_apiserver(workdir, crds=[TPUJOB_CRD, JOBSET_CRD, WORKLOAD_CRD]) as api:
        with running_operator(api, workdir, "--namespace", "default", "--resync-interval", "5") as op:
            yield api, op


# --- the Kueue stand-in -------------------------------------------------------------------------------------


def workload_name(jobset_name: str, jobset_uid: str) -> str:
    """Kueue's name for a JobSet's Workload (jobframework.GetWorkloadNameForOwnerWithGVK)."""
    digest = hashlib.sha1(f"JobSet\njobset.x-k8s.io\n{jobset_name}\n{jobset_uid}".encode()).hexdigest()[:5]
    return f"jobset-{jobset_name}-{digest}"


def kueue_creates_the_workload(server: Server, name: str, ns: str = "default") -> str:
    """Stand in for Kueue: the Workload of a queued, suspended JobSet, owned by it."""
    js = jobset(server, name, ns)
    assert js["spec"]["suspend"] is True and js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    uid = js["metadata"]["uid"]
    wl = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
          "metadata": {"name": workload_name(name, uid), "labels": {"kueue.x-k8s.io/job-uid": uid},
                       "ownerReferences": [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": name,
                                            "uid": uid, "controller": True, "blockOwnerDeletion": True}]},
          "spec": {"active": True, "queueName": js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"],
                   "podSets": [{"name": "slice", "count": 1, "template": js["spec"]["replicatedJobs"][0]["template"]}]}}
    code, body = server.request("POST", WORKLOADS.format(ns=ns), wl)
    assert code == 201, body
    return body["metadata"]["name"]


def kueue_sets(server: Server, wl: str, conditions: list[dict[str, Any]], ns: str = "default",
               cluster_queue: str | None = None) -> None:
    status: dict[str, Any] = {"conditions": conditions, "admission": {"clusterQueue": cluster_queue}
                              if cluster_queue else None}
    code, body = server.request("PATCH", f"{WORKLOADS.format(ns=ns)}/{wl}/status", {"status": status},
                                content_type="application/merge-patch+json")
    assert code == 200, body


def wl_condition(type_: str, status: str = "True", reason: str = "", message: str = "",
                 since: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason or type_, "message": message,
            "lastTransitionTime": since}


def set_jobset_suspend(server: Server, name: str, suspend: bool, ns: str = "default") -> None:
    code, body = server.request("PATCH", f"{JOBSETS.format(ns=ns)}/{name}", {"spec": {"suspend": suspend}},
                                content_type="application/merge-patch+json")
    assert code == 200, body


def kueue_keeps_it_waiting(server: Server, wl: str, ns: str = "default") -> None:
    kueue_sets(server, wl, [wl_condition("QuotaReserved", "False", "Pending", QUOTA)], ns)


def kueue_admits(server: Server, name: str, wl: str, ns: str = "default") -> None:
    """Admit the Workload, unsuspend the JobSet, and (the JobSet controller's part) run its one pod."""
    kueue_sets(server, wl, [wl_condition("QuotaReserved", message="Quota reserved in ClusterQueue tpu-cq"),
                            wl_condition("Admitted", message="The workload is admitted"),
                            wl_condition("Evicted", "False", "QuotaReserved", "Previously: evicted")], ns, "tpu-cq")
    set_jobset_suspend(server, name, False, ns)
    patch_jobset_status(server, name, {"conditions": [], "replicatedJobsStatus": replicated(active=1, ready=1)}, ns)


def kueue_evicts(server: Server, name: str, wl: str, reason: str, message: str, since: str,
                 ns: str = "default") -> None:
    """Evict the Workload and suspend the JobSet (the JobSet controller's part: its pods are gone)."""
    kueue_sets(server, wl, [wl_condition("QuotaReserved", "False", "Pending", message),
                            wl_condition("Admitted", "False", "NoReservation", "The workload has no reservation"),
                            wl_condition("Evicted", reason=reason, message=message, since=since)], ns)
    set_jobset_suspend(server, name, True, ns)
    patch_jobset_status(server, name, {"conditions": [jobset_condition("Suspended", "jobset is suspended")],
                                       "replicatedJobsStatus": replicated()}, ns)


def workload(server: Server, wl: str, ns: str = "default") -> dict[str, Any]:
    return get(server, f"{WORKLOADS.format(ns=ns)}/{wl}")


def running_queued_job(server: Server, operator: Operator, name: str) -> str:
    """A job on a queue that Kueue (the stand-in) has admitted and JobSet runs; its Workload's name."""
    create_job(server, job_doc(name, queueName="tpu-queue"))
    wait_status(server, operator, name, lambda s: s.get("phase") == "Queued", "phase Queued")
    wl = kueue_creates_the_workload(server, name)
    kueue_admits(server, name, wl)
    wait_status(server, operator, name, lambda s: s.get("phase") == "Running", "phase Running")
    return wl


def set_job_suspend(server: Server, name: str, suspend: bool) -> None:
    code, body = server.request("PATCH", f"{JOBS.format(ns='default')}/{name}", {"spec": {"suspend": suspend}},
                                content_type="application/merge-patch+json")
    assert code == 200, body


def operator_patched_the_jobset(server: Server, name: str) -> bool:
    return any(r["method"] == "PATCH" and r["path"].endswith(f"/jobsets/{name}")
               and r["userAgent"].startswith("tpu-operator") for r in server.requests_log())


# --- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.fake_controller
def test_fake_kueue_a_queued_job_is_queued_with_kueues_words_then_runs(server, operator):
    create_job(server, job_doc("waiting", queueName="tpu-queue",
                               tpu={"topology": "2x2x1", "capacity": "flexStart", "maxRunDuration": "2h"}))
    status = wait_status(server, operator, "waiting", lambda s: s.get("phase") == "Queued", "phase Queued")
    assert "waiting for Kueue to create the Workload of JobSet waiting" in status["message"]
    js = jobset(server, "waiting")
    assert js["spec"]["suspend"] is True and js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-queue"
    assert js["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "7200"

    wl = kueue_creates_the_workload(server, "waiting")
    kueue_keeps_it_waiting(server, wl)
    status = wait_status(server, operator, "waiting", lambda s: s.get("message") == QUOTA, "Kueue's message")
    assert status["phase"] == "Queued" and status["workloadName"] == wl
    admitted = condition(status, "Admitted")
    assert (admitted["status"], admitted["reason"], admitted["message"]) == ("False", "Pending", QUOTA)
    assert wait_event(server, "waiting", "Queued")["message"] == QUOTA
    table = kubectl(server, "get", "tpujobs", "waiting", "-o", "wide", check=True).stdout
    header, row = table.splitlines()[:2]
    assert row.split()[1] == "Queued" and header.split()[-1] == "MESSAGE" and "insufficient unused quota" in row
    described = kubectl(server, "describe", "tpujob", "waiting", check=True).stdout
    assert "Admitted" in described and "insufficient unused quota" in described

    kueue_admits(server, "waiting", wl)
    status = wait_status(server, operator, "waiting", lambda s: s.get("phase") == "Running", "phase Running")
    assert condition(status, "Admitted")["status"] == "True" and "ClusterQueue tpu-cq" in condition(status, "Admitted")[
        "message"]
    wait_event(server, "waiting", "Admitted")
    assert jobset(server, "waiting")["spec"]["suspend"] is False  # Kueue's to decide: the operator left it
    assert not operator_patched_the_jobset(server, "waiting")


@pytest.mark.fake_controller
def test_fake_kueue_an_eviction_queues_the_job_again_and_counts_a_preemption(server, operator):
    wl = running_queued_job(server, operator, "evictee")

    kueue_evicts(server, "evictee", wl, "Preempted", PREEMPTED, "2026-01-01T01:00:00Z")
    status = wait_status(server, operator, "evictee", lambda s: s.get("phase") == "Queued", "Queued again")
    assert status["restarts"]["preemption"] == 1 and status["lastEvictionTime"] == "2026-01-01T01:00:00Z"
    assert status["message"].startswith(f"evicted by Kueue (Preempted): {PREEMPTED}")
    assert condition(status, "Admitted")["reason"] == "Preempted"
    event = wait_event(server, "evictee", "Evicted")
    assert event["type"] == "Warning" and "Preempted to accommodate a workload" in event["message"]

    kueue_admits(server, "evictee", wl)
    status = wait_status(server, operator, "evictee", lambda s: s.get("phase") == "Running", "Running again")
    # Counted once, under preemption, and not charged against maxRestarts (no failure or hang).
    assert status["restarts"] == {"failure": 0, "preemption": 1, "hang": 0, "total": 1}
    assert [e["reason"] for e in events(server, "evictee")].count("Evicted") == 1
    assert not operator_patched_the_jobset(server, "evictee")


@pytest.mark.fake_controller
def test_fake_kueue_a_user_suspend_deactivates_the_workload_and_is_not_undone(server, operator):
    wl = running_queued_job(server, operator, "napper")
    set_job_suspend(server, "napper", True)
    wait_for(lambda: workload(server, wl)["spec"].get("active") is False, 30, 0.1, "Workload spec.active=false")
    assert workload(server, wl)["metadata"]["annotations"]["training.tpu-operator.dev/deactivated-for-suspend"]
    # Kueue evicts a deactivated Workload (reason Deactivated) and suspends the JobSet.
    kueue_evicts(server, "napper", wl, "Deactivated", "The workload is deactivated", "2026-01-01T02:00:00Z")
    status = wait_status(server, operator, "napper", lambda s: s.get("phase") == "Suspended", "phase Suspended")
    assert not (status.get("restarts") or {}).get("preemption") and condition(status, "SpecChange")["status"] == "True"
    wait_event(server, "napper", "Suspended")

    set_job_suspend(server, "napper", False)
    wait_for(lambda: workload(server, wl)["spec"].get("active") is True, 30, 0.1, "Workload spec.active=true")
    assert "training.tpu-operator.dev/deactivated-for-suspend" not in (workload(server, wl)["metadata"].get(
        "annotations") or {})
    wait_status(server, operator, "napper", lambda s: s.get("phase") == "Queued", "Queued until Kueue admits it")
    kueue_admits(server, "napper", wl)
    status = wait_status(server, operator, "napper", lambda s: s.get("phase") == "Running", "Running after resume")
    assert not (status.get("restarts") or {}).get("preemption")
    assert not operator_patched_the_jobset(server, "napper")


def test_every_operator_request_is_covered_by_its_rbac_rules_with_kueue(server, operator):
    from tpu_operator.controller.rbac import RBAC_RULES

    allowed = {(g, r, v) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    used = {rbac for r in server.requests_log() if r["userAgent"].startswith(("kopf", "tpu-operator"))
            if (rbac := _rbac_of(r)) is not None}
    assert ("kueue.x-k8s.io", "workloads", "watch") in used
    assert used <= allowed, f"requests outside the RBAC rules: {sorted(used - allowed)}"


# Requests the operator makes for a queued job once it is created (creation costs what a job without a
# queue costs; test_operator_e2e.py pins that), step by step as Kueue and JobSet move it, by what they
# are for. The Workload comes from the watch: following Kueue costs no GET and no list, only a status
# write for each step that changes what the job says, and the Events below.
BUDGET_QUEUED_TO_RUNNING = {
    # 1 the Workload exists (workloadName; Kueue has not tried it yet), 2 Kueue's message (no quota),
    # 3 Admitted=True (the JobSet not resumed yet), 4 resumed, no pod yet: Pending, 5 Running.
    ("PATCH", "tputrainingjobs/status"): 5,
    ("POST", "events"): 2,  # Queued (with Kueue's message), Admitted
}
BUDGET_EVICTED_TO_RUNNING = {
    # 1 Evicted (a preemption counted) while the pods still run, 2 the JobSet suspended: Queued, 3 Admitted
    # again, 4 Running. Kueue's and JobSet's other steps change nothing the job says: no write.
    ("PATCH", "tputrainingjobs/status"): 4,
    ("POST", "events"): 2,  # Evicted, Admitted
}


@pytest.mark.fake_controller
def test_fake_kueue_queued_jobs_requests_stay_within_budget(server, tmp_path):
    ns = "queued-budget"
    make_namespace(server, ns)
    with running_operator(server, tmp_path, "--namespace", ns, "--resync-interval", "3600") as op:
        def until(test: Any, what: str) -> None:
            wait_status(server, op, "thrifty", test, what, ns=ns)

        def admitted(s: dict[str, Any]) -> bool:
            return condition(s, "Admitted").get("status") == "True"

        wait_watching(server, ns, "tputrainingjobs", "jobsets", "workloads")
        create_job(server, job_doc("thrifty", queueName="tpu-queue"), ns)
        until(lambda s: s.get("phase") == "Queued", "phase Queued")
        wait_event(server, "thrifty", "Created", ns)
        server.clear_requests_log()

        wl = kueue_creates_the_workload(server, "thrifty", ns)
        until(lambda s: s.get("workloadName") == wl, "the Workload's name")
        kueue_keeps_it_waiting(server, wl, ns)
        until(lambda s: s.get("message") == QUOTA, "Kueue's message")
        kueue_sets(server, wl, [wl_condition("QuotaReserved"), wl_condition("Admitted")], ns, "tpu-cq")
        until(admitted, "Admitted")
        set_jobset_suspend(server, "thrifty", False, ns)
        until(lambda s: s.get("phase") == "Pending", "phase Pending (resumed)")
        patch_jobset_status(server, "thrifty", {"replicatedJobsStatus": replicated(active=1, ready=1)}, ns)
        until(lambda s: s.get("phase") == "Running", "phase Running")
        wait_event(server, "thrifty", "Admitted", ns)
        assert _operator_requests(server, ns) == BUDGET_QUEUED_TO_RUNNING
        server.clear_requests_log()

        kueue_sets(server, wl, [wl_condition("QuotaReserved", "False", "Pending", PREEMPTED),
                                wl_condition("Evicted", reason="Preempted", message=PREEMPTED,
                                             since="2026-01-01T03:00:00Z")], ns)
        until(lambda s: (s.get("restarts") or {}).get("preemption") == 1, "a preemption counted")
        set_jobset_suspend(server, "thrifty", True, ns)
        until(lambda s: s.get("phase") == "Queued", "Queued again")
        patch_jobset_status(server, "thrifty", {"conditions": [jobset_condition("Suspended")],
                                                "replicatedJobsStatus": replicated()}, ns)
        kueue_sets(server, wl, [wl_condition("QuotaReserved"), wl_condition("Admitted"),
                                wl_condition("Evicted", "False", "QuotaReserved", f"Previously: {PREEMPTED}")], ns,
                   "tpu-cq")
        until(admitted, "Admitted again")
        set_jobset_suspend(server, "thrifty", False, ns)
        running = {"conditions": [], "replicatedJobsStatus": replicated(active=1, ready=1)}
        patch_jobset_status(server, "thrifty", running, ns)
        until(lambda s: s.get("phase") == "Running", "Running again")
        wait_for(lambda: len([e for e in events(server, "thrifty", ns) if e["reason"] == "Admitted"]) == 2, 30, 0.1,
                 "the second Admitted Event")
        wait_event(server, "thrifty", "Evicted", ns)
        assert _operator_requests(server, ns) == BUDGET_EVICTED_TO_RUNNING

"""Queued jobs on the real Kueue controller (its JobSet integration and webhooks, served on loopback).

Each test has its own ClusterQueue with `google.com/tpu` quota for one single-host 2x2x1 slice (4 chips),
over kwok's 2x2x1 node pools, and a LocalQueue `tpu-queue` in its namespace. The pods run on kwok nodes
until they are deleted, or end when the job's env says (tests/cluster/stages.yaml).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from tests.cluster.kube import JOBSETS, WORKLOADS, Cluster, condition, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
WAIT_S = 120
FLAVOR = "tpu7x-2x2x1"
QUOTA_MESSAGE = (
    "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor "
    "tpu7x-2x2x1, 4 more needed"
)


@pytest.fixture(scope="module")
def priorities(local_cluster: Cluster) -> None:
    local_cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR},
            "spec": {
                "nodeLabels": {
                    "cloud.google.com/gke-tpu-accelerator": "tpu7x",
                    "cloud.google.com/gke-tpu-topology": "2x2x1",
                }
            },
        },
        *(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": name},
                "value": value,
                "description": f"{name} priority",
            }
            for name, value in (("low", 100), ("high", 1000))
        ),
    )


@pytest.fixture
def queue(local_cluster: Cluster, priorities: None) -> str:
    """A namespace with a LocalQueue `tpu-queue` on a ClusterQueue of its own (one slice of quota)."""
    ns = local_cluster.namespace("queued")
    local_cluster.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": ns},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["google.com/tpu"],
                        "flavors": [{"name": FLAVOR, "resources": [{"name": "google.com/tpu", "nominalQuota": 4}]}],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": "tpu-queue", "namespace": ns},
            "spec": {"clusterQueue": ns},
        },
    )
    wait_for(
        lambda: (
            condition(
                (local_cluster.get(("kueue.x-k8s.io", "v1beta2", "localqueues"), ns, "tpu-queue") or {}).get("status")
                or {},
                "Active",
            ).get("status")
            == "True"
        ),
        60,
        "the LocalQueue Active",
    )
    return ns


def queued_job(name: str, *, priority: str | None = None, run_for: str | None = None) -> dict[str, Any]:
    env = [{"name": "KWOK_EXIT_AFTER", "value": run_for}] if run_for else []
    doc = operator_job(
        queueName="tpu-queue", runtime={"env": env}, **({"workloadPriorityClassName": priority} if priority else {})
    )
    doc["metadata"]["name"] = name
    return doc


def phase(cluster: Cluster, ns: str, name: str, wanted: str):
    return lambda: (s := cluster.status(ns, name)).get("phase") == wanted and s


def test_one_job_runs_and_the_other_waits_with_kueues_own_message(
    local_cluster: Cluster, operator: Operator, queue: str
):
    cluster, ns = local_cluster, queue
    cluster.apply(queued_job("first"), namespace=ns)
    wait_for(phase(cluster, ns, "first", "Running"), WAIT_S, "the first job Running")
    cluster.apply(queued_job("second"), namespace=ns)
    status = wait_for(
        lambda: (
            (s := cluster.status(ns, "second")).get("phase") == "Queued" and QUOTA_MESSAGE in s.get("message", "") and s
        ),
        WAIT_S,
        "the second job Queued with Kueue's words",
        diagnose=lambda: str(cluster.status(ns, "second")),
    )
    admitted = condition(status, "Admitted")
    assert admitted["status"] == "False" and QUOTA_MESSAGE in admitted["message"], admitted
    # Kueue made the Workload, owned by the JobSet, which stays suspended with no pods.
    workload = cluster.get(WORKLOADS, ns, status["workloadName"])
    jobset = cluster.get(JOBSETS, ns, "second")
    assert [r["uid"] for r in workload["metadata"]["ownerReferences"]] == [jobset["metadata"]["uid"]]
    assert jobset["spec"]["suspend"] is True
    assert not cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=second")
    table = cluster.kubectl("get", "tpujobs", "-n", ns, "-o", "wide").stdout
    assert QUOTA_MESSAGE in table, table


def test_a_higher_priority_job_preempts_and_the_evicted_job_resumes(
    local_cluster: Cluster, operator: Operator, queue: str
):
    cluster, ns = local_cluster, queue
    cluster.apply(queued_job("low", priority="low"), namespace=ns)
    wait_for(phase(cluster, ns, "low", "Running"), WAIT_S, "the low-priority job Running")
    cluster.apply(queued_job("high", priority="high", run_for="10s"), namespace=ns)
    evicted = wait_for(
        lambda: (
            (s := cluster.status(ns, "low")).get("phase") == "Queued"
            and s.get("restarts", {}).get("preemption") == 1
            and s
        ),
        WAIT_S,
        "the low-priority job evicted and Queued again",
        diagnose=lambda: str(cluster.status(ns, "low")),
    )
    assert evicted["restarts"]["total"] == 1 and evicted["restarts"]["failure"] == 0, evicted["restarts"]
    assert "Preempted" in evicted["message"], evicted["message"]
    assert any(e["reason"] == "Evicted" and e["type"] == "Warning" for e in cluster.events(ns, "low"))
    wait_for(phase(cluster, ns, "high", "Running"), WAIT_S, "the high-priority job Running")
    # The high-priority job ends after 10 s: the evicted one is admitted again and resumes.
    wait_for(phase(cluster, ns, "high", "Succeeded"), WAIT_S, "the high-priority job Succeeded")
    resumed = wait_for(phase(cluster, ns, "low", "Running"), WAIT_S, "the evicted job Running again")
    assert resumed["restarts"]["preemption"] == 1 and condition(resumed, "Admitted")["status"] == "True"


def admitted_at(cluster: Cluster, ns: str, name: str) -> float | None:
    """When Kueue admitted the job's Workload (its QuotaReserved condition), in epoch seconds."""
    status = cluster.status(ns, name)
    workload = cluster.get(WORKLOADS, ns, status["workloadName"]) if status.get("workloadName") else None
    reserved = condition((workload or {}).get("status") or {}, "QuotaReserved")
    return epoch(reserved["lastTransitionTime"]) if reserved.get("status") == "True" else None


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_the_pre_flight_overlaps_the_queue_behind_kueues_admission_gate(
    local_cluster: Cluster, operator: Operator, queue: str
):
    """A queued job with the pre-flight: its JobSet joins the queue at once, held by Kueue's admission gate,
    which the pinned Kueue copies to the Workload; the real compile runs on the process kubelet meanwhile;
    Fits lifts the gate and Kueue admits. Timed against a job without the pre-flight on a queue with room."""
    cluster, ns = local_cluster, queue
    doc = queued_job("overlap")
    doc["spec"]["plan"] = {"preflight": "compile"}
    cluster.apply(doc, namespace=ns)
    created = epoch(cluster.job(ns, "overlap")["metadata"]["creationTimestamp"])

    def held():
        workloads = cluster.items(WORKLOADS, ns)
        compiling = condition(cluster.status(ns, "overlap"), "Planned").get("reason") == "Compiling"
        return compiling and workloads and workloads[0]

    workload = wait_for(held, WAIT_S, "the Workload, made while the pre-flight compiles")
    gate = (workload["metadata"].get("annotations") or {}).get("kueue.x-k8s.io/admission-gated-by")
    assert gate == "training.tpu-operator.dev/preflight", workload["metadata"]
    assert condition(workload.get("status") or {}, "QuotaReserved").get("status") != "True"
    running = wait_for(
        phase(cluster, ns, "overlap", "Running"),
        300,
        "the job Running after its compile",
        diagnose=lambda: str(cluster.status(ns, "overlap")),
    )
    planned = condition(running, "Planned")
    assert (planned["status"], planned["reason"]) == ("True", "Fits"), planned
    workload = cluster.get(WORKLOADS, ns, running["workloadName"])
    assert "kueue.x-k8s.io/admission-gated-by" not in (workload["metadata"].get("annotations") or {})
    compiled, admitted = epoch(planned["lastTransitionTime"]), admitted_at(cluster, ns, "overlap")
    cluster.kubectl("delete", "tpujob", "overlap", "-n", ns, "--wait=true")  # the queue's one slice, back

    cluster.apply(queued_job("direct"), namespace=ns)  # no pre-flight: the floor of time to admission
    wait_for(phase(cluster, ns, "direct", "Running"), WAIT_S, "the job without a pre-flight Running")
    direct = admitted_at(cluster, ns, "direct") - epoch(cluster.job(ns, "direct")["metadata"]["creationTimestamp"])
    print(
        f"time to admission on a queue with room: pre-flight overlapping the queue {admitted - created:.0f} s "
        f"(compile done at {compiled - created:.0f} s, admitted {admitted - compiled:.0f} s later); "
        f"without a pre-flight {direct:.0f} s"
    )
    assert admitted >= compiled  # the gate held the Workload until the compile said it fits

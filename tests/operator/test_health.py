"""TPU node health (controller/health.py): GKE's partition-state label and the Ready condition on the nodes a
running job's pods are on; over the in-memory API (FakeKube standing in for JobSet, the kubelet and GKE's
node labelling), a node of slice 1 turning unhealthy stops the job with its grace period (the trainer
saves the step in flight on SIGTERM), counts a restart `hardware`, and re-creates an elastic job on the
slice left."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import operator_job as tiny_job
from tests.fakes import T0, FakeKube, at, job_status, running
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import health, reconcile
from tpu_operator.controller.kube import JOBSETS, PODS
from tpu_operator.controller.reconcile import OperatorConfig

STATE = "cloud.google.com/gke-tpu-partition-4x4x4-state"


def node(name: str, state: str | None = "HEALTHY", ready: str = "True", reason: str = "") -> dict[str, Any]:
    labels = {health.ACCELERATOR_LABEL: "tpu7x", **({STATE: state} if state else {})}
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"conditions": [{"type": "Ready", "status": ready, "reason": reason}]},
    }


def pod(name: str, node_name: str | None, slice_index: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"jobset.sigs.k8s.io/jobset-name": "tiny", "jobset.sigs.k8s.io/job-index": str(slice_index)},
        },
        "spec": {"nodeName": node_name} if node_name else {},
        "status": {"phase": phase},
    }


def test_unhealthy_reads_the_partition_state_label_and_the_ready_condition():
    assert health.unhealthy_reason(node("a")) is None
    assert health.unhealthy_reason(node("a", state="DEGRADED")) is None  # "impaired but still usable" (GKE)
    assert (
        health.unhealthy_reason(node("a", state="UNSET")) is None and health.unhealthy_reason(node("a", None)) is None
    )
    assert health.unhealthy_reason(node("a", state="UNHEALTHY")) == f"label {STATE}=UNHEALTHY"
    other_shape = node("a", None)
    other_shape["metadata"]["labels"]["cloud.google.com/gke-tpu-partition-2x2x2-state"] = "UNHEALTHY"
    assert "partition-2x2x2-state=UNHEALTHY" in health.unhealthy_reason(other_shape)
    assert (
        health.unhealthy_reason(node("a", ready="False", reason="KubeletNotReady"))
        == "condition Ready=False (KubeletNotReady)"
    )
    assert health.unhealthy_reason(node("a", ready="Unknown")) == "condition Ready=Unknown (NodeStatusUnknown)"


def test_lost_names_the_first_unhealthy_node_the_jobs_running_pods_are_on():
    pods = [pod("p0", "n0", 0), pod("p1", "n1", 1), pod("p2", None, 1, "Pending"), pod("p3", "n3", 0, "Failed")]
    assert health.lost(pods, {}) is None
    assert health.lost(pods, {"elsewhere": "label x=UNHEALTHY", "n3": "gone"}) is None  # not this job's, or done
    loss = health.lost(pods, {"n1": f"label {STATE}=UNHEALTHY"})
    assert (loss.node, loss.pod, loss.slice_index) == ("n1", "p1", 1)
    assert loss.describe() == f"node n1 of slice 1's pod p1 is unhealthy (label {STATE}=UNHEALTHY)"
    failure = health.failure(loss)
    assert failure.cause == "hardware" and failure.slice_index == 1 and failure.code is None
    assert failure.describe().endswith("stopped with SIGTERM, which saves the step in flight")


def _run(kube: FakeKube, when: str, unhealthy: dict[str, str] | None = None, jobset: Any = "index"):
    notices = []
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n), clock=lambda: parse(when))
    seen = reconcile.Seen(kube.jobset() if jobset == "index" else jobset, unhealthy=unhealthy, look_at_nodes=True)
    asyncio.run(reconcile.reconcile(means, kube.job(), seen))
    return [n.reason for n in notices]


def test_an_unhealthy_node_of_slice_1_stops_the_job_with_grace_and_it_goes_on_on_slice_0_fake_jobset_and_kubelet():
    """FakeKube stands in for JobSet, the kubelet and GKE: the JobSet runs two slices, one pod each, on nodes n0 and
    n1; GKE labels n1 UNHEALTHY. The operator counts a `hardware` restart, deletes the JobSet without
    deleting its pods at once (their grace period lets the trainer save the step in flight), and
    re-creates it on one slice."""
    kube = FakeKube()
    kube.add_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1}},
            training={"steps": 10, "globalBatch": 16, "sequenceLength": 128},
            failurePolicy={"backoffSeconds": 10, "maxRestarts": 0},
        )
    )
    kube.objects[next(iter(kube.objects))]["metadata"]["creationTimestamp"] = T0
    _run(kube, at(0), jobset=None)
    running(kube)
    uid = kube.jobset()["metadata"]["uid"]
    for i in (0, 1):
        kube.objects[PODS.path("default", f"tiny-slice-{i}-0-{uid}")] = pod(f"tiny-slice-{i}-0-{uid}", f"n{i}", i)
    _run(kube, at(5))
    assert job_status(kube).phase == "Running"
    kube.calls.clear()
    assert _run(kube, at(6), unhealthy={"other-node": health.Unhealthy("label x=UNHEALTHY", at_once=True)}) == []  # not this job's node
    assert job_status(kube).restarts is None or job_status(kube).restarts.total == 0
    kube.calls.clear()
    events = _run(kube, at(8), unhealthy={"n1": health.judge(node("n1", state="UNHEALTHY"))})
    status = job_status(kube)
    assert events == ["Restarted", "Resized"] and status.phase == "Restarting"
    # Not charged against maxRestarts 0: the infrastructure's fault, as a preemption is.
    assert (status.restarts.hardware, status.restarts.total, status.last_restart.cause) == (1, 1, "hardware")
    assert status.last_restart.job_set_uid == uid and status.last_restart.exit_code is None
    assert f"node n1 of slice 1's pod tiny-slice-1-0-{uid} is unhealthy (label {STATE}=UNHEALTHY)" in status.message
    assert status.slices.running == 1 and status.condition("Resized").reason == "SliceLost"
    # The JobSet goes (foreground: the pods get their grace period and save the step in flight); no pod is
    # deleted at once, as a failed attempt's are.
    assert [c[0] for c in kube.calls] == ["LIST", "PATCH", "DELETE"] and kube.jobset() is None
    assert kube.calls[-1][1] == JOBSETS.path("default", "tiny")
    _run(kube, at(20), jobset=None)
    spec = kube.jobset()["spec"]["replicatedJobs"][0]
    assert spec["replicas"] == 1
    # The ledger: the gap before the smaller attempt is `shrinking`, not `restarting`.
    running(kube)
    _run(kube, at(30))
    badput = job_status(kube).badput
    assert badput.shrinking > 0 and badput.restarting == 0, badput

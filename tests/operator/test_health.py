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
    assert (
        _run(kube, at(6), unhealthy={"other-node": health.Unhealthy("label x=UNHEALTHY", at_once=True)}) == []
    )  # not this job's node
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


# --- issue 30: the grace period, untrusted timestamps, the cluster-wide hold -------------------------------------


def not_ready(name: str, since: Any, status: str = "Unknown") -> dict[str, Any]:
    n = node(name, state=None, ready=status, reason="NodeStatusUnknown")
    n["status"]["conditions"][0]["lastTransitionTime"] = since
    return n


def test_a_not_ready_node_waits_its_grace_counted_from_its_transition_and_the_partition_label_acts_at_once():
    now = parse(at(100))
    first_seen = parse(at(100))
    # Ready=Unknown since t=10: 90 s of a 120 s grace are spent, 30 s left.
    u = health.judge(not_ready("a", at(10)), first_seen)
    assert (u.reason, u.since, u.at_once) == ("condition Ready=Unknown (NodeStatusUnknown)", parse(at(10)), False)
    assert health.grace_left_s(u, 120, False, now) == 30 and health.grace_left_s(u, 60, False, now) == 0
    assert health.grace_left_s(u, 120, True, now) == 5 * 120 - 90  # under a hold: 5 x the grace
    assert health.grace_left_s(health.judge(node("b", state="UNHEALTHY"), first_seen), 120, True, now) == 0
    # Untrusted times: missing, unreadable or in the future stand as when the operator first saw it so, so the grace
    # is never skipped and never endless; a time in the past is the API's word (an operator back from an outage).
    for since in (None, "yesterday", 12, at(10_000)):
        u = health.judge(not_ready("a", since), first_seen)
        assert u.since == first_seen and health.grace_left_s(u, 120, False, now) == 120, since
        assert health.grace_left_s(u, 120, False, parse(at(220))) == 0
    assert health.judge(not_ready("a", at(10), status="True")) is None
    assert health.judge({"metadata": {"name": "a"}}) is None and health.judge({}) is None  # not reported yet


def test_the_hold_follows_the_node_lifecycle_controllers_zone_rule():
    assert not health.holding(28, 0) and not health.holding(28, 1) and not health.holding(28, 15)
    assert health.holding(28, 16) and health.holding(28, 28)  # 16/28 = 0.57 >= 0.55
    assert not health.holding(4, 2) and health.holding(4, 3)  # more than 2, and 75 %
    assert health.holding(1, 1) and health.holding(2, 2)  # every node NotReady: a full disruption
    assert not health.holding(0, 0)


def test_judged_stops_past_the_grace_and_says_when_to_look_again():
    pods = [pod("p0", "n0", 0), pod("p1", "n1", 1)]
    now = parse(at(200))
    fresh = {"n1": health.Unhealthy("condition Ready=Unknown (x)", since=parse(at(190)))}
    j = health.judged(pods, fresh, 120, False, now)
    assert j.loss is None and j.next_s == 110 and not j.held
    old = {"n1": health.Unhealthy("condition Ready=Unknown (x)", since=parse(at(70)))}
    j = health.judged(pods, old, 120, False, now)
    assert (j.loss.node, j.loss.slice_index, j.next_s) == ("n1", 1, None)
    j = health.judged(pods, old, 120, True, now)  # held: 130 s of 600 s spent
    assert j.loss is None and j.next_s == 470 and j.held


def _grace_job(kube: FakeKube, grace: int = 60) -> str:
    kube.add_job(tiny_job(failurePolicy={"backoffSeconds": 10, "maxRestarts": 0, "nodeUnhealthyGraceSeconds": grace}))
    kube.objects[next(iter(kube.objects))]["metadata"]["creationTimestamp"] = T0
    _run(kube, at(0), jobset=None)
    running(kube)
    uid = kube.jobset()["metadata"]["uid"]
    p = pod(f"tiny-slice-0-0-{uid}", "n0", 0)
    p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] = "0"
    kube.objects[PODS.path("default", f"tiny-slice-0-0-{uid}")] = p
    _run(kube, at(5))
    assert job_status(kube).phase == "Running"
    return uid


def _reconcile(kube: FakeKube, when: str, unhealthy: dict[str, Any], hold: str | None = None):
    notices = []
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n), clock=lambda: parse(when))
    seen = reconcile.Seen(kube.jobset(), unhealthy=unhealthy, look_at_nodes=True, hold=hold)
    return asyncio.run(reconcile.reconcile(means, kube.job(), seen)), [n.reason for n in notices]


def test_a_node_not_ready_for_less_than_the_grace_restarts_nothing_and_past_it_one_hardware_restart_fake_kubelet():
    _grace_job(kube := FakeKube(), grace=60)
    blip = {"n0": health.judge(not_ready("n0", at(10)), parse(at(10)))}
    result, events = _reconcile(kube, at(30), blip)
    assert events == [] and job_status(kube).phase == "Running" and job_status(kube).restarts.total == 0
    assert result.nodes_after_s == 40  # the manager looks again when the grace ends (a "node" trigger)
    kube.calls.clear()
    result, events = _reconcile(kube, at(71), blip)
    status = job_status(kube)
    # The pod on the silent node is deleted at once (no kubelet may confirm it), then the JobSet with its grace.
    assert [c[0] for c in kube.calls] == ["LIST", "PATCH", "DELETECOLLECTION", "DELETE"], kube.calls
    assert events == ["Restarted"] and status.phase == "Restarting" and result.nodes_after_s is None
    assert (status.restarts.hardware, status.restarts.total, status.last_restart.cause) == (1, 1, "hardware")
    assert "node n0 of slice 0's pod" in status.message and "Ready=Unknown" in status.message


def test_under_the_hold_a_not_ready_node_waits_and_the_job_says_why_once():
    _grace_job(kube := FakeKube(), grace=60)
    down = {"n0": health.judge(not_ready("n0", at(10)), parse(at(10)))}
    why = "28 of 28 TPU nodes are NotReady together"
    _, events = _reconcile(kube, at(100), down, hold=why)
    status = job_status(kube)
    assert events == ["NodesHeld"] and status.phase == "Running" and status.restarts.total == 0
    held = status.condition("NodesHeld")
    assert (held.status, held.reason) == ("True", "ClusterDisrupted") and why in held.message
    _, events = _reconcile(kube, at(150), down, hold=why)
    assert events == [] and job_status(kube).restarts.total == 0  # once per transition
    _, events = _reconcile(kube, at(160), {})  # every node Ready again: released, nothing restarted
    assert events == ["NodesReleased"] and job_status(kube).condition("NodesHeld").status == "False"
    assert job_status(kube).phase == "Running" and job_status(kube).restarts.total == 0


def test_the_manager_counts_tpu_nodes_not_objects_and_holds_when_most_are_not_ready():
    from tests.fakes import LATER, manager_for

    manager, _, _ = manager_for(FakeKube())
    nodes = [not_ready(f"n{i}", None) if i < 16 else node(f"n{i}") for i in range(28)]
    unhealthy = {n["metadata"]["name"]: [f] for n in nodes if (f := manager.node_health(n["metadata"]["name"], n))}
    # The index handler's values: the counts are one entry per node under "tpu" / "not_ready", nothing else.
    counts = {"tpu": [None] * 28, "not_ready": [None] * len(unhealthy)}
    manager.nodes, manager.node_counts = unhealthy, counts
    assert manager.unhealthy_since == {f"n{i}": LATER for i in range(16)}  # no transition time: first seen
    manager.node_seen(nodes[0])
    assert manager.held and manager.hold_message().startswith("16 of 28 TPU nodes are NotReady together")
    assert manager.stats.hold._value.get() == 1 and manager.stats.tpu_nodes.labels("not_ready")._value.get() == 16
    manager.node_counts = {"tpu": [None] * 28, "not_ready": [None] * 15}
    manager.node_seen(node("n0"))
    assert not manager.held and manager.hold_message() is None and manager.stats.hold._value.get() == 0
    manager.node_health("n0", node("n0"))  # Ready again: forgotten
    manager.node_seen(nodes[1], deleted=True)  # deleted: forgotten
    assert "n0" not in manager.unhealthy_since and "n1" not in manager.unhealthy_since

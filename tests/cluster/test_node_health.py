"""Node health on the real control plane (issue 30): kwok's TPU nodes turned NotReady through the API (their
Ready condition posted False, as a kubelet posts it, with the node taken from kwok, whose node-initialize Stage
would post Ready=True again at once) or deleted, under single-host `2x2x1` jobs whose pods kwok runs until
they are deleted. The times are scaled down with spec.failurePolicy (a few seconds of grace, not 120).

- a node NotReady for less than the grace restarts nothing; for longer, one restart, cause hardware, charged;
- a node deleted under a running job (what GKE's repair and upgrades do): the real pod garbage collector
  deletes its pod (DisruptionTarget DeletionByPodGC), the JobSet fails, and the job restarts once, cause
  hardware, and runs again;
- every kwok TPU node NotReady at once (24 of the cluster's 28): the operator holds, says so on the job
  (NodesHeld) and in its metric, and restarts nothing until they are Ready again;
- a node flapping under a job pinned to it: restarts stop at restartBudgets.hardware and the job fails saying so.

Every node a test touches is made Ready again (or created again) before it ends: the suite's other modules
share the nodes.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.cluster import nodes as cluster_nodes
from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
WAIT_S = 150
GRACE_S = 8


def job(name: str, **policy: Any) -> dict[str, Any]:
    doc = operator_job(failurePolicy={"backoffSeconds": 1, "nodeUnhealthyGraceSeconds": GRACE_S, **policy})
    doc["metadata"]["name"] = name
    return doc


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_ready(cluster: Cluster, node: str, ready: bool) -> None:
    """NotReady: take the node from kwok (its annotation off: kwok's node-initialize Stage would post Ready=True
    again at once, and it no longer runs the node's pods or lease, as a host that went silent) and post Ready=False
    as a kubelet does. Ready: give it back to kwok, whose Stage posts Ready=True and runs its pods again."""
    if ready:
        cluster.core.patch_node(node, {"metadata": {"annotations": {cluster_nodes.KWOK: "fake"}}})
        return
    cluster.core.patch_node(node, {"metadata": {"annotations": {cluster_nodes.KWOK: None}}})
    cond = {
        "type": "Ready",
        "status": "False",
        "reason": "KubeletNotReady",
        "message": "set by tests/cluster/test_node_health.py",
        "lastHeartbeatTime": _now(),
        "lastTransitionTime": _now(),
    }
    cluster.core.patch_node_status(node, {"status": {"conditions": [cond]}})


def ready(cluster: Cluster, name: str) -> bool:
    conds = cluster.api.sanitize_for_serialization(cluster.core.read_node(name))["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


@contextmanager
def not_ready(cluster: Cluster, *names: str) -> Iterator[None]:
    try:
        for name in names:
            set_ready(cluster, name, False)
        yield
    finally:  # last in, first back, each Ready before the next: a job's node named last is Ready before the hold ends
        for name in reversed(names):
            set_ready(cluster, name, True)
            wait_for(lambda n=name: ready(cluster, n), WAIT_S, f"node {name} Ready again")


def running_on(cluster: Cluster, ns: str, name: str) -> tuple[dict[str, Any], str]:
    """(status, node) once the job is Running with its pod on a node."""

    def placed() -> tuple[dict[str, Any], str] | None:
        status = cluster.status(ns, name)
        pods = [p for p in cluster.pods(ns) if p["status"].get("phase") == "Running" and p["spec"].get("nodeName")]
        return (status, pods[0]["spec"]["nodeName"]) if status.get("phase") == "Running" and pods else None

    return wait_for(placed, WAIT_S, f"{name} Running on a node", diagnose=lambda: str(cluster.status(ns, name)))


def kwok_tpu_nodes(cluster: Cluster) -> list[str]:
    selector = f"{cluster_nodes.ACCELERATOR},{cluster_nodes.KUBELET_LABEL}=kwok"
    return [n.metadata.name for n in cluster.core.list_node(label_selector=selector).items]


def restarts(status: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in (status.get("restarts") or {}).items() if k != "recent"}


def test_a_node_not_ready_for_less_than_the_grace_restarts_nothing_and_past_it_once_as_hardware(
    local_cluster: Cluster, operator: Operator
):
    cluster, ns = local_cluster, local_cluster.namespace("nodegrace")
    cluster.apply(job("blip"), namespace=ns)
    _, node = running_on(cluster, ns, "blip")
    first = cluster.get(JOBSETS, ns, "blip")["metadata"]["uid"]
    with not_ready(cluster, node):
        time.sleep(GRACE_S / 2)
    time.sleep(GRACE_S)  # past the grace from the blip's start: still nothing, the node is Ready again
    status = cluster.status(ns, "blip")
    assert status["phase"] == "Running" and restarts(status).get("total") == 0, status
    assert cluster.get(JOBSETS, ns, "blip")["metadata"]["uid"] == first
    with not_ready(cluster, node):
        restarted = wait_for(
            lambda: (s := cluster.status(ns, "blip")).get("restarts", {}).get("total") and s,
            WAIT_S,
            "a restart after the grace",
        )
    assert restarts(restarted) == {"failure": 0, "preemption": 0, "hang": 0, "hardware": 1, "total": 1}
    last = restarted["lastRestart"]
    assert last["cause"] == "hardware" and last["jobSetUid"] == first, last
    assert f"node {node} of slice 0's pod" in last["message"] and "Ready=False (KubeletNotReady)" in last["message"]
    assert "restart 1 (hardware)" in last["message"]
    again = wait_for(lambda: (s := cluster.status(ns, "blip")).get("phase") == "Running" and s, WAIT_S, "Running again")
    assert restarts(again)["total"] == 1 and cluster.get(JOBSETS, ns, "blip")["metadata"]["uid"] != first
    reasons = [e["reason"] for e in cluster.events(ns, "blip")]
    assert reasons.count("Restarted") == 1, reasons


def test_a_node_deleted_under_a_running_job_restarts_it_once_as_hardware(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("nodegone")
    cluster.apply(job("orphan", maxRestarts=0), namespace=ns)  # maxRestarts 0: hardware is not the job's fault
    _, node = running_on(cluster, ns, "orphan")
    first = cluster.get(JOBSETS, ns, "orphan")["metadata"]["uid"]
    saved = cluster.api.sanitize_for_serialization(cluster.core.read_node(node))
    cluster.core.delete_node(node)
    try:
        restarted = wait_for(
            lambda: (s := cluster.status(ns, "orphan")).get("restarts", {}).get("total") and s,
            WAIT_S,
            "a restart after the node went",
            diagnose=lambda: str(cluster.status(ns, "orphan")),
        )
        assert restarts(restarted)["hardware"] == 1 and restarts(restarted)["total"] == 1, restarted
        assert restarted["lastRestart"]["cause"] == "hardware" and restarted["lastRestart"]["jobSetUid"] == first
        message = restarted["lastRestart"]["message"]
        assert "lost with its node" in message or "no pod of the failed JobSet is left" in message, message
        again = wait_for(
            lambda: (s := cluster.status(ns, "orphan")).get("phase") == "Running" and s, WAIT_S, "Running again"
        )
        assert restarts(again)["total"] == 1 and again.get("message", "").find("Failed") < 0
    finally:
        meta = saved["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {k: meta[k] for k in ("name", "labels", "annotations") if k in meta},
            "spec": {"taints": [t for t in saved["spec"].get("taints") or [] if t["key"].startswith("google.com")]},
            "status": {k: saved["status"][k] for k in ("capacity", "allocatable", "addresses", "nodeInfo")},
        }
        cluster.core.create_node(body)
        wait_for(
            lambda: (
                condition(cluster.api.sanitize_for_serialization(cluster.core.read_node(node))["status"], "Ready").get(
                    "status"
                )
                == "True"
            ),
            WAIT_S,
            f"node {node} back and Ready",
        )


def test_most_tpu_nodes_not_ready_together_hold_every_restart_and_say_why(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("nodehold")
    grace = 20  # under the hold a node's stop waits 5 x this: far longer than the test looks
    cluster.apply(job("held", nodeUnhealthyGraceSeconds=grace), namespace=ns)
    _, node = running_on(cluster, ns, "held")
    kwok = kwok_tpu_nodes(cluster)
    assert len(kwok) == 24 and node in kwok
    # The job's node goes last, once the hold is on, and comes back first, while it still holds: were it NotReady
    # outside the hold, its plain grace would run while the other nodes are turned NotReady (or Ready) one API call
    # at a time (on CI's loaded machine that took longer than the grace).
    with not_ready(cluster, *[n for n in kwok if n != node], node):
        held = wait_for(
            lambda: condition(s := cluster.status(ns, "held"), "NodesHeld").get("status") == "True" and s,
            WAIT_S,
            "NodesHeld=True",
        )
        assert condition(held, "NodesHeld")["reason"] == "ClusterDisrupted"
        # Said once, with the count when the hold began: at least 16 of the 28 (0.55); the metric follows the nodes.
        found = re.search(r"(\d+) of 28 TPU nodes are NotReady together", condition(held, "NodesHeld")["message"])
        assert found and 16 <= int(found[1]) <= 24, condition(held, "NodesHeld")["message"]
        assert "tpu_operator_node_hold 1.0" in operator.metrics()
        wait_for(lambda: 'tpu_operator_tpu_nodes{state="not_ready"} 24.0' in operator.metrics(), WAIT_S, "24 NotReady")
        time.sleep(2 * grace)  # two graces: without the hold, the job's node would have stopped it by now
        status = cluster.status(ns, "held")
        assert status["phase"] == "Running" and restarts(status)["total"] == 0, status
    released = wait_for(
        lambda: condition(s := cluster.status(ns, "held"), "NodesHeld").get("status") == "False" and s,
        WAIT_S,
        "NodesHeld=False",
    )
    assert condition(released, "NodesHeld")["reason"] == "Released"
    assert released["phase"] == "Running" and restarts(released)["total"] == 0
    wait_for(lambda: "tpu_operator_node_hold 0.0" in operator.metrics(), WAIT_S, "the hold metric back to 0")
    reasons = [e["reason"] for e in cluster.events(ns, "held")]
    assert reasons.count("NodesHeld") == 1 and reasons.count("NodesReleased") == 1, reasons


def test_a_flapping_node_restarts_its_job_until_the_hardware_budget_is_spent(
    local_cluster: Cluster, operator: Operator
):
    cluster, ns = local_cluster, local_cluster.namespace("nodeflap")
    node = sorted(n for n in kwok_tpu_nodes(cluster) if "2x2x1" in n)[-1]
    doc = job("flappy", maxRestarts=0, restartBudgets={"hardware": 2})
    doc["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}  # every attempt lands on the flapping node
    cluster.apply(doc, namespace=ns)
    for cycle in range(3):
        status, on = running_on(cluster, ns, "flappy")
        assert on == node and restarts(status)["total"] == cycle
        with not_ready(cluster, node):
            wait_for(
                lambda c=cycle: (
                    (s := cluster.status(ns, "flappy")).get("restarts", {}).get("total", 0) > c
                    or s.get("phase") == "Failed"
                ),
                WAIT_S,
                f"cycle {cycle}: a restart or the job failed",
            )
    failed = wait_for(lambda: (s := cluster.status(ns, "flappy")).get("phase") == "Failed" and s, WAIT_S, "Failed")
    assert restarts(failed)["hardware"] == 2 and restarts(failed)["total"] == 2, failed
    assert "hardware restart budget spent (2 of restartBudgets.hardware 2 used)" in failed["message"], failed["message"]
    assert condition(failed, "Failed")["reason"] == "RestartPolicy"

"""The whole path on the real components: the operator's pre-flight Job gets its pod from the real Job
controller and the process kubelet runs the real compile; the operator creates the JobSet, the real JobSet
controller makes its Job and pods, the real scheduler places them on the 2x2x2 node pool, the process
kubelet runs the real trainer; status shows step and MFU; the job Succeeds; deleting it lets the garbage
collector remove every child. And why a job is Pending, in the real scheduler's words."""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.cluster.jobs import TRAIN_S, quickstart
from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster


def owned_by(obj: dict, uid: str) -> bool:
    return any(ref["uid"] == uid for ref in obj["metadata"].get("ownerReferences") or [])


def test_quickstart_preflight_jobset_pods_metrics_success_and_garbage_collection(
    local_cluster: Cluster, operator: Operator, tmp_path
):
    cluster, ns = local_cluster, local_cluster.namespace("quickstart")
    doc = quickstart(tmp_path, steps=20)
    cluster.apply(doc, namespace=ns)

    def status(what):
        return lambda: (s := cluster.status(ns, "quickstart")) and what(s) and s

    def diagnose() -> str:
        pods = cluster.kubectl("get", "jobs,pods,jobsets", "-n", ns, "-o", "wide", check=False).stdout
        return f"status: {cluster.status(ns, 'quickstart')}\n{pods}"

    # 1. The pre-flight: a batch Job, its pod made by the Job controller and run by the process kubelet.
    planned = wait_for(
        status(lambda s: condition(s, "Planned").get("status") in ("True", "False")),
        TRAIN_S,
        "the pre-flight's verdict",
        diagnose=diagnose,
    )
    (preflight,) = [
        j for j in cluster.batch.list_namespaced_job(ns).items if j.metadata.name.startswith("quickstart-plan-")
    ]
    assert preflight.status.succeeded == 1, preflight.status
    (plan_pod,) = cluster.pods(ns, f"job-name={preflight.metadata.name}")
    assert plan_pod["spec"]["nodeName"] == "cpu-0" and plan_pod["status"]["phase"] == "Succeeded"
    if importlib.util.find_spec("libtpu") is not None:
        assert condition(planned, "Planned")["reason"] == "Fits", planned
        assert planned["plan"]["fits"] is True and planned["plan"]["hbmCapacityGiB"] == 96

    # 2. The JobSet, its Job and pods from the real JobSet controller, placed by the real scheduler.
    running = wait_for(
        status(lambda s: s.get("phase") == "Running" and s.get("step")),
        TRAIN_S,
        "Running with a step from the trainer",
        diagnose=diagnose,
    )
    job = cluster.job(ns, "quickstart")
    jobset = cluster.get(JOBSETS, ns, "quickstart")
    assert owned_by(jobset, job["metadata"]["uid"])
    (child,) = cluster.batch.list_namespaced_job(ns, label_selector="jobset.sigs.k8s.io/jobset-name=quickstart").items
    assert owned_by(cluster.api.sanitize_for_serialization(child), jobset["metadata"]["uid"])
    pods = cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=quickstart")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["tpu7x-2x2x2-0", "tpu7x-2x2x2-1"], pods
    assert running["mfu"] > 0 and running["stepTimeSeconds"] > 0

    # 3. Succeeded, with the trainer's final numbers.
    done = wait_for(status(lambda s: s.get("phase") in ("Succeeded", "Failed")), TRAIN_S, "the end", diagnose=diagnose)
    assert done["phase"] == "Succeeded", done
    assert done["step"] == 20 and done["lastCheckpointStep"] == 20 and done["completionTime"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0

    # 4. Deleting the job: the garbage collector removes the JobSet, its Job and pods, the ConfigMap and
    # the pre-flight Job (owner references, no finalizer of ours).
    cluster.kubectl("delete", "tpujob", "quickstart", "-n", ns, "--wait=false")

    def children() -> list[str]:
        left = [f"jobset/{j['metadata']['name']}" for j in cluster.items(JOBSETS, ns)]
        left += [f"job/{j.metadata.name}" for j in cluster.batch.list_namespaced_job(ns).items]
        left += [f"pod/{p['metadata']['name']}" for p in cluster.pods(ns)]
        left += [
            f"configmap/{c.metadata.name}"
            for c in cluster.core.list_namespaced_config_map(ns).items
            if c.metadata.name != "kube-root-ca.crt"
        ]
        return left

    wait_for(
        lambda: not children() and cluster.job(ns, "quickstart") is None,
        120,
        "every child to be collected",
        diagnose=lambda: str(children()),
    )


def test_a_slice_that_cannot_be_placed_says_why_in_the_schedulers_words(local_cluster: Cluster, operator: Operator):
    cluster = local_cluster
    ns = cluster.namespace("pending")
    # One of the 16 hosts of the 4x4x4 node pool is taken: 15 free hosts for a 16-host slice.
    blocker = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "blocker"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "tpu7x-4x4x4-0"},
            "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "c", "image": "busybox", "resources": {"limits": {"google.com/tpu": "4"}}}],
        },
    }
    cluster.apply(blocker, namespace=ns)
    wait_for(
        lambda: cluster.core.read_namespaced_pod("blocker", ns).status.phase == "Running",
        60,
        "the blocker pod running on kwok's node",
    )
    doc = operator_job(
        tpu={"generation": "v7x", "topology": "4x4x4"},
        training={"steps": 10, "globalBatch": 128, "sequenceLength": 128},
    )
    doc["metadata"]["name"] = "wide"
    started = time.monotonic()
    cluster.apply(doc, namespace=ns)
    status = wait_for(
        lambda: (s := cluster.status(ns, "wide")) and "Insufficient google.com/tpu" in s.get("message", "") and s,
        120,
        "the scheduler's words in status.message",
        diagnose=lambda: cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout,
    )
    print(f"scheduler's words in status.message {time.monotonic() - started:.1f} s after the job was created")
    assert status["phase"] == "Pending", status
    nodes = len(cluster.core.list_node().items)
    # One slice runs on the pod network (spec.runtime.hostNetwork off), so no host port keeps the 15 placed pods'
    # nodes out: the 16th pod finds all 16 hosts of the pool full, 15 by its own slice and 1 by the blocker.
    assert f"cannot be scheduled: 0/{nodes} nodes are available: " in status["message"], status["message"]
    assert "16 Insufficient google.com/tpu" in status["message"], status["message"]
    scheduled = condition(status, "Scheduled")
    assert scheduled["status"] == "False" and scheduled["reason"] == "Unschedulable", scheduled
    events = wait_for(
        lambda: [e for e in cluster.events(ns, "wide") if "Insufficient google.com/tpu" in e["message"]],
        30,
        "a Warning Event with the scheduler's words",
    )
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    # The 15 other pods did run on the pool's free hosts: only the one that does not fit is Pending.
    pods = cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=wide")
    assert len(pods) == 16 and sum(p["status"]["phase"] == "Pending" for p in pods) == 1, [
        (p["metadata"]["name"], p["status"]["phase"]) for p in pods
    ]

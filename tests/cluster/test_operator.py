"""The operator's own behaviour on the real components, with single-host 2x2x1 jobs on kwok's nodes (no
pre-flight: spec.plan.preflight skip; the pre-flight runs for real in test_lifecycle.py): its children and
their owner references, an invalid job, suspend and resume through the real JobSet controller, a name
conflict, a JobSet deleted under a job, and edits refused by the API server."""

from __future__ import annotations

import copy
import json

import pytest

from tests.cluster.jobs import WAIT_S, job_doc, status_where
from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.operator_process import Operator
from tpu_operator.controller.children import config_map_of

pytestmark = pytest.mark.cluster


def test_valid_job_gets_its_configmap_and_jobset_owned_by_it(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("shape")
    cluster.apply(job_doc("shape", failurePolicy={"maxRestarts": 4}), namespace=ns)
    status = status_where(cluster, ns, "shape", lambda s: s.get("phase") == "Running", "phase Running", operator)
    uid = cluster.job(ns, "shape")["metadata"]["uid"]
    jobset = cluster.get(JOBSETS, ns, "shape")
    config_map = cluster.api.sanitize_for_serialization(
        cluster.core.read_namespaced_config_map(config_map_of(jobset), ns)
    )
    for child in (jobset, config_map):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["kind"] == "TPUTrainingJob" and ref["controller"] is True
        assert child["metadata"]["labels"]["training.tpu-operator.dev/job"] == "shape"
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0  # the operator restarts, within the job's 4
    assert json.loads(config_map["data"]["config.json"])["name"] == "shape"
    assert condition(status, "Ready")["status"] == "True" and status["observedGeneration"] == 1
    # The real JobSet controller made one Job; its pod runs on one of kwok's single-host 2x2x1 node pools.
    (pod,) = cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=shape")
    assert pod["spec"]["nodeName"].startswith("tpu7x-2x2x1-") and pod["status"]["phase"] == "Running"
    wait_for(
        lambda: any(e["reason"] == "Created" and e["type"] == "Normal" for e in cluster.events(ns, "shape")),
        WAIT_S,
        "a Normal Event Created",
    )
    meta = cluster.job(ns, "shape")["metadata"]
    assert not meta.get("finalizers") and not any(
        k.startswith("kopf.zalando.org") for k in meta.get("annotations") or {}
    )


def test_invalid_job_is_marked_invalid_then_runs_once_fixed(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("broken")
    # Valid for the CRD schema (its pattern), invalid for the operator: v7x has no 3x3x3 slice.
    doc = job_doc("broken", tpu={"generation": "v7x", "topology": "3x3x3"})
    cluster.apply(doc, namespace=ns)
    status = status_where(cluster, ns, "broken", lambda s: s.get("phase") == "Invalid", "phase Invalid", operator)
    ready = condition(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec" and "spec.tpu.topology" in ready["message"]
    wait_for(
        lambda: any(e["reason"] == "Invalid" and e["type"] == "Warning" for e in cluster.events(ns, "broken")),
        WAIT_S,
        "a Warning Event Invalid",
    )
    assert cluster.get(JOBSETS, ns, "broken") is None
    # No JobSet yet, so the API server lets the spec be fixed.
    fixed = copy.deepcopy(doc)
    fixed["spec"]["tpu"]["topology"] = "2x2x1"
    cluster.apply(fixed, namespace=ns)
    status_where(cluster, ns, "broken", lambda s: s.get("phase") == "Running", "phase Running after the fix", operator)


def test_suspend_and_resume_through_the_jobset_controller(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("pausable")
    cluster.apply(job_doc("pausable"), namespace=ns)
    status_where(cluster, ns, "pausable", lambda s: s.get("phase") == "Running", "phase Running", operator)
    cluster.kubectl("patch", "tpujob", "pausable", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    status = status_where(cluster, ns, "pausable", lambda s: s.get("phase") == "Suspended", "phase Suspended", operator)
    assert condition(status, "SpecChange").get("status", "True") == "True"  # suspend is the mutable field
    wait_for(
        lambda: not cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=pausable"),
        WAIT_S,
        "the JobSet controller to delete the suspended job's pods",
    )
    cluster.kubectl("patch", "tpujob", "pausable", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    status_where(cluster, ns, "pausable", lambda s: s.get("phase") == "Running", "phase Running after resume", operator)
    wait_for(lambda: any(e["reason"] == "Resumed" for e in cluster.events(ns, "pausable")), WAIT_S, "a Resumed Event")


def test_name_conflict_with_a_jobset_it_does_not_own(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("squatted")
    foreign = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "squatted"},
        "spec": {
            "suspend": True,
            "replicatedJobs": [
                {
                    "name": "x",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "template": {
                                "spec": {"containers": [{"name": "c", "image": "busybox"}], "restartPolicy": "Never"}
                            }
                        }
                    },
                }
            ],
        },
    }
    cluster.apply(foreign, namespace=ns)
    before = cluster.get(JOBSETS, ns, "squatted")
    cluster.apply(job_doc("squatted"), namespace=ns)
    status = status_where(
        cluster,
        ns,
        "squatted",
        lambda s: condition(s, "Ready").get("reason") == "NameConflict",
        "Ready=False NameConflict",
        operator,
    )
    assert "JobSet squatted" in condition(status, "Ready")["message"]
    after = cluster.get(JOBSETS, ns, "squatted")  # neither adopted nor changed (its controller writes its status)
    assert after["spec"] == before["spec"] and not after["metadata"].get("ownerReferences")
    wait_for(
        lambda: any(e["reason"] == "NameConflict" for e in cluster.events(ns, "squatted")),
        WAIT_S,
        "a NameConflict Event",
    )


def test_jobset_deleted_under_a_running_job_is_created_again(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("phoenix")
    cluster.apply(job_doc("phoenix"), namespace=ns)
    status_where(cluster, ns, "phoenix", lambda s: s.get("phase") == "Running", "phase Running", operator)
    first = cluster.get(JOBSETS, ns, "phoenix")["metadata"]["uid"]
    cluster.kubectl("delete", "jobset", "phoenix", "-n", ns, "--wait=false")
    wait_for(
        lambda: (js := cluster.get(JOBSETS, ns, "phoenix")) and js["metadata"]["uid"] != first,
        WAIT_S,
        "a new JobSet",
        diagnose=operator.log_tail,
    )
    status_where(cluster, ns, "phoenix", lambda s: s.get("phase") == "Running", "phase Running again", operator)


def test_edits_to_a_running_job_are_refused_by_the_api_server(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("frozen")
    doc = job_doc("frozen")
    cluster.apply(doc, namespace=ns)
    status_where(cluster, ns, "frozen", lambda s: s.get("jobSetName"), "a JobSet", operator)
    before = cluster.get(JOBSETS, ns, "frozen")
    changed = copy.deepcopy(doc)
    changed["spec"]["training"]["steps"] = 99
    result = cluster.apply(changed, namespace=ns, check=False)
    assert result.returncode != 0 and "spec.training: Forbidden" in result.stderr, result.stderr
    assert cluster.job(ns, "frozen")["metadata"]["generation"] == 1
    assert cluster.get(JOBSETS, ns, "frozen")["spec"] == before["spec"]

"""Owned objects stay as the operator made them (issue 30, item 5; controller/drift.py), on the real API server:
a running job's JobSet has its job label removed, then relabelled to another job's name, then its applied-spec
annotation edited; its ConfigMap has a label edited, then is deleted. Each is put back by the operator, named
in condition ChildrenAsMade and in one Warning Event, and the job keeps exactly one JobSet, the same one."""

from __future__ import annotations

import pytest

from tests.cluster.jobs import WAIT_S, job_doc, status_where
from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.operator_process import Operator
from tpu_operator.api import names
from tpu_operator.controller import drift
from tpu_operator.controller.children import config_map_of

pytestmark = pytest.mark.cluster
JOB_LABEL = drift.field("labels", names.LABEL_JOB)


def test_hand_edits_of_a_jobs_jobset_and_config_map_are_put_back_and_reported(
    local_cluster: Cluster, operator: Operator
):
    cluster, ns = local_cluster, local_cluster.namespace("drift")
    cluster.apply(job_doc("drifted"), job_doc("bystander", suspend=True), namespace=ns)
    status_where(cluster, ns, "drifted", lambda s: s.get("phase") == "Running", "phase Running", operator)
    status_where(cluster, ns, "bystander", lambda s: s.get("jobSetName"), "a JobSet", operator)
    uid = cluster.job(ns, "drifted")["metadata"]["uid"]
    made = cluster.get(JOBSETS, ns, "drifted")
    bystander = cluster.get(JOBSETS, ns, "bystander")["metadata"]["uid"]

    def reported(edits: int, *words: str) -> dict:
        """The job's status once its `edits`-th edit is reported, the condition naming `words`; and as many
        Warning Events ChildEdited, the last one naming them too."""
        status = status_where(
            cluster,
            ns,
            "drifted",
            lambda s: (
                (s.get("children") or {}).get("edits") == edits
                and all(w in condition(s, drift.CONDITION).get("message", "") for w in words)
            ),
            f"edit {edits} reported naming {words}",
            operator,
        )
        events = wait_for(
            lambda: len(e := [e for e in cluster.events(ns, "drifted") if e["reason"] == "ChildEdited"]) == edits and e,
            WAIT_S,
            f"{edits} Warning Events ChildEdited",
        )
        assert all(e["type"] == "Warning" for e in events)
        assert any(all(w in e["message"] for w in words) for e in events)
        return status

    def jobset_where(test, what: str) -> dict:
        return wait_for(lambda: (j := cluster.get(JOBSETS, ns, "drifted")) and test(j) and j, WAIT_S, what)

    def ours() -> list[dict]:
        return [j for j in cluster.items(JOBSETS, ns) if any(r["uid"] == uid for r in j["metadata"]["ownerReferences"])]

    # The job label removed: the JobSet leaves the operator's label-selected watch, and is still the job's.
    cluster.kubectl("label", "jobset", "drifted", "-n", ns, f"{names.LABEL_JOB}-")
    jobset_where(lambda j: j["metadata"]["labels"].get(names.LABEL_JOB) == "drifted", "the job label put back")
    status = reported(1, "JobSet drifted", JOB_LABEL)
    assert (condition(status, drift.CONDITION)["status"], condition(status, drift.CONDITION)["reason"]) == (
        "True",
        "Reverted",
    )
    assert [j["metadata"]["uid"] for j in ours()] == [made["metadata"]["uid"]]  # one JobSet, the same one

    # Relabelled to another job's name: put back for its true owner (its ownerReference), not adopted by the other.
    cluster.kubectl("label", "--overwrite", "jobset", "drifted", "-n", ns, f"{names.LABEL_JOB}=bystander")
    jobset_where(lambda j: j["metadata"]["labels"].get(names.LABEL_JOB) == "drifted", "the job label put back")
    reported(2, JOB_LABEL)
    assert [j["metadata"]["uid"] for j in ours()] == [made["metadata"]["uid"]]
    assert cluster.get(JOBSETS, ns, "bystander")["metadata"]["uid"] == bystander
    assert cluster.status(ns, "bystander")["jobSetName"] == "bystander"

    # The applied-spec annotation edited (the spec is the JobSet's): put back as it was made.
    applied = made["metadata"]["annotations"][names.APPLIED_SPEC]
    cluster.kubectl("annotate", "--overwrite", "jobset", "drifted", "-n", ns, f"{names.APPLIED_SPEC}={{}}")
    jobset_where(lambda j: j["metadata"]["annotations"].get(names.APPLIED_SPEC) == applied, "the annotation put back")
    reported(3, drift.field("annotations", names.APPLIED_SPEC))

    # The ConfigMap's label edited, then the ConfigMap deleted: its labels put back, then made again.
    name = config_map_of(made)
    before = cluster.core.read_namespaced_config_map(name, ns)
    cluster.kubectl("label", "--overwrite", "configmap", name, "-n", ns, f"{names.LABEL_MANAGED_BY}=someone")
    wait_for(
        lambda: (
            cluster.core.read_namespaced_config_map(name, ns).metadata.labels.get(names.LABEL_MANAGED_BY)
            == names.MANAGED_BY
        ),
        WAIT_S,
        "the ConfigMap's label put back",
    )
    reported(4, f"ConfigMap {name}", drift.field("labels", names.LABEL_MANAGED_BY))
    cluster.kubectl("delete", "configmap", name, "-n", ns)
    again = wait_for(
        lambda: next(
            iter(cluster.core.list_namespaced_config_map(ns, field_selector=f"metadata.name={name}").items), None
        ),
        WAIT_S,
        "the ConfigMap made again",
    )
    assert again.metadata.uid != before.metadata.uid and again.data == before.data and again.immutable is True
    assert [r.uid for r in again.metadata.owner_references] == [uid]
    status = reported(5, f"ConfigMap {name}", "deleted")
    assert status.get("phase") == "Running" and [j["metadata"]["uid"] for j in ours()] == [made["metadata"]["uid"]]

"""A profile on demand on the real components: the job's annotation, then the trace file the real trainer
(run by the process kubelet) writes, then the path in the job's status, put there by the operator."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.jobs import TRAIN_S, quickstart
from tests.cluster.kube import Cluster, wait_for
from tests.operator_process import Operator
from tpu_operator.api import names

pytestmark = pytest.mark.cluster


def test_annotation_trace_file_then_path_in_status(local_cluster: Cluster, operator: Operator, tmp_path):
    cluster, ns = local_cluster, local_cluster.namespace("profile")
    doc = quickstart(tmp_path, steps=30)
    doc["spec"]["plan"] = {"preflight": "skip"}
    # Set before the job runs: the operator sends it at its first metrics read of the Running job, while the
    # trainer compiles its first step, long before step 15.
    doc["metadata"]["annotations"] = {names.PROFILE_ANNOTATION: "steps:15-16"}
    cluster.apply(doc, namespace=ns)

    def profile():
        return (cluster.status(ns, "quickstart") or {}).get("profile") or {}

    done = wait_for(
        lambda: profile().get("state") in ("done", "failed") and profile(),
        TRAIN_S,
        "status.profile done",
        diagnose=lambda: str(cluster.status(ns, "quickstart")),
    )
    assert done["state"] == "done", done
    assert done["request"] == "steps:15-16" and done["steps"] == "15-16"
    trace = Path(done["path"])
    assert trace.is_file() and trace.suffix == ".pb" and trace.stat().st_size > 0
    assert trace.parents[2] == tmp_path / "ckpt" / "tensorboard" / "plugins"
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "reason=Profiled", "-o", "name", check=False
    ).stdout
    assert events.strip(), "no Profiled Event"

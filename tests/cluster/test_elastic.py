"""An elastic two-slice job of the real trainer through the operator, the real JobSet controller, scheduler and
the process kubelet (two single-host 2x2x1 pools, nodes.py): one slice's process is killed (SIGKILL), the
operator re-creates the JobSet on the slice left, training goes on from the checkpoint with the same global
batch; with growBack, the operator's probe finds the second slice's hosts free again and the job goes back to
two slices after its next checkpoint, and finishes there."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.cluster.nodes import KUBELET_LABEL
from tests.conftest import operator_job
from tests.operator_process import Operator
from tpu_operator.controller.children import config_map_of
from tpu_operator.local.pods import free_port

pytestmark = pytest.mark.cluster
TRAIN_S = 600
STEPS = 40


def elastic_job(tmp_path: Path) -> dict:
    doc = operator_job(
        tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1, "growBack": True}},
        training={"steps": STEPS, "globalBatch": 16, "sequenceLength": 128},
        checkpoint={"directory": str(tmp_path / "ckpt"), "interval": 4, "keep": 3},
        failurePolicy={"backoffSeconds": 1},
        runtime={"metricsPort": free_port()},
        nodeSelector={KUBELET_LABEL: "process"},  # the process kubelet's 2x2x1 pools, not kwok's
        tolerations=[{"key": KUBELET_LABEL, "operator": "Equal", "value": "process", "effect": "NoSchedule"}],
    )
    doc["metadata"]["name"] = "elastic"
    return doc


def trainer_pids(job: str, slice_id: int) -> list[int]:
    """The process kubelet's trainer processes of one slice (its env, as the kubelet resolved it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1) for kv in (proc / "environ").read_text(errors="replace").split("\0") if "=" in kv
            )
        except OSError:
            continue
        if env.get("TPUJOB_NAME") == job and env.get("TPUJOB_SLICE_ID") == str(slice_id):
            found.append(int(proc.name))
    return found


def test_a_slice_killed_shrinks_the_job_and_it_grows_back_after_a_checkpoint(
    local_cluster: Cluster, operator: Operator, tmp_path
):
    cluster, ns = local_cluster, local_cluster.namespace("elastic")
    cluster.apply(elastic_job(tmp_path), namespace=ns)

    def status(what):
        return lambda: (s := cluster.status(ns, "elastic")) and what(s) and s

    def diagnose() -> str:
        pods = cluster.kubectl("get", "jobsets,jobs,pods", "-n", ns, "-o", "wide", check=False).stdout
        return f"status: {cluster.status(ns, 'elastic')}\n{pods}"

    # 1. Two slices, one process each, on the two process pools.
    wait_for(
        status(lambda s: s.get("phase") == "Running" and (s.get("lastCheckpointStep") or 0) >= 4),
        TRAIN_S,
        "Running on two slices past a checkpoint",
        diagnose=diagnose,
    )
    pods = cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=elastic")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["tpu7x-2x2x1-p0-0", "tpu7x-2x2x1-p1-0"], pods
    config_map = cluster.core.read_namespaced_config_map(config_map_of(cluster.get(JOBSETS, ns, "elastic")), ns).data

    # 2. Slice 1's host process killed: the job goes on on slice 0, from the checkpoint.
    pids = wait_for(lambda: trainer_pids("elastic", 1), 60, "slice 1's trainer process")
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    shrunk = wait_for(
        status(
            lambda s: (
                (s.get("slices") or {}).get("shown") == "1/2"
                and s.get("phase") == "Running"
                and ((s.get("accounting") or {}).get("attempt") or {}).get("progress", {}).get("startStep")
            )
        ),
        TRAIN_S,
        "Running on one slice",
        diagnose=diagnose,
    )
    assert condition(shrunk, "Resized")["reason"] == "SliceLost", shrunk
    assert shrunk["restarts"]["failure"] == 1, shrunk
    resumed = shrunk["accounting"]["attempt"]["progress"]["startStep"]
    assert resumed >= 4 and resumed % 4 == 0, shrunk
    small = cluster.get(JOBSETS, ns, "elastic")
    (rj,) = small["spec"]["replicatedJobs"]
    env = {e["name"]: e.get("value") for e in rj["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert rj["replicas"] == 1 and env["TPUJOB_SLICES"] == "1" and env["TPUJOB_NUM_PROCESSES"] == "1"
    assert cluster.core.read_namespaced_config_map(config_map_of(small), ns).data == config_map  # same global batch

    # 3. Grow back: after its next checkpoint the probe is placed on the free pool, the one-slice JobSet is stopped
    # (SIGTERM: the step in flight saved) and the job finishes on both slices.
    grown = wait_for(
        status(lambda s: condition(s, "Resized").get("reason") == "GrewBack"), TRAIN_S, "grown back", diagnose=diagnose
    )
    assert grown["slices"]["running"] == 2 and grown["slices"]["replaces"] == small["metadata"]["uid"], grown
    done = wait_for(status(lambda s: s.get("phase") in ("Succeeded", "Failed")), TRAIN_S, "the end", diagnose=diagnose)
    assert done["phase"] == "Succeeded" and done["step"] == STEPS, done
    assert done["slices"]["shown"] == "2/2" and done["restarts"]["failure"] == 1, done
    assert not done["restarts"].get("preemption"), done  # a grow-back is not a restart
    assert cluster.get(JOBSETS, ns, "elastic-grow") is None
    reasons = [(e["reason"], e["type"]) for e in cluster.events(ns, "elastic")]
    assert ("Resized", "Warning") in reasons and ("Resized", "Normal") in reasons, reasons

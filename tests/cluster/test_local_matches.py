"""`tpujob run --local` writes the status the operator writes on a cluster: the same small job of the real
trainer (one single-host 2x2x1 slice, on the process kubelet's pool) run through the real API server, JobSet,
scheduler and the operator, and run locally (the operator's Manager over the in-memory API), ends with the
same status field by field; only what no two runs share is set aside (times, uids, pod name suffixes, the
namespace, measured figures, the applied spec's digest: each is compared by presence)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.jobs import TRAIN_S, status_where
from tests.cluster.kube import Cluster
from tests.cluster.nodes import KUBELET_LABEL
from tests.conftest import operator_job
from tests.operator_process import Operator
from tpu_operator.local.pods import free_port

pytestmark = pytest.mark.cluster
STEPS = 4
MEASURED = ("goodput", "badput", "accounting", "loss", "evalLoss", "mfu", "stepTimeSeconds", "tokensPerSecond")


def small_job(tmp_path: Path) -> dict[str, Any]:
    doc = operator_job(
        tpu={"generation": "v7x", "topology": "2x2x1"},
        training={"steps": STEPS, "globalBatch": 8, "sequenceLength": 128},
        checkpoint={"directory": str(tmp_path / "ckpt"), "interval": 2, "keep": 2},
        runtime={"metricsPort": free_port()},
        nodeSelector={KUBELET_LABEL: "process"},  # the process kubelet's 2x2x1 pools, not kwok's
        tolerations=[{"key": KUBELET_LABEL, "operator": "Equal", "value": "process", "effect": "NoSchedule"}],
    )
    doc["metadata"]["name"] = "same"
    return doc


def normalized(value: Any, namespace: str, key: str = "") -> Any:
    """The status with what differs between any two runs replaced by placeholders."""
    if key in MEASURED:
        return "<measured>" if value is not None else None
    if key == "appliedSpecDigest":  # the two specs differ in their checkpoint directory and metrics port
        return "<digest>" if value is not None else None
    if isinstance(value, dict):
        return {k: normalized(v, namespace, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v, namespace) for v in value]
    if key.endswith(("Time", "At")):
        return "<time>"
    if isinstance(value, str):
        value = re.sub(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b|\buid-\d+\b", "<uid>", value)
        value = re.sub(r"\b(same-slice-\d+-\d+)-[a-z0-9]{5}\b", r"\1-<pod>", value)
        return value.replace(namespace, "<ns>")
    return value


def test_a_local_run_ends_with_the_status_the_operator_writes_on_a_cluster(
    local_cluster: Cluster, operator: Operator, tmp_path: Path
):
    cluster, ns = local_cluster, local_cluster.namespace("matches")
    doc = small_job(tmp_path / "cluster")
    cluster.apply(doc, namespace=ns)
    on_cluster = status_where(
        cluster, ns, "same", lambda s: s.get("phase") in ("Succeeded", "Failed"), "a last phase", operator, TRAIN_S
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(small_job(tmp_path / "local")))
    run = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "run", "--local", "--no-plan", "-f", str(tmp_path / "job.yaml")]
        + ["--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=TRAIN_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    local = yaml.safe_load((tmp_path / "run" / "status.yaml").read_text())["status"]
    assert on_cluster["phase"] == "Succeeded" and on_cluster["step"] == STEPS
    # Field by field: the same fields, the same conditions in the same order, the same values.
    want, got = normalized(on_cluster, ns), normalized(local, "default")
    assert sorted(got) == sorted(want)
    assert [c["type"] for c in got["conditions"]] == [c["type"] for c in want["conditions"]]
    for field in sorted(want):
        assert got[field] == want[field], (field, got[field], want[field])

"""What the cluster suite's test modules share (a helper module, not a test module): job documents, waiting for
a job's status, the chart's operator arguments narrowed to one namespace, and what proves that something did
not happen (an operator's own count of reconciles; the end of its watch in the audit log)."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.cluster.kube import Cluster, wait_for
from tests.conftest import EXAMPLES, operator_job
from tests.operator_process import Operator
from tpu_operator.local.pods import free_port

WAIT_S = 90  # for what the operator does on kwok's nodes (no trainer runs)
TRAIN_S = 600  # for what the real trainer (or the real pre-flight compile) does on the process kubelet's nodes


def job_doc(name: str, **spec: Any) -> dict[str, Any]:
    """`operator_job` (no pre-flight) named `name`; keyword arguments replace top-level spec sections."""
    doc = operator_job(**spec)
    doc["metadata"]["name"] = name
    return doc


def quickstart(tmp_path, steps: int) -> dict:
    """examples/quickstart.yaml for the real trainer: `steps` steps, checkpoints under tmp_path, a free metrics port."""
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["checkpoint"] = {"directory": str(tmp_path / "ckpt"), "interval": 10, "keep": 2}
    doc["spec"]["runtime"] = {"metricsPort": free_port()}
    return doc


def status_where(
    cluster: Cluster, ns: str, name: str, test, what: str, operator: Operator | None = None, timeout: float = WAIT_S
) -> dict[str, Any]:
    """The job's status once `test(status)` holds; a failure names `what`, with the status and the operator's log."""
    return wait_for(
        lambda: (s := cluster.status(ns, name)) and test(s) and s,
        timeout,
        f"{what} of {ns}/{name}",
        diagnose=lambda: (
            f"status: {json.dumps(cluster.status(ns, name))}\n" + (operator.log_tail(15) if operator else "")
        ),
    )


def namespaced(args: list[str], ns: str) -> list[str]:
    """The chart's operator arguments on one namespace instead of all."""
    return [a for a in args if a != "--all-namespaces"] + [f"--namespace={ns}"]


def reconciles(op: Operator, result: str) -> int:
    """How many reconciles of the operator ended with `result` (its own tpu_operator_reconciles_total)."""
    return int(
        sum(
            float(n)
            for n in re.findall(
                rf'^tpu_operator_reconciles_total{{handler="[^"]+",result="{result}"}} (\S+)$', op.metrics(), re.M
            )
        )
    )


def watch_ended(cluster: Cluster, since: float, user: str, namespace: str, resource: str) -> bool:
    """The audit log has the end of `user`'s watch of `resource` in `namespace` (ResponseComplete: the
    connection closed), so every request that user made before it is in the log too."""
    return any(
        e["user"]["username"] == user
        and e["verb"] == "watch"
        and e["objectRef"].get("resource") == resource
        and e["objectRef"].get("namespace") == namespace
        for e in cluster.audit(since)
    )

"""Restarts on the real JobSet and Job controllers, with pods that kwok ends with a chosen exit code
(tests/cluster/stages.yaml: the job's env KWOK_EXIT_AFTER / KWOK_EXIT_CODE / KWOK_EXIT_MESSAGE): a
retryable exit (42) fails the pod, so its Job (backoffLimit 0), so the JobSet (maxRestarts 0), and the
operator restarts the job by re-creating the JobSet after its backoff, counted by cause; a user error (3)
fails the job at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cluster.kube import JOBSETS, Cluster, condition, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
WAIT_S = 120


def kwok_job(name: str, *, exit_code: int, error: str, after: str = "3s", **spec: Any) -> dict[str, Any]:
    """A single-host 2x2x1 job whose pods kwok ends `after` they run, with `exit_code` and the trainer's
    termination record naming `error`."""
    record = json.dumps({"code": exit_code, "error": error})
    doc = operator_job(
        runtime={
            "env": [
                {"name": "KWOK_EXIT_AFTER", "value": after},
                {"name": "KWOK_EXIT_CODE", "value": str(exit_code)},
                {"name": "KWOK_EXIT_MESSAGE", "value": record},
            ]
        },
        **spec,
    )
    doc["metadata"]["name"] = name
    return doc


def test_retryable_exit_restarts_by_cause_after_the_backoff_until_the_budget_is_spent(
    local_cluster: Cluster, operator: Operator
):
    cluster, ns = local_cluster, local_cluster.namespace("restarts")
    cluster.apply(
        kwok_job(
            "flaky",
            exit_code=42,
            error="Retryable: gloo: connection reset by peer",
            failurePolicy={"maxRestarts": 1, "backoffSeconds": 5},
        ),
        namespace=ns,
    )
    first = wait_for(lambda: cluster.get(JOBSETS, ns, "flaky"), WAIT_S, "the first JobSet")["metadata"]["uid"]
    restarting = wait_for(
        lambda: (s := cluster.status(ns, "flaky")).get("restarts", {}).get("total") == 1 and s,
        WAIT_S,
        "a restart counted",
    )
    assert restarting["restarts"] == {
        "failure": 1,
        "preemption": 0,
        "hang": 0,
        "hardware": 0,
        "total": 1,
    }, restarting["restarts"]
    assert restarting["lastRestart"]["exitCode"] == 42 and restarting["lastRestart"]["jobSetUid"] == first
    assert "Retryable: gloo: connection reset by peer" in restarting["lastRestart"]["message"]
    # The real JobSet controller failed the first JobSet: its Job failed with the pod (backoffLimit 0).
    second = wait_for(
        lambda: (js := cluster.get(JOBSETS, ns, "flaky")) and js["metadata"]["uid"] != first and js,
        WAIT_S,
        "the JobSet re-created",
    )
    # ...after the backoff: not before the time the status announced for it.
    assert restarting["nextRestartTime"] and second["metadata"]["creationTimestamp"] >= restarting["nextRestartTime"]
    # It fails the same way again: the budget (maxRestarts 1) is spent and the job fails.
    failed = wait_for(lambda: (s := cluster.status(ns, "flaky")).get("phase") == "Failed" and s, WAIT_S, "phase Failed")
    assert "restart budget spent (1 of maxRestarts 1 used)" in failed["message"], failed["message"]
    assert failed["restarts"]["total"] == 1
    assert cluster.get(JOBSETS, ns, "flaky")["metadata"]["uid"] == second["metadata"]["uid"]  # kept, for its logs
    # Events are posted after the status write that decides them: wait for the last one, then count.
    reasons = wait_for(
        lambda: (r := [e["reason"] for e in cluster.events(ns, "flaky")]) and "Failed" in r and r,
        WAIT_S,
        "the Failed Event",
    )
    assert reasons.count("Restarted") == 1, reasons


def test_user_error_fails_the_job_at_once_quoting_the_trainer(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("usererror")
    cluster.apply(
        kwok_job(
            "doomed",
            exit_code=3,
            error="UserError: data.path gs://bucket/tokens has no .npy files",
            failurePolicy={"maxRestarts": 3, "backoffSeconds": 1},
        ),
        namespace=ns,
    )
    status = wait_for(
        lambda: (s := cluster.status(ns, "doomed")).get("phase") == "Failed" and s, WAIT_S, "phase Failed"
    )
    assert (
        "exited with code 3 (user or configuration error): UserError: data.path gs://bucket/tokens has no .npy "
        "files; a user error is never retried" in status["message"]
    ), status["message"]
    assert status["restarts"]["total"] == 0 and condition(status, "Failed")["reason"] == "RestartPolicy"
    jobset = cluster.get(JOBSETS, ns, "doomed")
    assert any(c["type"] == "Failed" and c["status"] == "True" for c in jobset["status"]["conditions"]), jobset[
        "status"
    ]

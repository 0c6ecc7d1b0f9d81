"""The whole loop: kubectl apply → operator → JobSet → pod processes → trainer → metrics → .status.

The API server (tests/kubeapi) and `tpujob operator` run as processes. There is no JobSet controller
or kubelet: the node agent (node_agent.py) stands in for both and runs the real trainer, so these
tests are marked `fake_controller` and named for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal

import pytest
import yaml

from tests.conftest import EXAMPLES, JOBSET_CRD, ROOT
from tests.e2e.node_agent import NodeAgent
from tests.kubeapi.harness import kubectl, running_apiserver, wait_for
from tests.operator_process import running_operator
from tpu_operator.local.pods import free_port

pytestmark = [pytest.mark.fake_controller, pytest.mark.e2e]
TRAIN_S = 300.0


@pytest.fixture
def cluster(tmp_path):
    with running_apiserver(tmp_path, crds=[JOBSET_CRD]) as server:
        # The CRD goes in the way a user installs it.
        kubectl(server, "apply", "--server-side", "-f", str(ROOT / "crds" / "tputrainingjob.yaml"), check=True)
        kubectl(server, "wait", "--for=condition=established", "crd/tputrainingjobs.training.tpu-operator.dev",
                check=True)
        # Proxy mode: the operator reads the trainer through the API server, as from outside a cluster.
        with running_operator(server, tmp_path, "--namespace", "default", "--metrics-access", "proxy",
                              "--metrics-interval", "1") as operator:
            agent = NodeAgent(server.kubeconfig, "default", tmp_path / "nodes").start()
            try:
                yield server, operator, agent
            finally:
                agent.stop()


def _apply_quickstart(server, tmp_path, plan=None, env=None, failure_policy=None, spec=None, **training) -> dict:
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    if plan is not None:
        doc["spec"]["plan"] = plan
    doc["spec"]["checkpoint"] = {"directory": str(tmp_path / "ckpt"), "interval": 5, "keep": 3}
    doc["spec"]["runtime"] = {"metricsPort": free_port(),
                              "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    doc["spec"]["failurePolicy"] = {"maxRestarts": 2, "backoffSeconds": 1, **(failure_policy or {})}
    doc["spec"]["training"].update(training)
    doc["spec"].update(spec or {})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    kubectl(server, "apply", "-f", str(path), check=True)
    return doc


def _status(server) -> dict:
    out = kubectl(server, "get", "tpujob", "quickstart", "-o", "json", check=True).stdout
    return json.loads(out).get("status") or {}


def _watch_phases(server, operator, until: str, seen: list, steps: list) -> dict:
    """Poll the job's status until `phase == until`, recording every phase and step seen."""
    def check():
        status = _status(server)
        if status.get("phase") and (not seen or seen[-1] != status["phase"]):
            seen.append(status["phase"])
        if status.get("step") is not None:
            steps.append(status["step"])
        assert status.get("phase") not in {"Failed", "Invalid"} - {until}, (status, operator.log_tail())
        return status if status.get("phase") == until else None
    return wait_for(check, TRAIN_S, 0.2, f"phase {until}")


def test_fake_jobset_controller_job_trains_to_success_with_metrics_in_status(cluster, tmp_path):
    server, operator, agent = cluster
    doc = _apply_quickstart(server, tmp_path, steps=10)
    phases, steps = [], []
    status = _watch_phases(server, operator, "Succeeded", phases, steps)
    total = doc["spec"]["training"]["steps"]
    assert "Running" in phases
    # The pre-flight ran first (the node agent ran `python -m tpu_workload.plan` as the Job's pod): the
    # quickstart's step, compiled by libtpu for its v7x 2x2x2 slice, fits.
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    if importlib.util.find_spec("libtpu") is not None:
        assert (planned["status"], planned["reason"]) == ("True", "Fits"), planned
        assert status["plan"]["fits"] is True and 0 < status["plan"]["hbmPerDeviceGiB"] < 1
        assert status["plan"]["hbmCapacityGiB"] == 96 and status["plan"]["libtpuVersion"]
    else:  # the plan says it could not check: the job runs all the same
        assert (planned["status"], planned["reason"]) == ("Unknown", "NoLibtpu"), planned
    assert status["step"] == total and status["mfu"] > 0 and status["stepTimeSeconds"] > 0
    # The status carries the trainer's own final report (what process 0 served at the end).
    summary = agent.outcomes["quickstart"].summary
    assert status["mfu"] == pytest.approx(summary["mfu"], rel=1e-3)  # the operator rounds
    assert status["stepTimeSeconds"] == pytest.approx(summary["step_time_s"], rel=1e-3)
    assert status["lastCheckpointStep"] == total and (tmp_path / "ckpt" / str(total)).is_dir()
    # ...read through the API server's pod proxy, from outside the (absent) cluster network.
    assert any(r["path"].endswith(f":{doc['spec']['runtime']['metricsPort']}/proxy/status") and r["status"] == 200
               for r in server.requests_log())
    table = kubectl(server, "get", "tpujobs", check=True).stdout.splitlines()
    assert table[0].split()[:7] == ["NAME", "PHASE", "TOPOLOGY", "STEP", "MFU", "STEP", "TIME"], table
    row = table[1].split()
    assert row[:4] == ["quickstart", "Succeeded", "2x2x2", str(total)] and float(row[4]) > 0


def _resumed_at(tmp_path) -> int:
    """The step the latest run of host 0 started from (each run appends to the host's log)."""
    log = (tmp_path / "nodes" / "quickstart" / "logs" / "quickstart-slice-0-0.log").read_text()
    return int(re.findall(r"starting at step (\d+)", log)[-1])


def test_fake_jobset_controller_killed_pod_restarts_and_resumes(cluster, tmp_path):
    server, operator, agent = cluster
    _apply_quickstart(server, tmp_path, plan={"preflight": "skip"}, steps=20)
    phases, steps = [], []

    def checkpointed():
        status = _status(server)
        return (status.get("lastCheckpointStep") or 0) >= 5 and status
    before = wait_for(checkpointed, TRAIN_S, 0.2, "a first checkpoint in status")
    # Kill host 1 of the slice, as a node failure would.
    os.killpg(agent.pids["quickstart"][1], signal.SIGKILL)
    status = _watch_phases(server, operator, "Succeeded", phases, steps)
    assert "Restarting" in phases and phases.index("Restarting") < len(phases) - 1
    assert phases[phases.index("Restarting") + 1] == "Running", phases
    # The operator restarted it: the failed JobSet was replaced by a new one, counted in the job's status.
    assert status["restarts"] == {"failure": 1, "preemption": 0, "hang": 0, "total": 1} and status["step"] == 20
    assert status["lastRestart"]["exitCode"] == 137 and "quickstart-slice-0-1" in status["lastRestart"]["message"]
    assert agent.started["quickstart"] == 2
    # Training resumed from the checkpoint: the step never went back past it.
    assert steps and min(steps) >= before["lastCheckpointStep"], steps
    assert _resumed_at(tmp_path) >= before["lastCheckpointStep"] > 0
    # Where the time went: start-up twice, and the restart itself.
    badput = status["badput"]
    assert 0 < status["goodput"] < 1 and badput["restarting"] > 0 and badput["startup"] > 0, status
    table = _printed_columns(kubectl(server, "get", "tpujobs", "-o", "wide", check=True).stdout)
    assert (table["RESTARTS"], table["PREEMPTIONS"], table["GOODPUT"]) == ("1", "0", str(status["goodput"])), table


def _printed_columns(table: str) -> dict[str, str]:
    """The first row of kubectl's table by column name (cells are cut at the header's offsets, as kubectl
    aligns them, so a message with spaces stays one cell)."""
    header, row = table.splitlines()[:2]
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+", header)]
    ends = [start for start, _ in starts[1:]] + [None]
    return {name: row[start:end].strip() for (start, name), end in zip(starts, ends)}


def test_fake_jobset_controller_hung_trainer_is_restarted_and_finishes(cluster, tmp_path):
    server, operator, agent = cluster
    # Host 1 stops making progress after step 7 (once: the restarted job trains on). A hung host ignores
    # SIGTERM, so it is killed after the pod's grace period.
    _apply_quickstart(server, tmp_path, plan={"preflight": "skip"}, steps=12,
                      env={"TPUJOB_TEST_HANG_AT_STEP": "7@1"},
                      failure_policy={"hangTimeoutSeconds": 6}, spec={"terminationGracePeriodSeconds": 2})
    phases, steps = [], []
    status = _watch_phases(server, operator, "Succeeded", phases, steps)
    assert phases[-3:] == ["Restarting", "Running", "Succeeded"], phases
    assert status["restarts"]["hang"] == 1 and status["restarts"]["total"] == 1, status["restarts"]
    # Host 1 hangs after reporting step 7; step 8, dispatched already, still completes everywhere.
    assert "hung: no step completed after step 8 for" in status["lastRestart"]["message"], status["lastRestart"]
    hung = next(c for c in status["conditions"] if c["type"] == "Hung")
    assert hung["status"] == "False" and hung["reason"] == "Progressing"  # it made progress again
    assert _resumed_at(tmp_path) == 5  # the checkpoint before the hang
    assert status["badput"]["hung"] >= 6 and status["step"] == 12
    events = kubectl(server, "get", "events", "-o", "json", check=True).stdout
    assert '"reason": "Hung"' in events


def test_fake_jobset_controller_user_error_fails_at_once_quoting_the_trainer(cluster, tmp_path):
    server, operator, agent = cluster
    _apply_quickstart(server, tmp_path, plan={"preflight": "skip"}, steps=10,
                      env={"TPUJOB_TEST_FAIL_AT_STEP": "2:3@1"})
    status = _watch_phases(server, operator, "Failed", [], [])
    # The trainer's last error line, from its termination record through the pod's container state.
    assert "exited with code 3 (user or configuration error): UserError: injected fault (TPUJOB_TEST_FAIL_AT_STEP) " \
           "at step 2; a user error is never retried" in status["message"], status["message"]
    assert status["restarts"]["total"] == 0 and agent.started["quickstart"] == 1
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "RestartPolicy"

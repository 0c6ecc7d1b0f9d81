"""Black-box tests of the operator's pre-flight compile: the test API server and `tpujob operator` run as
processes; the tests play the Job controller and the kubelet for the pre-flight batch Job (its pod, the
pod's termination message, the Job's status), so they are marked `fake_controller` and named
`test_fake_job_controller_...`. The real compile of a real pre-flight pod, run by the node agent, is in
tests/e2e/test_end_to_end.py.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import JOBSET_CRD
from tests.kubeapi.harness import Server, running_apiserver, wait_for
from tests.operator.test_operator_e2e import (JOBSETS, TPUJOB_CRD, WAIT_S, _operator_requests, condition, create_job,
                                              events, get, job_doc, jobset, make_namespace, operator,
                                              patch_jobset_status, replicated, server, wait_event, wait_status,
                                              wait_watching)
from tests.operator_process import Operator, running_operator
from tpu_operator.api.contract import PlanResult

pytestmark = [pytest.mark.e2e, pytest.mark.fake_controller]
__all__ = ["server", "operator"]  # the e2e module's fixtures, over this module's `cluster`

BATCH_JOBS = "/apis/batch/v1/namespaces/{ns}/jobs"
START_S = 3  # --preflight-start-timeout: a pod not running after this is looked at
FITS = PlanResult(verdict="Fits", message="fits: 13.03 GiB per device (0.70 state + 12.33 temporaries) on a v7x "
                  "4x4x4 x 1 slice(s), of 96 GiB (86.4 GiB with 10% headroom)", hbm_per_device_gib=13.03,
                  state_gib=0.7, temporaries_gib=12.33, hbm_capacity_gib=96, headroom=0.1, compile_seconds=47.1,
                  libtpu_version="0.0.52", device_kind="TPU7x", devices=128)
TOO_BIG = PlanResult(verdict="DoesNotFit", message="does not fit HBM on a v7x 2x2x1 x 1 slice(s): RESOURCE_EXHAUSTED: "
                     "E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for HLO "
                     "temporaries (162.91G) exceeds available HBM (94.74G).", state_gib=105.2, hbm_capacity_gib=96,
                     headroom=0.1, compile_seconds=23.0, libtpu_version="0.0.52",
                     change=["tpu.topology", "training.globalBatch", "tpu.slices"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Operator]]:
    workdir = tmp_path_factory.mktemp("operator-preflight-e2e")
    with running_apiserver(workdir, crds=[TPUJOB_CRD, JOBSET_CRD]) as api:
        with running_operator(api, workdir, "--namespace", "default", "--resync-interval", "5",
                              "--preflight-start-timeout", str(START_S)) as op:
            yield api, op


def planned_job(name: str, **spec: Any) -> dict[str, Any]:
    return job_doc(name, plan={"preflight": "compile", "hbmHeadroom": 0.1}, **spec)


def preflight(server: Server, name: str, ns: str = "default", generation: int = 1) -> dict[str, Any] | None:
    return get(server, f"{BATCH_JOBS.format(ns=ns)}/{name}-plan-{generation}")


def the_job_controller_runs(server: Server, name: str, result: PlanResult | None = None, *, exit_code: int = 0,
                            waiting: dict[str, Any] | None = None, ns: str = "default") -> None:
    """Stand in for the Job controller and the kubelet: the pre-flight Job's pod, ended with `result` as its
    termination message and the Job finished; or, with `waiting`, a pod that cannot start."""
    pf = wait_for(lambda: preflight(server, name, ns), WAIT_S, 0.1, "the pre-flight Job")
    template = pf["spec"]["template"]
    pod_name = f"{pf['metadata']['name']}-x7k2q"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "labels": template["metadata"]["labels"]},
           "spec": template["spec"]}
    code, body = server.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
    assert code == 201, body
    image = template["spec"]["containers"][0]["image"]
    if waiting is not None:
        state, phase, job_status = {"waiting": waiting}, "Pending", {"active": 1, "ready": 0}
    else:
        state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                "message": result.to_termination_message()}}
        phase = "Succeeded" if exit_code == 0 else "Failed"
        job_status = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]} if exit_code == 0 else \
            {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}
    status = {"phase": phase, "containerStatuses": [{"name": "plan", "image": image, "ready": False, "state": state}]}
    code, body = server.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{pod_name}/status", {"status": status},
                                content_type="application/merge-patch+json")
    assert code == 200, body
    code, body = server.request("PATCH", f"{BATCH_JOBS.format(ns=ns)}/{pf['metadata']['name']}/status",
                                {"status": job_status}, content_type="application/merge-patch+json")
    assert code == 200, body


def test_fake_job_controller_a_job_that_fits_gets_its_jobset_and_status_plan(server, operator):
    created = create_job(server, planned_job("fitting", runtime={"libtpuInitArgs": ["--xla_tpu_x=1"]}))
    status = wait_status(server, operator, "fitting", lambda s: condition(s, "Planned").get("reason") == "Compiling",
                         "Planned=Unknown Compiling")
    assert status["phase"] == "Pending" and "fitting-plan-1" in status["message"] and jobset(server, "fitting") is None
    pf = preflight(server, "fitting")
    (ref,) = pf["metadata"]["ownerReferences"]
    assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] is True
    assert pf["spec"]["backoffLimit"] == 0 and pf["spec"]["activeDeadlineSeconds"] > 0
    pod = pf["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:3] == ["python", "-m", "tpu_workload.plan"]
    assert container["command"][container["command"].index("--hbm-capacity-gib") + 1] == "96"
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert "google.com/tpu" not in json.dumps(container["resources"]) and "nodeSelector" not in pod
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LIBTPU_INIT_ARGS"].endswith("--xla_tpu_x=1")
    assert pod["volumes"][0]["configMap"]["name"] == "fitting-config"
    assert get(server, "/api/v1/namespaces/default/configmaps/fitting-config") is not None

    the_job_controller_runs(server, "fitting", FITS)
    status = wait_status(server, operator, "fitting", lambda s: s.get("jobSetName"), "a JobSet")
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("True", "Fits") and "13.03 GiB" in planned["message"]
    assert status["plan"]["hbmPerDeviceGiB"] == 13.03 and status["plan"]["hbmCapacityGiB"] == 96
    assert status["plan"]["fits"] is True and status["plan"]["compileSeconds"] == 47.1
    assert status["plan"]["libtpuVersion"] == "0.0.52" and status["plan"]["checkedAt"]
    assert condition(status, "Ready")["status"] == "True" and jobset(server, "fitting") is not None
    assert wait_event(server, "fitting", "Planned")["type"] == "Normal"


def test_fake_job_controller_a_job_that_does_not_fit_is_invalid_and_never_gets_a_jobset(server, operator):
    create_job(server, planned_job("greedy"))
    the_job_controller_runs(server, "greedy", TOO_BIG, exit_code=2)
    status = wait_status(server, operator, "greedy", lambda s: s.get("phase") == "Invalid", "phase Invalid")
    ready, planned = condition(status, "Ready"), condition(status, "Planned")
    assert (ready["status"], ready["reason"]) == ("False", "DoesNotFit")
    assert (planned["status"], planned["reason"]) == ("False", "DoesNotFit")
    assert "162.91G" in status["message"] and "change spec.tpu.topology, spec.training.globalBatch" in status["message"]
    assert status["plan"]["fits"] is False and "jobSetName" not in status
    event = wait_event(server, "greedy", "DoesNotFit")
    assert event["type"] == "Warning" and "162.91G" in event["message"]
    time.sleep(2)  # events and resyncs come and go: still no JobSet, and no second pre-flight
    assert jobset(server, "greedy") is None and preflight(server, "greedy", generation=2) is None
    assert [e["reason"] for e in events(server, "greedy")].count("DoesNotFit") == 1


def test_fake_job_controller_a_pre_flight_that_cannot_start_says_so_and_the_jobset_is_made(server, operator):
    create_job(server, planned_job("unpulled"))
    the_job_controller_runs(server, "unpulled", waiting={
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/tpu-operator/workload:0.1.0"'})
    status = wait_status(server, operator, "unpulled", lambda s: s.get("jobSetName"), "a JobSet without the check",
                         timeout=START_S + WAIT_S)
    planned = condition(status, "Planned")
    assert (planned["status"], planned["reason"]) == ("Unknown", "PreflightNotStarted")
    assert "ImagePullBackOff" in planned["message"] and "created without the check" in planned["message"]
    event = wait_event(server, "unpulled", "PreflightNotStarted")
    assert event["type"] == "Warning" and "ImagePullBackOff" in event["message"]
    assert jobset(server, "unpulled") is not None


def test_fake_job_controller_restarted_mid_pre_flight_the_operator_creates_no_second_one(server, tmp_path):
    ns = "preflight-restart"
    make_namespace(server, ns)
    with running_operator(server, tmp_path, "--namespace", ns) as first:
        create_job(server, planned_job("patient"), ns)
        wait_status(server, first, "patient", lambda s: condition(s, "Planned").get("reason") == "Compiling",
                    "Compiling", ns=ns)
        first.kill(signal.SIGKILL)
    with running_operator(server, tmp_path, "--namespace", ns) as second:
        wait_watching(server, ns, "tputrainingjobs", "jobs")
        time.sleep(1)  # it has looked at the job: the pre-flight Job is in its index
        the_job_controller_runs(server, "patient", FITS, ns=ns)
        wait_status(server, second, "patient", lambda s: s.get("jobSetName"), "a JobSet after the restart", ns=ns)
    posts = [r for r in server.requests_log() if r["method"] == "POST" and r["path"] == BATCH_JOBS.format(ns=ns)]
    assert len(posts) == 1 and [j["metadata"]["name"] for j in get(server, BATCH_JOBS.format(ns=ns))["items"]] \
        == ["patient-plan-1"]


# A pre-flighted job's requests, create -> Running: the budget of test_operator_e2e
# (BUDGET_TO_RUNNING, a job with preflight skip) plus the pre-flight's own, each said below.
BUDGET_PLANNED_TO_RUNNING = {
    ("POST", "configmaps"): 1,  # made with the pre-flight Job (its pod mounts it), not again with the JobSet
    ("POST", "jobs"): 1,  # the pre-flight Job
    ("GET", "pods"): 1,  # its pod, once it finished: the result is the pod's termination message
    ("POST", "jobsets"): 1,
    ("PATCH", "tputrainingjobs/status"): 3,  # Compiling (Pending), then Planned + the JobSet, then Running
    ("POST", "events"): 2,  # Planned, Created
}


def test_fake_job_controller_one_pre_flighted_jobs_requests_stay_within_budget(server, tmp_path):
    ns = "preflight-budget"
    make_namespace(server, ns)
    with running_operator(server, tmp_path, "--namespace", ns, "--resync-interval", "3600") as op:
        wait_watching(server, ns, "tputrainingjobs", "jobsets", "jobs")
        server.clear_requests_log()
        create_job(server, planned_job("counted"), ns)
        the_job_controller_runs(server, "counted", FITS, ns=ns)
        wait_status(server, op, "counted", lambda s: s.get("jobSetName"), "a JobSet", ns=ns)
        patch_jobset_status(server, "counted", {"replicatedJobsStatus": replicated(active=1, ready=1)}, ns)
        wait_status(server, op, "counted", lambda s: s.get("phase") == "Running", "phase Running", ns=ns)
        wait_event(server, "counted", "Created", ns)
        wait_event(server, "counted", "Planned", ns)
        assert _operator_requests(server, ns) == BUDGET_PLANNED_TO_RUNNING
    assert [js["metadata"]["name"] for js in get(server, JOBSETS.format(ns=ns))["items"]] == ["counted"]

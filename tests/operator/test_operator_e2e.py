"""Black-box tests: the test API server and `tpujob operator` run as real processes; the tests drive
them over HTTP and kubectl and assert on objects, status, Events and the request log.

There is no JobSet controller and no kubelet here: tests that write a JobSet's status or a Pod
stand in for them, say so in their names (`test_fake_jobset_controller_...`) and are marked
`fake_controller`. One operator (namespace `default`, direct metrics access, 1 s metrics interval)
serves the module; tests that kill or restart an operator run their own in their own namespace.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import JOBSET_CRD, ROOT, operator_job
from tests.kubeapi.harness import Server, kubectl, running_apiserver, wait_for
from tests.operator_process import Operator, running_operator
from tpu_workload.metrics import serve_http

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out

TPUJOB_CRD = ROOT / "crds" / "tputrainingjob.yaml"
JOBS = "/apis/training.tpu-operator.dev/v1alpha1/namespaces/{ns}/tputrainingjobs"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets"
CONFIGMAPS = "/api/v1/namespaces/{ns}/configmaps"
PODS = "/api/v1/namespaces/{ns}/pods"
WAIT_S = 30.0



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Operator]]:
    workdir = tmp_path_factory.mktemp("operator-e2e")
    with running_apiserver(workdir, crds=[TPUJOB_CRD, JOBSET_CRD]) as server:
        with running_operator(server, workdir, "--namespace", "default", "--metrics-access", "direct",
                              "--metrics-interval", "1", "--resync-interval", "5") as op:
            yield server, op


@pytest.fixture
def server(cluster: tuple[Server, Operator]) -> Iterator[Server]:
    try:
        yield cluster[0]
    finally:
        cluster[0].clear_faults()  # a failed test leaves no injected fault behind for the next one


@pytest.fixture
def operator(cluster: tuple[Server, Operator]) -> Operator:
    return cluster[1]


# --- helpers --------------------------------------------------------------------------------------------


def job_doc(name: str, **spec: Any) -> dict[str, Any]:
    """A tiny job named `name`; without the pre-flight unless `plan` says otherwise (its tests below)."""
    doc = operator_job(**spec)
    doc["metadata"]["name"] = name
    return doc


def create_job(server: Server, doc: dict[str, Any], ns: str = "default") -> dict[str, Any]:
    code, body = server.request("POST", JOBS.format(ns=ns), doc)
    assert code == 201, f"creating the job failed: {code} {body}"
    return body


def get(server: Server, path: str) -> dict[str, Any] | None:
    code, body = server.request("GET", path)
    if code == 404:
        return None
    assert code == 200, f"GET {path}: {code} {body}"
    return body


def job(server: Server, name: str, ns: str = "default") -> dict[str, Any] | None:
    return get(server, f"{JOBS.format(ns=ns)}/{name}")


def jobset(server: Server, name: str, ns: str = "default") -> dict[str, Any] | None:
    return get(server, f"{JOBSETS.format(ns=ns)}/{name}")


def wait_status(server: Server, operator: Operator, name: str, test: Callable[[dict[str, Any]], Any],
                what: str, ns: str = "default", timeout: float = WAIT_S) -> dict[str, Any]:
    """Wait until `test(status)` holds; fail with the last status and the operator's log."""
    last: dict[str, Any] = {}

    def check() -> Any:
        nonlocal last
        obj = job(server, name, ns)
        last = (obj or {}).get("status") or {}
        return last if test(last) else None

    try:
        return wait_for(check, timeout, 0.1, what)
    except AssertionError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what} of job {ns}/{name}; last status:\n"
                             f"{json.dumps(last, indent=1)}\noperator log:\n{operator.log_tail()}") from None


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def events(server: Server, name: str, ns: str = "default") -> list[dict[str, Any]]:
    items = (get(server, f"/api/v1/namespaces/{ns}/events") or {}).get("items") or []
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == name
            and (e.get("involvedObject") or {}).get("kind") == "TPUTrainingJob"]


def wait_event(server: Server, name: str, reason: str, ns: str = "default") -> dict[str, Any]:
    found = wait_for(lambda: [e for e in events(server, name, ns) if e.get("reason") == reason], WAIT_S, 0.1,
                     f"a {reason} Event on {ns}/{name}")
    return found[0]


def patch_jobset_status(server: Server, name: str, status: dict[str, Any], ns: str = "default") -> None:
    """Stand in for the JobSet controller: write the JobSet's status."""
    code, body = server.request("PATCH", f"{JOBSETS.format(ns=ns)}/{name}/status", {"status": status},
                                content_type="application/merge-patch+json")
    assert code == 200, f"patching the JobSet status failed: {code} {body}"


def replicated(active: int = 0, ready: int = 0, succeeded: int = 0, failed: int = 0) -> list[dict[str, Any]]:
    return [{"name": "slice", "active": active, "ready": ready, "succeeded": succeeded, "failed": failed,
             "suspended": 0}]


def jobset_condition(type_: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": "True", "reason": f"{type_}Reason", "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


def wait_watching(server: Server, ns: str, *plurals: str) -> None:
    """Wait until the operator watches each of `plurals` in `ns`: its liveness endpoint answers before
    kopf has listed them, and requests counted from here on are a job's, not the operator's start-up."""
    def watching() -> bool:
        watched = {r["path"].rsplit("/", 1)[-1] for r in server.requests_log()
                   if r["query"].get("watch") in ("true", "1") and f"/namespaces/{ns}/" in r["path"]}
        return set(plurals) <= watched

    wait_for(watching, WAIT_S, 0.1, f"the operator to watch {', '.join(plurals)} in {ns}")


def created_ok(server: Server, method: str, path_suffix: str) -> int:
    return sum(1 for r in server.requests_log()
               if r["method"] == method and r["path"].endswith(path_suffix) and r["status"] in (200, 201))


# --- tests ------------------------------------------------------------------------------------------------


def test_valid_job_gets_configmap_and_jobset_owned_by_it(server, operator):
    created = create_job(server, job_doc("shape", failurePolicy={"maxRestarts": 4}))
    uid = created["metadata"]["uid"]
    status = wait_status(server, operator, "shape", lambda s: s.get("phase") == "Pending" and s.get("jobSetName"),
                         "phase Pending with a JobSet")
    js, cm = jobset(server, "shape"), get(server, f"{CONFIGMAPS.format(ns='default')}/shape-config")
    assert js is not None and cm is not None
    for child in (js, cm):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["kind"] == "TPUTrainingJob" and ref["controller"] is True
        assert child["metadata"]["labels"]["training.tpu-operator.dev/job"] == "shape"
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1 and rjob["template"]["spec"]["parallelism"] == 1  # 2x2x1 = 1 host
    # JobSet never restarts itself: the operator does, within the job's maxRestarts (4) kept in its status.
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 0 and js["spec"]["suspend"] is False
    assert json.loads(cm["data"]["config.json"])["name"] == "shape"
    assert condition(status, "Ready")["status"] == "True" and status["observedGeneration"] == 1
    assert wait_event(server, "shape", "Created")["type"] == "Normal"
    # No finalizer and no annotation on the job: children go by garbage collection, and kopf keeps no state on it.
    meta = job(server, "shape")["metadata"]
    assert not meta.get("finalizers") and not any(k.startswith("kopf.zalando.org") for k in meta.get("annotations") or {})


def test_invalid_job_is_marked_invalid_with_event_and_no_children(server, operator):
    # Valid for the CRD schema (its pattern), invalid for the operator: v7x has no 3x3x3 slice.
    create_job(server, job_doc("broken", tpu={"generation": "v7x", "topology": "3x3x3"}))
    status = wait_status(server, operator, "broken", lambda s: s.get("phase") == "Invalid", "phase Invalid")
    ready = condition(status, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.tpu.topology" in ready["message"] and "3x3x3" in ready["message"]
    event = wait_event(server, "broken", "Invalid")
    assert event["type"] == "Warning" and "spec.tpu.topology" in event["message"]
    assert jobset(server, "broken") is None and get(server, f"{CONFIGMAPS.format(ns='default')}/broken-config") is None

    # Fixing the spec makes it run.
    code, body = server.request("PATCH", f"{JOBS.format(ns='default')}/broken",
                                {"spec": {"tpu": {"topology": "2x2x1"}}}, content_type="application/merge-patch+json")
    assert code == 200, body
    status = wait_status(server, operator, "broken", lambda s: s.get("phase") == "Pending", "phase Pending after a fix")
    assert condition(status, "Ready")["status"] == "True" and jobset(server, "broken") is not None


def fake_terminated_pod(server: Server, jobset_name: str, host: int, code: int, line: str, ns: str = "default") -> None:
    """Stand in for JobSet + kubelet: a pod of the JobSet whose trainer exited with `code`, its termination
    message the trainer's record (api/lifecycle.py)."""
    js = jobset(server, jobset_name, ns)
    name = f"{jobset_name}-slice-0-{host}-{js['metadata']['uid'][:5]}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {
        "jobset.sigs.k8s.io/jobset-name": jobset_name, "jobset.sigs.k8s.io/job-index": "0",
        "batch.kubernetes.io/job-completion-index": str(host)}},
        "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
    code_, body = server.request("POST", PODS.format(ns=ns), pod)
    assert code_ == 201, body
    terminated = {"exitCode": code, "reason": "Error", "finishedAt": "2026-01-01T00:00:00Z",
                  "message": json.dumps({"code": code, "error": line})}
    code_, body = server.request("PATCH", f"{PODS.format(ns=ns)}/{name}/status", {"status": {
        "phase": "Failed", "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "restartCount": 0,
                                                  "ready": False, "state": {"terminated": terminated}}]}},
        content_type="application/merge-patch+json")
    assert code_ == 200, body


def fail_jobset(server: Server, name: str, code: int, line: str, ns: str = "default") -> str:
    """A pod of the JobSet fails, and so the JobSet (maxRestarts 0): its uid."""
    fake_terminated_pod(server, name, 1, code, line, ns)
    patch_jobset_status(server, name, {"terminalState": "Failed", "replicatedJobsStatus": replicated(failed=1),
                                       "conditions": [jobset_condition("Failed", "jobs failed")]}, ns)
    return jobset(server, name, ns)["metadata"]["uid"]


def replaced_jobset(server: Server, name: str, old_uid: str, ns: str = "default") -> dict[str, Any]:
    return wait_for(lambda: (js := jobset(server, name, ns)) is not None and js["metadata"]["uid"] != old_uid and js,
                    WAIT_S, 0.1, f"a new JobSet {name}")


@pytest.mark.fake_controller
def test_fake_jobset_controller_running_restarting_succeeded(server, operator):
    create_job(server, job_doc("lifecycle", failurePolicy={"backoffSeconds": 1}))
    wait_status(server, operator, "lifecycle", lambda s: s.get("phase") == "Pending", "phase Pending")

    patch_jobset_status(server, "lifecycle", {"replicatedJobsStatus": replicated(active=1)})
    status = wait_status(server, operator, "lifecycle", lambda s: s.get("phase") == "Running", "phase Running")
    assert status["startTime"] and condition(status, "Running")["status"] == "True"
    running_since = condition(status, "Running")["lastTransitionTime"]

    # A host fails with a retryable code: the operator counts the restart and replaces the JobSet after its backoff.
    first = fail_jobset(server, "lifecycle", 42, "Retryable: gloo: connection reset by peer")
    status = wait_status(server, operator, "lifecycle", lambda s: s.get("phase") == "Restarting", "phase Restarting")
    assert status["restarts"] == {"failure": 1, "preemption": 0, "hang": 0, "total": 1}
    assert status["lastRestart"]["jobSetUid"] == first and status["lastRestart"]["exitCode"] == 42
    assert "Retryable: gloo: connection reset by peer; restart 1 (failure) in 1 s" in status["message"]
    assert status["nextRestartTime"]
    assert wait_event(server, "lifecycle", "Restarted")["type"] == "Warning"
    replaced_jobset(server, "lifecycle", first)
    status = wait_status(server, operator, "lifecycle", lambda s: not s.get("nextRestartTime"), "the JobSet re-created")
    assert status["phase"] == "Restarting"

    patch_jobset_status(server, "lifecycle", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    status = wait_status(server, operator, "lifecycle", lambda s: s.get("phase") == "Running", "Running again")
    assert status["restarts"]["total"] == 1

    patch_jobset_status(server, "lifecycle", {"terminalState": "Completed", "replicatedJobsStatus": replicated(succeeded=1),
                                              "conditions": [jobset_condition("Completed", "jobset completed")]})
    status = wait_status(server, operator, "lifecycle", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert status["completionTime"] and condition(status, "Succeeded")["status"] == "True"
    assert condition(status, "Running")["status"] == "False"
    assert condition(status, "Running")["lastTransitionTime"] >= running_since
    assert 0 <= status["goodput"] <= 1 and status["badput"]["restarting"] >= 1  # the backoff at least
    wait_event(server, "lifecycle", "Succeeded")


@pytest.mark.fake_controller
def test_fake_jobset_controller_user_error_fails_at_once_quoting_the_trainer(server, operator):
    create_job(server, job_doc("doomed"))
    wait_status(server, operator, "doomed", lambda s: s.get("phase") == "Pending", "phase Pending")
    uid = fail_jobset(server, "doomed", 3, "UserError: data.path gs://bucket/tokens has no .npy files")
    status = wait_status(server, operator, "doomed", lambda s: s.get("phase") == "Failed", "phase Failed")
    assert status["message"] == ("doomed-slice-0-1-" + uid[:5] + " exited with code 3 (user or configuration error): "
                                 "UserError: data.path gs://bucket/tokens has no .npy files; a user error is never retried")
    assert status["restarts"]["total"] == 0 and status["completionTime"]
    assert condition(status, "Failed")["status"] == "True"
    assert wait_event(server, "doomed", "Failed")["type"] == "Warning"
    assert jobset(server, "doomed")["metadata"]["uid"] == uid  # kept, for its pods' logs


@pytest.mark.fake_controller
def test_fake_jobset_controller_restart_budget_survives_jobset_recreation(server, operator):
    create_job(server, job_doc("budgeted", failurePolicy={"maxRestarts": 1, "backoffSeconds": 1}))
    wait_status(server, operator, "budgeted", lambda s: s.get("phase") == "Pending", "phase Pending")
    first = fail_jobset(server, "budgeted", 42, "Retryable: TPU runtime error")
    second = replaced_jobset(server, "budgeted", first)["metadata"]["uid"]
    # Someone deletes the JobSet: the operator creates it again, and the job's restart count stays as it was.
    code, _ = server.request("DELETE", f"{JOBSETS.format(ns='default')}/budgeted")
    assert code == 200
    third = replaced_jobset(server, "budgeted", second)["metadata"]["uid"]
    status = wait_status(server, operator, "budgeted", lambda s: not s.get("nextRestartTime"), "the JobSet re-created")
    assert status["restarts"]["total"] == 1
    fail_jobset(server, "budgeted", 137, "")
    status = wait_status(server, operator, "budgeted", lambda s: s.get("phase") == "Failed", "phase Failed")
    assert "restart budget spent (1 of maxRestarts 1 used)" in status["message"]
    assert jobset(server, "budgeted")["metadata"]["uid"] == third and status["restarts"]["total"] == 1


@pytest.mark.fake_controller
def test_fake_jobset_controller_suspend_and_resume(server, operator):
    create_job(server, job_doc("pausable"))
    wait_status(server, operator, "pausable", lambda s: s.get("phase") == "Pending", "phase Pending")
    patch = {"spec": {"suspend": True}}
    code, body = server.request("PATCH", f"{JOBS.format(ns='default')}/pausable", patch,
                                content_type="application/merge-patch+json")
    assert code == 200, body
    wait_for(lambda: jobset(server, "pausable")["spec"].get("suspend") is True, WAIT_S, 0.1, "JobSet spec.suspend=true")
    patch_jobset_status(server, "pausable", {"conditions": [jobset_condition("Suspended", "jobset suspended")]})
    status = wait_status(server, operator, "pausable", lambda s: s.get("phase") == "Suspended", "phase Suspended")
    assert condition(status, "SpecChange")["status"] == "True"  # suspend is an allowed change

    code, body = server.request("PATCH", f"{JOBS.format(ns='default')}/pausable", {"spec": {"suspend": False}},
                                content_type="application/merge-patch+json")
    assert code == 200, body
    wait_for(lambda: jobset(server, "pausable")["spec"].get("suspend") is False, WAIT_S, 0.1, "JobSet spec.suspend=false")
    patch_jobset_status(server, "pausable", {"conditions": [], "replicatedJobsStatus": replicated(active=1)})
    wait_status(server, operator, "pausable", lambda s: s.get("phase") == "Running", "phase Running after resume")
    wait_event(server, "pausable", "Resumed")


def test_spec_change_is_refused_and_jobset_kept(server, operator):
    create_job(server, job_doc("frozen"))
    wait_status(server, operator, "frozen", lambda s: s.get("phase") == "Pending", "phase Pending")
    before = jobset(server, "frozen")
    code, body = server.request("PATCH", f"{JOBS.format(ns='default')}/frozen",
                                {"spec": {"training": {"steps": 99}, "image": "example.com/other:1"}},
                                content_type="application/merge-patch+json")
    assert code == 200, body
    status = wait_status(server, operator, "frozen", lambda s: condition(s, "SpecChange").get("status") == "False",
                         "SpecChange=False")
    change = condition(status, "SpecChange")
    assert change["reason"] == "Immutable"
    assert "spec.training.steps" in change["message"] and "spec.image" in change["message"]
    assert "delete and re-create" in change["message"]
    assert status["observedGeneration"] == 2
    event = wait_event(server, "frozen", "SpecChangeRefused")
    assert event["type"] == "Warning" and "spec.training.steps" in event["message"]
    after = jobset(server, "frozen")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"]


def test_deleting_the_job_deletes_its_children(server, operator):
    create_job(server, job_doc("ephemeral"))
    wait_status(server, operator, "ephemeral", lambda s: s.get("jobSetName"), "a JobSet")
    kubectl(server, "delete", "tpujob", "ephemeral", "--wait=false", check=True)
    wait_for(lambda: job(server, "ephemeral") is None and jobset(server, "ephemeral") is None
             and get(server, f"{CONFIGMAPS.format(ns='default')}/ephemeral-config") is None,
             WAIT_S, 0.1, "the job, its JobSet and its ConfigMap to be gone")


def test_name_conflict_with_an_unowned_jobset(server, operator):
    foreign = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "squatted"},
               "spec": {"replicatedJobs": [{"name": "x", "replicas": 1, "template": {"spec": {"template": {"spec": {
                   "containers": [{"name": "c", "image": "busybox"}], "restartPolicy": "Never"}}}}}]}}
    code, body = server.request("POST", JOBSETS.format(ns="default"), foreign)
    assert code == 201, body
    create_job(server, job_doc("squatted"))
    status = wait_status(server, operator, "squatted", lambda s: condition(s, "Ready").get("reason") == "NameConflict",
                         "Ready=False NameConflict")
    assert condition(status, "Ready")["status"] == "False" and "JobSet squatted" in condition(status, "Ready")["message"]
    wait_event(server, "squatted", "NameConflict")
    assert jobset(server, "squatted")["metadata"]["resourceVersion"] == body["metadata"]["resourceVersion"]


def test_jobset_deleted_under_a_running_job_is_recreated(server, operator):
    create_job(server, job_doc("phoenix"))
    wait_status(server, operator, "phoenix", lambda s: s.get("jobSetName"), "a JobSet")
    first = jobset(server, "phoenix")["metadata"]["uid"]
    code, _ = server.request("DELETE", f"{JOBSETS.format(ns='default')}/phoenix")
    assert code == 200
    wait_for(lambda: (js := jobset(server, "phoenix")) is not None and js["metadata"]["uid"] != first,
             WAIT_S, 0.1, "a new JobSet")


@pytest.mark.fake_controller
def test_fake_jobset_controller_api_errors_and_dropped_watch_recover(server, operator):
    create_job(server, job_doc("bumpy"))
    wait_status(server, operator, "bumpy", lambda s: s.get("phase") == "Pending", "phase Pending")
    # Status writes fail for a while (503s, then resourceVersion conflicts), and every watch is cut.
    server.inject_fault(r"/tputrainingjobs/bumpy/status$", 503, method="PATCH", count=3)
    server.inject_fault(r"/tputrainingjobs/bumpy/status$", 409, method="PATCH", count=2)
    assert server.drop_watches() >= 2
    patch_jobset_status(server, "bumpy", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    wait_status(server, operator, "bumpy", lambda s: s.get("phase") == "Running", "phase Running after API errors",
                timeout=60)
    assert not server.request("GET", "/_test/faults")[1]["items"], "the injected faults were not all hit"
    assert operator.process.poll() is None


def test_operator_metrics_and_rbac_printout(server, operator):
    create_job(server, job_doc("counted"))
    wait_status(server, operator, "counted", lambda s: s.get("jobSetName"), "a JobSet")
    text = wait_for(lambda: next((t for t in [operator.metrics()] if 'handler="job"' in t), None), WAIT_S, 0.2,
                    "reconcile metrics")
    assert '# TYPE tpu_operator_reconciles_total counter' in text
    assert 'tpu_operator_reconcile_duration_seconds_bucket{handler="job",le="+Inf"}' in text
    assert 'tpu_operator_reconcile_errors_total{handler="job"}' in text
    rbac = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "operator", "--print-rbac"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "jobsets" in rbac and "tputrainingjobs/status" in rbac and "pods/proxy" in rbac


# --- the trainer's metrics --------------------------------------------------------------------------------


class Trainer:
    """A tiny HTTP server standing in for process 0 of the trainer: GET /status."""

    def __init__(self) -> None:
        self.sample: dict[str, Any] = {}
        self.httpd = serve_http(lambda path: (200 if path == "/status" else 404, json.dumps(self.sample).encode(),
                                              "application/json"), 0, "127.0.0.1")
        self.port = self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    try:
        yield t
    finally:
        t.stop()


def fake_pod0(server: Server, jobset_name: str, ns: str = "default") -> None:
    """Stand in for JobSet + kubelet: pod 0 of slice 0, running on 127.0.0.1."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{jobset_name}-slice-0-0-abcde", "labels": {
               "jobset.sigs.k8s.io/jobset-name": jobset_name, "jobset.sigs.k8s.io/job-index": "0",
               "batch.kubernetes.io/job-completion-index": "0"}},
           "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
    code, body = server.request("POST", PODS.format(ns=ns), pod)
    assert code == 201, body
    code, body = server.request("PATCH", f"{PODS.format(ns=ns)}/{pod['metadata']['name']}/status",
                                {"status": {"phase": "Running", "podIP": "127.0.0.1"}},
                                content_type="application/merge-patch+json")
    assert code == 200, body


@pytest.mark.fake_controller
def test_fake_jobset_controller_trainer_metrics_land_in_status_and_columns(server, operator, trainer):
    trainer.sample = {"step": 42, "loss": 2.5, "step_time_s": 0.75, "tokens_per_s": 1234.5, "mfu": 0.41,
                      "last_checkpoint_step": 40, "total_steps": 100, "state": "training", "time": 1.0}
    create_job(server, job_doc("measured", runtime={"metricsPort": trainer.port}))
    wait_status(server, operator, "measured", lambda s: s.get("phase") == "Pending", "phase Pending")
    fake_pod0(server, "measured")
    patch_jobset_status(server, "measured", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    status = wait_status(server, operator, "measured", lambda s: s.get("step") == 42, "step 42 from the trainer")
    assert status["mfu"] == 0.41 and status["stepTimeSeconds"] == 0.75 and status["tokensPerSecond"] == 1234.5
    assert status["lastCheckpointStep"] == 40 and status["metricsTime"]
    assert condition(status, "Metrics")["status"] == "True"
    table = kubectl(server, "get", "tpujobs", "measured", check=True).stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:6] == ["NAME", "PHASE", "TOPOLOGY", "STEP", "MFU", "STEP"], table
    assert row.split()[:6] == ["measured", "Running", "2x2x1", "42", "0.41", "0.75"], table

    # The trainer goes away: stale values, Metrics=False Unreachable, operator still up.
    trainer.stop()
    status = wait_status(server, operator, "measured", lambda s: condition(s, "Metrics").get("status") == "False",
                         "Metrics=False")
    assert condition(status, "Metrics")["reason"] == "Unreachable" and status["step"] == 42
    assert operator.process.poll() is None


@pytest.mark.fake_controller
def test_fake_jobset_controller_final_metrics_read_on_completion(server, operator, trainer):
    trainer.sample = {"step": 5, "step_time_s": 1.0, "mfu": 0.3}
    create_job(server, job_doc("finisher", runtime={"metricsPort": trainer.port}))
    wait_status(server, operator, "finisher", lambda s: s.get("phase") == "Pending", "phase Pending")
    fake_pod0(server, "finisher")
    trainer.sample = {"step": 10, "step_time_s": 0.9, "mfu": 0.35, "state": "done"}  # the trainer's final values
    patch_jobset_status(server, "finisher", {"terminalState": "Completed",
                                             "conditions": [jobset_condition("Completed")]})
    status = wait_status(server, operator, "finisher", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert status["step"] == 10 and status["mfu"] == 0.35


# --- why pending --------------------------------------------------------------------------------------------

UNSCHEDULABLE = ("0/12 nodes are available: 12 Insufficient google.com/tpu. preemption: 0/12 nodes are available: "
                 "12 No preemption victims found for incoming pod.")


def fake_pod(server: Server, jobset_name: str, status: dict[str, Any], ns: str = "default") -> str:
    """Stand in for JobSet + the scheduler + kubelet: pod 0 of slice 0 of the JobSet, with `status`."""
    name = f"{jobset_name}-slice-0-0-xyz12"
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/jobset-name": jobset_name}},
           "spec": {"containers": [{"name": "trainer", "image": "example.com/trainer:1"}]}}
    if get(server, f"{PODS.format(ns=ns)}/{name}") is None:
        code, body = server.request("POST", PODS.format(ns=ns), pod)
        assert code == 201, body
    code, body = server.request("PATCH", f"{PODS.format(ns=ns)}/{name}/status", {"status": status},
                                content_type="application/merge-patch+json")
    assert code == 200, body
    return name


def pod_lists(server: Server, jobset_name: str, ns: str = "default") -> int:
    """The operator's looks at all of one JobSet's pods (not the metrics reader's search for its pod 0)."""
    return sum(1 for r in server.requests_log() if r["method"] == "GET" and r["path"] == PODS.format(ns=ns)
               and r["userAgent"].startswith("tpu-operator")
               and r["query"].get("labelSelector") == f"jobset.sigs.k8s.io/jobset-name={jobset_name}")


def jobset_gets(server: Server, name: str, ns: str = "default") -> int:
    return sum(1 for r in server.requests_log() if r["method"] == "GET" and r["path"] == f"{JOBSETS.format(ns=ns)}/{name}")


@pytest.mark.fake_controller
def test_fake_scheduler_unschedulable_pods_are_explained_within_a_resync(server, operator):
    create_job(server, job_doc("stuck"))
    wait_status(server, operator, "stuck", lambda s: s.get("phase") == "Pending", "phase Pending")
    # The JobSet controller counts the Job active (its pod is pending) and none ready. It says nothing more
    # when the scheduler then gives up on the pod: only the resync (5 s here) can find out why.
    patch_jobset_status(server, "stuck", {"replicatedJobsStatus": replicated(active=1)})
    wait_status(server, operator, "stuck", lambda s: s.get("phase") == "Running", "phase Running (active)")
    pod = fake_pod(server, "stuck", {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHEDULABLE}]})
    status = wait_status(server, operator, "stuck", lambda s: s.get("phase") == "Pending" and "Insufficient" in
                         s.get("message", ""), "phase Pending with the scheduler's words", timeout=15)
    assert status["message"] == f"pod {pod} cannot be scheduled: {UNSCHEDULABLE}"
    assert (condition(status, "Scheduled")["status"], condition(status, "Scheduled")["reason"]) == \
        ("False", "Unschedulable")
    event = wait_event(server, "stuck", "Unschedulable")
    assert event["type"] == "Warning" and UNSCHEDULABLE in event["message"]
    table = kubectl(server, "get", "tpujobs", "stuck", "-o", "wide", check=True).stdout
    assert "Pending" in table and "Insufficient google.com/tpu" in table, table
    # Two more resyncs list the pod again and find the same: no new Event.
    lists = pod_lists(server, "stuck")
    wait_for(lambda: pod_lists(server, "stuck") >= lists + 2, WAIT_S, 0.2, "two more resyncs")
    assert [e["reason"] for e in events(server, "stuck")].count("Unschedulable") == 1

    # Placed, but its image cannot be pulled: the kubelet's words, with the image.
    fake_pod(server, "stuck", {"conditions": [{"type": "PodScheduled", "status": "True"}], "containerStatuses": [
        {"name": "trainer", "image": "example.com/trainer:1", "ready": False, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "example.com/trainer:1"'}}}]})
    status = wait_status(server, operator, "stuck", lambda s: "ImagePullBackOff" in s.get("message", ""),
                         "the image pull failure", timeout=15)
    assert 'Back-off pulling image "example.com/trainer:1"' in status["message"] and status["phase"] == "Pending"
    assert condition(status, "Scheduled")["status"] == "True"
    assert condition(status, "ContainersReady")["reason"] == "ImagePullBackOff"
    wait_event(server, "stuck", "ImagePullBackOff")

    # It runs: the JobSet says so, and the operator stops listing pods.
    patch_jobset_status(server, "stuck", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    status = wait_status(server, operator, "stuck", lambda s: s.get("phase") == "Running" and
                         condition(s, "ContainersReady").get("status") == "True", "phase Running")
    assert "ImagePullBackOff" not in status["message"]
    lists, gets, seen = pod_lists(server, "stuck"), jobset_gets(server, "stuck"), len(server.requests_log())
    wait_for(lambda: jobset_gets(server, "stuck") >= gets + 2, WAIT_S, 0.2, "two more resyncs")  # each GETs the JobSet
    assert pod_lists(server, "stuck") == lists, [(r["method"], r["path"], r["query"]) for r in server.requests_log()[seen:]
                                        if r["userAgent"].startswith("tpu-operator")]


def test_without_kueue_the_workload_watch_waits_for_its_crd(server, operator):
    # The module's API server has no Workload CRD: kopf says so once and serves everything else (every
    # other test here), and the operator never asks for Workloads.
    log = operator.log_path.read_text(errors="replace")
    assert "Unresolved resources cannot be served (try creating their CRDs): Selector(group='kueue.x-k8s.io', " \
           "plural='workloads')" in log
    assert not [r for r in server.requests_log() if r["path"].startswith("/apis/kueue.x-k8s.io/")]


@pytest.mark.fake_controller
def test_fake_jobset_controller_a_trainer_that_stops_stepping_is_hung_and_restarted(server, operator, trainer):
    create_job(server, job_doc("stalled", runtime={"metricsPort": trainer.port},
                               failurePolicy={"hangTimeoutSeconds": 4, "backoffSeconds": 1}))
    wait_status(server, operator, "stalled", lambda s: s.get("phase") == "Pending", "phase Pending")
    fake_pod0(server, "stalled")
    now = time.time()  # the trainer started, completed step 3, and has made no progress since
    trainer.sample = {"step": 3, "step_time_s": 0.5, "progress": {
        "started_at": now, "start_step": 0, "first_step_at": now, "last_step_at": now, "step": 3,
        "step_seconds": 1.0, "steps_timed": 2, "median_step_seconds": 0.5}}
    patch_jobset_status(server, "stalled", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    first = jobset(server, "stalled")["metadata"]["uid"]
    status = wait_status(server, operator, "stalled", lambda s: (s.get("restarts") or {}).get("hang") == 1,
                         "a restart for a hang")
    hung = condition(status, "Hung")
    assert hung["status"] == "True" and hung["reason"] == "NoProgress"
    assert "hung: no step completed after step 3 for" in hung["message"] and "(limit 4 s)" in hung["message"]
    assert wait_event(server, "stalled", "Hung")["type"] == "Warning" and status["lastRestart"]["cause"] == "hang"
    replaced_jobset(server, "stalled", first)
    text = operator.metrics()
    assert 'tpu_operator_job_restarts{cause="hang",job="stalled",namespace="default"} 1.0' in text
    assert 'tpu_operator_job_goodput{job="stalled",namespace="default"}' in text
    assert 'tpu_operator_job_badput_seconds{bucket="hung",job="stalled",namespace="default"}' in text


# --- restarts of the operator ------------------------------------------------------------------------------


def make_namespace(server: Server, name: str) -> None:
    code, body = server.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert code in (201, 409), body


def test_operator_killed_mid_reconcile_creates_exactly_one_jobset(server, tmp_path):
    ns = "restarts"
    make_namespace(server, ns)
    # JobSet creation fails while the first operator runs: it has made the ConfigMap, not the JobSet.
    server.inject_fault(rf"/namespaces/{ns}/jobsets$", 503, method="POST", count=10_000)
    with running_operator(server, tmp_path, "--namespace", ns) as first:
        create_job(server, job_doc("survivor"), ns)
        wait_for(lambda: get(server, f"{CONFIGMAPS.format(ns=ns)}/survivor-config"), WAIT_S, 0.1, "the ConfigMap")
        wait_for(lambda: any(r["method"] == "POST" and r["path"].endswith(f"/{ns}/jobsets") for r in server.requests_log()),
                 WAIT_S, 0.1, "a JobSet create attempt")
        first.kill(signal.SIGKILL)
    server.clear_faults()
    with running_operator(server, tmp_path, "--namespace", ns) as second:
        wait_status(server, second, "survivor", lambda s: s.get("jobSetName") and s.get("phase") == "Pending",
                    "a JobSet after the restart", ns=ns)
        wait_event(server, "survivor", "Created", ns)  # Events are posted in the background: let it go out
        # Killed again after everything exists, and restarted: it adopts, creates nothing new.
        second.kill(signal.SIGKILL)
    with running_operator(server, tmp_path, "--namespace", ns) as third:
        patch_jobset_status(server, "survivor", {"replicatedJobsStatus": replicated(active=1)}, ns)
        wait_status(server, third, "survivor", lambda s: s.get("phase") == "Running", "phase Running", ns=ns)
    items = get(server, JOBSETS.format(ns=ns))["items"]
    assert [js["metadata"]["name"] for js in items] == ["survivor"]
    assert len(get(server, CONFIGMAPS.format(ns=ns))["items"]) == 1
    assert created_ok(server, "POST", f"/{ns}/jobsets") == 1
    assert created_ok(server, "POST", f"/{ns}/configmaps") == 1
    assert len([e for e in events(server, "survivor", ns) if e["reason"] == "Created"]) == 1


@pytest.mark.fake_controller
def test_fake_jobset_controller_deleting_a_running_job_completes(server, operator):
    # While Running, the operator reads the trainer every second; deletion must still finish at once.
    create_job(server, job_doc("busy"))
    wait_status(server, operator, "busy", lambda s: s.get("phase") == "Pending", "phase Pending")
    patch_jobset_status(server, "busy", {"replicatedJobsStatus": replicated(active=1, ready=1)})
    wait_status(server, operator, "busy", lambda s: s.get("phase") == "Running", "phase Running")
    code, body = server.request("DELETE", f"{JOBS.format(ns='default')}/busy")
    assert code == 200, body
    wait_for(lambda: job(server, "busy") is None and jobset(server, "busy") is None
             and get(server, f"{CONFIGMAPS.format(ns='default')}/busy-config") is None,
             WAIT_S, 0.1, "the Running job and its children to be gone")


# --- the periodic resync ------------------------------------------------------------------------------------

# The operator's log line when a status write conflicted, was recomputed, and conflicted again.
GAVE_UP = "the status write of resync/straggler conflicted twice; leaving it to the next event or resync"


@pytest.mark.fake_controller
def test_fake_jobset_controller_lost_completion_is_caught_up_by_the_resync(server, tmp_path):
    ns = "resync"
    make_namespace(server, ns)
    with running_operator(server, tmp_path, "--namespace", ns, "--resync-interval", "1") as op:
        create_job(server, job_doc("straggler"), ns)
        wait_status(server, op, "straggler", lambda s: s.get("jobSetName") and s.get("phase") == "Pending",
                    "phase Pending with a JobSet", ns=ns)
        # Every status write conflicts, as if another writer kept changing the status: the reconcile of the
        # JobSet's completion event re-reads, conflicts again and gives up; no event will come again.
        server.inject_fault(rf"/namespaces/{ns}/tputrainingjobs/straggler/status$", 409, method="PATCH", count=16)
        completed = {"terminalState": "Completed", "replicatedJobsStatus": replicated(succeeded=1),
                     "conditions": [jobset_condition("Completed", "jobset completed")]}
        patch_jobset_status(server, "straggler", completed, ns)
        wait_for(lambda: GAVE_UP in op.log_path.read_text(errors="replace"), WAIT_S, 0.1,
                 "the handling of the JobSet's completion event to give up")
        # No JobSet event comes after the last one: only the resync can see that the JobSet completed.
        status = wait_status(server, op, "straggler", lambda s: s.get("phase") == "Succeeded",
                             "phase Succeeded through the resync", ns=ns)
        assert status["completionTime"] and condition(status, "Succeeded")["status"] == "True"
        assert status["message"] == "jobset completed"
        wait_event(server, "straggler", "Succeeded", ns)
        assert len([e for e in events(server, "straggler", ns) if e["reason"] == "Succeeded"]) == 1
    assert not server.request("GET", "/_test/faults")[1]["items"], "the injected conflicts were not all hit"
    # The resync re-derived the status and created nothing.
    assert [js["metadata"]["name"] for js in get(server, JOBSETS.format(ns=ns))["items"]] == ["straggler"]
    assert created_ok(server, "POST", f"/{ns}/jobsets") == 1
    assert created_ok(server, "POST", f"/{ns}/configmaps") == 1


def _rbac_of(request: dict[str, Any]) -> tuple[str, str, str] | None:
    """(apiGroup, resource[/subresource], verb) of one logged request; None for discovery paths."""
    parts = [p for p in request["path"].split("/") if p]
    if parts[:1] == ["api"] and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    method, watch = request["method"], request["query"].get("watch") in ("true", "1")
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method) or (
        ("delete" if name else "deletecollection") if method == "DELETE" else
        "watch" if watch else "get" if name else "list")
    return group, f"{resource}/{sub}" if sub else resource, verb


def test_every_operator_request_is_covered_by_its_rbac_rules(server, operator):
    from tpu_operator.controller.rbac import RBAC_RULES

    allowed = {(g, r, v) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    used = {rbac for r in server.requests_log() if r["userAgent"].startswith(("kopf", "tpu-operator"))
            if (rbac := _rbac_of(r)) is not None}
    assert ("jobset.x-k8s.io", "jobsets", "create") in used and ("", "events", "create") in used
    assert used <= allowed, f"requests outside the RBAC rules: {sorted(used - allowed)}"
    print("RBAC used:", sorted(used))


def test_all_namespaces_operator_serves_a_namespace_made_after_it_started(tmp_path):
    # Its own API server: an --all-namespaces operator would also serve the module's namespaces.
    with running_apiserver(tmp_path, crds=[TPUJOB_CRD, JOBSET_CRD]) as server, \
            running_operator(server, tmp_path, "--all-namespaces", "--default-image", "example.com/trainer:7") as op:
        make_namespace(server, "team-a")
        create_job(server, job_doc("late"), "team-a")
        wait_status(server, op, "late", lambda s: s.get("jobSetName"), "a JobSet in a new namespace", ns="team-a")
        pod = jobset(server, "late", "team-a")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "example.com/trainer:7"


# --- API cost ---------------------------------------------------------------------------------------------------

# Requests the operator makes for one job, by what they are for. A change that adds one fails here:
# say why in the budget (and README) if it must.
BUDGET_TO_RUNNING = {("POST", "configmaps"): 1, ("POST", "jobsets"): 1, ("PATCH", "tputrainingjobs/status"): 2,
                     ("POST", "events"): 1}  # Pending (+ the Created Event), then Running
BUDGET_RUNNING_TO_END = {("GET", "pods"): 1,  # pod 0, found once and remembered
                         ("PATCH", "tputrainingjobs/status"): 2,  # the first metrics, then Succeeded
                         ("POST", "events"): 1}  # Succeeded


def _operator_requests(server: Server, ns: str) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for r in server.requests_log():
        if r["userAgent"].startswith(("kopf", "tpu-operator")) and f"/namespaces/{ns}/" in r["path"] \
                and r["query"].get("watch") not in ("true", "1"):
            rbac = _rbac_of(r)
            key = (r["method"], rbac[1] if rbac else r["path"])
            counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.fake_controller
def test_fake_jobset_controller_one_jobs_requests_stay_within_budget(server, tmp_path, trainer):
    ns = "budget"
    make_namespace(server, ns)
    trainer.sample = {"step": 3, "step_time_s": 0.5, "mfu": 0.2}
    with running_operator(server, tmp_path, "--namespace", ns, "--metrics-access", "direct",
                          "--metrics-interval", "1", "--resync-interval", "3600") as op:
        wait_watching(server, ns, "tputrainingjobs", "jobsets")
        server.clear_requests_log()
        create_job(server, job_doc("frugal", runtime={"metricsPort": trainer.port}), ns)
        wait_status(server, op, "frugal", lambda s: s.get("phase") == "Pending", "phase Pending", ns=ns)
        fake_pod0(server, "frugal", ns)
        patch_jobset_status(server, "frugal", {"replicatedJobsStatus": replicated(active=1, ready=1)}, ns)
        wait_status(server, op, "frugal", lambda s: s.get("phase") == "Running", "phase Running", ns=ns)
        wait_event(server, "frugal", "Created", ns)
        assert _operator_requests(server, ns) == BUDGET_TO_RUNNING
        server.clear_requests_log()
        wait_status(server, op, "frugal", lambda s: s.get("step") == 3, "the trainer's step", ns=ns)
        trainer.sample = {"step": 3, "step_time_s": 0.5, "mfu": 0.2}  # unchanged reads write nothing
        patch_jobset_status(server, "frugal", {"terminalState": "Completed", "replicatedJobsStatus": replicated(
            succeeded=1), "conditions": [jobset_condition("Completed")]}, ns)
        wait_status(server, op, "frugal", lambda s: s.get("phase") == "Succeeded", "phase Succeeded", ns=ns)
        wait_event(server, "frugal", "Succeeded", ns)
        assert _operator_requests(server, ns) == BUDGET_RUNNING_TO_END

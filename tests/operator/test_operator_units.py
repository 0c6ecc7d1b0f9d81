"""Unit tests of the operator's plain functions: phase rules, status mapping, reconcile over an
in-memory API, the metrics reader, the Prometheus text. No processes, no network."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from tests.conftest import tiny_job
from tpu_operator.api import names
from tpu_operator.controller import metrics_reader, phases, reconcile
from tpu_operator.controller.metrics_reader import MetricsReader, Unreachable, apply_sample, pick_pod, to_status
from tpu_operator.controller.main import Stats
from tpu_operator.controller.reconcile import ApiError, OperatorConfig

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def jobset(restarts: int = 0, active: int = 0, ready: int = 0, conditions: tuple[str, ...] = (),
           terminal: str | None = None, suspend: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {"restarts": restarts,
                              "replicatedJobsStatus": [{"name": "slice", "active": active, "ready": ready}],
                              "conditions": [{"type": t, "status": "True", "message": f"{t} msg"} for t in conditions]}
    if terminal:
        status["terminalState"] = terminal
    return {"metadata": {"name": "js"}, "spec": {"suspend": suspend}, "status": status}


@pytest.mark.parametrize("previous, seen, js, expected", [
    (None, 0, jobset(), "Pending"),
    ("Pending", 0, jobset(active=2), "Running"),
    ("Running", 0, jobset(restarts=1, active=2), "Restarting"),  # recreated pods are active, not ready
    ("Restarting", 1, jobset(restarts=1, active=2), "Restarting"),
    ("Restarting", 1, jobset(restarts=1, active=2, ready=1), "Running"),
    ("Running", 0, jobset(restarts=1, ready=2), "Running"),  # the restart is over by the time we look
    ("Running", 0, jobset(conditions=("Completed",)), "Succeeded"),
    ("Running", 0, jobset(terminal="Failed"), "Failed"),
    ("Running", 0, jobset(conditions=("Suspended",)), "Suspended"),
    ("Running", 0, jobset(suspend=True, active=1), "Suspended"),
    ("Succeeded", 0, jobset(active=1), "Succeeded"),  # terminal phases are sticky
    ("Failed", 0, jobset(), "Failed"),
])
def test_phase_rule(previous, seen, js, expected):
    assert phases.phase_of(previous, seen, phases.JobSetView.of(js)) == expected


def test_follow_keeps_transition_times_and_emits_on_transitions_only():
    status, notices = phases.follow({}, jobset(active=1), NOW)
    assert status["phase"] == "Running" and status["startTime"] == NOW and notices == []
    again, notices = phases.follow(status, jobset(active=1), LATER)
    assert again == status and notices == []
    restarted, notices = phases.follow(status, jobset(restarts=1, active=1), LATER)
    assert restarted["phase"] == "Restarting" and restarted["restarts"] == 1
    assert [n.reason for n in notices] == ["Restarted"]
    running = phases.condition(restarted["conditions"], "Running")
    assert running["status"] == "False" and running["lastTransitionTime"] == LATER
    done, notices = phases.follow(restarted, jobset(restarts=1, conditions=("Completed",)), LATER)
    assert done["phase"] == "Succeeded" and done["completionTime"] == LATER and done["message"] == "Completed msg"
    assert [n.reason for n in notices] == ["Succeeded"]
    assert phases.condition(done["conditions"], "Running")["lastTransitionTime"] == LATER


def test_set_condition_moves_transition_time_only_on_status_change():
    conds = phases.set_condition([], "Ready", "True", "A", "m", NOW)
    conds = phases.set_condition(conds, "Ready", "True", "B", "other message", LATER)
    assert conds[0]["lastTransitionTime"] == NOW and conds[0]["reason"] == "B"
    conds = phases.set_condition(conds, "Ready", "False", "C", "", LATER)
    assert conds[0]["lastTransitionTime"] == LATER and len(conds) == 1


def test_changed_fields_names_paths():
    before = {"training": {"steps": 10, "seed": 1}, "image": "a", "tpu": {"topology": "2x2x1"}}
    after = {"training": {"steps": 20, "seed": 1}, "image": "b", "tpu": {"topology": "2x2x1"}, "args": ["x"]}
    assert reconcile.changed_fields(before, after) == ["spec.args", "spec.image", "spec.training.steps"]
    assert reconcile.changed_fields(before, copy.deepcopy(before)) == []


def test_to_status_keeps_good_values_and_drops_bad_ones():
    sample = {"step": 7, "step_time_s": 0.5, "tokens_per_s": None, "mfu": float("nan"), "last_checkpoint_step": True,
              "loss": 1.0, "state": "training"}
    assert to_status(sample) == {"step": 7, "stepTimeSeconds": 0.5}
    with pytest.raises(Unreachable):
        to_status([1, 2])


def test_pick_pod_prefers_the_newest_running_pod():
    def pod(name, ts, phase="Running", ip="10.0.0.1"):
        return {"metadata": {"name": name, "creationTimestamp": ts}, "status": {"phase": phase, "podIP": ip}}

    pods = [pod("old", "2026-01-01T00:00:00Z", "Failed"), pod("new", "2026-01-01T00:01:00Z"),
            pod("noip", "2026-01-01T00:02:00Z", ip="")]
    assert pick_pod(pods)["metadata"]["name"] == "new"
    assert pick_pod([]) is None


def test_apply_sample_goes_stale_on_error():
    fresh = apply_sample({}, {"step": 3, "mfu": 0.5}, None, NOW)
    assert fresh["step"] == 3 and fresh["metricsTime"] == NOW
    assert phases.condition(fresh["conditions"], "Metrics")["status"] == "True"
    stale = apply_sample(fresh, None, "connection refused", LATER)
    assert stale["step"] == 3 and stale["metricsTime"] == NOW
    metrics = phases.condition(stale["conditions"], "Metrics")
    assert (metrics["status"], metrics["reason"], metrics["lastTransitionTime"]) == ("False", "Unreachable", LATER)


def test_metrics_reader_proxy_path_and_selector():
    asked: list[str] = []

    async def api_get(path: str) -> Any:
        asked.append(path)
        return {"items": [{"metadata": {"name": "job-slice-0-0-x", "creationTimestamp": NOW},
                           "status": {"phase": "Running", "podIP": "10.1.2.3"}}]}

    async def api_get_text(path: str) -> str:
        asked.append(path)
        return json.dumps({"step": 9, "mfu": 0.25})

    reader = MetricsReader(api_get, api_get_text, "proxy")
    assert asyncio.run(reader.read("ml", "job", 9431)) == {"step": 9, "mfu": 0.25}
    assert "labelSelector=jobset.sigs.k8s.io%2Fjobset-name%3Djob%2Cjobset.sigs.k8s.io%2Fjob-index%3D0%2C" \
           "batch.kubernetes.io%2Fjob-completion-index%3D0" in asked[0]
    assert asked[1] == "/api/v1/namespaces/ml/pods/job-slice-0-0-x:9431/proxy/status"


def test_metrics_reader_direct_unreachable_is_an_error_not_a_crash():
    async def api_get(path: str) -> Any:
        return {"items": [{"metadata": {"name": "p"}, "status": {"phase": "Running", "podIP": "127.0.0.1"}}]}

    async def scenario() -> None:
        reader = MetricsReader(api_get, api_get, "direct", timeout_s=2)
        try:
            with pytest.raises(Unreachable, match="127.0.0.1:1/status"):
                await reader.read("default", "job", 1)  # port 1: nothing listens
        finally:
            await reader.close()

    asyncio.run(scenario())


# --- reconcile over an in-memory API ----------------------------------------------------------------------


class FakeKube:
    """Just enough API server: create (409 on a taken name), get (404), merge patch with the
    resourceVersion precondition, and /status writes that change only .status."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.calls: list[tuple[str, str]] = []

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    async def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        if path not in self.objects:
            raise ApiError(404, "not found")
        return copy.deepcopy(self.objects[path])

    async def get_text(self, path: str) -> str:
        raise ApiError(404, "no proxy here")

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        key = f"{path}/{body['metadata']['name']}"
        if key in self.objects:
            raise ApiError(409, "already exists")
        obj = copy.deepcopy(body)
        obj["metadata"].setdefault("uid", f"uid-{len(self.objects)}")
        self._bump(obj)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        key = path.removesuffix("/status")
        obj = self.objects[key]
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        if path.endswith("/status"):
            status = obj.setdefault("status", {})
            for k, v in body["status"].items():
                if v is None:
                    status.pop(k, None)
                else:
                    status[k] = v
        else:
            for k, v in body.get("spec", {}).items():
                obj["spec"][k] = v
        self._bump(obj)
        return copy.deepcopy(obj)

    def add_job(self, doc: dict[str, Any], uid: str = "job-uid") -> dict[str, Any]:
        obj = copy.deepcopy(doc)
        obj["metadata"].update(namespace="default", uid=uid, generation=1)
        self._bump(obj)
        self.objects[reconcile.job_path("default", obj["metadata"]["name"])] = obj
        return copy.deepcopy(obj)


def run_reconcile(kube: FakeKube, obj: dict[str, Any]) -> tuple[str, list[phases.Notice]]:
    notices: list[phases.Notice] = []
    result = asyncio.run(reconcile.reconcile_job(kube, obj, OperatorConfig(), lambda o, n: notices.append(n),
                                                 now=lambda: NOW))
    return result, notices


def job_status(kube: FakeKube, name: str = "tiny") -> dict[str, Any]:
    return kube.objects[reconcile.job_path("default", name)].get("status") or {}


def test_reconcile_creates_then_adopts_without_duplicates():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    assert run_reconcile(kube, obj)[0] == "created"
    first = dict(kube.objects)
    result, notices = run_reconcile(kube, kube.objects[reconcile.job_path("default", "tiny")])  # a restart: resume
    assert result == "adopted" and notices == []
    assert kube.objects.keys() == first.keys()
    assert [c for c in kube.calls if c[0] == "POST"].count(("POST", reconcile.jobset_path("default"))) == 2
    status = job_status(kube)
    assert status["phase"] == "Pending" and status["jobSetName"] == "tiny"
    js = kube.objects[reconcile.jobset_path("default", "tiny")]
    assert js["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    applied = json.loads(js["metadata"]["annotations"][names.APPLIED_SPEC])
    assert applied == {k: v for k, v in obj["spec"].items() if k != "suspend"}  # the spec as written


def test_reconcile_refuses_a_name_owned_by_someone_else():
    kube = FakeKube()
    asyncio.run(kube.post(reconcile.jobset_path("default"), {"metadata": {"name": "tiny", "ownerReferences": [
        {"kind": "TPUTrainingJob", "name": "tiny", "uid": "someone-else"}]}}))
    obj = kube.add_job(tiny_job())
    with pytest.raises(reconcile.RetryLater):
        run_reconcile(kube, obj)
    ready = phases.condition(job_status(kube)["conditions"], "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "TPUTrainingJob/tiny" in ready["message"]


def test_reconcile_invalid_job_creates_nothing():
    kube = FakeKube()
    obj = kube.add_job(tiny_job(training={"steps": 10, "globalBatch": 3, "sequenceLength": 128}))
    result, notices = run_reconcile(kube, obj)
    assert result == "invalid" and [n.reason for n in notices] == ["Invalid"]
    assert job_status(kube)["phase"] == "Invalid" and "spec.training.globalBatch" in job_status(kube)["message"]
    assert not [c for c in kube.calls if c[0] == "POST"]
    # Reconciling the same invalid job again changes nothing and says nothing new.
    assert run_reconcile(kube, kube.objects[reconcile.job_path("default", "tiny")])[1] == []


def test_reconcile_patches_suspend_and_refuses_other_changes():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    run_reconcile(kube, obj)
    path = reconcile.job_path("default", "tiny")
    edited = copy.deepcopy(kube.objects[path])
    edited["spec"]["suspend"] = True
    edited["spec"]["training"]["steps"] = 50
    edited["metadata"]["generation"] = 2
    kube.objects[path] = edited
    result, notices = run_reconcile(kube, edited)
    js = kube.objects[reconcile.jobset_path("default", "tiny")]
    assert js["spec"]["suspend"] is True
    change = phases.condition(job_status(kube)["conditions"], "SpecChange")
    assert (change["status"], change["reason"]) == ("False", "Immutable") and "spec.training.steps" in change["message"]
    assert "SpecChangeRefused" in [n.reason for n in notices]
    assert job_status(kube)["observedGeneration"] == 2


def test_follow_jobset_ignores_jobsets_of_other_owners():
    kube = FakeKube()
    kube.add_job(tiny_job())
    stray = {"metadata": {"name": "tiny", "namespace": "default", "labels": {"training.tpu-operator.dev/job": "tiny"},
                          "ownerReferences": [{"kind": "TPUTrainingJob", "name": "tiny", "uid": "old-uid",
                                               "controller": True}]}, "status": {}}
    result = asyncio.run(reconcile.follow_jobset(kube, stray, "MODIFIED", OperatorConfig(), lambda o, n: None))
    assert result == "gone" and job_status(kube) == {}


def test_stats_exposition_is_prometheus_text():
    stats = Stats()
    stats.observe("job", "created", 0.02)
    stats.observe("job", "api_error", 3.0)
    text = stats.exposition()
    assert 'tpu_operator_reconciles_total{handler="job",result="created"} 1' in text
    assert 'tpu_operator_reconcile_errors_total{handler="job"} 1' in text
    assert 'tpu_operator_reconcile_duration_seconds_bucket{handler="job",le="0.025"} 1' in text
    assert 'tpu_operator_reconcile_duration_seconds_bucket{handler="job",le="+Inf"} 2' in text
    assert 'tpu_operator_reconcile_duration_seconds_count{handler="job"} 2' in text
    assert metrics_reader.pod0_selector("x").count("=") == 3


def test_reconcile_uses_the_default_image_only_where_the_job_names_none():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    notices: list[phases.Notice] = []
    asyncio.run(reconcile.reconcile_job(kube, obj, OperatorConfig(default_image="registry.example/trainer:2"),
                                        lambda o, n: notices.append(n), now=lambda: NOW))
    pod = kube.objects[reconcile.jobset_path("default", "tiny")]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["containers"][0]["image"] == "registry.example/trainer:2"
    assert [n.reason for n in notices] == ["Created"]


def test_reconcile_leaves_a_finished_job_alone():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    obj["status"] = {"phase": "Succeeded"}
    assert run_reconcile(kube, obj) == ("finished", [])
    assert not [c for c in kube.calls if c[0] in ("POST", "PATCH")]


# --- the periodic resync -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, due", [
    ({}, False),  # not reconciled yet: the job handler owns it
    ({"phase": "Pending"}, False),  # no JobSet yet (e.g. a name conflict)
    ({"phase": "Pending", "jobSetName": "tiny"}, True),
    ({"phase": "Running", "jobSetName": "tiny"}, True),
    ({"phase": "Restarting", "jobSetName": "tiny"}, True),
    ({"phase": "Suspended", "jobSetName": "tiny"}, True),
    ({"phase": "Succeeded", "jobSetName": "tiny"}, False),
    ({"phase": "Failed", "jobSetName": "tiny"}, False),
    ({"phase": "Invalid"}, False),
])
def test_resync_is_due_for_unfinished_jobs_with_a_jobset(status, due):
    assert reconcile.resync_due(status) is due


def run_resync(kube: FakeKube, name: str = "tiny") -> tuple[str, list[phases.Notice]]:
    notices: list[phases.Notice] = []
    obj = copy.deepcopy(kube.objects[reconcile.job_path("default", name)])
    result = asyncio.run(reconcile.resync_job(kube, obj, OperatorConfig(), lambda o, n: notices.append(n),
                                              now=lambda: LATER))
    return result, notices


def writes(kube: FakeKube) -> list[tuple[str, str]]:
    return [c for c in kube.calls if c[0] in ("POST", "PATCH")]


def test_resync_follows_a_jobset_whose_event_was_lost():
    kube = FakeKube()
    run_reconcile(kube, kube.add_job(tiny_job()))
    assert run_resync(kube) == ("unchanged", [])  # nothing new: one GET of the JobSet, no write
    # The JobSet controller completes the JobSet; the operator never sees the event.
    kube.objects[reconcile.jobset_path("default", "tiny")]["status"] = jobset(conditions=("Completed",))["status"]
    before = len(writes(kube))
    result, notices = run_resync(kube)
    status = job_status(kube)
    assert result == "followed" and status["phase"] == "Succeeded" and status["completionTime"] == LATER
    assert [n.reason for n in notices] == ["Succeeded"]
    assert writes(kube)[before:] == [("PATCH", reconcile.job_path("default", "tiny", "status"))]
    assert run_resync(kube) == ("skipped", [])  # finished: nothing more to follow


def test_resync_recreates_a_missing_jobset_exactly_once():
    kube = FakeKube()
    run_reconcile(kube, kube.add_job(tiny_job()))
    del kube.objects[reconcile.jobset_path("default", "tiny")]  # deleted, and its DELETED event lost
    result, _ = run_resync(kube)
    assert result == "created"
    assert kube.objects[reconcile.jobset_path("default", "tiny")]["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    assert run_resync(kube) == ("unchanged", [])  # there now: followed, not created again
    assert writes(kube).count(("POST", reconcile.jobset_path("default"))) == 2  # the first one and the re-creation


def test_resync_leaves_deleting_and_finished_jobs_alone():
    kube = FakeKube()
    run_reconcile(kube, kube.add_job(tiny_job()))
    path = reconcile.job_path("default", "tiny")
    kube.calls.clear()
    kube.objects[path]["metadata"]["deletionTimestamp"] = NOW
    assert run_resync(kube) == ("skipped", [])
    del kube.objects[path]["metadata"]["deletionTimestamp"]
    kube.objects[path]["status"]["phase"] = "Failed"
    assert run_resync(kube) == ("skipped", [])
    assert kube.calls == []


def test_operator_intervals_are_positive_seconds():
    from tpu_operator.cli import build_parser

    args = build_parser().parse_args(["operator"])
    assert (args.metrics_interval, args.resync_interval) == (10.0, 60.0)
    assert build_parser().parse_args(["operator", "--resync-interval", "2.5"]).resync_interval == 2.5
    for flag in ("--resync-interval", "--metrics-interval"):
        for bad in ("0", "-1", "nan", "inf", "often"):
            with pytest.raises(SystemExit):
                build_parser().parse_args(["operator", flag, bad])

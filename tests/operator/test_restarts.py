"""The operator's restarts, hangs and goodput over the in-memory API (FakeKube): the JobSet that
failed or hung is counted once, deleted, and created again after its backoff; the budget lives in
the job's status. No processes."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Any

from prometheus_client import generate_latest

from tests.conftest import operator_job as tiny_job  # the pre-flight is skipped: tested on its own
from tests.fakes import T0, FakeKube, at, fail_slices, failed_jobset, failed_pod, job_status, running
from tpu_operator.api.failures import RestartCounts
from tpu_operator.api.lifecycle import Progress, TerminationRecord
from tpu_operator.api.spec import FailurePolicySpec
from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import reconcile, restarts
from tpu_operator.controller.kube import PODS
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.stats import Stats
from tpu_operator.controller.status import Sample


def when(seconds: int) -> datetime.datetime:
    return parse(at(seconds))


def run(kube: FakeKube, when: str, jobset_seen: Any = "index", sample: Sample | None = None):
    notices = []
    seen = kube.jobset() if jobset_seen == "index" else jobset_seen
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n), clock=lambda: parse(when))
    outcome = asyncio.run(reconcile.reconcile(means, kube.job(), reconcile.Seen(seen, sample)))
    return outcome, [n.reason for n in notices]


def new_job(kube: FakeKube, checkpoint: dict[str, Any] | None = None, **policy: Any) -> None:
    sections = {"checkpoint": checkpoint} if checkpoint else {}
    kube.add_job(tiny_job(failurePolicy={"backoffSeconds": 10, **policy}, **sections))
    kube.objects[next(iter(kube.objects))]["metadata"]["creationTimestamp"] = T0
    run(kube, at(0), None)


def fail_jobset(kube: FakeKube, *codes_and_lines: tuple[int, str]) -> None:
    """Stand in for JobSet and the kubelet: pods that terminated with these codes and messages."""
    js = failed_jobset(kube, "tiny", "jobset failed")
    for i, (code, line) in enumerate(codes_and_lines):
        failed_pod(kube, js, f"tiny-slice-0-{i}", code, TerminationRecord(code=code, error=line).message(), at(10 + i))


def test_a_failed_jobset_is_restarted_once_after_its_backoff_and_the_budget_is_the_jobs():
    kube = FakeKube()
    new_job(kube, maxRestarts=1)
    running(kube)
    run(kube, at(5))
    first = kube.jobset()["metadata"]["uid"]
    fail_jobset(kube, (42, "Retryable: gloo connection reset"), (143, "stopped by SIGTERM"))
    kube.calls.clear()
    outcome, events = run(kube, at(20))
    status = job_status(kube)
    assert status.phase == "Restarting" and status.restarts == RestartCounts(failure=1, total=1)
    assert status.last_restart.job_set_uid == first and status.last_restart.exit_code == 42
    assert f"tiny-slice-0-0-{first} exited with code 42" in status.message and "Retryable: gloo" in status.message
    assert status.next_restart_time == parse(at(30)) and events == ["Restarted"]
    # One LIST of the pods, one status write, then the pods go at once and the JobSet (only that uid).
    assert [c[0] for c in kube.calls] == ["LIST", "PATCH", "DELETECOLLECTION", "DELETE"] and kube.jobset() is None
    assert not [p for p in kube.objects if "/pods/" in p]
    # Seen again (a stale cache, or after an operator restart): counted once, not deleted twice.
    stale = {**fail_jobset_copy(kube, first)}
    kube.calls.clear()
    run(kube, at(21), stale)
    assert job_status(kube).restarts.total == 1
    # Gone: the JobSet is created again only once the backoff is over.
    outcome, _ = run(kube, at(25), None)
    assert (outcome.result, outcome.requeue_after_s) == ("waiting", 5.0) and kube.jobset() is None
    outcome, events = run(kube, at(30), None)
    assert outcome.result == "created" and kube.jobset()["metadata"]["uid"] != first
    assert job_status(kube).next_restart_time is None and job_status(kube).phase == "Restarting"
    # The re-created JobSet fails too: the job's budget (1) is spent, whatever the JobSet's count says.
    fail_jobset(kube, (137, ""))
    run(kube, at(40))
    status = job_status(kube)
    assert status.phase == "Failed" and "restart budget spent (1 of maxRestarts 1 used)" in status.message
    assert status.condition("Failed").reason == "RestartPolicy" and kube.jobset() is not None  # kept to debug


def fail_jobset_copy(kube: FakeKube, uid: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "tiny",
            "uid": uid,
            "namespace": "default",
            "labels": {"training.tpu-operator.dev/job": "tiny"},
            "ownerReferences": [{"kind": "TPUTrainingJob", "name": "tiny", "uid": "job-uid", "controller": True}],
        },
        "spec": {},
        "status": {"terminalState": "Failed"},
    }


def test_a_user_error_fails_at_once_quoting_the_trainers_line():
    kube = FakeKube()
    new_job(kube)
    fail_jobset(kube, (143, "stopped by SIGTERM"), (3, "UserError: data.path gs://b/x has no files"))
    _, events = run(kube, at(20))
    status = job_status(kube)
    assert status.phase == "Failed" and status.restarts.total == 0 and events == ["Failed"]
    uid = kube.jobset()["metadata"]["uid"]
    assert status.message == (
        f"tiny-slice-0-1-{uid} exited with code 3 (user or configuration error): "
        "UserError: data.path gs://b/x has no files; a user error is never retried"
    )
    assert not [c for c in kube.calls if c[0] == "DELETE"]


def test_hang_detection_needs_a_trainer_that_reported_and_uses_its_own_clock():
    policy = FailurePolicySpec(startupTimeoutSeconds=100)
    base = TPUTrainingJobStatus(phase="Running")
    assert restarts.hang(base, policy, 10, when(59 * 60)) is None  # never heard from: not hung

    def with_progress(**p: Any) -> TPUTrainingJobStatus:
        from tpu_operator.api.goodput import Attempt, Ledger

        progress = Progress(started_at=parse(T0).timestamp(), **p)
        return base.model_copy(update=dict(accounting=Ledger(attempt=Attempt(running_since=0.0, progress=progress))))

    starting = with_progress(start_step=0)
    assert restarts.hang(starting, policy, 10, when(100)) is None
    assert restarts.hang(starting, policy, 10, when(101)) == "hung: no first step for 101 s (limit 100 s)"
    stepped = with_progress(start_step=0, step=4, last_step_at=when(60).timestamp(), median_step_seconds=40.0)
    assert restarts.hang(stepped, policy, 10, when(60 + 800)) is None  # 20 x 40 s
    assert "no step completed after step 4 for 801 s (limit 800 s)" in restarts.hang(stepped, policy, 10, when(861))
    assert restarts.hang(stepped, FailurePolicySpec(hangTimeoutSeconds=5), 10, when(66)) is not None
    assert restarts.hang(stepped, FailurePolicySpec(hangTimeoutSeconds=5), 4, when(66)) is None  # the last step


def test_a_hung_job_is_marked_restarted_and_goodput_lands_in_status_and_metrics():
    kube = FakeKube()
    new_job(kube, hangTimeoutSeconds=30)
    running(kube)
    run(kube, at(2))
    t = lambda text: parse(text).timestamp()  # noqa: E731
    p = Progress(
        started_at=t(at(1)),
        start_step=0,
        first_step_at=t(at(5)),
        last_step_at=t(at(10)),
        step=6,
        last_checkpoint_step=5,
        step_seconds=5.0,
        steps_timed=5,
        median_step_seconds=1.0,
    )
    run(kube, at(11), sample=Sample(step=6, progress=p))
    status = job_status(kube)
    assert status.goodput == round(5.0 / 11, 4) and status.badput.queued == 1.0 and status.badput.startup == 4.0
    # Long past the timeout, a reconcile with no fresh read (a resync, an operator back from an outage)
    # or with a failed one restarts nothing: only a trainer that answers and says it is stuck is hung.
    assert run(kube, at(41))[1] == [] and run(kube, at(41), sample=Sample(error="refused"))[1] == []
    assert job_status(kube).restarts.total == 0
    _, events = run(kube, at(41), sample=Sample(step=6, progress=p))
    status = job_status(kube)
    assert events == ["Hung", "Restarted"] and status.phase == "Restarting"
    assert status.restarts == RestartCounts(hang=1, total=1) and status.condition("Hung").status == "True"
    assert status.badput.hung == 31.0 and kube.jobset() is None  # replaced
    stats = Stats()
    stats.job(("default", "tiny"), status)
    text = generate_latest(stats.registry).decode()
    assert 'tpu_operator_job_badput_seconds{bucket="hung",job="tiny",namespace="default"} 31.0' in text
    assert 'tpu_operator_job_restarts{cause="hang",job="tiny",namespace="default"} 1.0' in text
    assert json.dumps(status.to_wire()["badput"])  # serialisable as the API stores it


def test_an_elastic_job_that_loses_a_slice_is_recreated_on_the_slices_left_fake_jobset_and_kubelet():
    """FakeKube stands in for JobSet and the kubelet: slice 1's pod exits 137 (its host lost); the operator
    re-creates the JobSet on one slice (replicas, process count, $TPUJOB_SLICES), says so in status.slices,
    the Resized condition and an Event; the same ConfigMap stays."""
    kube = FakeKube()
    kube.add_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1}},
            training={"steps": 10, "globalBatch": 16, "sequenceLength": 128},
            failurePolicy={"backoffSeconds": 10},
        )
    )
    kube.objects[next(iter(kube.objects))]["metadata"]["creationTimestamp"] = T0
    run(kube, at(0), None)
    status = job_status(kube)
    assert status.slices.model_dump(exclude_none=True) == {"desired": 2, "running": 2, "shown": "2/2"}
    assert kube.jobset()["spec"]["replicatedJobs"][0]["replicas"] == 2
    running(kube)
    run(kube, at(5))
    fail_slices(kube, (1, 137), (0, 42))  # slice 1's host lost first, slice 0's collective fails after it
    _, events = run(kube, at(20))
    status = job_status(kube)
    assert status.phase == "Restarting" and status.restarts.failure == 1
    assert status.slices.model_dump(exclude_none=True) == {"desired": 2, "running": 1, "shown": "1/2"}
    resized = status.condition("Resized")
    assert (resized.status, resized.reason) == ("True", "SliceLost")
    assert resized.message.startswith("slice 1 was lost: training goes on on 1 of 2 slices"), resized.message
    assert events == ["Restarted", "Resized"]
    config_map = json.dumps(kube.objects[next(p for p in kube.objects if "/configmaps/" in p)], sort_keys=True)
    run(kube, at(30), None)
    spec = kube.jobset()["spec"]["replicatedJobs"][0]
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert spec["replicas"] == 1 and env["TPUJOB_SLICES"] == "1" and env["TPUJOB_NUM_PROCESSES"] == "1"
    assert "MEGASCALE_NUM_SLICES" not in env
    assert json.dumps(kube.objects[next(p for p in kube.objects if "/configmaps/" in p)], sort_keys=True) == config_map
    # Lost again with one slice left: fewer than minSlices 1 would remain, so every slice restarts.
    fail_slices(kube, (0, 42), start=40)
    run(kube, at(45))
    status = job_status(kube)
    assert status.slices.running == 2 and status.condition("Resized").reason == "Restarted"


def _diverge(kube: FakeKube, at_s: int = 10) -> None:
    js = failed_jobset(kube, "tiny", "jobset failed")
    record = TerminationRecord(
        code=43,
        error="Diverged: loss is nan at step 120",
        diverged={"step": 120, "metric": "loss", "value": "nan", "lastCheckpointStep": 100},
        last={"step": 119, "loss": "nan"},
    )
    failed_pod(kube, js, "tiny-slice-0-0", 43, record.message(), at(at_s))
    failed_pod(kube, js, "tiny-slice-0-1", 143, "", at(at_s + 1))


def test_a_diverged_run_fails_by_default_saying_where_and_rewinds_within_its_budget_with_rewind():
    kube = FakeKube()
    new_job(kube)
    running(kube)
    run(kube, at(5))
    _diverge(kube)
    _, events = run(kube, at(20))
    status = job_status(kube)
    assert status.phase == "Failed" and events == ["Diverged", "Failed"], events
    assert status.condition("Failed").reason == "Diverged" and "onDivergence is Fail" in status.message
    assert "exited with code 43 (diverged: a non-finite loss or gradient norm) at step 120: loss nan" in status.message
    d = status.divergence
    assert (d.step, d.metric, d.value, d.last_checkpoint_step) == (120, "loss", "nan", 100)
    assert status.restarts.total == 0

    kube = FakeKube()
    rewinds = {"onDivergence": "Rewind", "restartBudgets": {"diverged": 1}, "maxRestarts": 5}
    new_job(kube, checkpoint={"directory": "gs://bucket/ckpt"}, **rewinds)  # a rewind restores a checkpoint
    for attempt in range(2):
        running(kube)
        run(kube, at(100 * attempt + 5))
        _diverge(kube, 100 * attempt + 10)
        _, events = run(kube, at(100 * attempt + 20))
        status = job_status(kube)
        if attempt == 0:
            assert events == ["Diverged", "Restarted"] and status.phase == "Restarting"
            assert (status.restarts.diverged, status.restarts.total, status.last_restart.cause) == (1, 1, "diverged")
            run(kube, at(100 * attempt + 90), None)  # the backoff is over: the JobSet again
    assert status.phase == "Failed" and status.condition("Failed").reason == "Diverged"
    assert "diverged restart budget spent (1 of restartBudgets.diverged 1 used)" in status.message


def _look_at_nodes(kube: FakeKube, now: datetime.datetime, unhealthy: dict[str, Any]) -> list[str]:
    notices: list[str] = []
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n.reason), clock=lambda: now)
    seen = reconcile.Seen(kube.jobset(), unhealthy=unhealthy, look_at_nodes=True)
    asyncio.run(reconcile.reconcile(means, kube.job(), seen))
    return notices


def test_a_flapping_node_restarts_the_job_until_the_hardware_budget_is_spent_fake_kubelet():
    """Every restart on an unhealthy node is charged as hardware: a node that keeps failing no longer restarts a
    job without end (maxRestarts, the job's own faults, is untouched)."""
    from tpu_operator.controller import health

    kube = FakeKube()
    new_job(kube, maxRestarts=0, restartBudgets={"hardware": 2}, nodeUnhealthyGraceSeconds=0, backoffSeconds=1)
    bad = {"n0": health.Unhealthy("condition Ready=False (KubeletNotReady)", since=when(0))}
    for attempt in range(3):
        running(kube)
        uid = kube.jobset()["metadata"]["uid"]
        kube.objects[PODS.path("default", f"p-{uid}")] = {
            "metadata": {"name": f"p-{uid}", "labels": {"jobset.sigs.k8s.io/jobset-name": "tiny"}},
            "spec": {"nodeName": "n0"},
            "status": {"phase": "Running"},
        }
        run(kube, at(100 * attempt + 5))
        notices = _look_at_nodes(kube, when(100 * attempt + 6), bad)
        if attempt < 2:
            assert notices == ["Restarted"] and job_status(kube).restarts.hardware == attempt + 1
            kube.objects.pop(PODS.path("default", f"p-{uid}"))
            run(kube, at(100 * attempt + 50), None)
    status = job_status(kube)
    assert status.phase == "Failed" and status.restarts.hardware == 2 and status.restarts.charged == 0
    assert "hardware restart budget spent (2 of restartBudgets.hardware 2 used)" in status.message

"""Unit tests of the controller's plain parts: the phase rule, status building, reconcile and the
manager over an in-memory API, the work queue, the metrics reader, the Prometheus text. No processes."""

from __future__ import annotations

import asyncio
import copy
import datetime
import json

import pytest
from prometheus_client import generate_latest

from tests.conftest import operator_job as tiny_job  # the pre-flight is skipped: tested on its own
from tests.fakes import (
    LATER,
    NOW,
    Clock,
    FakeKube,
    add_pod0,
    drain,
    job_status,
    jobset,
    manager_for,
    run_reconcile,
    writes,
)
from tpu_operator.api import names
from tpu_operator.api.lifecycle import Progress, TerminationRecord
from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.api.timestamps import format as rfc3339
from tpu_operator.controller import children, metrics_reader, phases
from tpu_operator.controller import status as status_lib
from tpu_operator.controller.conditions import set_condition
from tpu_operator.controller.kube import CONFIGMAPS, JOBS, JOBSETS, PODS
from tpu_operator.controller.metrics_reader import MetricsReader, Unreachable, pick_pod, to_sample
from tpu_operator.controller.queue import WorkQueue
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.stats import Stats
from tpu_operator.controller.status import Sample

EMPTY = TPUTrainingJobStatus()


@pytest.mark.parametrize(
    "previous, restart, js, expected",
    [
        (None, None, jobset(), "Pending"),
        ("Pending", None, jobset(active=2), "Running"),
        ("Running", "replaced", jobset(active=2, ready=2), "Restarting"),  # a hung JobSet, to be replaced
        ("Running", "replaced", jobset(terminal="Failed"), "Restarting"),  # a failed one, restarted
        ("Restarting", None, jobset(active=2), "Restarting"),  # recreated pods are active, not ready
        ("Restarting", None, jobset(active=2, ready=1), "Running"),
        ("Running", None, jobset(conditions=("Completed",)), "Succeeded"),
        ("Running", "given-up", jobset(terminal="Failed"), "Failed"),
        ("Running", None, jobset(terminal="Failed"), "Failed"),  # no decision about it: the JobSet's word
        ("Running", None, jobset(conditions=("Suspended",)), "Suspended"),
        ("Running", None, jobset(suspend=True, active=1), "Suspended"),
        ("Succeeded", None, jobset(active=1), "Succeeded"),  # terminal phases are sticky
        ("Failed", None, jobset(), "Failed"),
    ],
)
def test_phase_rule(previous, restart, js, expected):
    assert phases.phase_of(previous, phases.JobSetView.of(js), restart=restart) == expected


QUEUED, USER_SUSPENDED = phases.Intent(queued=True), phases.Intent(queued=True, suspend=True)


@pytest.mark.parametrize(
    "previous, js, intent, trouble, expected",
    [
        (None, jobset(suspend=True), QUEUED, False, "Queued"),  # Kueue holds the JobSet until admission
        ("Queued", jobset(conditions=("Suspended",)), QUEUED, False, "Queued"),
        ("Queued", jobset(active=1), QUEUED, False, "Running"),  # admitted: Kueue resumed the JobSet
        ("Running", jobset(suspend=True), QUEUED, False, "Queued"),  # evicted: Kueue suspended it again
        ("Running", jobset(suspend=True), USER_SUSPENDED, False, "Suspended"),  # the user's own suspend
        ("Running", jobset(active=1), USER_SUSPENDED, False, "Running"),  # until Kueue has stopped it
        ("Queued", jobset(suspend=True, conditions=("Completed",)), QUEUED, False, "Succeeded"),
        ("Pending", jobset(active=1), phases.Intent(), True, "Pending"),  # active, but a pod cannot start
        ("Running", jobset(active=2, ready=1), phases.Intent(), True, "Running"),  # one slice runs
        ("Restarting", jobset(active=1), phases.Intent(), True, "Restarting"),
        (None, jobset(suspend=True), phases.Intent(), True, "Suspended"),
    ],
)
def test_phase_rule_with_a_queue_and_the_pods_diagnosis(previous, js, intent, trouble, expected):
    assert phases.phase_of(previous, phases.JobSetView.of(js), intent, trouble=trouble) == expected


def test_follow_keeps_transition_times_and_emits_on_transitions_only():
    status, notices = phases.follow(EMPTY, jobset(active=1), NOW)
    assert status.phase == "Running" and status.start_time == NOW and notices == []
    again, notices = phases.follow(status, jobset(active=1), LATER)
    assert again == status and notices == []
    restarted, notices = phases.follow(
        status.model_copy(update=dict(message="restart 1 (failure) in 10 s")),
        jobset(active=1),
        LATER,
        restart="replaced",
    )
    assert restarted.phase == "Restarting" and restarted.message == "restart 1 (failure) in 10 s" and notices == []
    running = restarted.condition("Running")
    assert running.status == "False" and running.last_transition_time == LATER
    done, notices = phases.follow(restarted, jobset(conditions=("Completed",)), LATER)
    assert done.phase == "Succeeded" and done.completion_time == LATER and done.message == "Completed msg"
    assert [n.reason for n in notices] == ["Succeeded"]
    assert done.condition("Running").last_transition_time == LATER


def test_set_condition_moves_transition_time_only_on_status_change():
    conds = set_condition((), "Ready", "True", "A", "m", NOW)
    conds = set_condition(conds, "Ready", "True", "B", "other message", LATER)
    assert conds[0].last_transition_time == NOW and conds[0].reason == "B"
    conds = set_condition(conds, "Ready", "False", "C", "", LATER)
    assert conds[0].last_transition_time == LATER and len(conds) == 1


def test_status_is_written_in_the_wire_form_and_read_back_leniently():
    status, _ = phases.follow(EMPTY, jobset(active=1), NOW)
    wire = status.to_wire()
    assert wire["phase"] == "Running" and wire["startTime"] == rfc3339(NOW)
    assert (
        wire["conditions"][0]["lastTransitionTime"] == rfc3339(NOW)
        and "observedGeneration" not in wire["conditions"][0]
    )
    assert TPUTrainingJobStatus.model_validate({**wire, "fieldOfANewerOperator": 1}) == status


def test_changed_fields_names_paths():
    before = {"training": {"steps": 10, "seed": 1}, "image": "a", "tpu": {"topology": "2x2x1"}}
    after = {"training": {"steps": 20, "seed": 1}, "image": "b", "tpu": {"topology": "2x2x1"}, "args": ["x"]}
    assert children.changed_fields(before, after) == ["spec.args", "spec.image", "spec.training.steps"]
    assert children.changed_fields(before, copy.deepcopy(before)) == []


def test_merge_patch_has_only_what_changed():
    assert status_lib.merge_patch({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5, "d": 4}) == {"b": 5, "c": None, "d": 4}
    assert status_lib.merge_patch({"a": [1]}, {"a": [1]}) == {}
    # Objects are merged by the server: a nested field that goes away must be nulled explicitly.
    assert status_lib.merge_patch({"o": {"x": 1, "y": {"z": 2}}}, {"o": {"y": {"z": 3}}}) == {
        "o": {"x": None, "y": {"z": 3}}
    }


def test_to_sample_keeps_good_values_and_drops_bad_ones():
    body = {
        "step": 7,
        "step_time_s": 0.5,
        "global_tokens_per_s": None,
        "mfu": float("nan"),
        "last_checkpoint_step": True,
        "loss": 1.0,
        "state": "training",
    }
    assert to_sample(body) == Sample(step=7, step_time_seconds=0.5, loss=1.0, non_finite=(("mfu", "nan"),))
    with pytest.raises(Unreachable):
        to_sample([1, 2])


def test_a_non_finite_reading_is_reported_never_hidden_behind_the_last_finite_value():
    """A diverged run's /status: the trainer sends "nan" (its wire format) or a bare NaN token (Python's json
    reads it); the status drops the stale finite loss, says what was read, and a finite read clears it."""
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    healthy = status_lib.with_sample(TPUTrainingJobStatus(), to_sample({"step": 5, "loss": 2.5, "mfu": 0.4}), t0)
    nan = to_sample(json.loads('{"step": 6, "loss": "nan", "mfu": NaN, "eval_loss": "-Infinity", "step_time_s": "x"}'))
    assert dict(nan.non_finite) == {"loss": "nan", "mfu": "nan", "eval_loss": "-inf"}
    later = t0 + datetime.timedelta(seconds=10)
    diverged = status_lib.with_sample(healthy, nan, later)
    wire = diverged.to_wire()
    assert "loss" not in wire and "mfu" not in wire and wire["step"] == 6 and wire["metricsTime"] == rfc3339(later)
    assert wire["nonFinite"] == {"loss": "nan", "mfu": "nan", "evalLoss": "-inf"}
    metrics = diverged.condition("Metrics")
    assert (metrics.status, metrics.reason) == ("True", "NonFinite") and "loss nan" in metrics.message
    recovered = status_lib.with_sample(diverged, to_sample({"step": 7, "loss": 2.4}), later)
    assert recovered.non_finite is None and recovered.loss == 2.4 and recovered.condition("Metrics").reason == "Read"
    # Untrusted: text where an integer belongs, absurd numbers and long strings are left out, as malformed values are.
    odd = to_sample({"step": "nan", "last_checkpoint_step": 1e300, "loss": "nan" * 1000, "mfu": 1e300})
    assert odd == status_lib.Sample()


def test_pick_pod_prefers_the_newest_running_pod():
    def pod(name, ts, phase="Running", ip="10.0.0.1"):
        return {"metadata": {"name": name, "creationTimestamp": ts}, "status": {"phase": phase, "podIP": ip}}

    pods = [
        pod("old", "2026-01-01T00:00:00Z", "Failed"),
        pod("new", "2026-01-01T00:01:00Z"),
        pod("noip", "2026-01-01T00:02:00Z", ip=""),
    ]
    assert pick_pod(pods)["metadata"]["name"] == "new"
    assert pick_pod([]) is None


def test_a_sample_goes_stale_on_error_and_changes_nothing_when_nothing_is_new():
    fresh = status_lib.with_sample(EMPTY, Sample(step=3, mfu=0.5), NOW)
    assert fresh.step == 3 and fresh.metrics_time == NOW and fresh.condition("Metrics").status == "True"
    assert status_lib.with_sample(fresh, Sample(step=3, mfu=0.5), LATER) is fresh  # nothing to write
    assert status_lib.with_sample(fresh, Sample(step=4, mfu=0.5), LATER).metrics_time == LATER
    stale = status_lib.with_sample(fresh, Sample(error="connection refused"), LATER)
    assert stale.step == 3 and stale.metrics_time == NOW
    metrics = stale.condition("Metrics")
    assert (metrics.status, metrics.reason, metrics.last_transition_time) == ("False", "Unreachable", LATER)


# --- reconcile ----------------------------------------------------------------------------------------------


def test_reconcile_creates_then_adopts_without_duplicates():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    outcome, notices = run_reconcile(kube, obj)
    assert outcome.result == "created" and [n.reason for n in notices] == ["Created"]
    assert writes(kube) == [
        ("POST", CONFIGMAPS.path("default")),
        ("POST", JOBSETS.path("default")),
        ("PATCH", JOBS.path("default", "tiny", "status")),
    ]  # one status write
    first = dict(kube.objects)
    outcome, notices = run_reconcile(kube, kube.job())  # a restart that has not seen the JobSet: adopt it
    assert outcome.result == "adopted" and notices == []
    assert kube.objects.keys() == first.keys()
    status = job_status(kube)
    ready = status.condition("Ready")  # Ready: training progressing, which it is not yet
    assert (
        status.phase == "Pending"
        and status.job_set_name == "tiny"
        and (ready.status, ready.reason) == ("False", "PodsPending")
    )
    js = kube.jobset()
    assert js["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    applied = json.loads(js["metadata"]["annotations"][names.APPLIED_SPEC])
    assert applied == {k: v for k, v in obj["spec"].items() if k != "suspend"}  # the spec as written
    kube.calls.clear()
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())  # the JobSet is known: nothing to do
    assert (outcome.result, notices, kube.calls) == ("followed", [], [])


def test_reconcile_refuses_a_name_owned_by_someone_else():
    kube = FakeKube()
    asyncio.run(
        kube.create(
            JOBSETS,
            "default",
            {
                "metadata": {
                    "name": "tiny",
                    "ownerReferences": [{"kind": "TPUTrainingJob", "name": "tiny", "uid": "someone-else"}],
                }
            },
        )
    )
    outcome, notices = run_reconcile(kube, kube.add_job(tiny_job()))
    assert outcome.result == "conflict" and outcome.requeue_after_s == OperatorConfig().conflict_retry_s
    ready = job_status(kube).condition("Ready")
    assert (ready.status, ready.reason) == ("False", "NameConflict") and "TPUTrainingJob/tiny" in ready.message
    assert [n.reason for n in notices] == ["NameConflict"]
    _, notices = run_reconcile(kube, kube.job())
    assert notices == []  # said once


def test_reconcile_invalid_job_creates_nothing():
    kube = FakeKube()
    outcome, notices = run_reconcile(
        kube, kube.add_job(tiny_job(training={"steps": 10, "globalBatch": 3, "sequenceLength": 128}))
    )
    assert outcome.result == "invalid" and [n.reason for n in notices] == ["Invalid"]
    assert job_status(kube).phase == "Invalid" and "spec.training.globalBatch" in job_status(kube).message
    assert not [c for c in kube.calls if c[0] == "POST"]
    # Reconciling the same invalid job again writes nothing and says nothing new.
    kube.calls.clear()
    assert run_reconcile(kube, kube.job())[1] == [] and writes(kube) == []


def test_reconcile_patches_suspend_and_refuses_other_changes():
    kube = FakeKube()
    run_reconcile(kube, kube.add_job(tiny_job()))
    edited = kube.job()
    edited["spec"]["suspend"] = True
    edited["spec"]["training"]["steps"] = 50
    edited["metadata"]["generation"] = 2
    kube.objects[JOBS.path("default", "tiny")] = edited
    _, notices = run_reconcile(kube, edited, kube.jobset())
    assert kube.jobset()["spec"]["suspend"] is True
    change = job_status(kube).condition("SpecChange")
    assert (change.status, change.reason) == ("False", "Immutable") and "spec.training.steps" in change.message
    assert "SpecChangeRefused" in [n.reason for n in notices]
    assert job_status(kube).observed_generation == 2


def test_reconcile_uses_the_default_image_only_where_the_job_names_none():
    kube = FakeKube()
    imageless = tiny_job()
    del imageless["spec"]["image"]
    run_reconcile(kube, kube.add_job(imageless), config=OperatorConfig(default_image="registry.example/trainer:2"))
    pod = kube.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["containers"][0]["image"] == "registry.example/trainer:2"


def test_a_job_with_no_image_and_no_default_is_invalid_saying_so():
    kube = FakeKube()
    imageless = tiny_job()
    del imageless["spec"]["image"]
    outcome, _ = run_reconcile(kube, kube.add_job(imageless))
    assert outcome.result == "invalid" and kube.jobset() is None
    status = job_status(kube)
    assert status.phase == "Invalid" and "spec.image: not set" in status.message, status


def test_reconcile_leaves_finished_and_deleting_jobs_alone():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    obj["status"] = {"phase": "Succeeded"}
    assert run_reconcile(kube, obj)[0].result == "finished"
    obj["status"], obj["metadata"]["deletionTimestamp"] = {}, rfc3339(NOW)
    assert run_reconcile(kube, obj)[0].result == "deleting"
    assert kube.calls == []


def test_a_conflicting_status_write_rereads_once_then_leaves_it():
    kube = FakeKube()
    run_reconcile(kube, kube.add_job(tiny_job()))
    completed = kube.jobset()
    completed["status"] = jobset(conditions=("Completed",))["status"]
    kube.conflicts = 1  # someone wrote in between: read, recompute, write
    kube.calls.clear()
    outcome, notices = run_reconcile(kube, kube.job(), completed)
    assert outcome.result == "followed" and job_status(kube).phase == "Succeeded"
    assert [c[0] for c in kube.calls] == ["PATCH", "GET", "PATCH"] and [n.reason for n in notices] == ["Succeeded"]
    kube.objects[JOBS.path("default", "tiny")]["status"] = {"jobSetName": "tiny"}  # back before Succeeded
    kube.conflicts, kube.calls = 2, []
    outcome, notices = run_reconcile(kube, kube.job(), completed)
    assert outcome.job is None and notices == [] and [c[0] for c in kube.calls] == ["PATCH", "GET", "PATCH"]


# --- the manager ------------------------------------------------------------------------------------------------


def test_manager_reread_catches_up_a_lost_completion_with_one_get():
    async def scenario() -> None:
        kube = FakeKube()
        manager, clock, notices = manager_for(kube)
        job = kube.add_job(tiny_job())
        manager.add(("default", "tiny"), "job")
        index = {("default", "tiny"): [job]}
        assert await drain(manager, index, {}) == ["created"]
        assert ("default", "tiny") in manager.due_resync
        # The JobSet completes and its event is lost: the index still has the JobSet as created.
        jobset_index = {("default", "tiny"): [kube.jobset()]}
        kube.objects[JOBSETS.path("default", "tiny")]["status"] = jobset(conditions=("Completed",))["status"]
        index[("default", "tiny")] = [kube.job()]
        kube.calls.clear()
        manager.add(("default", "tiny"), "resync")  # a resync from the caches: no request, nothing new
        assert await drain(manager, index, jobset_index) == ["followed"] and kube.calls == []
        manager.add(("default", "tiny"), "reread")
        assert await drain(manager, index, jobset_index) == ["followed"]
        # The JobSet once, pod 0 for the trainer's final values (there is none here), the status once.
        assert [c[0] for c in kube.calls] == ["GET", "LIST", "PATCH"]
        assert job_status(kube).phase == "Succeeded" and [n.reason for n in notices][-1] == "Succeeded"
        assert ("default", "tiny") not in manager.due_resync  # finished: nothing more to follow

    asyncio.run(scenario())


def test_manager_recreates_a_missing_jobset_exactly_once():
    async def scenario() -> None:
        kube = FakeKube()
        manager, _, _ = manager_for(kube)
        index = {("default", "tiny"): [kube.add_job(tiny_job())]}
        manager.add(("default", "tiny"), "job")
        await drain(manager, index, {})
        del kube.objects[JOBSETS.path("default", "tiny")]  # deleted, and its DELETED event lost
        index[("default", "tiny")] = [kube.job()]
        manager.add(("default", "tiny"), "reread")
        assert await drain(manager, index, {("default", "tiny"): [{"metadata": {"name": "stale"}}]}) == ["created"]
        manager.add(("default", "tiny"), "resync")
        index[("default", "tiny")] = [kube.job()]
        assert await drain(manager, index, {("default", "tiny"): [kube.jobset()]}) == ["followed"]
        assert writes(kube).count(("POST", JOBSETS.path("default"))) == 2  # the first one and the re-creation

    asyncio.run(scenario())


def test_manager_rereads_a_jobset_once_every_ten_resyncs_of_its_job():
    manager, _, _ = manager_for(FakeKube())
    kinds = [manager._resync_kind(("default", "tiny")) for _ in range(40)]
    first = kinds.index("reread")
    assert 10 <= first < 20 and "reread" not in kinds[:10]  # a burst of new jobs: no GET in its first ten resyncs
    assert [i for i, kind in enumerate(kinds) if kind == "reread"] == [first, first + 10, first + 20][
        : 1 + (39 - first) // 10
    ]


def test_a_suspended_job_is_resynced_only_to_reread_its_jobset():
    async def scenario() -> None:
        kube = FakeKube()
        manager, clock, _ = manager_for(kube)
        key = ("default", "tiny")
        index = {key: [kube.add_job(tiny_job(suspend=True))]}
        manager.add(key, "job")
        assert await drain(manager, index, {}) == ["created"] and job_status(kube).phase == "Suspended"
        assert key in manager.quiet and key in manager.due_resync
        queued = []
        for _ in range(25):  # 25 resync intervals: nothing changes a suspended job but its events
            clock.t = manager.due_resync[key]
            manager.tick()
            if len(manager.queue):
                queued.append((await manager.queue.get())[1])
                manager.queue.done(key)
        assert queued and set().union(*queued) == {"reread"} and len(queued) <= 2

    asyncio.run(scenario())


def test_manager_remembers_the_jobset_it_created_until_the_watch_delivers_it():
    async def scenario() -> None:
        kube = FakeKube()
        manager, _, _ = manager_for(kube)
        index = {("default", "tiny"): [kube.add_job(tiny_job())]}
        manager.add(("default", "tiny"), "job")
        assert await drain(manager, index, {}) == ["created"]
        # The job's own status write comes back before the JobSet's ADDED event: no second POST (a 409)
        # and no GET to adopt what this operator just made.
        index[("default", "tiny")] = [kube.job()]
        kube.calls.clear()
        manager.add(("default", "tiny"), "job")
        assert await drain(manager, index, {}) == ["echo"]  # its own write, nothing else new: not reconciled
        assert [c[0] for c in kube.calls] == []
        manager.add(("default", "tiny"), "jobset")  # the watch catches up: the index is what counts again
        assert await drain(manager, index, {("default", "tiny"): [kube.jobset()]}) == ["followed"]
        assert not manager.made and not [c for c in kube.calls if c[0] == "POST"]

    asyncio.run(scenario())


def test_manager_computes_from_its_own_last_write_until_the_watch_catches_up():
    async def scenario() -> None:
        kube = FakeKube()
        manager, _, _ = manager_for(kube)
        stale = kube.add_job(tiny_job())
        index = {("default", "tiny"): [stale]}
        manager.add(("default", "tiny"), "job")
        await drain(manager, index, {})
        # The JobSet's event arrives before the job's own: the index still holds the job as created.
        kube.calls.clear()
        manager.add(("default", "tiny"), "jobset")
        assert await drain(manager, index, {("default", "tiny"): [kube.jobset()]}) == ["followed"]
        assert kube.calls == []  # no write computed from the stale version, so no 409 and no re-read
        index[("default", "tiny")] = [kube.job()]  # the watch catches up
        assert manager.job(("default", "tiny")) == kube.job() and not manager.written

    asyncio.run(scenario())


# --- the work queue ------------------------------------------------------------------------------------------------


def test_work_queue_coalesces_and_processes_a_key_again_after_a_change_in_flight():
    async def scenario() -> None:
        queue = WorkQueue()
        queue.add("a", "job")
        queue.add("a", "jobset")
        queue.add("b", "job")
        key, reasons = await queue.get()
        assert (key, reasons) == ("a", {"job", "jobset"})
        queue.add("a", "metrics")  # while "a" is being processed
        assert len(queue) == 1  # only "b": "a" is not handed to a second worker
        queue.done("a")
        assert [await queue.get() for _ in range(2)] == [("b", {"job"}), ("a", {"metrics"})]

    asyncio.run(scenario())


def test_work_queue_backs_off_exponentially_and_forgets_on_success():
    async def scenario() -> None:
        clock = Clock()
        queue = WorkQueue(base_delay_s=0.5, max_delay_s=4, clock=clock)
        assert [queue.retry("a") for _ in range(5)] == [0.5, 1, 2, 4, 4]
        queue.forget("a")
        assert queue.retry("a") == 0.5
        timers = asyncio.create_task(queue.run_timers())
        await asyncio.sleep(0)
        assert len(queue) == 0
        clock.t += 0.5
        queue.add_after("b", 100, "retry")  # wakes the timer task, which finds "a" due
        await asyncio.sleep(0.01)
        assert await queue.get() == ("a", {"retry"})
        timers.cancel()

    asyncio.run(scenario())


# --- the metrics reader -----------------------------------------------------------------------------------------------


def test_metrics_reader_lists_pod0_once_and_reads_through_the_proxy():
    kube = FakeKube()
    add_pod0(kube)
    reader = MetricsReader(kube, "proxy")

    async def reads() -> list[Sample]:
        return [await reader.read("ml", "job", 9431) for _ in range(3)]

    assert asyncio.run(reads()) == [Sample(step=9, mfu=0.25)] * 3
    assert kube.calls == [("LIST", PODS.path("ml"))] + [("PROXY", "job-slice-0-0-x:9431/status")] * 3
    assert metrics_reader.pod0_selector("x").count("=") == 3


def test_metrics_reader_final_values_come_from_pod0s_termination_record():
    # A completed JobSet's pods have exited: the kubelet keeps process 0's last line as its termination message.
    kube = FakeKube()
    add_pod0(kube)
    pod = kube.objects[PODS.path("ml", "job-slice-0-0-x")]
    # The values /status served last: the final loss and evaluation, which a read before the end missed. They are
    # untrusted as /status is: a non-number, a boolean and a string are dropped, the rest is kept.
    last = {"loss": 2.5, "eval_loss": 2.75, "step_time_s": 0.5, "mfu": True, "global_tokens_per_s": "fast", "step": 3}
    record = TerminationRecord(code=0, progress=Progress(started_at=1.0, step=20, last_checkpoint_step=20), last=last)
    pod["status"] = {
        "phase": "Succeeded",
        "podIP": "10.0.0.7",
        "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": 0, "message": record.message()}}}
        ],
    }
    sample = asyncio.run(MetricsReader(kube, "direct").final("ml", "job"))
    assert (sample.step, sample.last_checkpoint_step, sample.error) == (20, 20, None)  # the clock's, not `last`'s
    assert (sample.loss, sample.eval_loss, sample.step_time_seconds) == (2.5, 2.75, 0.5)
    assert (sample.mfu, sample.tokens_per_second) == (None, None)
    assert kube.calls == [("LIST", PODS.path("ml"))]
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = ""  # FallbackToLogsOnError, exit 0
    assert "left no termination record" in asyncio.run(MetricsReader(kube, "direct").final("ml", "job")).error


def test_metrics_reader_direct_unreachable_is_an_error_not_a_crash():
    kube = FakeKube()
    add_pod0(kube, ip="127.0.0.1")

    async def scenario() -> None:
        reader = MetricsReader(kube, "direct", timeout_s=2)
        try:
            sample = await reader.read("ml", "job", 1)  # port 1: nothing listens
            assert sample.error and "127.0.0.1:1/status" in sample.error
            # The remembered pod failed: forget it and list once more, then report the failure.
            assert [c[0] for c in kube.calls] == ["LIST"]
            await reader.read("ml", "job", 1)
            assert [c[0] for c in kube.calls] == ["LIST", "LIST"]
        finally:
            await reader.close()

    asyncio.run(scenario())


def test_stats_exposition_is_prometheus_text():
    stats = Stats()
    stats.observe("job", "created", 0.02)
    stats.observe("job", "api_error", 3.0)
    text = generate_latest(stats.registry).decode()
    assert 'tpu_operator_reconciles_total{handler="job",result="created"} 1' in text
    assert 'tpu_operator_reconcile_errors_total{handler="job"} 1' in text
    assert 'tpu_operator_reconcile_duration_seconds_bucket{handler="job",le="0.025"} 1' in text
    assert 'tpu_operator_reconcile_duration_seconds_bucket{handler="job",le="+Inf"} 2' in text
    assert 'tpu_operator_reconcile_duration_seconds_count{handler="job"} 2' in text


def test_operator_intervals_are_positive_seconds():
    from tpu_operator.cli import build_parser, operator_options

    config = operator_options(build_parser().parse_args(["operator"])).controller
    assert (config.metrics_interval_s, config.resync_interval_s) == (10.0, 60.0)
    assert (
        operator_options(
            build_parser().parse_args(["operator", "--resync-interval", "2.5"])
        ).controller.resync_interval_s
        == 2.5
    )
    for flag in ("--resync-interval", "--metrics-interval"):
        for bad in ("0", "-1", "nan", "inf", "often"):
            with pytest.raises(SystemExit):
                build_parser().parse_args(["operator", flag, bad])

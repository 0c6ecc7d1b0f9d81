"""The controller's policies, each tested on its own: the retry policy (one timer per key, capped
backoff, permanent errors reported and held), time at the API boundary, the conditions table, and the
status pipeline (`steps.compute`) called with no client at all. A fake clock drives time; nothing sleeps."""

from __future__ import annotations

import ast
import asyncio
import datetime
import pathlib
from typing import Any

import pytest

from tests.conftest import operator_job as tiny_job
from tests.fakes import LATER, NOW, Clock, FakeKube, drain, job_status, jobset, manager_for
from tpu_operator.api import timestamps
from tpu_operator.api.failures import RestartCounts, backoff_s
from tpu_operator.api.spec import FailurePolicySpec
from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.controller import conditions, phases, steps
from tpu_operator.controller.kube import JOBS, JOBSETS, ApiError, Resource
from tpu_operator.controller.queue import WorkQueue

CONTROLLER = pathlib.Path(steps.__file__).parent


# --- retries ----------------------------------------------------------------------------------------------


def test_a_key_has_one_pending_timer_with_its_earliest_due_time():
    async def scenario() -> None:
        clock = Clock()
        queue = WorkQueue(clock=clock)
        for delay in (30, 10, 20, 40, 10):
            queue.add_after("a", delay, "retry")
        queue.add_after("a", 25, "resync")
        assert queue.pending("a") == clock.t + 10
        timers = asyncio.create_task(queue.run_timers())
        clock.t += 10
        queue.add_after("b", 100, "retry")  # wakes the timer task
        await asyncio.sleep(0.01)
        assert len(queue) == 1 and await queue.get() == ("a", {"retry", "resync"})
        queue.done("a")
        clock.t += 100
        queue.add_after("c", 1000, "retry")
        await asyncio.sleep(0.01)
        assert len(queue) == 1 and (await queue.get())[0] == "b"  # the stale entries of "a" fired nothing
        timers.cancel()

    asyncio.run(scenario())


def test_a_million_failures_in_a_row_do_not_overflow():
    queue = WorkQueue(base_delay_s=0.5, max_delay_s=300)
    queue._failures["a"] = 10**6
    assert queue.retry("a") == 300
    policy = FailurePolicySpec(backoffSeconds=10, maxBackoffSeconds=3600)
    assert backoff_s(policy, RestartCounts(total=10**6)) == 3600


@pytest.mark.parametrize(
    "status, verb, permanent",
    [
        (403, "POST", True),
        (422, "POST", True),
        (400, "PATCH", True),
        (404, "POST", True),
        (404, "GET", False),
        (409, "POST", False),
        (0, "GET", False),
        (429, "POST", False),
        (500, "PATCH", False),
        (503, "GET", False),
        (408, "GET", False),
    ],
)
def test_which_api_errors_are_permanent(status, verb, permanent):
    assert ApiError(status, "m", verb).permanent is permanent


class Forbidding(FakeKube):
    """The API server of an operator whose RBAC lacks `create` on JobSets."""

    def __init__(self) -> None:
        super().__init__()
        self.forbid = True

    async def create(
        self, resource: Resource, namespace: str, body: dict[str, Any], dry_run: bool = False
    ) -> dict[str, Any]:
        if resource == JOBSETS and self.forbid:
            self.calls.append(("DRYRUN" if dry_run else "POST", resource.path(namespace)))
            raise ApiError(
                403, 'jobsets.jobset.x-k8s.io is forbidden: User "op" cannot create resource "jobsets"', "POST"
            )
        return await super().create(resource, namespace, body, dry_run)


async def _work(manager, key) -> str:  # noqa: ANN001
    """One pass of a worker over `key`, as Manager._worker runs it."""
    got, reasons = await manager.queue.get()
    assert got == key
    try:
        return await manager._reconcile(key, reasons)
    except ApiError as exc:
        return await manager._failed(key, exc)
    finally:
        manager.queue.done(key)


def test_a_403_is_shown_on_the_job_once_and_not_retried_until_the_spec_changes():
    async def scenario() -> None:
        kube = Forbidding()
        manager, clock, notices = manager_for(kube)
        key = ("default", "tiny")
        job = kube.add_job(tiny_job())
        manager.jobs = {key: [job]}
        manager.add(key, "job")
        assert await _work(manager, key) == "refused"
        status = job_status(kube)
        refused = status.condition("Reconciled")
        assert (refused.status, refused.reason, refused.observed_generation) == ("False", "Forbidden", 1)
        assert 'cannot create resource "jobsets"' in refused.message and "403" in refused.message
        assert [n.reason for n in notices] == ["Forbidden"]
        assert manager.queue.pending(key) == clock.t + manager.config.refused_retry_s  # the long retry only
        # Its own status write, a JobSet or Workload event: held, no request, no second Event.
        manager.jobs = {key: [kube.job()]}
        kube.calls.clear()
        manager.add(key, "job")
        assert await _work(manager, key) == "held" and kube.calls == [] and len(notices) == 1
        # The RBAC is fixed and the spec edited: tried at once, and Reconciled=True again.
        kube.forbid = False
        edited = kube.objects[JOBS.path("default", "tiny")]
        edited["metadata"]["generation"] = 2
        manager.jobs = {key: [kube.job()]}
        manager.add(key, "job")
        assert await _work(manager, key) == "created"
        assert job_status(kube).condition("Reconciled").status == "True"

    asyncio.run(scenario())


def test_a_permanent_error_is_tried_again_after_the_long_wait():
    async def scenario() -> None:
        kube = Forbidding()
        manager, clock, _ = manager_for(kube)
        key = ("default", "tiny")
        manager.jobs = {key: [kube.add_job(tiny_job())]}
        manager.add(key, "job")
        await _work(manager, key)
        manager.jobs = {key: [kube.job()]}
        clock.t += manager.config.refused_retry_s
        kube.calls.clear()
        manager.add(key, "retry")
        assert await _work(manager, key) == "refused" and ("POST", JOBSETS.path("default")) in kube.calls

    asyncio.run(scenario())


def test_a_transient_error_backs_off_and_is_not_shown_on_the_job():
    async def scenario() -> None:
        kube = FakeKube()
        manager, clock, notices = manager_for(kube)
        key = ("default", "tiny")
        manager.jobs = {key: [kube.add_job(tiny_job())]}
        assert await manager._failed(key, ApiError(503, "unavailable", "POST")) == "api_error"
        assert await manager._failed(key, ApiError(0, "connection reset", "GET")) == "api_error"
        assert manager.queue.pending(key) == clock.t + 0.5  # the first backoff's timer; the second is later
        assert kube.calls == [] and notices == []

    asyncio.run(scenario())


# --- time ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2026-01-01T00:00:00Z", NOW),
        ("2026-01-01T00:00:00.123456Z", NOW + datetime.timedelta(microseconds=123456)),
        ("2026-01-01T01:00:00+01:00", NOW),
        ("2026-01-01T00:00:00.5z", NOW + datetime.timedelta(milliseconds=500)),
    ],
)
def test_rfc3339_is_parsed_with_or_without_fractional_seconds(text, expected):
    assert timestamps.parse(text) == expected
    assert timestamps.format(timestamps.parse(text)).endswith("Z")


@pytest.mark.parametrize("text", ["", "yesterday", "2026-01-01T00:00:00"])
def test_what_is_not_rfc3339_is_refused_or_none(text):
    with pytest.raises(ValueError):
        timestamps.parse(text)
    assert timestamps.parse_or_none(text) is None


def test_status_times_are_datetimes_inside_and_rfc3339_on_the_wire():
    status = TPUTrainingJobStatus.model_validate({"startTime": "2026-01-01T00:00:00.250Z"})
    assert status.start_time == NOW + datetime.timedelta(milliseconds=250)
    assert status.to_wire()["startTime"] == "2026-01-01T00:00:00Z"


# --- conditions -----------------------------------------------------------------------------------------------


def _written_conditions() -> list[tuple[str, str, str]]:
    """(file, type, reason) of every set_condition call in the controller whose type and reason are literals."""
    found = []
    for path in sorted(CONTROLLER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "set_condition":
                type_, reason = node.args[1], node.args[3]
                if isinstance(type_, ast.Constant) and isinstance(reason, ast.Constant):
                    found.append((path.name, type_.value, reason.value))
    return found


def test_every_condition_type_and_reason_written_is_in_the_table():
    written = _written_conditions()
    assert len(written) > 10
    for where, type_, reason in written:
        assert type_ in conditions.BY_TYPE, (where, type_)
        assert reason in {r.name for r in conditions.BY_TYPE[type_].reasons}, (where, type_, reason)
    for t in conditions.TYPES:
        assert t.normal in ("True", "False") and t.meaning and t.reasons
        for r in t.reasons:
            assert r.name[0].isupper() and " " not in r.name and r.meaning, r


def test_ready_means_progressing_or_succeeded_and_running_does_not_repeat_the_phase():
    for phase, (ready, _) in steps.READY.items():
        assert (ready == "True") == (phase in ("Running", "Succeeded")), phase
    assert set(phases.RUNNING) == set(steps.READY)
    assert not set(phases.RUNNING.values()) & set(phases.RUNNING) - {"Suspended", "Restarting", "Failed"}


# --- the status pipeline, with no client ---------------------------------------------------------------


def observed(js: dict[str, Any], **more: Any) -> steps.Observed:
    return steps.Observed(
        now=LATER,
        generation=3,
        jobset_name="tiny",
        config_map="tiny-config",
        jobset_uid="js-1",
        view=phases.JobSetView.of(js),
        intent=phases.Intent(),
        policy=FailurePolicySpec(),
        total_steps=100,
        created_at=NOW,
        **more,
    )


def test_compute_is_a_pure_function_of_what_was_observed():
    status, notices = steps.compute(TPUTrainingJobStatus(), observed(jobset(active=1, ready=1), created=True))
    assert status.phase == "Running" and status.job_set_name == "tiny" and status.start_time == LATER
    ready = status.condition("Ready")
    assert (ready.status, ready.reason) == ("True", "Progressing")
    assert {c.observed_generation for c in status.conditions} == {3}
    assert [n.reason for n in notices] == ["Created"]
    again, notices = steps.compute(status, observed(jobset(active=1, ready=1)))
    assert again == status and notices == []  # nothing new: nothing to write
    done, notices = steps.compute(status, observed(jobset(conditions=("Completed",))))
    assert done.phase == "Succeeded" and done.condition("Ready").reason == "Completed"
    assert [n.reason for n in notices] == ["Succeeded"]


def test_compute_says_which_fields_it_refused():
    status, notices = steps.compute(TPUTrainingJobStatus(), observed(jobset(), refused=("spec.training.steps",)))
    change = status.condition("SpecChange")
    assert (change.status, change.reason) == ("False", "Immutable") and "spec.training.steps" in change.message
    assert status.condition("Ready").reason == "PodsPending"
    assert [n.reason for n in notices] == ["SpecChangeRefused"]


def test_every_condition_of_a_reconciled_job_carries_its_generation():
    async def scenario() -> None:
        kube = FakeKube()
        manager, _, _ = manager_for(kube)
        key = ("default", "tiny")
        manager.add(key, "job")
        await drain(manager, {key: [kube.add_job(tiny_job())]}, {})
        kube.objects[JOBSETS.path("default", "tiny")]["status"] = jobset(active=1, ready=1)["status"]
        manager.add(key, "jobset")
        await drain(manager, {key: [kube.job()]}, {key: [kube.jobset()]})
        status = job_status(kube)
        assert status.phase == "Running" and len(status.conditions) >= 5
        assert all(c.observed_generation == 1 for c in status.conditions), status.conditions

    asyncio.run(scenario())


def test_a_status_time_another_version_wrote_as_text_reads_as_unset():
    status = TPUTrainingJobStatus.model_validate({"lastEvictionTime": "Preempted: by a higher priority job"})
    assert status.last_eviction_time is None

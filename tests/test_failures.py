"""The restart policy (api/failures.py), the termination record (api/lifecycle.py) and the goodput
ledger (api/goodput.py): pure, shared by the operator and the local runner."""

import datetime

import pytest

from tests.conftest import tiny_job
from tpu_operator.api import goodput as g
from tpu_operator.api.failures import Failure, PodExit, RecentRestarts, RestartCounts, record, root_cause, verdict
from tpu_operator.api.lifecycle import Divergence, Progress, TerminationRecord, exit_code
from tpu_operator.api.spec import FailurePolicySpec
from tpu_operator.api.validation import InvalidJob, parse_job
from tpu_operator.controller.restarts import failure_of


def rec(code, error=""):
    return TerminationRecord(code=code, error=error)


def test_root_cause_is_the_first_real_failure_not_the_pods_stopped_after_it():
    exits = [
        PodExit("h0", 143, rec(143, "stopped"), "2026-01-01T00:00:09Z"),
        PodExit("h1", 42, rec(42, "Retryable: gloo"), "2026-01-01T00:00:05Z"),
        PodExit("h2", 0, None, "2026-01-01T00:00:01Z"),
    ]
    f = root_cause(exits)
    assert (f.cause, f.code, f.pod, f.error) == ("failure", 42, "h1", "Retryable: gloo")
    assert root_cause([PodExit("h0", 143, finished_at=2), PodExit("h1", 143, finished_at=1)]).pod == "h1"
    assert root_cause([PodExit("h0", 143), PodExit("h1", 137, finished_at=1)]).cause == "failure"
    # Finished together: the host killed from outside, not its peer that lost the connection to it.
    together = [
        PodExit("h0", 42, rec(42, "UNKNOWN: Gloo AllGather failed: Connection reset by peer"), 5.0),
        PodExit("h1", 137, None, 5.0),
    ]
    assert (root_cause(together).pod, root_cause(together).code) == ("h1", 137)
    assert root_cause([PodExit("h0", 1, finished_at=1), PodExit("h1", 3, finished_at=2)]).cause == "user"
    assert root_cause([PodExit("h0", 137, disrupted=True)]).cause == "preemption"  # the cluster stopped it
    assert root_cause([PodExit("h0", 0)]) is None


def f(code, cause="failure"):
    return root_cause([PodExit("h1", code, rec(code, "E: why"))])


POLICY = FailurePolicySpec(maxRestarts=2, backoffSeconds=10, maxBackoffSeconds=30)


@pytest.mark.parametrize(
    "policy, counts, code, restart, cause, delay, says",
    [
        (POLICY, RestartCounts(), 42, True, "failure", 10, "h1 exited with code 42 (retryable infrastructure failure)"),
        (POLICY, RestartCounts(failure=1, total=1), 137, True, "failure", 20, "restart 2 (failure) in 20 s"),
        (POLICY, RestartCounts(failure=1, preemption=3, total=4), 42, True, "failure", 30, "in 30 s"),  # capped
        (POLICY, RestartCounts(failure=2, total=2), 42, False, None, 0, "restart budget spent (2 of maxRestarts 2"),
        (POLICY, RestartCounts(failure=2, total=2), 143, True, "preemption", 30, "stopped by SIGTERM"),  # not charged
        (POLICY, RestartCounts(), 3, False, None, 0, "E: why; a user error is never retried"),
        (POLICY, RestartCounts(), 1, False, None, 0, "not in restartOnExitCodes [42, 137, 143]"),
        (FailurePolicySpec(restartOnExitCodes=[]), RestartCounts(), 1, True, "failure", 10, "unexpected error"),
        (FailurePolicySpec(restartOnExitCodes=[]), RestartCounts(), 3, False, None, 0, "never retried"),
    ],
)
def test_verdict(policy, counts, code, restart, cause, delay, says):
    v = verdict(policy, counts, f(code))
    assert (v.restart, v.cause, v.delay_s) == (restart, cause, delay) and says in v.message, v.message


def test_a_hang_is_charged_like_a_failure():
    assert verdict(POLICY, RestartCounts(), None, "hung: no step for 700 s").cause == "hang"
    assert not verdict(POLICY, RestartCounts(hang=2, total=2), None, "hung").restart


def test_user_errors_cannot_be_listed_as_restartable():
    with pytest.raises(InvalidJob, match="exit code 3 is a user or configuration error"):
        parse_job(tiny_job(failurePolicy={"restartOnExitCodes": [42, 3]}))
    assert parse_job(tiny_job()).spec.failure_policy.restart_on_exit_codes == [42, 137, 143]


def test_termination_records_round_trip_and_log_tails_give_their_last_line():
    record = TerminationRecord(code=42, error="Retryable: x" * 1000, progress=Progress(started_at=1.0, step=3))
    text = record.message()
    assert len(text.encode()) <= 4096 and TerminationRecord.parse(text).progress.step == 3
    assert TerminationRecord.parse("W0101 noise\nTraceback...\nValueError: bad\n\n", 1) == TerminationRecord(
        code=1, error="ValueError: bad"
    )
    assert TerminationRecord.parse("") is None
    # A record nested deeper than the JSON parser goes (4 KiB of brackets) is read as a log tail, never raised.
    nested = "[" * 2000 + "]" * 2000
    assert TerminationRecord.parse(nested, 1) == TerminationRecord(code=1, error=nested[:4096])
    assert (exit_code(-9), exit_code(-15), exit_code(42)) == (137, 143, 42)


# --- goodput -------------------------------------------------------------------------------------------------


def progress(**kw):
    return Progress(**{"started_at": 0.0, **kw})


def test_goodput_of_a_killed_attempt_counts_its_unsaved_steps_as_lost():
    ledger = g.start_attempt(g.Ledger(), 12.0, created=0.0)  # pods seen running at 12 s
    # The trainer started at 10 s, its first step (compile) was done at 20 s, then 10 steps of 1 s.
    p = progress(
        started_at=10.0,
        start_step=0,
        first_step_at=20.0,
        last_step_at=30.0,
        step=11,
        last_checkpoint_step=8,
        step_seconds=10.0,
        steps_timed=10,
    )
    ledger = g.reported(ledger, p, 30.0, 0.0)
    assert ledger.attempt.running_since == 10.0 and ledger.badput.queued == 10.0
    ledger = g.end_attempt(ledger, 30.5, "failure")  # a host is killed half-way through step 12
    ledger = g.start_attempt(ledger, 40.0, 0.0)
    # It resumed from step 8: steps 9..11 are recomputed.
    p2 = progress(
        started_at=38.0,
        start_step=8,
        first_step_at=45.0,
        last_step_at=57.0,
        step=21,
        last_checkpoint_step=21,
        step_seconds=11.0,
        steps_timed=12,
        checkpoint_seconds=1.0,
    )
    ledger = g.reported(ledger, p2, 57.0, 0.0)
    ledger = g.end_attempt(ledger, 58.0, "succeeded")
    fraction, productive, badput = g.report(ledger, 0.0)
    assert badput.lost == pytest.approx(3.0 + 0.5)  # 3 steps of 1 s and the step in flight
    assert (badput.queued, badput.startup, badput.restarting, badput.checkpoint) == (10.0, 17.0, 7.5, 1.0)
    assert productive == pytest.approx(7.0 + 11.0)  # steps 2..8 of the first attempt, all of the second
    assert productive + badput.named() + badput.other == pytest.approx(58.0)
    assert fraction == pytest.approx(18.0 / 58.0)


def test_goodput_reads_the_same_until_the_ledger_changes_and_ignores_stale_reports():
    ledger = g.start_attempt(g.Ledger(), 5.0, 0.0)
    p = progress(
        started_at=4.0, start_step=0, first_step_at=9.0, last_step_at=12.0, step=4, step_seconds=3.0, steps_timed=3
    )
    ledger = g.reported(ledger, p, 12.0, 0.0)
    assert g.reported(ledger, p, 20.0, 0.0) is ledger  # the same report: nothing to write
    assert g.report(ledger, 0.0) == g.report(ledger, 0.0)
    hung = g.end_attempt(ledger, 100.0, "hang")
    assert hung.unsettled.last_checkpoint_step == 0 and g.report(hung, 0.0, 100.0)[2].hung == 88.0
    restarted = g.start_attempt(hung, 110.0, 0.0)
    assert g.reported(restarted, p, 111.0, 0.0) is restarted  # from the hung process: older than the attempt


# --- issue 30: per-cause budgets, the window, divergence, a pod lost with its node -------------------------------

T = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)


def ago(*seconds: int) -> tuple[datetime.datetime, ...]:
    return tuple(T - datetime.timedelta(seconds=s) for s in seconds)


def diverged(value: str = "nan") -> Failure:
    record = TerminationRecord(
        code=43,
        error="Diverged: loss",
        diverged=Divergence(step=120, metric="loss", value=value, lastCheckpointStep=100),
    )
    return root_cause([PodExit("h0", 143, rec(143), 9.0), PodExit("h1", 43, record, 5.0)])


def hw() -> Failure:
    return Failure(cause="hardware", code=None, pod="h1", error="node n1 of pod h1 is unhealthy")


REWIND = {"onDivergence": "Rewind"}
WINDOW = {"restartWindowSeconds": 600}


@pytest.mark.parametrize(
    "policy, counts, failure, restart, cause, says",
    [
        # Divergence: Fail by default; Rewind within its own budget (2) and maxRestarts' total.
        ({}, RestartCounts(), diverged(), False, None, "h1 exited with code 43 (diverged: a non-finite loss"),
        ({}, RestartCounts(), diverged(), False, None, "at step 120: loss nan: Diverged: loss; onDivergence is Fail"),
        (REWIND, RestartCounts(), diverged("inf"), True, "diverged", "restart 1 (diverged)"),
        (REWIND, RestartCounts(diverged=2, total=2), diverged(), False, None, "diverged restart budget spent (2 of "),
        (REWIND, RestartCounts(failure=3, total=3), diverged(), False, None, "(3 of maxRestarts 3 used)"),
        # maxRestarts is the total of the job's own faults: a divergence counts toward a failure's limit.
        ({}, RestartCounts(failure=2, diverged=1, total=3), f(42), False, None, "(3 of maxRestarts 3 used)"),
        # Hardware: charged against its own budget (10 by default), never against maxRestarts.
        ({"maxRestarts": 0}, RestartCounts(hardware=9, total=9), hw(), True, "hardware", "restart 10 (hardware)"),
        ({}, RestartCounts(hardware=10, total=10), hw(), False, None, "hardware restart budget spent (10 of "),
        ({"restartBudgets": {"hardware": 1}}, RestartCounts(hardware=1, total=1), hw(), False, None, "hardware 1 used"),
        # A failure's own budget beside maxRestarts; preemption uncharged unless it has one.
        ({"restartBudgets": {"failure": 1}}, RestartCounts(failure=1, total=1), f(42), False, None, "failure 1 used"),
        ({}, RestartCounts(preemption=500, total=500), f(143), True, "preemption", "restart 501 (preemption)"),
        ({"restartBudgets": {"preemption": 2}}, RestartCounts(preemption=2, total=2), f(143), False, None, "2 used"),
        # A pod lost with its node: hardware, whatever the exit codes of its peers.
        (
            {"maxRestarts": 0},
            RestartCounts(),
            root_cause([PodExit("h0", 42, rec(42, "gloo: reset"), 1.0), PodExit("h1", None, lost="DeletionByPodGC")]),
            True,
            "hardware",
            "pod h1 was lost with its node (DeletionByPodGC)",
        ),
    ],
)
def test_verdict_per_cause(policy, counts, failure, restart, cause, says):
    v = verdict(FailurePolicySpec.model_validate({"backoffSeconds": 1, **policy}), counts, failure, now=T)
    assert (v.restart, v.cause) == (restart, cause) and says in v.message, v.message


@pytest.mark.parametrize(
    "policy, recent, failure, restart, says",
    [
        # Within the window: two hardware restarts in the last 10 minutes spend a budget of 2.
        ({"restartBudgets": {"hardware": 2}}, {"hardware": ago(30, 90)}, hw(), False, "2 of restartBudgets.hardware 2"),
        # One of them is older than the window: it no longer counts (as Kubernetes forgets a crash back-off).
        ({"restartBudgets": {"hardware": 2}}, {"hardware": ago(30, 700)}, hw(), True, "restart"),
        ({"maxRestarts": 1}, {"failure": ago(601)}, f(42), True, "restart"),
        ({"maxRestarts": 1}, {"hang": ago(10)}, f(42), False, "1 of maxRestarts 1 used within restartWindowSeconds"),
        # A time in the future (a clock that moved back) still counts: never more restarts than asked for.
        ({"maxRestarts": 1}, {"failure": (T + datetime.timedelta(hours=1),)}, f(42), False, "1 of maxRestarts 1"),
    ],
)
def test_the_window_counts_only_recent_restarts(policy, recent, failure, restart, says):
    counts = RestartCounts(failure=50, hang=50, hardware=50, total=150, recent=RecentRestarts(**recent))
    v = verdict(FailurePolicySpec.model_validate({**WINDOW, **policy}), counts, failure, now=T)
    assert v.restart == restart and says in v.message, v.message


def test_recent_restart_times_are_bounded_by_the_budgets_that_read_them():
    policy = FailurePolicySpec.model_validate({**WINDOW, "maxRestarts": 3, "restartBudgets": {"hardware": 100}})
    counts = RestartCounts()
    for i in range(150):
        counts = record(policy, counts, "hardware", T + datetime.timedelta(seconds=i))
        counts = record(policy, counts, "failure", T + datetime.timedelta(seconds=i))
    assert (counts.hardware, counts.failure, counts.total) == (150, 150, 300)  # the counts are the job's whole life
    assert len(counts.recent.hardware) == 100 and counts.recent.hardware[-1] == T + datetime.timedelta(seconds=149)
    assert len(counts.recent.failure) == 64  # maxRestarts 3, but the backoff's exponent reads up to 64
    later = record(policy, counts, "hang", T + datetime.timedelta(seconds=149 + 601))
    assert later.recent.hardware == () and later.recent.hang == (T + datetime.timedelta(seconds=750),)  # all expired
    assert record(FailurePolicySpec(), RestartCounts(), "failure", T).recent is None  # no window: counts suffice
    # Old statuses (no diverged, no recent) read as before.
    old = RestartCounts.model_validate({"failure": 1, "preemption": 2, "hang": 0, "hardware": 1, "total": 4})
    assert old.charged == 1 and old.diverged is None


def test_a_status_a_later_operator_wrote_reads_with_its_unknown_fields_left_out():
    """A rollback: the operator reads a status that a newer version wrote (new counts, condition fields,
    badput buckets); what it does not know is ignored, so it goes on reconciling (tests/cluster/test_upgrade.py)."""
    from tpu_operator.api.status import TPUTrainingJobStatus

    status = TPUTrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "restarts": {"failure": 1, "total": 2, "laterCause": 1, "recent": {"laterCause": []}},
            "conditions": [{"type": "Ready", "status": "True", "laterField": "x"}],
            "badput": {"laterBucket": 2.0},
            "plan": {"fits": True, "laterFigure": 1.0},
        }
    )
    assert status.restarts is not None and (status.restarts.failure, status.restarts.total) == (1, 2)
    assert status.conditions[0].type == "Ready" and status.plan is not None and status.plan.fits


def test_a_pod_garbage_collected_with_its_node_is_hardware_and_a_disrupted_one_a_preemption():
    def pod(name, reason=None, code=None):
        status = {"phase": "Failed", "conditions": []}
        if reason:
            status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": reason})
        if code is not None:
            status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": code}}}]
        return {"metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/job-index": "1"}}, "status": status}

    gc = failure_of([pod("p0", code=143), pod("p1", "DeletionByPodGC")], "")
    assert (gc.cause, gc.pod, gc.slice_index) == ("hardware", "p1", 1)
    assert failure_of([pod("p0", "PreemptionByScheduler", 143)], "").cause == "preemption"
    assert failure_of([pod("p0", "x" * 10_000, 137)], "").cause == "preemption"  # a huge reason is just a reason
    gone = failure_of([], "jobset failed due to job failure")  # the pods vanished with their node before the list
    assert gone.cause == "hardware" and "the JobSet says: jobset failed due to job failure" in gone.describe()
    assert verdict(FailurePolicySpec(maxRestarts=0), RestartCounts(), gone).restart

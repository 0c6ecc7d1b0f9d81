"""Leader election (operator/controller/leader.py) on a fake clock: who may take the Lease and when, what is
written, and that a leader has stopped before a standby can start. The real Lease, API server and processes:
tests/cluster/test_leader.py."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time

import pytest

from tpu_operator.controller.leader import (
    EXIT_LOST,
    Candidate,
    Conflict,
    Elector,
    LeaseTiming,
    Record,
    micro_time,
)

T = LeaseTiming()  # controller-runtime's defaults: 15, 10, 2


def test_the_defaults_are_controller_runtimes_and_bad_timings_are_refused():
    assert (T.lease_duration_s, T.renew_deadline_s, T.retry_period_s) == (15.0, 10.0, 2.0)
    for bad in ((10, 10, 2), (15, 20, 2), (15, 10, 9), (15, 10, 0)):
        with pytest.raises(ValueError, match="lease duration > renew deadline"):
            LeaseTiming(*bad)


def test_the_first_candidate_creates_the_record():
    a = Candidate("a", T)
    assert a.may_take(0.0)
    record = a.claim(wall=1_000.0)
    assert record == Record("a", 15, micro_time(1_000.0), micro_time(1_000.0), 0)
    assert record.renew_time == "1970-01-01T00:16:40.000000Z"


def test_a_standby_waits_out_the_lease_from_when_it_last_saw_the_record_change():
    b = Candidate("b", T)
    held = Record("a", 15, "t0", "t0", 0)
    b.saw(held, now=100.0)
    assert not b.may_take(100.0) and not b.may_take(114.9)
    renewed = Record("a", 15, "t0", "t2", 0)  # the leader renews: the clock starts again
    b.saw(renewed, now=110.0)
    assert not b.may_take(124.9)
    b.saw(renewed, now=120.0)  # the same record again: no change, the clock keeps running
    assert b.may_take(125.0)
    taken = b.claim(wall=5_000.0)
    assert (taken.holder, taken.transitions) == ("b", 1)
    assert taken.acquire_time == taken.renew_time == micro_time(5_000.0)


def test_the_records_timestamps_are_never_compared_with_this_clock():
    """A holder whose clock is an hour behind (or ahead) is still given the whole lease from when it was seen."""
    b = Candidate("b", T)
    b.saw(Record("a", 15, micro_time(time.time() - 3600), micro_time(time.time() - 3600), 4), now=0.0)
    assert not b.may_take(14.0) and b.may_take(15.0)


def test_the_holders_lease_duration_counts_not_the_observers():
    b = Candidate("b", LeaseTiming(30, 20, 2))
    b.saw(Record("a", 15, "t", "t", 0), now=0.0)
    assert b.may_take(15.0)


def test_a_fractional_lease_duration_is_written_rounded_up():
    """The Lease keeps whole seconds: 6.5 s is written as 7, never 6, so a standby never comes sooner than the
    leader's renew deadline allows for."""
    assert Candidate("a", LeaseTiming(6.5, 6.2, 2)).claim(wall=0.0).lease_duration_s == 7


def test_a_released_lease_is_taken_at_once_and_counts_a_transition():
    b = Candidate("b", T)
    b.saw(Record("", 1, "t", "t", 3), now=0.0)
    assert b.may_take(0.0)
    assert b.claim(wall=0.0).transitions == 4


def test_renewing_keeps_the_acquire_time_and_the_transitions():
    a = Candidate("a", T)
    first = a.claim(wall=10.0)
    a.wrote(first, sent=0.0, now=0.1)
    again = a.claim(wall=12.0)
    assert (again.acquire_time, again.transitions) == (first.acquire_time, first.transitions)
    assert again.renew_time == micro_time(12.0)


def test_a_standby_polls_every_retry_period_and_exactly_when_the_lease_runs_out():
    b = Candidate("b", T)
    b.saw(Record("a", 15, "t", "t", 0), now=0.0)
    assert b.next_try(0.0, jitter=0.0) == 2.0
    assert 2.0 <= b.next_try(0.0, jitter=0.99) <= 2.4
    assert b.next_try(14.0, jitter=0.5) == 15.0  # not up to 2.4 s after it
    a = Candidate("a", T)
    a.wrote(a.claim(0.0), sent=0.0, now=0.0)
    assert a.next_try(3.0, jitter=0.9) == 5.0  # the leader renews every retry period, unjittered


def test_a_leader_has_stopped_before_any_standby_may_start():
    """For any delays (the write stored up to 3 s after it was sent, seen by the standby up to one poll later,
    renewals that fail), the standby's first moment to take the Lease comes after the leader's stop_by, by at
    least LeaseDuration - RenewDeadline."""
    rng = random.Random(7)
    for _ in range(2_000):
        a, b = Candidate("a", T), Candidate("b", T)
        now, last = 0.0, None
        for _ in range(rng.randrange(1, 8)):  # the renewals that succeed
            sent = now
            record = a.claim(wall=sent)
            stored = sent + rng.uniform(0, 3.0)
            a.wrote(record, sent=sent, now=stored + rng.uniform(0, 0.5))
            b.saw(record, now=stored + rng.uniform(0, T.retry_period_s * 1.2))
            last = sent
            now = stored + rng.uniform(0, T.renew_deadline_s)
        assert last is not None
        earliest_takeover = b.expires_at()
        assert a.stop_by() == last + T.renew_deadline_s
        assert earliest_takeover - a.stop_by() >= T.lease_duration_s - T.renew_deadline_s - 1e-9


# --- the Elector over an in-memory Lease: resourceVersions, conflicts, the watchdog -----------------------


class MemoryLease:
    """The Lease as the API server keeps it: an update must carry the current resourceVersion (else 409)."""

    def __init__(self) -> None:
        self.lease: dict | None = None
        self.failing = False

    def _check(self) -> None:
        if self.failing:
            raise OSError("connection refused")

    async def get(self) -> dict | None:
        self._check()
        return copy.deepcopy(self.lease)

    async def create(self, record: Record) -> dict:
        self._check()
        if self.lease is not None:
            raise Conflict("exists")
        self.lease = {"metadata": {"resourceVersion": "1"}, "spec": record.spec()}
        return copy.deepcopy(self.lease)

    async def update(self, lease: dict, record: Record) -> dict:
        self._check()
        assert self.lease is not None
        if lease["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise Conflict("the object has been modified")
        version = str(int(self.lease["metadata"]["resourceVersion"]) + 1)
        self.lease = {"metadata": {"resourceVersion": version}, "spec": record.spec()}
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(store: MemoryLease, name: str, clock: Clock, exits: list) -> Elector:
    changes: list[bool] = []
    e = Elector(store, name, T, on_change=changes.append, clock=clock, wall=clock, exit=exits.append)
    e.changes = changes  # type: ignore[attr-defined]
    return e


def test_two_electors_one_leads_the_other_takes_over_after_the_lease_and_the_old_one_exits():
    async def scenario() -> None:
        store, clock, exits_a, exits_b = MemoryLease(), Clock(), [], []
        a, b = elector(store, "a", clock, exits_a), elector(store, "b", clock, exits_b)
        assert await a._try() and not await b._try()
        clock.t += 5
        assert await a._try()  # a renewal: b's clock starts again when it sees it
        assert not await b._try()
        clock.t += 14.9
        assert not await b._try()
        clock.t += 0.1
        assert await b._try()  # 15 s after b saw the last renewal
        assert store.lease is not None and store.lease["spec"]["holderIdentity"] == "b"
        assert store.lease["spec"]["leaseTransitions"] == 1
        assert not await a._try()  # a's renewal conflicts; it reads, and someone else holds it
        assert a.candidate.observed is not None and a.candidate.observed.holder == "b"

    asyncio.run(scenario())


def test_a_leader_that_sees_another_holder_exits_at_once():
    async def scenario() -> None:
        store, clock, exits = MemoryLease(), Clock(), []
        a = elector(store, "a", clock, exits)
        a.candidate.timing = LeaseTiming(15, 10, 0.01)  # renew at once in hold()
        assert await a._try()
        store.lease["spec"]["holderIdentity"] = "intruder"  # type: ignore[index]
        store.lease["metadata"]["resourceVersion"] = "99"  # type: ignore[index]
        holding = asyncio.create_task(a.hold())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if exits:
                break
        holding.cancel()
        assert exits == [EXIT_LOST]

    asyncio.run(scenario())


def test_the_watchdog_ends_a_leader_that_cannot_renew_at_the_renew_deadline():
    async def scenario() -> None:
        store, clock, exits = MemoryLease(), Clock(), []
        a = elector(store, "a", clock, exits)
        await a.acquire()  # leads: the watchdog thread runs
        assert a.changes == [True]  # type: ignore[attr-defined]
        store.failing = True
        clock.t += T.renew_deadline_s - 0.5
        await asyncio.sleep(0.6)
        assert exits == []
        clock.t += 0.5
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert exits == [EXIT_LOST] and a.changes == [True, False]  # type: ignore[attr-defined]

    asyncio.run(scenario())
    assert not [t for t in threading.enumerate() if t.name == "leader-watchdog"]


def test_a_clean_stop_releases_the_lease_and_a_standby_takes_it_at_once():
    async def scenario() -> None:
        store, clock = MemoryLease(), Clock()
        a, b = elector(store, "a", clock, []), elector(store, "b", clock, [])
        await a.acquire()
        assert not await b._try()
        await a.release()
        assert store.lease is not None and store.lease["spec"]["holderIdentity"] == ""
        assert await b._try()  # no wait: the record names no holder
        assert store.lease["spec"]["leaseTransitions"] == 1

    asyncio.run(scenario())


@pytest.mark.e2e
def test_a_standby_process_answers_its_liveness_probe_and_stops_at_once_on_sigterm(tmp_path):
    """`tpujob operator --leader-elect` with no API server to reach: it stands by (the kubelet's probe of
    /healthz is answered, so a standby is not restarted), and SIGTERM ends it at once with status 0."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from tpu_operator.local.pods import free_port

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    port = free_port()
    command = [sys.executable, "-m", "tpu_operator.cli", "operator", "--standalone", "--leader-elect"]
    command += ["--health-port", str(port), "--health-host", "127.0.0.1"]
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": "op-0"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    answer = json.loads(r.read())
            except OSError:
                time.sleep(0.2)
        assert answer is not None and answer["standby"].startswith("op-0_"), answer
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        out = process.communicate()[0]
    assert '"waiting to lead"' in out and '"leading"' not in out, out

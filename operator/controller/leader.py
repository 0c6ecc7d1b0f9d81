"""Leader election on a `coordination.k8s.io/v1` Lease: of the operator's replicas, one acts; the others wait.

What this follows, read from the sources (no code copied):
- client-go `tools/leaderelection` (leaderelection.go): a candidate acquires the Lease when it holds no one,
  holds itself, or when the record has not changed for the record's `leaseDurationSeconds` *by the candidate's
  own clock since it last saw the record change* (`observedTime`, `isLeaseValid`); timestamps written by
  another process are never compared with local time, so clock skew does not matter, only clock rate. An
  update carries the read's resourceVersion, so of two candidates one wins and the other gets 409.
  Acquiring keeps `leaseTransitions` + 1 and sets `acquireTime`; renewing keeps both and moves `renewTime`.
  A leader that cannot renew within RenewDeadline stops leading (`OnStoppedLeading`, which client-go's users
  answer with `klog.Fatal`); `ReleaseOnCancel` empties `holderIdentity` on a clean stop so a standby need not
  wait out the lease.
- controller-runtime `pkg/manager` (manager.go): LeaseDuration 15 s, RenewDeadline 10 s, RetryPeriod 2 s,
  the defaults Kueue's and JobSet's managers run with (two replicas each); the identity is the hostname plus
  `_` and a UUID.

What this module does differently, and why:
- It does not run handlers inside a leader: it decides *whether the process may act at all*. Until this
  replica holds the Lease it starts nothing (no kopf, no watch, no write: main.py); once it holds it, kopf and
  the controller start, and from then on the process lives only as long as its leadership. A watchdog
  thread, not a coroutine (a busy event loop must not delay it), ends the process with `os._exit` when
  RenewDeadline has passed since the *sending* of the last renewal that succeeded: another replica can take
  the Lease only LeaseDuration after it saw that renewal stored, which is later than it was sent, so the old
  leader is gone at least LeaseDuration - RenewDeadline (5 s) before the new one starts. `os._exit` leaves no
  in-flight handler to write afterwards; the Deployment starts the container again, as a standby.
- A standby polls every RetryPeriod (up to 20% later, jittered) and also exactly when the lease it watches
  would expire, so it takes over LeaseDuration after the last renewal it saw, not up to a RetryPeriod later.
- Nothing here guards against a process frozen (SIGSTOP, a paused VM) past the deadline and then resumed:
  as in client-go there is no fencing token, and a write already on its way when the watchdog fires may
  still land. docs/operations.md says so.

`Candidate` is the decision, pure and clocked by its caller (tests/operator/test_leader.py drives it with
a fake clock); `LeaseStore` is the Lease's three requests; `Elector` joins them on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import math
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

LOG = logging.getLogger("tpu_operator.leader")
EXIT_LOST = 3  # the process's exit status when it stopped because it could no longer be sure it leads
JITTER = 0.2  # a standby's polls come RetryPeriod to 1.2 x RetryPeriod apart


@dataclasses.dataclass(frozen=True)
class LeaseTiming:
    """The election's three durations, in seconds (controller-runtime's defaults)."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        # As client-go's NewLeaderElector requires: LeaseDuration > RenewDeadline > JitterFactor x RetryPeriod,
        # all positive. The gap LeaseDuration - RenewDeadline is what keeps two leaders apart.
        if not 0 < self.retry_period_s * (1 + JITTER) < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs lease duration > renew deadline > 1.2 x retry period > 0, got "
                f"{self.lease_duration_s}, {self.renew_deadline_s}, {self.retry_period_s}"
            )


@dataclasses.dataclass(frozen=True)
class Record:
    """A Lease's spec, as far as the election reads and writes it."""

    holder: str = ""
    lease_duration_s: int = 0
    acquire_time: str = ""  # RFC 3339 with microseconds (the API's MicroTime), as written
    renew_time: str = ""
    transitions: int = 0

    def spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration_s,
            "acquireTime": self.acquire_time or None,
            "renewTime": self.renew_time or None,
            "leaseTransitions": self.transitions,
        }

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=str(spec.get("acquireTime") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
        )


def micro_time(wall: float) -> str:
    """The API's MicroTime: UTC, microseconds, `Z`."""
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Candidate:
    """One replica's view of the Lease and what it may do next (pure: every clock reading is an argument).

    `now` is a monotonic clock (seconds); `wall` the wall clock, used only for the timestamps written into the
    Lease for people and tests to read, never for a decision."""

    def __init__(self, identity: str, timing: LeaseTiming):
        self.identity, self.timing = identity, timing
        self.observed: Record | None = None
        self.observed_at = -float("inf")  # when (our clock) the record last changed as we saw it
        self.renewed_at: float | None = None  # when we sent the last write that made or kept us the holder

    @property
    def leading(self) -> bool:
        return self.renewed_at is not None

    def saw(self, record: Record | None, now: float) -> None:
        """A read (or our own successful write) returned `record` at `now`."""
        if record != self.observed:
            self.observed, self.observed_at = record, now

    def expires_at(self) -> float:
        """When the observed holder's lease runs out by our clock (-inf: nobody holds it)."""
        if self.observed is None or not self.observed.holder:
            return -float("inf")
        return self.observed_at + self.observed.lease_duration_s

    def may_take(self, now: float) -> bool:
        """client-go's rule: write ourselves in when nobody holds the Lease, we do, or it has expired."""
        record = self.observed
        return record is None or not record.holder or record.holder == self.identity or now >= self.expires_at()

    def held_by_other(self, now: float) -> bool:
        return not self.may_take(now)

    def claim(self, wall: float) -> Record:
        """The record to write to acquire or renew at wall-clock `wall`."""
        old = self.observed
        mine = old is not None and old.holder == self.identity
        return Record(
            holder=self.identity,
            # Whole seconds, as the API keeps them, rounded up: a standby then waits at least as long as we assume.
            lease_duration_s=math.ceil(self.timing.lease_duration_s),
            acquire_time=old.acquire_time if mine and old is not None else micro_time(wall),
            renew_time=micro_time(wall),
            transitions=(old.transitions if mine else old.transitions + 1) if old is not None else 0,
        )

    def wrote(self, record: Record, sent: float, now: float) -> None:
        """Our write of `record`, sent at `sent`, succeeded at `now`."""
        self.saw(record, now)
        self.renewed_at = sent

    def stop_by(self) -> float:
        """While leading: the moment by which this process must have stopped acting."""
        assert self.renewed_at is not None
        return self.renewed_at + self.timing.renew_deadline_s

    def next_try(self, now: float, jitter: float) -> float:
        """When to read or write the Lease again; `jitter` in [0, 1)."""
        if self.leading:
            return now + self.timing.retry_period_s
        poll = now + self.timing.retry_period_s * (1 + JITTER * jitter)
        expiry = self.expires_at()
        return min(poll, expiry) if expiry > now else poll


class LeaseStore(Protocol):
    """The Lease's requests: each returns the Lease as the API answers it (a dict), None for a 404 on get."""

    async def get(self) -> dict[str, Any] | None: ...
    async def create(self, record: Record) -> dict[str, Any]: ...
    async def update(self, lease: dict[str, Any], record: Record) -> dict[str, Any]: ...  # 409 if it moved


class Conflict(Exception):
    """The Lease changed since it was read (409), or was made by another first."""


class LeaseError(Exception):
    """The API refused a Lease request for another reason (403: the RBAC; 5xx...)."""


class ApiLeaseStore:
    """`LeaseStore` over kubernetes_asyncio's generic `call_api` (no generated API class: slim_client.py), on a
    client of its own: a leader's renewals never queue behind the controller's requests in a shared
    connection pool."""

    def __init__(self, api: Any, namespace: str, name: str, timeout_s: float):
        self.api, self.namespace, self.name, self.timeout_s = api, namespace, name, timeout_s
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    async def _raw(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The call's JSON answer; None for a 404; Conflict for a 409; LeaseError for any other refusal. (Without
        preloading, kubernetes_asyncio returns the response whatever its status: it is checked here.)"""
        import json

        response = await self.api.call_api(
            path,
            method,
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=self.timeout_s,
        )
        async with response:
            data = await response.read()
            status = response.status
        if status == 404:
            return None
        if status == 409:
            raise Conflict(data[:200].decode("utf-8", "replace"))
        if not 200 <= status <= 299:
            raise LeaseError(f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}")
        found: dict[str, Any] = json.loads(data)
        return found

    async def _found(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        found = await self._raw(method, path, body)
        if found is None:  # deleted under us (or its namespace is gone): as if another had moved it
            raise Conflict("the Lease is gone")
        return found

    async def get(self) -> dict[str, Any] | None:
        return await self._raw("GET", f"{self.path}/{self.name}")

    async def create(self, record: Record) -> dict[str, Any]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": self.name}}
        return await self._found("POST", self.path, {**body, "spec": record.spec()})

    async def update(self, lease: dict[str, Any], record: Record) -> dict[str, Any]:
        body = {**lease, "spec": {**(lease.get("spec") or {}), **record.spec()}}
        return await self._found("PUT", f"{self.path}/{self.name}", body)

    async def close(self) -> None:
        await self.api.close()


def identity() -> str:
    """This replica's holderIdentity: the pod's name (the chart's downward API), else the host's, and a random
    suffix, so a restarted container is a new holder (controller-runtime: hostname + "_" + UUID)."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:12]}"


class Elector:
    """`Candidate` on the event loop: `acquire()` returns once this replica leads; `hold()` then renews until it
    is cancelled, and a watchdog thread ends the process when renewal has not succeeded in time."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        timing: LeaseTiming,
        on_change: Callable[[bool], None] = lambda leading: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        exit: Callable[[int], None] = os._exit,
    ):
        self.store, self.candidate = store, Candidate(identity, timing)
        self.on_change, self.clock, self.wall, self.exit = on_change, clock, wall, exit
        self.lease: dict[str, Any] | None = None  # the last Lease read or written (its resourceVersion)
        self._watchdog: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def identity(self) -> str:
        return self.candidate.identity

    async def _try(self) -> bool:
        """One round of client-go's tryAcquireOrRenew: read (unless we lead and hold a fresh resourceVersion),
        then write ourselves in if the rule allows. True when we hold the Lease after it."""
        candidate = self.candidate
        if not candidate.leading or self.lease is None:
            self.lease = await self.store.get()
            candidate.saw(Record.of(self.lease) if self.lease is not None else None, self.clock())
        if not candidate.may_take(self.clock()):
            return False
        sent, record = self.clock(), candidate.claim(self.wall())
        try:
            if self.lease is None:
                self.lease = await self.store.create(record)
            else:
                self.lease = await self.store.update(self.lease, record)
        except Conflict:  # it moved since our read (another candidate wrote first): see what it says now
            self.lease = await self.store.get()
            self.candidate.saw(Record.of(self.lease) if self.lease is not None else None, self.clock())
            return False
        candidate.wrote(record, sent, self.clock())
        return True

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        LOG.info("waiting to lead", extra={"identity": self.identity})
        while True:
            try:
                if await self._try():
                    break
            except Exception as exc:  # noqa: BLE001 -- any failure to reach the Lease: try again later
                LOG.warning(f"cannot read or take the lease: {type(exc).__name__}: {exc}")
            holder = self.candidate.observed.holder if self.candidate.observed else ""
            LOG.debug("standing by", extra={"holder": holder})
            await asyncio.sleep(max(0.0, self.candidate.next_try(self.clock(), random.random()) - self.clock()))
        LOG.info(
            "leading",
            extra={
                "identity": self.identity,
                "transitions": self.candidate.observed and self.candidate.observed.transitions,
            },
        )
        self.on_change(True)
        self._watchdog = threading.Thread(target=self._watch, name="leader-watchdog", daemon=True)
        self._watchdog.start()

    async def hold(self) -> None:
        """Renew every RetryPeriod while leading; returns only if cancelled. Losing the Lease to another ends the
        process at once; failing to renew ends it at the deadline (the watchdog)."""
        candidate = self.candidate
        while True:
            await asyncio.sleep(max(0.0, candidate.next_try(self.clock(), 0.0) - self.clock()))
            try:
                if await self._try():
                    continue
            except Exception as exc:  # noqa: BLE001 -- transient: the watchdog bounds how long we keep trying
                LOG.warning(f"cannot renew the lease: {type(exc).__name__}: {exc}")
                continue
            if candidate.observed is not None and candidate.observed.holder not in ("", self.identity):
                self._lose(f"the lease is held by {candidate.observed.holder}")

    def _watch(self) -> None:
        while not self._stopped.is_set():
            left = self.candidate.stop_by() - self.clock()
            if left <= 0:
                self._lose("the lease was not renewed within the renew deadline")
                return
            self._stopped.wait(min(left, 0.25))

    def _lose(self, why: str) -> None:
        """Stop acting now: nothing of this process may write once another replica can lead."""
        LOG.error(f"lost leadership: {why}; exiting", extra={"identity": self.identity})
        self.on_change(False)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.exit(EXIT_LOST)

    async def release(self) -> None:
        """On a clean stop, once nothing of the controller runs: hand the Lease back (client-go's
        ReleaseOnCancel), so a standby takes over at its next poll instead of after LeaseDuration."""
        self._stopped.set()
        if not self.candidate.leading or self.lease is None:
            return
        record = dataclasses.replace(
            self.candidate.observed or Record(), holder="", lease_duration_s=1, renew_time=micro_time(self.wall())
        )
        try:
            self.lease = await self.store.update(self.lease, record)
            self.on_change(False)
            LOG.info("released the lease", extra={"identity": self.identity})
        except Exception as exc:  # noqa: BLE001 -- the standby will wait out the lease instead
            LOG.warning(f"cannot release the lease: {type(exc).__name__}: {exc}")

    async def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            await close()

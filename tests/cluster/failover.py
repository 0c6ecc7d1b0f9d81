"""Two operator replicas with a leader, the leader SIGKILLed during a burst of jobs (a helper module, not a test
module: tests/cluster/test_leader.py asserts on what it records, benchmarks/failover.py prints it).

Real: the API server, its Lease and audit log, the JobSet controller, kwok's pods, `tpujob operator
--leader-elect` as two processes. Stand-in: the Deployment controller and kubelet that would restart a killed
replica's container: a killed replica is started again at once, as a new process (a new holderIdentity).

Each process runs with a token of its own (TokenRequest) for the same ServiceAccount, so the audit log tells
their requests apart: `user.extra["authentication.kubernetes.io/credential-id"]` is the token's `JTI=...`.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from tests.cluster.jobs import job_doc
from tests.cluster.kube import Cluster, wait_for
from tests.operator_process import Operator

LEASE_READS = {("get", "leases"), ("create", "leases"), ("update", "leases")}
READS = {"get", "list", "watch"}


@dataclass
class Replica:
    op: Operator
    jti: str
    identity: str = ""
    killed_at: float | None = None


@dataclass(frozen=True)
class Sample:
    """One reading of the Lease by the test (its own clock `at`, epoch seconds)."""

    at: float
    holder: str
    acquire: float
    renew: float
    transitions: int


@dataclass(frozen=True)
class Takeover:
    old: str
    new: str
    gap_s: float  # the new holder's acquireTime - the old holder's last renewTime, both read from the Lease
    after_kill_s: float | None  # the new acquireTime - when the test killed the old holder


class LeaseLog(threading.Thread):
    """Reads the Lease every 0.1 s and keeps each distinct record (the old holder's last renewTime is in it until
    the next holder overwrites it, 15 s after the kill)."""

    def __init__(self, kubeconfig: Path, namespace: str, name: str) -> None:
        super().__init__(daemon=True)
        self.api = client.CoordinationV1Api(config.new_client_from_config(str(kubeconfig)))
        self.namespace, self.name = namespace, name
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                spec = self.api.read_namespaced_lease(self.name, self.namespace).spec
                sample = Sample(
                    time.time(),
                    spec.holder_identity or "",
                    spec.acquire_time.timestamp() if spec.acquire_time else 0.0,
                    spec.renew_time.timestamp() if spec.renew_time else 0.0,
                    spec.lease_transitions or 0,
                )
                last = self.samples[-1] if self.samples else None
                if last is None or (last.holder, last.acquire, last.renew) != (
                    sample.holder,
                    sample.acquire,
                    sample.renew,
                ):
                    self.samples.append(sample)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
            self.stop.wait(0.1)

    def holder(self) -> str:
        return self.samples[-1].holder if self.samples else ""


def jti_of(kubeconfig: Path) -> str:
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]


def identity_of(op: Operator) -> str:
    """The holderIdentity the replica logged when it joined the election."""
    for line in op.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"leader election"' in line:
            return json.loads(line).get("identity", "")
    return ""


@dataclass
class Failover:
    cluster: Cluster
    ns: str
    lease_ns: str
    lease: str
    kubeconfig: Callable[[Path], Path]  # a new token's kubeconfig at this path
    args: list[str]
    workdir: Path
    replicas: list[Replica] = field(default_factory=list)
    kills: list[tuple[str, float]] = field(default_factory=list)  # (identity, epoch s)

    def start_replica(self) -> Replica:
        path = self.kubeconfig(self.workdir / f"replica-{len(self.replicas)}.kubeconfig")
        op = Operator(
            path,
            self.workdir,
            *self.args,
            "--leader-elect",
            f"--leader-elect-resource-name={self.lease}",
            f"--leader-elect-resource-namespace={self.lease_ns}",
        ).start()
        replica = Replica(op, jti_of(path))
        replica.identity = wait_for(lambda: identity_of(op), 30, "the replica's identity in its log")
        self.replicas.append(replica)
        return replica

    def by_identity(self, identity: str) -> Replica:
        return next(r for r in self.replicas if r.identity == identity)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.op.kill(signal.SIGTERM)


def burst(n: int, running: int) -> list[dict[str, Any]]:
    """n jobs: `running` of them run 40 s on kwok's single-host nodes and succeed, the others are suspended (the
    JobSet controller makes their Jobs, no pod)."""
    docs = []
    for i in range(n):
        if i < running:
            env = [{"name": "KWOK_EXIT_AFTER", "value": "40s"}]
            docs.append(job_doc(f"burst-{i:03d}", runtime={"env": env}))
        else:
            docs.append(job_doc(f"burst-{i:03d}", suspend=True))
    return docs


def run(
    f: Failover,
    jobs: int,
    running: int,
    kills: int,
    every_s: float,
    lease_log: LeaseLog,
    on_kill: Callable[[], None] = lambda: None,
) -> list[str]:
    """Two replicas; `jobs` jobs at once; the leader SIGKILLed every `every_s` seconds, `kills` times, each killed
    replica started again at once (`on_kill` runs just before each kill); returns the jobs' names."""
    first = f.start_replica()
    wait_for(lambda: lease_log.holder() == first.identity, 30, "the first replica to lead", diagnose=first.op.log_tail)
    f.start_replica()
    docs = burst(jobs, running)
    start = time.monotonic()
    f.cluster.apply(*docs, namespace=f.ns)
    for k in range(kills):
        time.sleep(max(0.0, start + every_s * (k + 1) - time.monotonic()))
        leader = f.by_identity(lease_log.holder())
        on_kill()
        leader.op.kill(signal.SIGKILL)
        leader.killed_at = time.time()
        f.kills.append((leader.identity, leader.killed_at))
        f.start_replica()  # the Deployment's restart of the container, as a new standby
        wait_for(
            lambda old=leader.identity: lease_log.holder() not in ("", old),
            40,
            "a standby to take over",
            diagnose=lambda: "\n".join(r.op.log_tail(5) for r in f.replicas),
        )
    return [d["metadata"]["name"] for d in docs]


def takeovers(samples: list[Sample], kills: list[tuple[str, float]]) -> list[Takeover]:
    """Each change of holder, from the Lease's own records."""
    killed = dict(kills)
    found = []
    for before, after in zip(samples, samples[1:], strict=False):
        if after.holder != before.holder and before.holder and after.holder:
            found.append(
                Takeover(
                    before.holder,
                    after.holder,
                    after.acquire - before.renew,
                    after.acquire - killed[before.holder] if before.holder in killed else None,
                )
            )
    return found


def audit_by_replica(cluster: Cluster, since: float, replicas: list[Replica]) -> dict[str, list[dict[str, Any]]]:
    """Each replica's requests (by its token's id), oldest first."""
    by_jti = {f"JTI={r.jti}": r.identity for r in replicas}
    found: dict[str, list[dict[str, Any]]] = {r.identity: [] for r in replicas}
    for event in cluster.audit(since):
        ids = (event["user"].get("extra") or {}).get("authentication.kubernetes.io/credential-id") or []
        for credential in ids:
            if credential in by_jti:
                found[by_jti[credential]].append(event)
    for events in found.values():
        events.sort(key=lambda e: e["requestReceivedTimestamp"])
    return found


def epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def acquired_at(events: list[dict[str, Any]]) -> float | None:
    """When the replica first wrote the Lease successfully (a standby writes it only to take it)."""
    for e in events:
        key = (e["verb"], e["objectRef"].get("resource"))
        if key in (("update", "leases"), ("create", "leases")) and e["responseStatus"]["code"] in (200, 201):
            return epoch(e["requestReceivedTimestamp"])
    return None

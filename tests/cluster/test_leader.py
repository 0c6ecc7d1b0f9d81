"""Two operator replicas with a leader (issue 30, item 4), on the real API server: the leader SIGKILLed every
30 s during a burst of jobs (tests/cluster/failover.py says what is real and what stands in).

What a user depends on: every job gets exactly one JobSet and reaches its phase; a standby takes over
within 20 s of the leader's last renewal each time, measured from the Lease's own records (acquireTime of the
new holder - renewTime of the old); a standby makes no request but the Lease's while it is not leader, and a
replica makes none of the controller's once another has taken over (the API server's audit log).

The timings are the chart's (controller-runtime's 15/10/2 s), so the bound is the issue's: a standby may take
the Lease 15 s after it last saw it change, it sees a change at most one poll (2.4 s) after it is stored, and it
polls exactly when the lease runs out: 15 to 17.4 s plus a request or two; the 2.6 s left to 20 s are for the
requests on this loaded 2-core machine. Scaled down from the issue's 100 jobs (the benchmark runs 100): 40
jobs, 3 kills, so that it takes about 2.5 minutes.

And a leader whose renewals are refused (its Lease RoleBinding deleted) exits at its renew deadline, before the
standby takes the Lease (about 1 minute).
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from tests.cluster import failover
from tests.cluster.conftest import OPERATOR_NAMESPACE
from tests.cluster.jobs import job_doc, namespaced
from tests.cluster.kube import JOBSETS, Cluster, wait_for
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
JOBS, RUNNING, KILLS, EVERY_S = 40, 6, 3, 30.0
LEASE_S, TAKEOVER_S = 15.0, 20.0


def test_the_leader_killed_every_30_s_a_standby_takes_over_and_every_job_gets_one_jobset(
    local_cluster: Cluster, chart: str, operator_args, tmp_path
):
    cluster, ns = local_cluster, local_cluster.namespace("failover")
    lease = f"leader-{uuid.uuid4().hex[:6]}"
    since = time.time()
    f = failover.Failover(
        cluster,
        ns,
        OPERATOR_NAMESPACE,
        lease,
        lambda path: cluster.token_kubeconfig(OPERATOR_NAMESPACE, chart, path),
        [*namespaced(operator_args, ns), "--metrics-interval=2", "--resync-interval=5"],
        tmp_path,
    )
    lease_log = failover.LeaseLog(cluster.kubeconfig, OPERATOR_NAMESPACE, lease)
    lease_log.start()
    try:
        names = failover.run(f, JOBS, RUNNING, KILLS, EVERY_S, lease_log)
        leader = f.by_identity(lease_log.holder())
        for name in names:
            want = ("Succeeded",) if int(name.rsplit("-", 1)[1]) < RUNNING else ("Suspended",)
            wait_for(
                lambda name=name, want=want: cluster.status(ns, name).get("phase") in want,
                180,
                f"{ns}/{name} to reach {want}",
                diagnose=lambda name=name: json.dumps(cluster.status(ns, name)) + "\n" + leader.op.log_tail(10),
            )
        metrics = leader.op.metrics()
        assert "tpu_operator_leader 1.0" in metrics, metrics
        standby = next(r for r in f.replicas if r.killed_at is None and r is not leader)
        assert "tpu_operator_leader 0.0" in standby.op.metrics()
    finally:
        f.stop()  # SIGTERM: the leader releases the Lease
        lease_log.stop.set()
        lease_log.join(5)
    # Exactly one JobSet per job, owned by it, none deleted, at most one successful POST each.
    jobsets = {j["metadata"]["name"]: j for j in cluster.items(JOBSETS, ns)}
    assert sorted(jobsets) == sorted(names)
    for name in names:
        assert [r["uid"] for r in jobsets[name]["metadata"]["ownerReferences"]] == [
            cluster.job(ns, name)["metadata"]["uid"]
        ]

    # The takeovers, from the Lease.
    takeovers = failover.takeovers(lease_log.samples, f.kills)
    print("takeovers (s, from the Lease; and from the kill):", [(round(t.gap_s, 2), t.after_kill_s) for t in takeovers])
    assert [t.old for t in takeovers] == [identity for identity, _ in f.kills], (takeovers, f.kills)
    for t in takeovers:
        # Never before the lease ran out (the old holder's last renewal + 15 s, both clocks this machine's) ...
        assert t.gap_s >= LEASE_S - 0.05, t
        # ... and within the bound.
        assert t.gap_s <= TAKEOVER_S, t
    first, last = lease_log.samples[0], lease_log.samples[-1]
    assert last.transitions - first.transitions >= KILLS

    # No request of a standby but the Lease's before it leads; none of the controller's after the next takes over.
    requests = failover.audit_by_replica(cluster, since, f.replicas)
    acquired = {identity: failover.acquired_at(events) for identity, events in requests.items()}
    order = sorted((t, identity) for identity, t in acquired.items() if t is not None)
    assert len(order) == KILLS + 1, order
    for (t, identity), following in zip(order, [*order[1:], (None, None)], strict=True):
        events = requests[identity]
        before = [(e["verb"], e["requestURI"]) for e in events if failover.epoch(e["requestReceivedTimestamp"]) < t]
        assert all("/leases/" in uri or uri.endswith("/leases") for _, uri in before), (identity, before)
        if following[0] is not None:
            late = [
                (e["verb"], e["requestURI"])
                for e in events
                if failover.epoch(e["requestReceivedTimestamp"]) >= following[0]
                and e["verb"] not in failover.READS
                and e["objectRef"].get("resource") != "leases"
            ]
            assert not late, (identity, late)
    for identity, events in requests.items():
        if acquired[identity] is None:  # a standby to the end: only the Lease
            assert {(e["verb"], e["objectRef"].get("resource")) for e in events} <= failover.LEASE_READS, identity
    writes = [e for events in requests.values() for e in events if e["objectRef"].get("namespace") == ns]
    jobset_creates = [
        e
        for e in writes
        if (e["verb"], e["objectRef"].get("resource")) == ("create", "jobsets")
        and e["responseStatus"]["code"] == 201
        and "dryRun=" not in e["requestURI"]
    ]
    assert 0 < len(jobset_creates) <= JOBS
    assert not [e for e in writes if (e["verb"], e["objectRef"].get("resource")) == ("delete", "jobsets")]


def test_a_leader_that_cannot_renew_exits_before_the_standby_takes_over(local_cluster: Cluster, chart: str, tmp_path):
    """The leader's Lease permission is taken away (its RoleBinding deleted): its renewals are refused, it exits
    with status 3 at its renew deadline, and the standby takes over after the lease; the audit log has no
    request of the old leader after the new one took the Lease, and every job still gets one JobSet."""
    cluster = local_cluster
    ns, home = cluster.namespace("lost"), cluster.namespace("lost-system")
    lease = "lost-leader"
    cluster.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "lease", "namespace": home},
            "rules": [
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
                # the control key (controller/control.py), which the one that leads loads
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]},
            ],
        }
    )
    kubeconfigs = {}
    for sa in ("a", "b"):
        cluster.kubectl("create", "serviceaccount", sa, "-n", home)
        cluster.kubectl(
            "create", "rolebinding", f"lease-{sa}", "--role=lease", f"--serviceaccount={home}:{sa}", "-n", home
        )
        cluster.kubectl(
            "create", "clusterrolebinding", f"{home}-{sa}", f"--clusterrole={chart}", f"--serviceaccount={home}:{sa}"
        )
        kubeconfigs[sa] = cluster.token_kubeconfig(home, sa, tmp_path / f"{sa}.kubeconfig")
    args = [
        f"--namespace={ns}",
        "--metrics-access=direct",
        "--leader-elect",
        f"--leader-elect-resource-name={lease}",
        f"--leader-elect-resource-namespace={home}",
        f"--control-key-namespace={home}",
    ]
    lease_log = failover.LeaseLog(cluster.kubeconfig, home, lease)
    lease_log.start()
    a = Operator(kubeconfigs["a"], tmp_path, *args).start()
    b = None
    try:
        wait_for(lambda: lease_log.holder(), 30, "a to lead", diagnose=a.log_tail)
        b = Operator(kubeconfigs["b"], tmp_path, *args).start()
        cluster.apply(*(job_doc(f"lost-{i}", suspend=True) for i in range(5)), namespace=ns)
        wait_for(lambda: all(cluster.status(ns, f"lost-{i}").get("jobSetName") for i in range(5)), 60, "a's JobSets")
        since = time.time()
        cluster.kubectl("delete", "rolebinding", "lease-a", "-n", home)
        assert a.process is not None
        code = a.process.wait(timeout=30)
        a_exited = time.time()
        assert code == 3, a.log_tail()
        assert "lost leadership: the lease was not renewed within the renew deadline" in a.log_tail(5)
        cluster.apply(*(job_doc(f"lost-{i}", suspend=True) for i in range(5, 10)), namespace=ns)
        wait_for(
            lambda: lease_log.holder() not in ("", lease_log.samples[0].holder),
            30,
            "b to take over",
            diagnose=b.log_tail,
        )
        wait_for(
            lambda: all(cluster.status(ns, f"lost-{i}").get("phase") == "Suspended" for i in range(10)),
            90,
            "every job Suspended",
        )
    finally:
        for op in (a, b):
            if op is not None:
                op.kill(signal.SIGTERM)
        lease_log.stop.set()
        for sa in ("a", "b"):
            cluster.kubectl("delete", "clusterrolebinding", f"{home}-{sa}", "--ignore-not-found", check=False)
    b_acquired = next(s.acquire for s in lease_log.samples if s.holder and s.holder != lease_log.samples[0].holder)
    assert a_exited < b_acquired + 1.0  # the test saw a's exit before (or about when) b took the Lease ...
    a_user = f"system:serviceaccount:{home}:a"
    a_last = max(
        failover.epoch(e["requestReceivedTimestamp"]) for e in cluster.audit(since) if e["user"]["username"] == a_user
    )
    print(f"a's last request {b_acquired - a_last:.2f} s before b took the Lease")
    assert a_last < b_acquired  # ... and the API server had a's last request before b took it
    assert sorted(j["metadata"]["name"] for j in cluster.items(JOBSETS, ns)) == sorted(f"lost-{i}" for i in range(10))

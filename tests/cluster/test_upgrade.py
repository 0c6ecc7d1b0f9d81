"""`helm upgrade` from the previous chart version with 10 jobs running (issue 30, item 7): none restarted, none
lost; and `helm rollback` to it, with the previous operator reading what the new one wrote.

Real: the API server, the CRD as it is now (the previous operator runs against it: a CRD change is applied
before or with the new operator, docs/operations.md), `helm install` of the previous chart (charts/tpu-operator
at the commit before its version last changed, from git), `helm upgrade` to this one and `helm rollback`, the
RBAC each renders (the operators run with tokens of the release's ServiceAccount), the previous operator's code
(the same commit's `operator/`, `templates/` and `crds/`, run from a copy), the JobSet controller, kwok's pods,
the Lease. Stand-in: the Deployment controller and kubelet (no container runtime here: the Deployment's pods
are kept off every node): the test starts and stops operator processes in the order a RollingUpdate with
maxSurge 1 and maxUnavailable 0 does, with the arguments each Deployment revision holds.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tarfile
import time
from io import BytesIO
from pathlib import Path

import pytest
import yaml

from tests.cluster import failover
from tests.cluster.conftest import CHART, NO_NODE, helm_run
from tests.cluster.jobs import job_doc
from tests.cluster.kube import JOBSETS, Cluster, wait_for
from tests.cluster.nodes import tpu_pool
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
ROOT = CHART.parents[1]
JOBS = 10
EXTRA_NODES = 2  # kwok runs eight single-host pools; two more, for this test only, so that ten jobs all run


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def previous_release() -> str:
    """The commit before the chart's version last changed: the previous chart version, as it was last."""
    chart_yaml = "charts/tpu-operator/Chart.yaml"
    current = yaml.safe_load((ROOT / chart_yaml).read_text())["version"]
    for commit in git("log", "--format=%H", "--reverse", "--", chart_yaml).split():
        if yaml.safe_load(git("show", f"{commit}:{chart_yaml}"))["version"] == current:
            if not git("log", "--format=%H", "-1", f"{commit}^", "--", chart_yaml).strip():
                break  # the chart began at this version: there is no previous one
            return git("rev-parse", f"{commit}^").strip()
    pytest.skip(f"no earlier chart version than {current} in this clone's git history (a shallow clone?)")


def checkout(commit: str, dest: Path) -> tuple[Path, Path]:
    """The previous release from git: (its chart, a folder whose `tpu_operator` is its code with its templates
    and CRD, for PYTHONPATH)."""
    archive = subprocess.run(
        ["git", "archive", commit, "charts/tpu-operator", "operator", "templates", "crds"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    package = dest / "pkg" / "tpu_operator"
    package.parent.mkdir()
    shutil.move(dest / "operator", package)
    shutil.move(dest / "templates", package / "templates")
    shutil.move(dest / "crds", package / "crds")
    return dest / "charts" / "tpu-operator", package.parent


def deployment_args(cluster: Cluster, home: str, release: str) -> list[str]:
    """The Deployment's operator arguments as helm left them, less its ports (a local process picks free ones)
    and --standalone (Operator adds it)."""
    deployment = json.loads(
        cluster.kubectl("get", "deployment", f"{release}-tpu-operator", "-n", home, "-o", "json").stdout
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if not a.startswith(("--health-port", "--metrics-port", "--standalone"))]


def snapshot(cluster: Cluster, ns: str, names: list[str]) -> dict[str, tuple[str, str, int]]:
    """Each job's (JobSet uid, phase, restarts in all)."""
    found = {}
    for name in names:
        status = cluster.status(ns, name)
        jobset = cluster.get(JOBSETS, ns, name) or {"metadata": {"uid": ""}}
        restarts = sum(v for v in (status.get("restarts") or {}).values() if isinstance(v, int))
        found[name] = (jobset["metadata"]["uid"], status.get("phase", ""), restarts)
    return found


def test_helm_upgrade_from_the_previous_chart_with_ten_jobs_running_restarts_and_loses_none(
    local_cluster: Cluster, helm: str, chart: str, tmp_path
):
    # `chart`: the suite's install of this chart puts the CRD as it is now in place first (helm installs a
    # chart's crds/ only where none exists, so the previous chart's install must not be the first).
    cluster = local_cluster
    commit = previous_release()
    old_chart, old_code = checkout(commit, tmp_path / "previous")
    ns, home = cluster.namespace("upgrade"), cluster.namespace("upgrade-system")
    release = home  # unique: its ClusterRole is cluster-wide
    values = ["--set", f"operator.watchNamespaces={{{ns}}}", "--set", "operator.resyncInterval=5", *NO_NODE]
    nodes = [
        n.manifest("v1.36.3")
        for i in range(EXTRA_NODES)
        for n in tpu_pool(f"{home}-{i}", "2x2x1", 1, "kwok", (0, 40 + i))
    ]
    cluster.kubectl("create", "-f", "-", input=yaml.safe_dump_all(nodes))
    user = f"system:serviceaccount:{home}:{release}-tpu-operator"
    operators: list[Operator] = []

    def operator(code: Path | None, args: list[str]) -> Operator:
        path = cluster.token_kubeconfig(home, f"{release}-tpu-operator", tmp_path / f"op-{len(operators)}.kubeconfig")
        op = Operator(path, tmp_path, *args, "--metrics-interval=2")
        if code is not None:
            op.env["PYTHONPATH"] = str(code)
        operators.append(op)
        return op.start()

    lease_log = None
    try:
        helm_run(helm, cluster, "install", release, str(old_chart), "-n", home, *values)
        old = operator(old_code, deployment_args(cluster, home, release))
        assert not any(a.startswith("--leader-elect") for a in old.command)
        names = [f"up-{i}" for i in range(JOBS)]
        cluster.apply(
            *(job_doc(n, runtime={"env": [{"name": "KWOK_EXIT_AFTER", "value": "3600s"}]}) for n in names),
            namespace=ns,
        )
        wait_for(
            lambda: all(phase == "Running" for _, phase, _ in snapshot(cluster, ns, names).values()),
            180,
            "ten jobs Running under the previous operator",
            diagnose=lambda: f"{snapshot(cluster, ns, names)}\n{old.log_tail(10)}",
        )
        before = snapshot(cluster, ns, names)
        since = time.time()
        seen = [before]

        # helm upgrade to this chart; the roll as the Deployment does it: the new replicas start (a standby
        # first: the Lease does not exist yet, so the first new one leads at once, beside the old operator,
        # which has no election), then the old pod stops.
        helm_run(helm, cluster, "upgrade", release, str(CHART), "-n", home, *values)
        deployment = json.loads(
            cluster.kubectl("get", "deployment", f"{release}-tpu-operator", "-n", home, "-o", "json").stdout
        )
        assert deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        new_args = deployment_args(cluster, home, release)
        lease = next(a.split("=", 1)[1] for a in new_args if a.startswith("--leader-elect-resource-name="))
        lease_log = failover.LeaseLog(cluster.kubeconfig, home, lease)
        lease_log.start()
        first = operator(None, new_args)
        wait_for(lambda: lease_log.holder(), 30, "a new replica to lead", diagnose=first.log_tail)
        second = operator(None, new_args)
        seen.append(snapshot(cluster, ns, names))
        old.kill(signal.SIGTERM)
        time.sleep(10)  # two resyncs of every job by the new leader
        seen.append(snapshot(cluster, ns, names))

        # A second upgrade (a changed value rolls the pods): a new standby, the old standby stopped, another new
        # one, then the old leader stopped: it hands the Lease back and a new replica takes it at its next poll.
        helm_run(helm, cluster, "upgrade", release, str(CHART), "-n", home, *values, "--set", "operator.logLevel=DEBUG")
        roll_args = deployment_args(cluster, home, release)
        leading = lease_log.holder()
        leader, standby = sorted((first, second), key=lambda op: failover.identity_of(op) != leading)
        operator(None, roll_args)
        standby.kill(signal.SIGTERM)
        operator(None, roll_args)
        leader.kill(signal.SIGTERM)
        wait_for(lambda: lease_log.holder() not in ("", leading), 30, "a replica of the new revision to lead")
        time.sleep(10)
        seen.append(snapshot(cluster, ns, names))

        # helm rollback: the previous operator again, on what this one wrote. The previous Deployment's strategy
        # is Recreate: every replica stops before the old one starts.
        helm_run(helm, cluster, "rollback", release, "1", "-n", home)
        for op in operators[-2:]:
            op.kill(signal.SIGTERM)
        back = operator(old_code, deployment_args(cluster, home, release))
        time.sleep(10)
        seen.append(snapshot(cluster, ns, names))
        assert back.process is not None and back.process.poll() is None
    finally:
        for op in operators:
            op.kill(signal.SIGTERM)
        if lease_log is not None:
            lease_log.stop.set()
        helm_run(helm, cluster, "uninstall", release, "-n", home, check=False)
        cluster.kubectl("delete", "node", *(n["metadata"]["name"] for n in nodes), "--wait=false", check=False)

    # Every job kept its JobSet (same uid), stayed Running and was never restarted, at every step.
    for step, snap in enumerate(seen):
        assert snap == before, (step, {n: (snap[n], before[n]) for n in names if snap[n] != before[n]})
    assert all(phase == "Running" and uid for uid, phase, restarts in before.values())
    # Nothing deleted or made again by any of the operators (the audit log): no JobSet or pod deleted, no JobSet
    # created after the jobs ran.
    writes = [
        (e["verb"], e["objectRef"].get("resource"), e["responseStatus"]["code"])
        for e in cluster.audit(since)
        if e["user"]["username"] == user and e["objectRef"].get("namespace") == ns and "dryRun=" not in e["requestURI"]
    ]
    assert not [w for w in writes if w[0] in ("delete", "deletecollection")], writes
    assert not [w for w in writes if w[:2] == ("create", "jobsets") and w[2] == 201], writes
    # The second roll's handover: the old leader released the Lease on SIGTERM (holder "", its renewTime the
    # release), and a standby took it at its next poll: far inside the 20 s (the measured figure prints).
    handovers = [
        after.acquire - before.renew
        for before, after in zip(lease_log.samples, lease_log.samples[1:], strict=False)
        if not before.holder and after.holder
    ]
    print("handover on the second roll (s, from the Lease):", [round(h, 2) for h in handovers])
    assert len(handovers) == 1 and 0 <= handovers[0] <= 20, handovers

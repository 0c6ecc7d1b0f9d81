"""The operator against the floor, in one run, on the real API server of the local cluster (tests/cluster).

    python benchmarks/operator_load.py [--jobs 100 500 2000]

Needs the built cluster (`bash scripts/build-cluster.sh`); it uses one that `python -m tests.cluster up`
left running, or brings one up and down itself.

For N jobs created back to back (the 8B example's spec, so both operators render the same JobSet;
`spec.plan.preflight: skip`, as the floor has no pre-flight; `spec.suspend: true`, so the real JobSet
controller makes the Jobs but no pods: the scheduler and kwok stay out of the measurement), for the floor
(benchmarks/floor_operator.py: bare kopf, POST the JobSet, one status patch) and for `tpujob operator`,
each in a namespace of its own, it prints create -> JobSet and create -> first status (p50/p95/p99, seen
through watches), the API requests per job and the operator's peak RSS (VmHWM); then ours over the floor,
against issue 30's targets: p50 and p99 at most 1.1x the floor's, at most one request per job more than
the floor, peak RSS at most 150 MiB at 500 jobs and 250 MiB at 2,000.

Requests are counted twice: exactly, per operator, in the API server's audit log (each operator runs
with a token of a ServiceAccount of its own; watches left out), and with the API server's own counter
`apiserver_request_total` (before and after, for the requests only an operator makes here: job status
writes and JobSet creates).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import yaml
from kubernetes import watch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster import launcher  # noqa: E402
from tests.cluster.kube import JOBS, JOBSETS, Cluster, wait_for  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402
from tpu_operator.local.pods import free_port  # noqa: E402

# apiserver_request_total series that only an operator adds to here: (verb, resource, subresource).
RSS_TARGET_MIB = {500: 150, 2000: 250}  # issue 30: peak RSS of the operator at that many jobs
OPERATOR_ONLY = {("PATCH", "tputrainingjobs", "status"), ("POST", "jobsets", "")}


class FirstSeen(threading.Thread):
    """Record the first time each object of a namespace shows up in a watch and satisfies `seen`."""

    def __init__(self, cluster: Cluster, resource: tuple[str, str, str], namespace: str, seen) -> None:  # noqa: ANN001
        super().__init__(daemon=True)
        self.cluster, self.resource, self.namespace, self.seen = cluster, resource, namespace, seen
        self.first: dict[str, float] = {}
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            stream = watch.Watch().stream(
                self.cluster.custom.list_namespaced_custom_object,
                *self.resource[:2],
                self.namespace,
                self.resource[2],
                timeout_seconds=30,
            )
            self.ready.set()
            for event in stream:
                obj = event["object"]
                name = obj["metadata"]["name"]
                if name not in self.first and self.seen(obj):
                    self.first[name] = time.monotonic()


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {q: s[min(len(s) - 1, int(f * len(s)))] for q, f in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))}


def request_counters(cluster: Cluster) -> collections.Counter:
    """apiserver_request_total by (verb, resource, subresource), from the API server's /metrics."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.rindex("}")].split(","))
        labels = {k: v.strip('"') for k, v in labels.items()}
        counts[(labels.get("verb"), labels.get("resource"), labels.get("subresource", ""))] += float(line.split()[-1])
    return counts


@contextlib.contextmanager
def operator(kind: str, kubeconfig: Path, namespace: str, workdir: Path) -> Iterator[subprocess.Popen]:
    if kind == "floor":
        command = [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "--standalone",
            "--namespace",
            namespace,
            str(ROOT / "benchmarks" / "floor_operator.py"),
        ]
    else:
        command = [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "operator",
            "--standalone",
            "--namespace",
            namespace,
            "--metrics-access",
            "direct",
            "--health-port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
        ]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)  # yours first: a before/after
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": path}
    with open(workdir / f"{kind}.log", "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def burst(cluster: Cluster, kind: str, n: int, example: dict, workdir: Path) -> dict:
    ns = cluster.namespace(f"bench-{kind}")
    account = f"bench-{kind}"
    cluster.kubectl("create", "serviceaccount", account, "-n", ns)
    cluster.kubectl(
        "create", "clusterrolebinding", ns, "--clusterrole=cluster-admin", f"--serviceaccount={ns}:{account}"
    )
    kubeconfig = cluster.token_kubeconfig(ns, account, workdir / f"{kind}.kubeconfig")
    jobsets = FirstSeen(cluster, JOBSETS, ns, lambda obj: True)
    statuses = FirstSeen(cluster, JOBS, ns, lambda obj: bool(obj.get("status")))
    for w in (jobsets, statuses):
        w.start()
        w.ready.wait(10)

    def create(name: str) -> None:
        cluster.custom.create_namespaced_custom_object(*JOBS[:2], ns, JOBS[2], {**example, "metadata": {"name": name}})

    try:
        with operator(kind, kubeconfig, ns, workdir) as process:
            create("warmup")  # the operator is up and watching before the clock starts
            wait_for(lambda: "warmup" in statuses.first, 180, f"{kind} to handle a warm-up job")
            time.sleep(1)
            since, before, cpu_before = time.time(), request_counters(cluster), cpu_s(process.pid)
            created: dict[str, float] = {}
            start = time.monotonic()
            for i in range(n):
                name = f"bench-{i:04d}"
                created[name] = time.monotonic()
                create(name)
            wait_for(
                lambda: all(m in jobsets.first and m in statuses.first for m in created),
                1800,
                f"{n} JobSets and statuses from {kind}",
                interval=0.2,
            )
            whole = time.monotonic() - start
            time.sleep(2)  # requests the last jobs still trigger
            after, cpu = request_counters(cluster), cpu_s(process.pid) - cpu_before
            user = f"system:serviceaccount:{ns}:{account}"
            audited = collections.Counter(
                f"{e['verb']} {e['resource']}"
                for e in cluster.audit(since)
                if e["user"]["username"] == user and e["verb"] != "watch"
            )
            return {
                "kind": kind,
                "jobs": n,
                "whole_s": whole,
                "rss_mib": vm_hwm_mib(process.pid),
                "cpu_ms_per_job": 1e3 * cpu / n,
                "to_jobset": quantiles([jobsets.first[m] - t for m, t in created.items()]),
                "to_status": quantiles([statuses.first[m] - t for m, t in created.items()]),
                "requests_per_job": sum(audited.values()) / n,
                "by_kind": dict(audited.most_common(8)),
                "counter_per_job": {
                    f"{v} {r}{'/' + s if s else ''}": (after[(v, r, s)] - before[(v, r, s)]) / n
                    for v, r, s in sorted(OPERATOR_ONLY)
                },
            }
    finally:
        jobsets.stop.set()
        statuses.stop.set()
        cluster.kubectl("delete", "clusterrolebinding", ns, "--ignore-not-found")
        cluster.delete_namespaces()


def fmt(q: dict[str, float]) -> str:
    return " ".join(f"{k} {v * 1e3:6.0f} ms" for k, v in q.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 500, 2000])
    args = parser.parse_args()
    example = yaml.safe_load((EXAMPLES / "llama3-8b-fsdp.yaml").read_text())
    example["spec"]["plan"] = {"preflight": "skip"}
    example["spec"]["suspend"] = True
    example["spec"].pop("serviceAccountName", None)
    example["spec"]["image"] = "registry.example/tpu-operator/workload:bench"  # the examples name none; no pod runs
    with launcher.benchmark_cluster() as cluster:
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.jobs:
                floor, ours = (burst(cluster, kind, n, example, Path(tmp)) for kind in ("floor", "tpujob"))
                for r in (floor, ours):
                    print(
                        f"{r['kind']:7s} {n:4d} jobs: create->JobSet {fmt(r['to_jobset'])} | create->status "
                        f"{fmt(r['to_status'])} | {r['requests_per_job']:.1f} req/job | whole {r['whole_s']:.1f} s"
                        f" | peak RSS {r['rss_mib']:.0f} MiB | CPU {r['cpu_ms_per_job']:.1f} ms/job\n        audit: {r['by_kind']}\n"
                        f"        apiserver_request_total per job: {r['counter_per_job']}",
                        flush=True,
                    )
                ratio = {q: ours["to_jobset"][q] / floor["to_jobset"][q] for q in ("p50", "p99")}
                rss_target = RSS_TARGET_MIB.get(n)
                met = {
                    "p50": ratio["p50"] <= 1.1,
                    "p99": ratio["p99"] <= 1.1,
                    "requests": ours["requests_per_job"] <= floor["requests_per_job"] + 1,
                    "rss": rss_target is None or ours["rss_mib"] <= rss_target,
                }
                print(
                    f"ours/floor at {n} jobs: create->JobSet p50 x{ratio['p50']:.2f}, p99 x{ratio['p99']:.2f}; "
                    f"requests per job {ours['requests_per_job']:.2f} vs {floor['requests_per_job']:.2f}; peak RSS "
                    f"{ours['rss_mib']:.0f} MiB{f' (target {rss_target})' if rss_target else ''}; targets "
                    + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in met.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""The operator against the floor, in one run: bursts of jobs, then the steady state of running jobs.

    python benchmarks/operator_load.py [--jobs 100 500] [--running 200] [--window 120]

Everything runs on this machine: the test API server (tests/kubeapi), which counts every request,
and each operator as a subprocess of its own against a fresh server.

Bursts. For N jobs created back to back (the 8B example's spec, so both operators render the same
JobSet; `spec.plan.preflight: skip`, as the floor has no pre-flight), for the floor
(benchmarks/floor_operator.py: bare kopf, POST the JobSet, one status patch) and for `tpujob
operator`, it prints create -> JobSet and create -> first status (p50/p95/p99, seen through watches),
API requests per job (the operator's, watches left out), the whole run's time and the operator's
peak RSS (VmHWM); then ours over the floor. For ours the benchmark also plays
the JobSet controller (its requests are not counted) and counts requests up to Running.

Steady state. `--running` jobs held Running, one stand-in trainer answering every pod's /status
with a step that moves every 5 s, the default intervals (metrics every 10 s, resync every 60 s);
after a minute to settle, the operator's API requests per running job per minute over `--window`
seconds, with `--metrics-access direct` and with `proxy`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import EXAMPLES, JOBSET_CRD, operator_job  # noqa: E402
from tests.kubeapi.harness import Server, running_apiserver, wait_for  # noqa: E402
from tpu_workload.metrics import serve_http  # noqa: E402

NS = "default"
JOBS = f"/apis/training.tpu-operator.dev/v1alpha1/namespaces/{NS}/tputrainingjobs"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
PODS = f"/api/v1/namespaces/{NS}/pods"
TPUJOB_CRD = ROOT / "crds" / "tputrainingjob.yaml"
OURS = "urllib"  # the benchmark's own requests (Python-urllib) are not the operator's


class Watch(threading.Thread):
    """Record the first time each object name shows up in a watch stream and satisfies `seen`."""

    def __init__(self, url: str, seen) -> None:  # noqa: ANN001
        super().__init__(daemon=True)
        self.url, self.seen, self.first = url, seen, {}
        self.ready = threading.Event()

    def run(self) -> None:
        with urllib.request.urlopen(self.url + "?watch=true", timeout=3600) as stream:
            self.ready.set()
            for line in stream:
                obj = json.loads(line).get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                if name and name not in self.first and self.seen(obj):
                    self.first[name] = time.monotonic()


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def quantiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {q: s[min(len(s) - 1, int(f * len(s)))] for q, f in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))}


def operator_requests(server: Server) -> list[dict]:
    return [r for r in server.requests_log() if OURS not in r["userAgent"].lower()
            and r["query"].get("watch") not in ("true", "1")]


def by_kind(requests: list[dict]) -> dict[str, int]:
    """Requests counted by method and resource ('PATCH status', 'POST jobsets', ...), most first."""
    kinds = collections.Counter(
        f"{r['method']} {r['path'].split('/')[-1] if r['path'].endswith(('status', 'proxy')) else r['path'].rsplit('/', 2)[-2]}"
        for r in requests)
    return dict(kinds.most_common(8))


@contextlib.contextmanager
def operator(kind: str, server: Server, workdir: Path, *args: str) -> Iterator[subprocess.Popen]:
    if kind == "floor":
        command = [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace", NS,
                   str(ROOT / "benchmarks" / "floor_operator.py")]
    else:
        command = [sys.executable, "-m", "tpu_operator.cli", "operator", "--standalone", "--namespace", NS, *args]
    env = {**os.environ, "KUBECONFIG": str(server.kubeconfig), "PYTHONPATH": str(ROOT)}
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


def job_doc(name: str, doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    doc["metadata"] = {"name": name, "namespace": NS}
    return doc


def patch_status(server: Server, path: str, status: dict) -> None:
    code, body = server.request("PATCH", f"{path}/status", {"status": status}, content_type="application/merge-patch+json")
    assert code == 200, body


def running_jobset_status() -> dict:
    return {"restarts": 0, "replicatedJobsStatus": [{"name": "slice", "active": 16, "ready": 16, "succeeded": 0,
                                                     "failed": 0, "suspended": 0}]}


def burst(kind: str, n: int, example: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp, \
            running_apiserver(Path(tmp), crds=[TPUJOB_CRD, JOBSET_CRD]) as server:
        jobsets = Watch(server.url + JOBSETS, lambda obj: True)
        statuses = Watch(server.url + JOBS, lambda obj: bool(obj.get("status")))
        running = Watch(server.url + JOBS, lambda obj: (obj.get("status") or {}).get("phase") == "Running")
        for w in (jobsets, statuses, running):
            w.start()
            w.ready.wait(10)
        with operator(kind, server, Path(tmp)) as process:
            server.request("POST", JOBS, job_doc("warmup", example))  # the operator is up before the clock starts
            wait_for(lambda: "warmup" in statuses.first, 120, 0.1, f"{kind} to handle a warm-up job")
            server.clear_requests_log()
            created: dict[str, float] = {}
            start = time.monotonic()
            for i in range(n):
                name = f"bench-{i:04d}"
                created[name] = time.monotonic()
                code, body = server.request("POST", JOBS, job_doc(name, example))
                assert code == 201, body
            wait_for(lambda: all(m in jobsets.first and m in statuses.first for m in created), 900, 0.2,
                     f"{n} JobSets and statuses from {kind}")
            whole = time.monotonic() - start
            to_status_requests = len(operator_requests(server))
            result = {"kind": kind, "jobs": n, "whole_s": whole, "rss_mib": vm_hwm_mib(process.pid),
                      "to_jobset": quantiles([jobsets.first[m] - t for m, t in created.items()]),
                      "to_status": quantiles([statuses.first[m] - t for m, t in created.items()]),
                      "requests_per_job": to_status_requests / n}
            if kind == "tpujob":  # play the JobSet controller: every JobSet's pods are up
                for name in created:
                    patch_status(server, f"{JOBSETS}/{name}", running_jobset_status())
                wait_for(lambda: all(m in running.first for m in created), 900, 0.2, f"{n} jobs Running")
                result["requests_per_job_to_running"] = len(operator_requests(server)) / n
                result["by_kind"] = by_kind(operator_requests(server))
                result["rss_mib"] = vm_hwm_mib(process.pid)
            return result


def steady(access: str, jobs: int, window_s: float, settle_s: float) -> dict:
    t0 = time.monotonic()

    def respond(path: str) -> tuple[int, bytes, str]:  # the trainer of every job: a step every 5 s
        step = int((time.monotonic() - t0) / 5)
        body = {"step": step, "loss": 2.0, "step_time_s": 5.0, "tokens_per_s": 1e5, "mfu": 0.4, "state": "running"}
        return (200, json.dumps(body).encode(), "application/json") if path == "/status" else (404, b"", "text/plain")

    trainer = serve_http(respond, 0, "127.0.0.1")
    port = trainer.server_address[1]
    try:
        with tempfile.TemporaryDirectory() as tmp, \
                running_apiserver(Path(tmp), crds=[TPUJOB_CRD, JOBSET_CRD]) as server, \
                operator("tpujob", server, Path(tmp), "--metrics-access", access) as process:
            running = Watch(server.url + JOBS, lambda obj: (obj.get("status") or {}).get("phase") == "Running")
            running.start()
            running.ready.wait(10)
            names = [f"steady-{i:04d}" for i in range(jobs)]
            for name in names:
                code, body = server.request("POST", JOBS, job_doc(name, operator_job(runtime={"metricsPort": port})))
                assert code == 201, body
            wait_for(lambda: all(server.request("GET", f"{JOBSETS}/{m}")[0] == 200 for m in names), 600, 1,
                     "the JobSets")
            for name in names:  # play JobSet and the kubelet: pod 0 on loopback, the JobSet running
                pod = {"metadata": {"name": f"{name}-slice-0-0-x", "labels": {
                    "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/job-index": "0",
                    "batch.kubernetes.io/job-completion-index": "0"}},
                    "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
                assert server.request("POST", PODS, pod)[0] == 201
                patch_status(server, f"{PODS}/{pod['metadata']['name']}", {"phase": "Running", "podIP": "127.0.0.1"})
                patch_status(server, f"{JOBSETS}/{name}", running_jobset_status())
            wait_for(lambda: all(m in running.first for m in names), 600, 0.5, "every job Running")
            time.sleep(settle_s)
            server.clear_requests_log()
            time.sleep(window_s)
            requests = operator_requests(server)
            return {"access": access, "jobs": jobs, "per_job_per_min": len(requests) / jobs / (window_s / 60),
                    "rss_mib": vm_hwm_mib(process.pid), "by_kind": by_kind(requests)}
    finally:
        trainer.shutdown()


def fmt(q: dict[str, float]) -> str:
    return " ".join(f"{k} {v * 1e3:6.0f} ms" for k, v in q.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--running", type=int, default=200)
    parser.add_argument("--window", type=float, default=120.0, help="steady-state window, seconds")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds before the steady-state window")
    parser.add_argument("--skip-steady", action="store_true")
    args = parser.parse_args()
    example = yaml.safe_load((EXAMPLES / "llama3-8b-fsdp.yaml").read_text())
    # Without the pre-flight compile, which the floor has no counterpart of (it adds one batch Job and the
    # compiler's tens of seconds before the JobSet; benchmarks/plan.py measures the compile).
    example["spec"]["plan"] = {"preflight": "skip"}
    for n in args.jobs:
        floor, ours = burst("floor", n, example), burst("tpujob", n, example)
        for r in (floor, ours):
            print(f"{r['kind']:7s} {n:4d} jobs: create->JobSet {fmt(r['to_jobset'])} | create->status "
                  f"{fmt(r['to_status'])} | {r['requests_per_job']:.1f} req/job"
                  + (f" ({r['requests_per_job_to_running']:.1f} to Running)" if "requests_per_job_to_running" in r
                     else "") + f" | whole {r['whole_s']:.1f} s | peak RSS {r['rss_mib']:.0f} MiB"
                  + (f"\n        to Running: {r['by_kind']}" if "by_kind" in r else ""), flush=True)
        ratio = {q: ours["to_jobset"][q] / floor["to_jobset"][q] for q in ("p50", "p99")}
        print(f"ours/floor at {n} jobs: create->JobSet p50 x{ratio['p50']:.2f}, p99 x{ratio['p99']:.2f}; "
              f"requests to Running {ours['requests_per_job_to_running']:.1f} vs floor "
              f"{floor['requests_per_job']:.1f} (+{ours['requests_per_job_to_running'] - floor['requests_per_job']:.1f})",
              flush=True)
    if not args.skip_steady:
        for access in ("direct", "proxy"):
            r = steady(access, args.running, args.window, args.settle)
            print(f"steady {access:6s}: {r['jobs']} Running jobs, {r['per_job_per_min']:.2f} API requests per job per "
                  f"minute ({r['by_kind']}); peak RSS {r['rss_mib']:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()

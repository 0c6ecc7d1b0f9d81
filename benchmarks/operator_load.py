"""The operator under a burst of jobs: N TPUTrainingJobs created back to back against the test API
server (tests/kubeapi) with `tpujob operator` running, both as subprocesses on this machine.

    python benchmarks/operator.py [--jobs 500]

Prints p50/p95/p99 of the time from each job's create request to (a) its JobSet appearing and
(b) the first write of its status, both seen through watches, and the operator's peak RSS
(VmHWM from /proc/<pid>/status). Needs ../shared/schemas/jobset.x-k8s.io_jobsets.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import JOBSET_CRD, tiny_job  # noqa: E402
from tests.kubeapi.harness import running_apiserver, wait_for  # noqa: E402

JOBS = "/apis/training.tpu-operator.dev/v1alpha1/namespaces/default/tputrainingjobs"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"


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
                event = json.loads(line)
                obj = event.get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                if name and name not in self.first and self.seen(obj):
                    self.first[name] = time.monotonic()


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def percentiles(samples: list[float]) -> str:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"p50 {pick(0.50) * 1e3:.0f} ms, p95 {pick(0.95) * 1e3:.0f} ms, p99 {pick(0.99) * 1e3:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            running_apiserver(Path(tmp), crds=[ROOT / "crds" / "tputrainingjob.yaml", JOBSET_CRD]) as server:
        jobsets = Watch(server.url + JOBSETS, lambda obj: True)
        statuses = Watch(server.url + JOBS, lambda obj: bool(obj.get("status")))
        for w in (jobsets, statuses):
            w.start()
            w.ready.wait(10)
        env = {**os.environ, "KUBECONFIG": str(server.kubeconfig)}
        log = open(Path(tmp) / "operator.log", "wb")
        operator = subprocess.Popen([sys.executable, "-m", "tpu_operator.cli", "operator", "--standalone",
                                     "--namespace", "default"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            # A warm-up job: the operator is up and watching before the clock starts.
            server.request("POST", JOBS, {**tiny_job(), "metadata": {"name": "warmup"}})
            wait_for(lambda: "warmup" in statuses.first, 60, 0.1, "the operator to handle a warm-up job")
            created: dict[str, float] = {}
            start = time.monotonic()
            for i in range(args.jobs):
                name = f"bench-{i:04d}"
                doc = tiny_job()
                doc["metadata"]["name"] = name
                created[name] = time.monotonic()
                code, body = server.request("POST", JOBS, doc)
                assert code == 201, body
            create_s = time.monotonic() - start
            wait_for(lambda: all(n in jobsets.first and n in statuses.first for n in created), args.timeout, 0.2,
                     f"{args.jobs} JobSets and statuses")
            total_s = time.monotonic() - start
            to_jobset = [jobsets.first[n] - t for n, t in created.items()]
            to_status = [statuses.first[n] - t for n, t in created.items()]
            print(f"{args.jobs} jobs created in {create_s:.1f} s; all converged {total_s:.1f} s after the first create "
                  f"({args.jobs / total_s:.0f} jobs/s)")
            print(f"create -> JobSet created:     {percentiles(to_jobset)}")
            print(f"create -> first status write: {percentiles(to_status)}")
            print(f"operator peak RSS (VmHWM):    {vm_hwm_kib(operator.pid) / 1024:.0f} MiB")
        finally:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
            log.close()


if __name__ == "__main__":
    main()

"""Failover of the operator's leader, on the real API server of the local cluster (tests/cluster).

    python benchmarks/failover.py [--jobs 100] [--kills 3] [--every 30]

Needs the built cluster (`bash scripts/build-cluster.sh`); it uses one that `python -m tests.cluster up` left
running, or brings one up and down itself. Two `tpujob operator --leader-elect` replicas at the chart's timings
(15/10/2 s), N jobs created at once (a few run 40 s on kwok's single-host nodes, the rest suspended), the leader
SIGKILLed every 30 s and started again at once (the Deployment's restart, stood in for as in
tests/cluster/failover.py). It prints, for each takeover, the new holder's acquireTime minus the old holder's
last renewTime (from the Lease) and minus the kill; their min, median and max; how many jobs were not yet at
their phase at each kill (the jobs the failover held up); how long until every job was; and the JobSets per
job at the end (one each: none lost, none duplicated).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster import failover, launcher  # noqa: E402
from tests.cluster.kube import JOBSETS, wait_for  # noqa: E402

DONE = ("Suspended", "Succeeded")


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"min {min(values):.2f} / median {statistics.median(values):.2f} / max {max(values):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--running", type=int, default=6, help="of them, jobs that run 40 s on kwok's nodes")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between two kills")
    args = parser.parse_args()
    with launcher.benchmark_cluster() as cluster:
        ns = cluster.namespace("bench-failover")
        cluster.kubectl("create", "serviceaccount", "op", "-n", ns)
        cluster.kubectl("create", "clusterrolebinding", ns, "--clusterrole=cluster-admin", f"--serviceaccount={ns}:op")
        with tempfile.TemporaryDirectory() as tmp:
            f = failover.Failover(
                cluster,
                ns,
                ns,
                "bench-leader",
                lambda path: cluster.token_kubeconfig(ns, "op", path),
                [f"--namespace={ns}", "--metrics-access=direct", "--metrics-interval=15", "--resync-interval=60"],
                Path(tmp),
            )
            lease_log = failover.LeaseLog(cluster.kubeconfig, ns, "bench-leader")
            lease_log.start()
            waiting: list[int] = []
            names: list[str] = []

            def not_done() -> None:
                waiting.append(sum(1 for n in names if cluster.status(ns, n).get("phase") not in DONE))

            names[:] = [d["metadata"]["name"] for d in failover.burst(args.jobs, args.running)]
            start = time.monotonic()
            try:
                failover.run(f, args.jobs, args.running, args.kills, args.every, lease_log, on_kill=not_done)
                wait_for(
                    lambda: all(cluster.status(ns, n).get("phase") in DONE for n in names),
                    600,
                    "every job at its phase",
                )
                whole = time.monotonic() - start
            finally:
                f.stop()
                lease_log.stop.set()
            takeovers = failover.takeovers(lease_log.samples, f.kills)
            per_job = {n: 0 for n in names}
            for jobset in cluster.items(JOBSETS, ns):
                per_job[jobset["metadata"]["name"]] = per_job.get(jobset["metadata"]["name"], 0) + 1
        for t in takeovers:
            print(
                f"takeover {t.old} -> {t.new}: {t.gap_s:.2f} s after its last renewal, {t.after_kill_s:.2f} s after the kill"
            )
        print(
            f"{len(takeovers)} takeovers of {args.kills} kills; from the Lease: {spread([t.gap_s for t in takeovers])}"
        )
        print(f"from the kill: {spread([t.after_kill_s for t in takeovers if t.after_kill_s is not None])}")
        print(f"jobs not yet at their phase at each kill (held up by it): {waiting} of {args.jobs}")
        print(f"every job at its phase {whole:.0f} s after the burst began")
        print(
            f"JobSets per job at the end: {sorted(set(per_job.values()))} (jobs without one: "
            f"{sum(1 for v in per_job.values() if v == 0)})"
        )
        cluster.delete_namespaces()
        cluster.kubectl("delete", "clusterrolebinding", ns, "--ignore-not-found")


if __name__ == "__main__":
    main()

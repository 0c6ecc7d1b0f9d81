"""What one job costs the API server on the real components, counted in the API server's own audit log: every
request of an operator that runs as the chart's ServiceAccount, from the job's creation to its end."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import OPERATOR_NAMESPACE
from tests.cluster.jobs import WAIT_S, job_doc, namespaced, reconciles, status_where, watch_ended
from tests.cluster.kube import Cluster, wait_for
from tests.operator_process import Operator
from tpu_operator.api.lifecycle import Progress, TerminationRecord
from tpu_workload.process.metrics import serve_http

pytestmark = pytest.mark.cluster


class Trainer:
    """Stands in for process 0 of the trainer on a kwok node: its /status on the job's metrics port, which
    the operator reaches at the pod's IP (kwok's hostNetwork pods have their node's, 127.0.x.y)."""

    def __init__(self, sample: dict[str, Any]) -> None:
        self.sample = sample
        self.httpd = serve_http(
            lambda path: (200 if path == "/status" else 404, json.dumps(self.sample).encode(), "application/json"), 0
        )
        self.port = self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# Requests the operator makes for one job's whole life on the real components, at most, by (verb, resource);
# watches left out. A change that adds one fails here: say why in README's budget if it must. One pod list and
# one status write depend on timing: they happen when a reconcile sees the JobSet's pods not ready yet (kwok
# makes them ready within a second, so it may see them ready first, or, on a loaded machine, a second reconcile
# woken by the JobSet's or the pre-flight Job's status may see them not ready again: CI saw 5 pod lists of 4);
# each may be one under or one over its budget. Everything else is exact.
TIMING_DEPENDENT = {("list", "pods"): 1, ("patch", "tputrainingjobs/status"): 1}
BUDGET = {
    # the ConfigMap and the JobSet; the dry run of one pod per pod template first (once per shape: this
    # operator's first job, controller/admitted.py)
    ("create", "configmaps"): 1,
    ("create", "jobsets"): 1,
    ("create", "pods"): 1,
    ("create", "events"): 2,  # Created, Succeeded
    # the JobSet's pods not ready yet (why: Scheduled, ContainersReady); pod 0 found for the metrics; pod 0's
    # termination record when the JobSet completed (its process has exited: the final step and checkpoint)
    ("list", "pods"): 3,
    # Pending; the pods' state; Running; the first metrics; Succeeded with the trainer's final numbers
    ("patch", "tputrainingjobs/status"): 5,
}
# With the pre-flight (its Job, run by the process kubelet: the real compile): the batch Job, the list of its
# pod once it ended, the status while it compiles (Planned=Unknown, Compiling) and the Event Planned.
# What the operator lists, then watches, in a namespace it serves (kopf's watches and indices).
WATCHED = {"tputrainingjobs", "jobsets", "jobs", "workloads"}
# kopf lists a collection again whenever its watch ends: at the server timeout (main.py: 300 s) or when the stream
# breaks on a loaded machine. That is the operator's cost per watch, not the job's: each may come once in its life.
RELISTS = {("list", resource): 1 for resource in WATCHED}
# The dry run before the pre-flight (the ConfigMap, the JobSet, a pod), and a pod's again before the JobSet (the
# ConfigMap is the pre-flight's).
PREFLIGHT = {
    ("create", "jobs"): 1,
    ("list", "pods"): 1,
    ("patch", "tputrainingjobs/status"): 1,
    ("create", "events"): 1,
    ("create", "configmaps"): 1,
    ("create", "jobsets"): 1,
    ("create", "pods"): 1,
}


@pytest.mark.parametrize("preflight", ["skip", "compile"])
def test_one_jobs_requests_over_its_life_stay_within_budget(
    local_cluster: Cluster, chart: str, operator_kubeconfig, operator_args, tmp_path, preflight: str
):
    def life(run_dir: Path) -> dict[tuple[str, str], int]:
        """One job, from creation to its end, under an operator of its own: its requests by (verb, resource)."""
        run_dir.mkdir()
        cluster, ns = local_cluster, local_cluster.namespace("budget")
        trainer = Trainer({"step": 3, "step_time_s": 0.5, "mfu": 0.2})
        # An operator of its own, on this namespace, with no resync in the job's lifetime (one GET per interval).
        started = time.time()
        operator = Operator(
            operator_kubeconfig,
            run_dir,
            *namespaced(operator_args, ns),
            "--metrics-interval=1",
            "--resync-interval=3600",
        ).start()
        user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart}"
        try:
            # Its liveness answers before kopf has listed what it watches: requests are the job's only from then on.
            listed = lambda: {  # noqa: E731
                e["resource"]
                for e in cluster.audit(started)
                if e["user"]["username"] == user and e["verb"] == "list" and e["objectRef"].get("namespace") == ns
            }
            wait_for(lambda: WATCHED <= listed(), WAIT_S, "the operator's first lists", diagnose=lambda: str(listed()))
            time.sleep(1)  # audit timestamps have microseconds; requests after this line are the job's
            since = time.time()
            record = TerminationRecord(
                code=0, progress=Progress(started_at=time.time(), step=5, last_checkpoint_step=5)
            )
            # hostNetwork: kwok gives a pod on the pod network an address nothing serves; on its node's, the stand-in.
            cluster.apply(
                job_doc(
                    "frugal",
                    plan={"preflight": preflight},
                    runtime={
                        "metricsPort": trainer.port,
                        "hostNetwork": True,
                        "env": [
                            {"name": "KWOK_EXIT_AFTER", "value": "8s"},
                            {"name": "KWOK_EXIT_MESSAGE", "value": record.message()},
                        ],
                    },
                ),
                namespace=ns,
            )
            status_where(
                cluster,
                ns,
                "frugal",
                lambda s: s.get("phase") == "Running" and s.get("step") == 3,
                "Running with the trainer's step",
                operator,
                timeout=300,
            )
            done = status_where(
                cluster, ns, "frugal", lambda s: s.get("phase") == "Succeeded", "phase Succeeded", operator
            )
            # The final numbers come from the trainer's termination record, not from /status (its process has exited).
            assert (done["step"], done["lastCheckpointStep"]) == (5, 5), done
            wait_for(
                lambda: any(e["reason"] == "Succeeded" for e in cluster.events(ns, "frugal")),
                WAIT_S,
                "the Succeeded Event",
            )
            # What the end triggers has happened once the operator has reconciled the job as finished (its last status
            # write came back through the watch: nothing is left to do for it), then stopped; once the end of its watch
            # is in the audit log, so is every request it made.
            wait_for(
                lambda: reconciles(operator, "finished") >= 1,
                WAIT_S,
                "a reconcile of the finished job",
                diagnose=operator.log_tail,
            )
        finally:
            trainer.stop()
            operator.kill(signal.SIGTERM)
        wait_for(
            lambda: watch_ended(cluster, started, user, ns, "tputrainingjobs"),
            30,
            "the end of the operator's watch in the audit log",
        )
        counts: dict[tuple[str, str], int] = {}
        for event in cluster.audit(since):
            if (
                event["user"]["username"] == user
                and event["objectRef"].get("namespace") == ns
                and event["verb"] != "watch"
            ):
                key = (event["verb"], event["resource"])
                counts[key] = counts.get(key, 0) + 1
        return counts

    def over_budget(counts: dict[tuple[str, str], int]) -> list[str]:
        problems: list[str] = []
        budget = dict(BUDGET)
        if preflight == "compile":
            for key, n in PREFLIGHT.items():
                budget[key] = budget.get(key, 0) + n
        if not set(budget) <= set(counts) <= set(budget) | set(RELISTS):
            problems.append(f"kinds of request: {sorted(set(counts) ^ set(budget))}")
        for key, most in budget.items():
            slack = TIMING_DEPENDENT.get(key, 0)
            if not most - slack <= counts.get(key, 0) <= most + slack:
                problems.append(f"{key}: {counts.get(key, 0)} (budget {most} ± {slack})")
        for key, most in RELISTS.items():
            if counts.get(key, 0) > most:
                problems.append(f"{key}: {counts[key]} re-lists")
        return problems

    # How many reconciles see the pods not ready depends on a loaded machine's timing (TIMING_DEPENDENT);
    # a job over budget once is run again, and the budget must hold on that second life: a request a change
    # adds to every job is over both times.
    first = life(tmp_path / "first")
    if over_budget(first):
        second = life(tmp_path / "second")
        assert not over_budget(second), (over_budget(first), first, over_budget(second), second)

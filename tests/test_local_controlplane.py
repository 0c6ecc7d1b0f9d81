"""The operator's Manager over the in-memory API (local/controlplane.py `feed`) with the JobSet stand-in, no
processes: the test plays the kubelet, setting the pods' states; the operator's own reconciles take the job
from its creation to Running and Succeeded, and a slice's failure to a restart by cause."""

import asyncio

from tests.conftest import operator_job
from tpu_operator.api import names
from tpu_operator.controller.kube import JOBS, JOBSETS, PODS
from tpu_operator.controller.manager import Manager
from tpu_operator.controller.metrics_reader import MetricsReader
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.stats import Stats
from tpu_operator.local.controlplane import NODE, feed
from tpu_operator.local.jobset import JobSetStandIn
from tpu_operator.local.memory_api import MemoryApi

RUNNING = {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}


def _ended(code, message=""):
    terminated = {"exitCode": code, "message": message, "finishedAt": "2026-01-01T00:00:00Z"}
    return {
        "phase": "Succeeded" if code == 0 else "Failed",
        "conditions": [{"type": "Ready", "status": "False"}],
        "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
    }


async def _until(api, test, what, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        job = await api.get(JOBS, "default", "tiny")
        if test(job.get("status") or {}):
            return job["status"]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: {job.get('status')}")


async def _pods(api):
    return [
        p for p in await api.list(PODS, "default", f"{names.LABEL_JOBSET}=tiny") if p["status"]["phase"] != "Failed"
    ]


async def _set(api, pods, status):
    for pod in pods:
        await api.patch(PODS, "default", pod["metadata"]["name"], {"status": status}, "status")


def test_the_operator_runs_a_job_to_success_over_the_in_memory_api():
    async def scenario():
        api = MemoryApi()
        config = OperatorConfig(metrics_access="proxy", metrics_interval_s=60, resync_interval_s=60)
        notices = []
        manager = Manager(api, MetricsReader(api, "proxy"), config, lambda o, n: notices.append(n.reason), Stats())
        standin = JobSetStandIn(api, NODE)
        tasks = [asyncio.create_task(standin.run())]
        jobs, jobsets, preflights = feed(api, manager)
        manager.start(jobs, jobsets, {}, preflights, {})
        try:
            await api.create(JOBS, "default", operator_job(failurePolicy={"maxRestarts": 1, "backoffSeconds": 0}))
            await _until(api, lambda s: s.get("jobSetName") == "tiny", "the JobSet made")
            (pod,) = await _until_pods(api, 1)
            assert pod["spec"]["nodeName"] == NODE
            await _set(api, [pod], RUNNING)
            await _until(api, lambda s: s.get("phase") == "Running", "Running")
            # The slice fails (a retryable exit): the operator replaces the JobSet, and counts the restart.
            first = (await api.get(JOBSETS, "default", "tiny"))["metadata"]["uid"]
            await _set(api, [pod], _ended(42, '{"code": 42, "error": "Retryable: reset"}'))
            status = await _until(api, lambda s: (s.get("restarts") or {}).get("total") == 1, "a restart")
            assert status["restarts"]["failure"] == 1 and status["lastRestart"]["exitCode"] == 42
            (pod,) = await _until_pods(
                api, 1, lambda p: p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-uid"] != first
            )
            await _set(api, [pod], RUNNING)
            await _until(api, lambda s: s.get("phase") == "Running", "Running again")
            record = '{"code": 0, "progress": {"startedAt": 1.0, "step": 10, "lastCheckpointStep": 10}}'
            await _set(api, [pod], _ended(0, record))
            status = await _until(api, lambda s: s.get("phase") == "Succeeded", "Succeeded")
            assert status["step"] == 10 and status["observedGeneration"] == 1
            types = {c["type"]: c["status"] for c in status["conditions"]}
            assert types["Succeeded"] == "True" and types["Running"] == "False"
            assert "Created" in notices and "Restarted" in notices
        finally:
            for task in tasks:
                task.cancel()
            await manager.stop()

    asyncio.run(scenario())


async def _until_pods(api, n, test=lambda p: True, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        pods = [p for p in await _pods(api) if test(p) and not p["metadata"].get("deletionTimestamp")]
        if len(pods) == n:
            return pods
        await asyncio.sleep(0.02)
    raise AssertionError(f"{n} pods: {await _pods(api)}")

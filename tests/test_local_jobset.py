"""The JobSet stand-in of the local run (local/jobset.py) over the in-memory API: the pods it makes, and the
JobSet status it writes as pods run, fail and are deleted."""

import asyncio

from tests.conftest import tiny_job
from tpu_operator.api import names
from tpu_operator.api.validation import parse_job
from tpu_operator.controller.kube import JOBSETS, PODS
from tpu_operator.controller.phases import JobSetView
from tpu_operator.local.jobset import LABEL_RESTART_ATTEMPT, JobSetStandIn
from tpu_operator.local.memory_api import MemoryApi
from tpu_operator.rendering.manifests import render

NODE = "this-machine"


def _jobset(max_restarts=0, slices=2, topology="2x2x2"):
    doc = tiny_job(
        tpu={"generation": "v7x", "topology": topology, "slices": slices},
        training={"steps": 4, "globalBatch": 64, "sequenceLength": 128},
    )
    jobset = render(parse_job(doc))[1]
    jobset["spec"]["failurePolicy"] = {"maxRestarts": max_restarts}
    return jobset


class World:
    def __init__(self, jobset):
        self.api = MemoryApi()
        self.standin = JobSetStandIn(self.api, NODE)
        asyncio.run(self.api.create(JOBSETS, "default", jobset))

    def sync(self):
        asyncio.run(self.standin.sync("default", "tiny"))
        return asyncio.run(self.api.get(JOBSETS, "default", "tiny"))

    def pods(self):
        return asyncio.run(self.api.list(PODS, "default", f"{names.LABEL_JOBSET}=tiny"))

    def set_pod(self, pod, phase, ready=False, code=None):
        status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if code is not None:
            status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": code}}}]
        asyncio.run(self.api.patch(PODS, "default", pod["metadata"]["name"], {"status": status}, sub="status"))


def test_pods_carry_the_indices_jobset_and_the_job_controller_give_them():
    world = World(_jobset())
    world.sync()
    pods = world.pods()
    assert len(pods) == 4  # 2 slices x 2 hosts
    by_host = {p["spec"]["hostname"]: p for p in pods}
    assert sorted(by_host) == ["tiny-slice-0-0", "tiny-slice-0-1", "tiny-slice-1-0", "tiny-slice-1-1"]
    pod = by_host["tiny-slice-1-0"]
    meta = pod["metadata"]
    assert meta["name"].startswith("tiny-slice-1-0-") and pod["spec"]["subdomain"] == "tiny"
    for marks in (meta["labels"], meta["annotations"]):
        assert marks[names.LABEL_JOB_INDEX] == "1" and marks[names.LABEL_COMPLETION_INDEX] == "0"
        assert marks[names.LABEL_JOBSET] == "tiny" and marks[LABEL_RESTART_ATTEMPT] == "0"
    assert meta["labels"][names.LABEL_JOB] == "tiny"  # the template's own labels stay
    assert pod["spec"]["nodeName"] == NODE and names.slice_index(pod) == 1
    assert meta["ownerReferences"][0]["kind"] == "JobSet"
    world.sync()
    assert len(world.pods()) == 4  # made once


def test_status_counts_jobs_ready_then_completed():
    world = World(_jobset())
    world.sync()
    pods = sorted(world.pods(), key=lambda p: p["spec"]["hostname"])
    view = JobSetView.of(world.sync())
    assert (view.active, view.ready, view.succeeded) == (2, 0, 0)
    for pod in pods[:2]:  # slice 0 all ready
        world.set_pod(pod, "Running", ready=True)
    world.set_pod(pods[2], "Running", ready=True)
    view = JobSetView.of(world.sync())
    assert (view.active, view.ready) == (2, 1)
    for pod in pods:
        world.set_pod(pod, "Succeeded", code=0)
    jobset = world.sync()
    view = JobSetView.of(jobset)
    assert (view.active, view.ready, view.succeeded, view.terminal_state) == (0, 0, 2, "Completed")
    assert view.true_conditions["Completed"]["reason"] == "AllJobsCompleted"


def test_a_failed_pod_fails_its_job_stops_its_peers_and_the_jobset():
    world = World(_jobset())
    world.sync()
    pods = sorted(world.pods(), key=lambda p: p["spec"]["hostname"])
    for pod in pods:
        world.set_pod(pod, "Running", ready=True)
    world.set_pod(pods[1], "Failed", code=42)  # slice 0, host 1
    jobset = world.sync()
    view = JobSetView.of(jobset)
    assert view.terminal_state == "Failed" and view.failed == 1 and view.active == 1
    failed = view.true_conditions["Failed"]
    assert failed["reason"] == "ReachedMaxRestarts"
    assert failed["message"] == "jobset failed due to reaching max number of restarts (first failed job: tiny-slice-0)"
    # Host 0 of the failed slice is being stopped (the Job controller's part); slice 1 is left running.
    left = {p["spec"]["hostname"]: p["metadata"].get("deletionTimestamp") for p in world.pods()}
    assert left["tiny-slice-0-0"] and not left["tiny-slice-1-0"] and not left["tiny-slice-1-1"]
    world.sync()  # finished: nothing more
    assert len(world.pods()) == 4


def test_a_pod_deleted_by_the_operator_is_a_failed_job_never_a_new_pod():
    world = World(_jobset(slices=1))
    world.sync()
    pod = world.pods()[0]
    asyncio.run(world.api.delete(PODS, "default", pod["metadata"]["name"], {"gracePeriodSeconds": 0}))
    view = JobSetView.of(world.sync())
    assert view.terminal_state == "Failed" and len(world.pods()) == 1


def test_the_jobsets_own_failure_policy_restarts_with_new_pods():
    world = World(_jobset(max_restarts=1, slices=1))
    world.sync()
    first = world.pods()
    world.set_pod(first[0], "Failed", code=1)
    jobset = world.sync()
    assert jobset["status"]["restarts"] == 1 and "terminalState" not in jobset["status"]
    assert jobset["status"]["restartsCountTowardsMax"] == 1
    world.sync()
    fresh = [p for p in world.pods() if p["metadata"]["labels"][LABEL_RESTART_ATTEMPT] == "1"]
    assert len(fresh) == 2 and not {p["metadata"]["name"] for p in fresh} & {p["metadata"]["name"] for p in first}


def test_a_suspended_jobset_has_no_pods():
    jobset = _jobset(slices=1)
    jobset["spec"]["suspend"] = True
    world = World(jobset)
    view = JobSetView.of(world.sync())
    assert world.pods() == [] and view.true_conditions["Suspended"]["reason"] == "SuspendedJobs"


def test_events_feed_the_stand_in():
    async def scenario():
        api = MemoryApi()
        standin = JobSetStandIn(api, NODE)
        task = asyncio.create_task(standin.run())
        await api.create(JOBSETS, "default", _jobset(slices=1))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(await api.list(PODS, "default", "")) == 2:
                break
        task.cancel()
        assert len(await api.list(PODS, "default", "")) == 2
        assert api.watchers == [] or await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())

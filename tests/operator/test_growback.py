"""The operator's grow-back of an elastic job (controller/growback.py) over the in-memory API (FakeKube),
which stands in for JobSet, the scheduler and the kubelet: the tests set the JobSets' status as those would.
No processes."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import operator_job as tiny_job
from tests.fakes import T0, FakeKube, at, fail_slices, job_status, running
from tpu_operator.api.lifecycle import Progress
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import reconcile
from tpu_operator.controller.kube import JOBSETS
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.controller.status import Sample

SMALL, PROBE = JOBSETS.path("default", "tiny"), JOBSETS.path("default", "tiny-grow")


def run(
    kube: FakeKube,
    when: str,
    jobset: Any = "stored",
    probe: Any = "stored",
    sample: Sample | None = None,
    means_kube: Any = None,
) -> list[str]:
    """One reconcile, the watch having delivered the JobSet and the probe as stored (or as given)."""
    notices: list[str] = []
    jobset = kube.objects.get(SMALL) if jobset == "stored" else jobset
    probe = kube.objects.get(PROBE) if probe == "stored" else probe
    means = reconcile.Means(
        means_kube or kube, OperatorConfig(), lambda o, n: notices.append(n.reason), clock=lambda: parse(when)
    )
    asyncio.run(reconcile.reconcile(means, kube.job(), reconcile.Seen(jobset, sample, probe=probe)))
    return notices


def sample(t: int, step: int, checkpoint: int, start: int = 4) -> Sample:
    started = parse(at(35)).timestamp()
    return Sample(
        step=step,
        last_checkpoint_step=checkpoint,
        progress=Progress(
            started_at=started,
            start_step=start,
            first_step_at=started + 2,
            last_step_at=parse(at(t)).timestamp(),
            step=step,
            last_checkpoint_step=checkpoint,
        ),
    )


def shrunk(kube: FakeKube) -> None:
    """An elastic growBack job of two single-host slices that lost slice 1 and runs on slice 0 from step 4."""
    kube.add_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1, "growBack": True}},
            training={"steps": 40, "globalBatch": 16, "sequenceLength": 128},
            failurePolicy={"backoffSeconds": 10},
        )
    )
    kube.objects[next(iter(kube.objects))]["metadata"]["creationTimestamp"] = T0
    run(kube, at(0))
    running(kube)
    run(kube, at(5))
    fail_slices(kube, (1, 137))
    run(kube, at(20))
    run(kube, at(30), jobset=None)  # the backoff is over: the JobSet again, on one slice
    assert kube.objects[SMALL]["spec"]["replicatedJobs"][0]["replicas"] == 1
    running(kube)
    run(kube, at(40), sample=sample(40, 5, 4))
    assert job_status(kube).phase == "Running" and job_status(kube).slices.running == 1


def probe_ready(kube: FakeKube) -> None:
    """Stand in for the scheduler, the kubelet and JobSet: every probe pod placed and running."""
    kube.objects[PROBE]["status"] = {"replicatedJobsStatus": [{"name": "g", "active": 1, "ready": 1}]}


def jobset_posts(kube: FakeKube) -> int:
    return sum(1 for verb, path in kube.calls if verb == "POST" and path.endswith("/jobsets"))


def test_grows_back_after_a_checkpoint_once_the_missing_slice_can_be_placed_fake_scheduler():
    kube = FakeKube()
    shrunk(kube)
    assert PROBE not in kube.objects  # no checkpoint since it resumed from step 4: nothing to ask yet
    run(kube, at(50), sample=sample(50, 9, 8))
    probe = kube.objects[PROBE]  # asks the cluster for the one missing slice, placed as the job's slices are
    rj = probe["spec"]["replicatedJobs"][0]
    pod = rj["template"]["spec"]["template"]["spec"]
    small_pod = kube.objects[SMALL]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert rj["replicas"] == 1 and pod["containers"][0]["command"] == ["sleep", "infinity"]
    assert pod["nodeSelector"] == small_pod["nodeSelector"] and pod["tolerations"] == small_pod["tolerations"]
    assert pod["containers"][0]["resources"] == small_pod["containers"][0]["resources"]
    assert (
        probe["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"]
        == "cloud.google.com/gke-nodepool"
    )
    assert probe["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    small_uid = kube.objects[SMALL]["metadata"]["uid"]

    probe_ready(kube)
    kube.calls.clear()
    events = run(kube, at(60), sample=sample(60, 11, 8))
    status = job_status(kube)
    assert events == ["Resized"]
    assert status.slices.running == 2 and status.slices.desired == 2 and status.slices.replaces == small_uid
    resized = status.condition("Resized")
    assert (resized.status, resized.reason) == ("False", "GrewBack")
    assert status.phase == "Restarting"
    assert (status.restarts.failure, status.restarts.preemption) == (1, 0)  # a grow-back is not a restart
    assert SMALL not in kube.objects and PROBE not in kube.objects
    # Stopped as a preemption: the trainers get SIGTERM and save the step in flight (no grace-0 pod deletion).
    assert not any(verb == "DELETECOLLECTION" for verb, _ in kube.calls)

    run(kube, at(70), jobset=None, probe=None)
    spec = kube.objects[SMALL]["spec"]["replicatedJobs"][0]
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert spec["replicas"] == 2 and env["TPUJOB_SLICES"] == "2" and env["TPUJOB_NUM_PROCESSES"] == "2"
    running(kube)
    run(kube, at(80), probe=None)
    status = job_status(kube)
    assert status.phase == "Running" and status.slices.shown == "2/2"
    assert PROBE not in kube.objects


def test_without_capacity_the_smaller_job_keeps_training_fake_scheduler():
    kube = FakeKube()
    shrunk(kube)
    run(kube, at(50), sample=sample(50, 9, 8))
    kube.objects[PROBE]["status"] = {"replicatedJobsStatus": [{"name": "g", "active": 1, "ready": 0}]}  # Pending
    small_uid = kube.objects[SMALL]["metadata"]["uid"]
    kube.calls.clear()
    for t in range(60, 300, 20):
        assert run(kube, at(t), sample=sample(t, t // 5, 4 * (t // 20))) == []
    status = job_status(kube)
    assert kube.objects[SMALL]["metadata"]["uid"] == small_uid and status.phase == "Running"
    assert status.slices.shown == "1/2" and status.condition("Resized").reason == "SliceLost"
    assert jobset_posts(kube) == 0  # the probe waits, made once
    assert not any(verb in ("DELETE", "DELETECOLLECTION") for verb, _ in kube.calls)


class Killed(Exception):
    pass


class DiesOnDelete:
    """The operator killed after its status write, before it deletes anything."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kube, name)

    async def delete(self, *args: Any) -> Any:
        raise Killed()

    async def delete_all(self, *args: Any) -> Any:
        raise Killed()


def test_an_operator_restarted_mid_grow_back_neither_duplicates_nor_loses_objects():
    kube = FakeKube()
    shrunk(kube)
    run(kube, at(50), sample=sample(50, 9, 8))
    # Killed after creating the probe, before the watch delivered it: the next operator adopts it (409).
    run(kube, at(52), probe=None, sample=sample(52, 9, 8))
    assert [p for p in kube.objects if "/jobsets/" in p] == [SMALL, PROBE]
    probe_ready(kube)
    try:
        run(kube, at(60), sample=sample(60, 11, 8), means_kube=DiesOnDelete(kube))
    except Killed:
        pass
    assert job_status(kube).slices.running == 2 and SMALL in kube.objects  # decided, nothing deleted yet
    events = run(kube, at(62))  # the restarted operator finds the decision and carries it out
    assert events == []  # the Resized Event was posted once, with the decision
    assert SMALL not in kube.objects and PROBE not in kube.objects
    run(kube, at(64), jobset=None, probe=None)
    run(kube, at(65), probe=None)  # the watch had not said yet: the JobSet is adopted, not made twice
    assert [p for p in kube.objects if "/jobsets/" in p] == [SMALL]
    assert kube.objects[SMALL]["spec"]["replicatedJobs"][0]["replicas"] == 2
    status = job_status(kube)
    assert (status.restarts.failure, status.restarts.preemption) == (1, 0)

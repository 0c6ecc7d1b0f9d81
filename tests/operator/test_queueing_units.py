"""Unit tests of queued jobs (Kueue) and of why a job's pods are not running: the pure functions of
kueue.py and diagnosis.py, and the reconcile and the manager over the in-memory API. No processes."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest

from tests.conftest import operator_job as tiny_job  # the pre-flight is skipped: tested on its own
from tests.fakes import LATER, NOW, FakeKube, drain, job_status, manager_for, rfc3339, writes
from tpu_operator.api import names
from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.controller import diagnosis, kueue, phases, reconcile
from tpu_operator.controller.kube import JOBSETS, PODS, Resource
from tpu_operator.controller.reconcile import OperatorConfig

EMPTY = TPUTrainingJobStatus()
WORKLOADS = Resource(kueue.GROUP, "v1beta2", kueue.PLURAL)
QUOTA_MESSAGE = (
    "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor "
    "tpu7x-2x2x1, 4 more needed"
)
PREEMPTED = (
    "Preempted to accommodate a workload (UID: u2, JobUID: j2) due to prioritization in the ClusterQueue; "
    "preemptor path: /tpu-cq; preemptee path: /tpu-cq"
)
UNSCHEDULABLE = (
    "0/12 nodes are available: 12 Insufficient google.com/tpu. preemption: 0/12 nodes are available: "
    "12 No preemption victims found for incoming pod."
)


def cond(
    type_: str, status: str = "True", reason: str = "", message: str = "", since: datetime.datetime | str = NOW
) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason or type_,
        "message": message,
        "lastTransitionTime": since if isinstance(since, str) else rfc3339(since),
    }


def workload(
    *conditions: dict[str, Any],
    jobset_uid: str = "js-uid",
    name: str = "jobset-tiny-a1b2c",
    active: bool = True,
    created: datetime.datetime | str = NOW,
    deleting: bool = False,
    checks: tuple = (),
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Workload as Kueue makes one for JobSet `tiny` (trimmed as the operator's index keeps it)."""
    meta = {
        "name": name,
        "namespace": "default",
        "uid": f"wl-{name}",
        "creationTimestamp": created if isinstance(created, str) else rfc3339(created),
        "ownerReferences": [
            {
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "name": "tiny",
                "uid": jobset_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
        "labels": {"kueue.x-k8s.io/job-uid": jobset_uid},
        "annotations": annotations or {},
    }
    if deleting:
        meta["deletionTimestamp"] = rfc3339(NOW)
    full = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": meta,
        "spec": {"active": active, "queueName": "team-a", "podSets": [{"name": "slice", "template": {}}]},
        "status": {
            "conditions": list(conditions),
            "admission": {"clusterQueue": "tpu-cq"}
            if any(c["type"] == "QuotaReserved" and c["status"] == "True" for c in conditions)
            else None,
            "admissionChecks": list(checks),
        },
    }
    return kueue.trim(full)


def view(*conditions: dict[str, Any], **kw: Any) -> kueue.WorkloadView:
    return kueue.WorkloadView.of(workload(*conditions, **kw))


# --- kueue.py ------------------------------------------------------------------------------------------------


def test_trim_keeps_what_the_operator_reads_and_drops_the_pod_templates():
    kept = workload(cond("QuotaReserved"), annotations={names.DEACTIVATED_FOR_SUSPEND: "true", "other": "x"})
    assert "podSets" not in kept["spec"] and kept["spec"] == {"active": True, "queueName": "team-a"}
    assert kept["metadata"]["annotations"] == {names.DEACTIVATED_FOR_SUSPEND: "true"}
    assert kueue.jobset_owner(kept) == "tiny" and kept["status"]["admission"] == {"clusterQueue": "tpu-cq"}
    assert (
        kueue.jobset_owner({"metadata": {"ownerReferences": [{"kind": "Job", "name": "x", "controller": True}]}})
        is None
    )


def test_pick_takes_the_jobsets_own_live_newest_workload():
    old = workload(jobset_uid="js-uid", name="old", created="2026-01-01T00:00:00Z")
    new = workload(jobset_uid="js-uid", name="new", created="2026-01-01T00:01:00Z")
    dying = workload(jobset_uid="js-uid", name="dying", created="2026-01-01T00:02:00Z", deleting=True)
    other = workload(jobset_uid="previous-jobset", name="other", created="2026-01-01T00:03:00Z")
    assert kueue.pick([dying, new, other, old], "js-uid").name == "new"
    assert kueue.pick([other], "js-uid") is None and kueue.pick([], "js-uid") is None


@pytest.mark.parametrize(
    "wl, expected",
    [
        (None, ("False", "NoWorkload", "waiting for Kueue to create the Workload of JobSet tiny")),
        (view(), ("False", "Unattempted", "Kueue has not tried to admit Workload jobset-tiny-a1b2c")),
        # Kueue >= 0.19 (UnadmittedWorkloadsObservability) and before name the wait differently: both pass through.
        (
            view(cond("QuotaReserved", "False", "WaitingForQuota", QUOTA_MESSAGE)),
            ("False", "WaitingForQuota", QUOTA_MESSAGE),
        ),
        (view(cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE)), ("False", "Pending", QUOTA_MESSAGE)),
        (
            view(cond("QuotaReserved", "False", "Inadmissible", "LocalQueue team-a doesn't exist")),
            ("False", "Inadmissible", "LocalQueue team-a doesn't exist"),
        ),
        (
            view(
                cond("QuotaReserved"),
                cond("Admitted", "False", "UnsatisfiedChecks", "The workload has not all checks ready"),
                checks=({"name": "dws-prov", "state": "Pending", "message": "Waiting for resources"},),
            ),
            (
                "False",
                "UnsatisfiedChecks",
                "quota reserved in ClusterQueue tpu-cq; waiting for admission checks: "
                "dws-prov: Pending (Waiting for resources)",
            ),
        ),
        (view(cond("QuotaReserved"), cond("Admitted")), ("True", "Admitted", "admitted by ClusterQueue tpu-cq")),
        # Evicted while still admitted (Kueue clears the admission once the pods are gone): evicted wins.
        (
            view(cond("QuotaReserved"), cond("Admitted"), cond("Evicted", reason="Preempted", message=PREEMPTED)),
            ("False", "Preempted", f"evicted by Kueue (Preempted): {PREEMPTED}"),
        ),
        (
            view(
                cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE),
                cond("Evicted", reason="Preempted", message=PREEMPTED),
            ),
            ("False", "Preempted", f"evicted by Kueue (Preempted): {PREEMPTED}; now: {QUOTA_MESSAGE}"),
        ),
    ],
)
def test_admission_says_what_kueue_says(wl, expected):
    state, reason, message = kueue.admission(wl, "team-a", "tiny")
    assert (state, reason) == expected[:2] and message.startswith(expected[2]), message


def test_follow_counts_each_eviction_once_and_says_so_once():
    waiting = view(cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE))
    status, notices = kueue.follow(EMPTY, None, "team-a", "tiny", NOW)
    assert status.condition("Admitted").reason == "NoWorkload" and notices == []  # no Event for the usual start
    status, notices = kueue.follow(status, waiting, "team-a", "tiny", NOW)
    assert [(n.type, n.reason, n.message) for n in notices] == [("Normal", "Queued", QUOTA_MESSAGE)]
    assert status.workload_name == "jobset-tiny-a1b2c"
    assert kueue.follow(status, waiting, "team-a", "tiny", LATER)[1] == []  # the same wait: said once
    admitted = view(cond("QuotaReserved"), cond("Admitted"))
    status, notices = kueue.follow(status, admitted, "team-a", "tiny", LATER)
    assert [n.reason for n in notices] == ["Admitted"] and status.condition("Admitted").status == "True"
    evicted = view(
        cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE),
        cond("Evicted", reason="Preempted", message=PREEMPTED, since=LATER),
    )
    status, notices = kueue.follow(status, evicted, "team-a", "tiny", LATER)
    assert (status.restarts.preemption, status.restarts.total, status.last_eviction_time) == (1, 1, LATER)
    assert [(n.type, n.reason) for n in notices] == [("Warning", "Evicted")] and PREEMPTED in notices[0].message
    again, notices = kueue.follow(status, evicted, "team-a", "tiny", LATER)  # a resync sees the same eviction
    assert again.restarts.preemption == 1 and notices == []
    later = view(
        cond(
            "Evicted", reason="PodsReadyTimeout", message="Exceeded the PodsReady timeout", since="2026-01-01T01:00:00Z"
        )
    )
    assert kueue.follow(again, later, "team-a", "tiny", LATER)[0].restarts.preemption == 2


def test_a_deactivation_is_not_a_preemption():
    deactivated = view(cond("Evicted", reason="Deactivated", message="The workload is deactivated"), active=False)
    status, notices = kueue.follow(EMPTY, deactivated, "team-a", "tiny", NOW)
    assert status.restarts is None and notices == [] and status.condition("Admitted").reason == "Deactivated"


def test_misconfigured_queues_are_warnings():
    status, notices = kueue.follow(
        EMPTY,
        view(cond("QuotaReserved", "False", "Inadmissible", "LocalQueue team-a doesn't exist")),
        "team-a",
        "tiny",
        NOW,
    )
    assert [(n.type, n.reason) for n in notices] == [("Warning", "Queued")]


def test_activation_patch_follows_suspend_and_reactivates_only_what_it_deactivated():
    off = {"metadata": {"annotations": {names.DEACTIVATED_FOR_SUSPEND: "true"}}, "spec": {"active": False}}
    on = {"metadata": {"annotations": {names.DEACTIVATED_FOR_SUSPEND: None}}, "spec": {"active": True}}
    assert kueue.activation_patch(view(), suspend=True) == off
    assert kueue.activation_patch(view(), suspend=False) is None
    mine = view(active=False, annotations={names.DEACTIVATED_FOR_SUSPEND: "true"})
    assert kueue.activation_patch(mine, suspend=False) == on and kueue.activation_patch(mine, suspend=True) is None
    assert kueue.activation_patch(view(active=False), suspend=False) is None  # an administrator's stop stays


# --- diagnosis.py ----------------------------------------------------------------------------------------------


def pod(
    name: str,
    scheduled: dict[str, Any] | None = None,
    ready: bool = False,
    waiting: tuple[str, str] | None = None,
    exit_code: int | None = None,
    image: str = "example.com/trainer:1",
    phase: str = "Pending",
    gates: tuple[str, ...] = (),
) -> dict[str, Any]:
    conditions = [scheduled or cond("PodScheduled")] + [cond("Ready", "True" if ready else "False")]
    container: dict[str, Any] = {"name": "trainer", "image": image, "ready": ready, "state": {"running": {}}}
    if waiting:
        container["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    if exit_code is not None:
        container["state"] = {
            "terminated": {"exitCode": exit_code, "reason": "OOMKilled" if exit_code == 137 else "Error"}
        }
    return {
        "metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/jobset-name": "tiny"}},
        "spec": {"schedulingGates": [{"name": g} for g in gates]},
        "status": {"phase": phase, "conditions": conditions, "containerStatuses": [container]},
    }


UNSCHEDULED = cond("PodScheduled", "False", "Unschedulable", UNSCHEDULABLE)


@pytest.mark.parametrize(
    "pods, expected",
    [
        ([], ("False", "Pending", "the JobSet's pods are not created yet")),
        (
            [pod("tiny-slice-0-1", UNSCHEDULED), pod("tiny-slice-0-0")],
            ("False", "Unschedulable", f"pod tiny-slice-0-1 cannot be scheduled: {UNSCHEDULABLE}"),
        ),
        (
            [
                pod(
                    "tiny-slice-0-0",
                    cond("PodScheduled", "False", "SchedulingGated"),
                    gates=("kueue.x-k8s.io/topology",),
                )
            ],
            ("False", "SchedulingGated", "pod tiny-slice-0-0 waits for its scheduling gates: kueue.x-k8s.io/topology"),
        ),
        (
            [pod("tiny-slice-0-0", {"type": "Initialized", "status": "True"})],
            ("False", "Pending", "waiting for the scheduler"),
        ),
        ([pod("tiny-slice-0-0"), pod("tiny-slice-0-1")], ("True", "Scheduled", "every pod is on a node")),
    ],
)
def test_scheduled_carries_the_schedulers_words(pods, expected):
    assert diagnosis.scheduled(pods) == expected


@pytest.mark.parametrize(
    "pods, expected",
    [
        ([pod("a", ready=True), pod("b", ready=True)], ("True", "Ready", "every pod is ready")),
        ([pod("a", ready=True), pod("b")], ("False", "Starting", "waiting for the containers to be ready")),
        (
            [pod("a", waiting=("ImagePullBackOff", 'Back-off pulling image "example.com/trainer:1"'))],
            (
                "False",
                "ImagePullBackOff",
                'pod a: container trainer: ImagePullBackOff: Back-off pulling image "example.com/trainer:1"',
            ),
        ),
        (
            [pod("a", waiting=("ErrImagePull", "rpc error: code = NotFound desc = not found"))],
            (
                "False",
                "ErrImagePull",
                "pod a: container trainer: ErrImagePull: rpc error: code = NotFound desc = not found "
                "(image example.com/trainer:1)",
            ),
        ),  # the kubelet's message may not name the image
        (
            [pod("a", waiting=("CrashLoopBackOff", "back-off 40s restarting failed container=trainer"))],
            (
                "False",
                "CrashLoopBackOff",
                "pod a: container trainer: CrashLoopBackOff: back-off 40s restarting failed container=trainer",
            ),
        ),
        (
            [pod("a", exit_code=137, phase="Failed")],
            ("False", "OOMKilled", "pod a: container trainer exited with code 137 (OOMKilled)"),
        ),
        # An image problem names what to fix: it is told before a crash elsewhere.
        (
            [pod("a", exit_code=1, phase="Failed"), pod("b", waiting=("InvalidImageName", "bad ref"))],
            (
                "False",
                "InvalidImageName",
                "pod b: container trainer: InvalidImageName: bad ref (image example.com/trainer:1)",
            ),
        ),
    ],
)
def test_containers_say_why_they_do_not_start(pods, expected):
    assert diagnosis.containers(pods) == expected


def test_the_diagnosis_tells_the_most_telling_problem_once_per_change():
    js = phases.JobSetView.of(
        {"spec": {"replicatedJobs": [{"replicas": 2}]}, "status": {"replicatedJobsStatus": [{"active": 2, "ready": 0}]}}
    )
    pull = pod("b", waiting=("ImagePullBackOff", 'Back-off pulling image "example.com/trainer:1"'))
    status, notices = diagnosis.follow(EMPTY, js, [pod("a", UNSCHEDULED)], NOW)
    assert [(n.type, n.reason) for n in notices] == [("Warning", "Unschedulable")] and UNSCHEDULABLE in notices[
        0
    ].message
    assert diagnosis.trouble(status).reason == "Unschedulable"
    assert diagnosis.follow(status, js, [pod("a", UNSCHEDULED)], LATER) == (status, [])  # a resync: nothing new
    assert diagnosis.follow(status, js, None, LATER) == (status, [])  # not looked at: kept as it was
    status, notices = diagnosis.follow(status, js, [pod("a", UNSCHEDULED), pull], LATER)
    assert [n.reason for n in notices] == ["ImagePullBackOff"] and diagnosis.trouble(
        status
    ).reason == "ImagePullBackOff"
    ready = phases.JobSetView.of(
        {"spec": {"replicatedJobs": [{"replicas": 2}]}, "status": {"replicatedJobsStatus": [{"active": 2, "ready": 2}]}}
    )
    status, notices = diagnosis.follow(status, ready, None, LATER)  # the JobSet says all is well: no list
    assert diagnosis.trouble(status) is None and notices == []
    assert status.condition("Scheduled").status == status.condition("ContainersReady").status == "True"


@pytest.mark.parametrize(
    "jobset, needed",
    [
        ({"status": {"replicatedJobsStatus": [{"active": 1, "ready": 0}]}}, True),
        ({"status": {"replicatedJobsStatus": [{"active": 1, "ready": 1}]}}, False),  # running: its budget is pinned
        ({"status": {}}, False),  # no pods yet
        ({"spec": {"suspend": True}, "status": {"replicatedJobsStatus": [{"active": 1, "ready": 0}]}}, False),
        ({"status": {"terminalState": "Failed", "replicatedJobsStatus": [{"active": 1, "ready": 0}]}}, False),
    ],
)
def test_pods_are_read_only_while_some_are_not_ready(jobset, needed):
    assert diagnosis.needs_pods(phases.JobSetView.of(jobset)) is needed


# --- reconcile -----------------------------------------------------------------------------------------------


def run(
    kube: FakeKube,
    obj: dict[str, Any],
    jobset: dict[str, Any] | None = None,
    workloads: list[dict[str, Any]] = (),
    look_at_pods: bool = False,
) -> tuple[reconcile.ReconcileResult, list[Any]]:
    notices: list[phases.Notice] = []
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n), clock=lambda: NOW)
    seen = reconcile.Seen(jobset, workloads=workloads, look_at_pods=look_at_pods)
    outcome = asyncio.run(reconcile.reconcile(means, obj, seen))
    return outcome, notices


def queued_job(kube: FakeKube, **spec: Any) -> dict[str, Any]:
    return kube.add_job(tiny_job(queueName="team-a", **spec))


def add_workload(kube: FakeKube, wl: dict[str, Any]) -> dict[str, Any]:
    kube.objects[WORKLOADS.path("default", wl["metadata"]["name"])] = wl
    return wl


def test_a_queued_job_is_queued_with_kueues_words_and_its_jobset_left_to_kueue():
    kube = FakeKube()
    outcome, _ = run(kube, queued_job(kube))
    js = kube.jobset()
    assert outcome.result == "created" and js["spec"]["suspend"] is True
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    status = job_status(kube)
    assert status.phase == "Queued" and "waiting for Kueue to create the Workload" in status.message
    uid = js["metadata"]["uid"]
    waiting = workload(cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE), jobset_uid=uid)
    kube.calls.clear()
    _, notices = run(kube, kube.job(), js, [waiting])
    assert job_status(kube).message == QUOTA_MESSAGE and job_status(kube).workload_name == "jobset-tiny-a1b2c"
    assert [n.reason for n in notices] == ["Queued"]
    assert [c[0] for c in kube.calls] == ["PATCH"]  # the status only: the Workload came from the index
    # Kueue admits it and resumes the JobSet; the operator never suspends it again.
    admitted = workload(cond("QuotaReserved"), cond("Admitted"), jobset_uid=uid)
    js["spec"]["suspend"] = False
    js["status"] = {"replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 1}]}
    kube.calls.clear()
    run(kube, kube.job(), js, [admitted])
    assert job_status(kube).phase == "Running" and job_status(kube).condition("Admitted").status == "True"
    assert [c[0] for c in kube.calls] == ["PATCH"] and kube.jobset()["spec"]["suspend"] is True  # not touched


def test_a_user_suspend_of_a_queued_job_deactivates_its_workload_and_resume_reactivates_it():
    kube = FakeKube()
    run(kube, queued_job(kube))
    js = kube.jobset()
    wl = add_workload(kube, workload(cond("QuotaReserved"), cond("Admitted"), jobset_uid=js["metadata"]["uid"]))
    suspended = kube.job()
    suspended["spec"]["suspend"] = True
    kube.calls.clear()
    run(kube, suspended, js, [wl])
    path = WORKLOADS.path("default", wl["metadata"]["name"])
    assert ("PATCH", path) in kube.calls and ("PATCH", JOBSETS.path("default", "tiny")) not in kube.calls
    stored = kube.objects[path]
    assert stored["spec"]["active"] is False and stored["metadata"]["annotations"][names.DEACTIVATED_FOR_SUSPEND]
    # Kueue evicts it (Deactivated) and suspends the JobSet: the job is Suspended, not Queued, not preempted.
    stored["status"]["conditions"] = [cond("Evicted", reason="Deactivated", message="The workload is deactivated")]
    js["spec"]["suspend"] = True
    suspended = kube.job() | {"spec": suspended["spec"]}
    kube.calls.clear()
    run(kube, suspended, js, [stored])
    assert job_status(kube).phase == "Suspended" and not job_status(kube).restarts.total
    assert [c[0] for c in kube.calls] == ["PATCH"]  # the status: the Workload already follows
    resumed = kube.job()
    resumed["spec"]["suspend"] = False
    run(kube, resumed, js, [stored])
    assert kube.objects[path]["spec"]["active"] is True
    assert names.DEACTIVATED_FOR_SUSPEND not in kube.objects[path]["metadata"]["annotations"]
    assert job_status(kube).phase == "Queued"  # until Kueue admits it again


def test_a_job_without_a_queue_ignores_workloads():
    kube = FakeKube()
    run(kube, kube.add_job(tiny_job()))
    stray = workload(cond("Evicted", reason="Preempted"), jobset_uid=kube.jobset()["metadata"]["uid"])
    run(kube, kube.job(), kube.jobset(), [stray])
    assert job_status(kube).condition("Admitted") is None and not job_status(kube).restarts.total


def add_pod(kube: FakeKube, p: dict[str, Any]) -> None:
    kube.objects[PODS.path("default", p["metadata"]["name"])] = p


def test_a_job_whose_pods_cannot_be_scheduled_says_why_with_one_list():
    kube = FakeKube()
    run(kube, kube.add_job(tiny_job()))
    add_pod(kube, pod("tiny-slice-0-0-x", UNSCHEDULED))
    js = kube.jobset()
    js["status"] = {"replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 0}]}
    kube.calls.clear()
    _, notices = run(kube, kube.job(), js)  # a job event: no list
    assert [c[0] for c in kube.calls] == ["PATCH"] and job_status(kube).phase == "Running"
    kube.calls.clear()
    _, notices = run(kube, kube.job(), js, look_at_pods=True)  # a JobSet event or a resync: one list
    assert [c for c in kube.calls if c[0] == "LIST"] == [("LIST", PODS.path("default"))]
    status = job_status(kube)
    assert status.phase == "Pending" and status.message == f"pod tiny-slice-0-0-x cannot be scheduled: {UNSCHEDULABLE}"
    assert status.condition("Scheduled").reason == "Unschedulable"
    assert [(n.type, n.reason) for n in notices] == [("Warning", "Unschedulable")]
    kube.calls.clear()
    assert run(kube, kube.job(), js, look_at_pods=True)[1] == [] and writes(kube) == []  # the next resync: quiet
    js["status"] = {"replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 1}]}
    kube.calls.clear()
    run(kube, kube.job(), js, look_at_pods=True)  # all ready: no list
    assert [c[0] for c in kube.calls] == ["PATCH"] and job_status(kube).phase == "Running"
    assert job_status(kube).condition("Scheduled").status == "True"


# --- the manager -------------------------------------------------------------------------------------------------


def test_the_manager_follows_workloads_from_its_index_and_lists_pods_only_on_jobset_events_and_resyncs():
    async def scenario() -> None:
        kube = FakeKube()
        manager, _, _ = manager_for(kube)
        index = {("default", "tiny"): [queued_job(kube)]}
        manager.add(("default", "tiny"), "job")
        await drain(manager, index, {})
        jobsets = {("default", "tiny"): [kube.jobset()]}
        uid = kube.jobset()["metadata"]["uid"]
        manager.jobsets = jobsets
        manager.workloads = {
            ("default", "tiny"): [workload(cond("QuotaReserved", "False", "Pending", QUOTA_MESSAGE), jobset_uid=uid)]
        }
        manager.workload_seen(workload(jobset_uid=uid))
        assert manager.queue._reasons == {("default", "tiny"): {"workload"}}
        index[("default", "tiny")] = [kube.job()]
        kube.calls.clear()
        assert await drain(manager, index, jobsets) == ["followed"]
        assert job_status(kube).message == QUOTA_MESSAGE and [c[0] for c in kube.calls] == ["PATCH"]
        manager.workload_seen(
            {
                "metadata": {
                    "namespace": "default",
                    "ownerReferences": [
                        {
                            "apiVersion": "jobset.x-k8s.io/v1alpha2",
                            "kind": "JobSet",
                            "name": "not-ours",
                            "controller": True,
                        }
                    ],
                }
            }
        )
        assert len(manager.queue) == 0  # a JobSet the operator does not own

    asyncio.run(scenario())

"""The operator's pre-flight compile as plain functions: the decision table, and reconciles over the
in-memory API (what is created, what is written, which Events), with the pre-flight Job and its pod as
the Job controller and kubelet would leave them. No processes."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.conftest import tiny_job
from tests.fakes import PREFLIGHT_TIMING as TIMING
from tests.fakes import FakeKube, job_status
from tests.fakes import run_with_preflights as run
from tpu_operator.api.contract import PlanResult, StepResources
from tpu_operator.api.timestamps import parse
from tpu_operator.controller import preflight
from tpu_operator.controller.kube import BATCH_JOBS, CONFIGMAPS, JOBS, JOBSETS, PODS
from tpu_operator.rendering.preflight import preflight_labels

T0, T1, T3, LATE = "2026-01-01T00:00:00Z", "2026-01-01T00:00:30Z", "2026-01-01T00:03:00Z", "2026-01-01T00:10:00Z"
FITS = PlanResult(
    verdict="Fits",
    message="fits: 13.03 GiB per device",
    hbm_per_device_gib=13.03,
    hbm_capacity_gib=96,
    compile_seconds=47.0,
    libtpu_version="0.0.52",
)
TOO_BIG = PlanResult(
    verdict="DoesNotFit",
    message="does not fit HBM: temporaries (162.91G) exceed 94.74G",
    change=["training.globalBatch", "tpu.topology"],
    hbm_capacity_gib=96,
)


def pf_job(state: dict[str, Any] | None = None, created: str = T0) -> dict[str, Any]:
    return {
        "metadata": {"name": "tiny-plan-1", "creationTimestamp": created, "labels": preflight_labels("tiny", 1)},
        "status": state or {},
    }


def pod(
    terminated: dict[str, Any] | None = None, waiting: dict[str, Any] | None = None, phase: str = "Pending"
) -> dict[str, Any]:
    state = {"terminated": terminated} if terminated else {"waiting": waiting} if waiting else {}
    return {
        "metadata": {"name": "tiny-plan-1-x", "labels": preflight_labels("tiny", 1)},
        "status": {"phase": phase, "containerStatuses": [{"name": "plan", "image": "img:1", "state": state}]},
    }


def ended(result: PlanResult | str, code: int) -> dict[str, Any]:
    message = result if isinstance(result, str) else result.to_termination_message()
    return pod(
        terminated={"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message},
        phase="Succeeded" if code == 0 else "Failed",
    )


DONE, FAILED = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}, {"failed": 1}
PULL = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "img:1"'}


@pytest.mark.parametrize(
    "found, pods, age, compiling, kind, reason",
    [
        (None, None, 0, False, "create", ""),
        (None, None, 30, True, "wait", ""),  # created and written, the watch has not delivered it yet
        (None, None, 200, True, "create", ""),  # still not there: make it again (a 409 adopts it)
        (pf_job(), None, 30, False, "wait", ""),
        (pf_job(DONE), None, 30, False, "list_pods", ""),
        (pf_job(DONE), [ended(FITS, 0)], 30, False, "fits", "Fits"),
        (pf_job(FAILED), [ended(TOO_BIG, 2)], 30, False, "invalid", "DoesNotFit"),
        (
            pf_job(FAILED),
            [ended(PlanResult(verdict="NoLibtpu", message="no libtpu"), 3)],
            30,
            False,
            "unknown",
            "NoLibtpu",
        ),
        (pf_job(FAILED), [ended("Traceback ... Killed", 137)], 30, False, "unknown", "PreflightFailed"),
        (
            pf_job({"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}),
            [],
            400,
            False,
            "unknown",
            "DeadlineExceeded",
        ),
        (pf_job(), None, 200, False, "list_pods", ""),
        (pf_job(), [pod(waiting=PULL)], 200, False, "unknown", "PreflightNotStarted"),
        (pf_job(), [], 200, False, "unknown", "PreflightNotStarted"),  # no Job controller made a pod
        (pf_job({"active": 1, "ready": 1}), None, 200, False, "wait", ""),  # it compiles
        (pf_job({"active": 1, "ready": 1}), None, 400, False, "unknown", "DeadlineExceeded"),
    ],
)
def test_the_decision(found, pods, age, compiling, kind, reason):
    decision = preflight.decide(found, pods, age, TIMING, compiling)
    assert (decision.kind, decision.reason) == (kind, reason)
    if kind == "wait":
        assert decision.requeue_after_s and decision.requeue_after_s > 0
    if reason == "PreflightNotStarted" and pods:
        assert "ImagePullBackOff" in decision.message and "img:1" in decision.message


def posts(kube: FakeKube) -> list[str]:
    return [path for method, path in kube.calls if method == "POST"]


def started() -> FakeKube:
    """A job reconciled once: its ConfigMap and pre-flight Job exist, Planned=Unknown Compiling."""
    kube = FakeKube()
    kube.add_job(tiny_job())
    outcome, notices = run(kube, T0)
    assert outcome.result == "planning" and outcome.requeue_after_s == TIMING.start_s and notices == []
    assert posts(kube) == [CONFIGMAPS.path("default"), BATCH_JOBS.path("default")]
    made = kube.objects[BATCH_JOBS.path("default", "tiny-plan-1")]
    assert made["metadata"]["ownerReferences"][0]["uid"] == "job-uid" and made["spec"]["backoffLimit"] == 0
    made["metadata"]["creationTimestamp"] = T0
    status = job_status(kube)
    planned = status.condition("Planned")
    assert (status.phase, planned.status, planned.reason) == ("Pending", "Unknown", "Compiling")
    assert "tiny-plan-1" in status.message and status.job_set_name is None
    kube.calls.clear()
    return kube


def finish(kube: FakeKube, state: dict[str, Any], *pods: dict[str, Any]) -> None:
    kube.objects[BATCH_JOBS.path("default", "tiny-plan-1")]["status"] = state
    for i, p in enumerate(pods):
        p = copy.deepcopy(p)
        p["metadata"]["name"] += str(i)
        kube.objects[PODS.path("default", p["metadata"]["name"])] = p


def test_while_it_compiles_nothing_more_is_created_or_written():
    kube = started()
    outcome, notices = run(kube, T1)
    assert outcome.result == "planning" and kube.calls == [] and notices == []
    assert outcome.requeue_after_s == pytest.approx(TIMING.start_s - 30)


def test_it_fits_the_jobset_is_created_with_status_plan():
    kube = started()
    finish(kube, DONE, ended(FITS, 0))
    outcome, notices = run(kube, T1)
    assert outcome.result == "created" and [n.reason for n in notices] == ["Planned", "Created"]
    assert posts(kube) == [JOBSETS.path("default")]  # the ConfigMap exists already
    assert [c[0] for c in kube.calls].count("LIST") == 1
    status = job_status(kube)
    assert status.condition("Planned").status == "True" and status.condition("Ready").reason == "PodsPending"
    assert status.plan.fits is True and status.plan.hbm_per_device_gib == 13.03 and status.plan.hbm_capacity_gib == 96
    assert (
        status.plan.compile_seconds == 47.0
        and status.plan.libtpu_version == "0.0.52"
        and status.plan.checked_at == parse(T1)
    )
    assert status.job_set_name == "tiny" and status.phase == "Pending"
    kube.calls.clear()
    outcome, notices = run(kube, LATE)  # decided: no pod list, no second pre-flight
    assert notices == [] and not posts(kube) and "LIST" not in [c[0] for c in kube.calls]


def test_status_plan_carries_what_the_step_costs_and_its_time_bound_on_the_generation():
    # The 8B example's figures as the pre-flight pod leaves them: costs, no bounds (the pod has no catalogue).
    costs = StepResources(
        matmul_tflop=1115.6,
        model_tflop=1010.4,
        kernel_calls=128,
        ici_sent_gib=145.3,
        ici_gib={"all-gather": 93.9, "reduce-scatter": 44.5, "all-reduce": 3.9},
        hbm_traffic_gib=2603.0,
    )
    kube = started()
    finish(kube, DONE, ended(FITS.model_copy(update={"resources": costs}), 0))
    run(kube, T1)
    plan = job_status(kube).model_dump(by_alias=True, exclude_none=True)["plan"]
    r = plan["resources"]
    assert r["matmulTFLOP"] == 1115.6 and r["iciGiB"] == {"all-gather": 93.9, "reduce-scatter": 44.5, "all-reduce": 3.9}
    # The tiny job is on v7x: 2,307 TFLOP/s, 7,380 GB/s of HBM, 1,200 GB/s of ICI a chip, shared by 2 devices.
    assert r["boundSeconds"]["compute"] == pytest.approx(1115.6e12 / 1153.5e12, rel=1e-3)
    assert r["boundSeconds"]["ici"] == pytest.approx(145.3 * 2**30 / 300e9, rel=1e-3)
    assert r["boundSeconds"]["hbm"] == pytest.approx(2603 * 2**30 / 3690e9, rel=1e-3)
    assert r["binding"] == "compute" and r["stepTimeBoundSeconds"] == r["boundSeconds"]["compute"]
    assert r["mfuCeiling"] == pytest.approx(1010.4 / 1115.6, rel=1e-3)


def test_it_does_not_fit_the_job_is_invalid_and_gets_no_jobset():
    kube = started()
    finish(kube, FAILED, ended(TOO_BIG, 2))
    outcome, notices = run(kube, T1)
    assert outcome.result == "invalid" and [n.reason for n in notices] == ["DoesNotFit"]
    assert not posts(kube) and kube.jobset() is None
    status = job_status(kube)
    ready, planned = status.condition("Ready"), status.condition("Planned")
    assert status.phase == "Invalid" and (ready.status, ready.reason) == ("False", "DoesNotFit")
    assert (planned.status, planned.reason) == ("False", "DoesNotFit") and status.plan.fits is False
    assert status.message.startswith("spec.training.globalBatch: does not fit HBM")
    assert "change spec.training.globalBatch, spec.tpu.topology" in status.message
    kube.calls.clear()
    outcome, notices = run(kube, LATE)
    assert outcome.result == "invalid" and notices == [] and kube.calls == []  # said once, nothing written


def test_a_refused_flag_names_its_field():
    kube = FakeKube()
    kube.add_job(tiny_job(runtime={"libtpuInitArgs": ["--xla_tpu_bogus=1"]}))
    run(kube, T0)
    kube.objects[BATCH_JOBS.path("default", "tiny-plan-1")]["metadata"]["creationTimestamp"] = T0
    refused = PlanResult(
        verdict="RejectedFlags",
        message="libtpu refuses 1 flag",
        libtpu_version="0.0.52",
        rejected_flags=[{"flag": "--xla_tpu_bogus=1", "message": "ERROR: Unknown command line flag 'xla_tpu_bogus'"}],
    )
    finish(kube, FAILED, ended(refused, 2))
    _, notices = run(kube, T1)
    status = job_status(kube)
    assert status.phase == "Invalid" and status.condition("Planned").reason == "RejectedFlags"
    assert status.message.startswith("spec.runtime.libtpuInitArgs[0]: libtpu 0.0.52 refuses --xla_tpu_bogus=1")


def test_a_pre_flight_that_cannot_start_is_given_up_and_the_jobset_made():
    kube = started()
    finish(kube, {"active": 1}, pod(waiting=PULL))
    outcome, notices = run(kube, T3)  # past the start allowance, before the deadline
    assert outcome.result == "created" and [n.reason for n in notices] == ["PreflightNotStarted", "Created"]
    assert notices[0].type == "Warning" and "ImagePullBackOff" in notices[0].message
    planned = job_status(kube).condition("Planned")
    assert (planned.status, planned.reason) == ("Unknown", "PreflightNotStarted")
    assert "created without the check" in planned.message and kube.jobset() is not None


def test_an_edit_after_does_not_fit_plans_the_new_generation():
    kube = started()
    finish(kube, FAILED, ended(TOO_BIG, 2))
    run(kube, T1)
    obj = kube.objects[JOBS.path("default", "tiny")]
    obj["metadata"]["generation"] = 2
    obj["spec"]["training"]["globalBatch"] = 16
    kube.calls.clear()
    outcome, _ = run(kube, LATE)
    assert outcome.result == "planning" and posts(kube) == [CONFIGMAPS.path("default"), BATCH_JOBS.path("default")]
    assert BATCH_JOBS.path("default", "tiny-plan-2") in kube.objects
    status = job_status(kube)
    assert status.phase == "Pending" and status.condition("Planned").reason == "Compiling"
    assert status.condition("Planned").observed_generation == 2


def config_volume(pod_spec: dict[str, Any]) -> str:
    return next(v["configMap"]["name"] for v in pod_spec["volumes"] if v["name"] == "config")


def test_an_edit_after_does_not_fit_plans_and_runs_the_edited_config():
    # The fix a DoesNotFit message asks for is what the new pre-flight compiles and what the pods mount:
    # the edited config is a new ConfigMap (its name: a hash of it), the first one is left as it was.
    kube = started()
    first = next(o for p, o in kube.objects.items() if p.startswith(CONFIGMAPS.path("default") + "/"))
    finish(kube, FAILED, ended(TOO_BIG, 2))
    run(kube, T1)
    obj = kube.objects[JOBS.path("default", "tiny")]
    obj["metadata"]["generation"] = 2
    obj["spec"]["training"]["globalBatch"] = 16
    run(kube, LATE)
    maps = {o["metadata"]["name"]: o for p, o in kube.objects.items() if p.startswith(CONFIGMAPS.path("default") + "/")}
    edited = next(o for name, o in maps.items() if name != first["metadata"]["name"])
    assert len(maps) == 2 and maps[first["metadata"]["name"]]["data"] == first["data"]
    assert json.loads(edited["data"]["config.json"])["training"]["globalBatch"] == 16
    plan_pod = kube.objects[BATCH_JOBS.path("default", "tiny-plan-2")]["spec"]["template"]["spec"]
    assert config_volume(plan_pod) == edited["metadata"]["name"]
    kube.objects[BATCH_JOBS.path("default", "tiny-plan-2")]["metadata"]["creationTimestamp"] = LATE
    kube.objects[BATCH_JOBS.path("default", "tiny-plan-2")]["status"] = DONE
    fits = pod(
        terminated={"exitCode": 0, "reason": "Completed", "message": FITS.to_termination_message()}, phase="Succeeded"
    )
    fits["metadata"] = {"name": "tiny-plan-2-x", "labels": preflight_labels("tiny", 2)}
    kube.objects[PODS.path("default", "tiny-plan-2-x")] = fits
    outcome, _ = run(kube, LATE)
    assert outcome.result == "created"
    trainer_pod = kube.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert config_volume(trainer_pod) == edited["metadata"]["name"]


def test_a_job_with_its_own_command_or_preflight_skip_gets_its_jobset_at_once():
    for doc in (tiny_job(plan={"preflight": "skip"}), tiny_job(command=["python", "-c", "pass"])):
        kube = FakeKube()
        kube.add_job(doc)
        outcome, _ = run(kube, T0)
        assert outcome.result == "created" and BATCH_JOBS.path("default") not in posts(kube)
        assert job_status(kube).condition("Planned") is None


# --- a queued job: its JobSet joins the queue while it compiles, held by Kueue's admission gate ---------


def queued_started() -> FakeKube:
    """A queued job reconciled once: its pre-flight Job, and its JobSet already made with the gate."""
    kube = FakeKube()
    kube.add_job(tiny_job(queueName="tpu-queue"))
    outcome, notices = run(kube, T0)
    assert outcome.result == "planning" and notices == []
    assert posts(kube) == [
        CONFIGMAPS.path("default"),
        BATCH_JOBS.path("default"),
        JOBSETS.path("default"),
    ]
    kube.objects[BATCH_JOBS.path("default", "tiny-plan-1")]["metadata"]["creationTimestamp"] = T0
    jobset = kube.jobset()
    assert jobset["spec"]["suspend"] is True and preflight.gated(jobset)
    assert jobset["metadata"]["annotations"][preflight.ADMISSION_GATE] == "training.tpu-operator.dev/preflight"
    assert job_status(kube).condition("Planned").reason == "Compiling"
    kube.calls.clear()
    return kube


def test_a_queued_job_waits_in_its_queue_gated_while_it_compiles():
    kube = queued_started()
    outcome, _ = run(kube, T1)
    assert outcome.result == "planning" and kube.calls == []  # no second JobSet, nothing written


def test_a_queued_job_that_fits_has_its_gate_lifted():
    kube = queued_started()
    finish(kube, DONE, ended(FITS, 0))
    outcome, notices = run(kube, T1)
    assert "Planned" in [n.reason for n in notices] and not posts(kube)
    assert ("PATCH", JOBSETS.path("default", "tiny")) in kube.calls
    jobset = kube.jobset()
    assert not preflight.gated(jobset) and jobset["spec"]["suspend"] is True  # Kueue unsuspends it on admission
    assert job_status(kube).condition("Planned").status == "True" and job_status(kube).job_set_name == "tiny"


def test_a_queued_job_that_does_not_fit_loses_its_held_jobset():
    kube = queued_started()
    finish(kube, FAILED, ended(TOO_BIG, 2))
    outcome, notices = run(kube, T1)
    assert outcome.result == "invalid" and [n.reason for n in notices] == ["DoesNotFit"]
    assert ("DELETE", JOBSETS.path("default", "tiny")) in kube.calls and kube.jobset() is None
    assert job_status(kube).phase == "Invalid"


def test_other_gates_stay_when_ours_is_lifted():
    jobset = {
        "metadata": {
            "annotations": {preflight.ADMISSION_GATE: "example.com/quota, training.tpu-operator.dev/preflight"}
        }
    }
    assert preflight.gated(jobset)
    assert preflight.lift_patch(jobset) == {
        "metadata": {"annotations": {preflight.ADMISSION_GATE: "example.com/quota"}}
    }
    assert preflight.lift_patch(preflight.with_gate({"metadata": {}})) == {
        "metadata": {"annotations": {preflight.ADMISSION_GATE: None}}
    }


def test_an_elastic_jobs_preflight_compiles_every_slice_count_and_reports_the_worst():
    """The pre-flight pod's command names every count from spec.tpu.slices down to minSlices; the plan's one
    result is the first that does not fit (else the most HBM per device), with each count's HBM in status.plan."""
    from tpu_operator.api.contract import PlanResult
    from tpu_operator.api.validation import parse_job
    from tpu_operator.controller.preflight import plan_status
    from tpu_operator.rendering.preflight import render_preflight
    from tpu_workload.performance.plan import worst

    elastic = parse_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": "2x2x1", "slices": 3, "elastic": {"minSlices": 1}},
            training={"steps": 10, "globalBatch": 48, "sequenceLength": 128},
        )
    )
    command = render_preflight(elastic, 1)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--slice-counts") + 1] == "3,2,1"
    whole = parse_job(tiny_job())
    assert "--slice-counts" not in render_preflight(whole, 1)["spec"]["template"]["spec"]["containers"][0]["command"]

    def fits(gib: float) -> PlanResult:
        return PlanResult(verdict="Fits", message="fits", hbm_per_device_gib=gib, compile_seconds=2.0)

    best = worst([(3, fits(5.0)), (2, fits(7.0)), (1, fits(6.0))])
    assert (best.slices, best.hbm_per_device_gib, best.compile_seconds) == (2, 7.0, 6.0)
    assert best.hbm_by_slices == {"3": 5.0, "2": 7.0, "1": 6.0} and best.message == "on 2 slice(s): fits"
    too_big = PlanResult(verdict="DoesNotFit", message="does not fit HBM", hbm_per_device_gib=120.0)
    bad = worst([(3, fits(5.0)), (2, too_big), (1, fits(6.0))])
    assert (bad.verdict, bad.slices, bad.fits) == ("DoesNotFit", 2, False)
    status = plan_status(best, 96.0, parse("2026-01-01T00:00:00Z"))
    assert status.slices == 2 and status.hbm_by_slices == {"3": 5.0, "2": 7.0, "1": 6.0}
    assert status.model_dump(by_alias=True)["hbmPerDeviceGiBBySlices"] == {"3": 5.0, "2": 7.0, "1": 6.0}

"""Nothing of a job is left half-made by the API server's refusal. Its pods, which the API server sees only
when the Job controller makes them, are admitted first in a dry run, once per shape (admitted.py); the
ConfigMap, the Secret and the JobSet are refused, if at all, by their own create, which undoes what was
made beside them (children.ensure_children). What it refuses makes the job Invalid with the API's words.
Over the in-memory API, which refuses as it is told."""

from __future__ import annotations

import pytest

from tests.conftest import operator_job as tiny_job
from tests.conftest import tiny_job as planned_job
from tests.fakes import FakeKube, job_status, run_reconcile
from tests.fakes import run_with_preflights as run
from tpu_operator.controller.admitted import AdmittedShapes
from tpu_operator.controller.kube import BATCH_JOBS, CONFIGMAPS, JOBSETS, PODS, SECRETS, ApiError

TOLERATION = (
    'Pod "tiny-slice-x" is invalid: spec.tolerations[1].effect: Invalid value: "NoSchedule": effect must be '
    "'NoExecute' when `tolerationSeconds` is set"
)
PODSECURITY = (
    'pods "tiny-slice-x" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true '
    '(pod or container "trainer" must set securityContext.runAsNonRoot=true)'
)
WEBHOOK = (
    'admission webhook "vjobset.kb.io" denied the request: spec.replicatedJobs[0].name: Invalid value: '
    '"slice": the JobSet name is too long'
)


def creates(kube: FakeKube) -> list[tuple[str, str]]:
    return [c for c in kube.calls if c[0] in ("POST", "DRYRUN")]


def test_the_pods_are_dry_run_first_then_everything_is_created():
    kube = FakeKube()
    outcome, _ = run_reconcile(kube, kube.add_job(tiny_job()))
    assert outcome.result == "created"
    assert [path for method, path in creates(kube) if method == "DRYRUN"] == [PODS.path("default")]
    assert creates(kube)[0] == ("DRYRUN", PODS.path("default"))  # before the first create


def test_jobs_of_one_shape_have_their_pods_dry_run_once():
    kube, shapes = FakeKube(), AdmittedShapes()
    for i, spec in enumerate([{}, {}, {"image": "registry.example/other:1"}]):
        kube.calls.clear()
        doc = tiny_job(**spec)
        doc["metadata"]["name"] = f"tiny-{i}"
        outcome, _ = run_reconcile(kube, kube.add_job(doc, uid=f"uid-{i}"), shapes=shapes)
        assert outcome.result == "created"
        assert [c for c in creates(kube) if c[0] == "DRYRUN"] == ([] if i == 1 else [("DRYRUN", PODS.path("default"))])


def test_a_shape_is_admitted_again_once_its_time_is_up():
    now = [0.0]
    shapes = AdmittedShapes(ttl_s=600, size=2, clock=lambda: now[0])
    shapes.add("a")
    assert "a" in shapes and "b" not in shapes
    now[0] = 600.0
    assert "a" not in shapes
    for key in ("a", "b", "c"):
        shapes.add(key)
    assert "a" not in shapes and "b" in shapes and "c" in shapes  # the least recently admitted goes


def test_a_pod_the_api_refuses_makes_the_job_invalid_in_its_words_with_nothing_created():
    kube = FakeKube()
    kube.refuse[PODS] = ApiError(422, TOLERATION, "POST")
    obj = kube.add_job(tiny_job())
    outcome, notices = run_reconcile(kube, obj)
    status = job_status(kube)
    assert outcome.result == "invalid" and status.phase == "Invalid"
    assert TOLERATION in status.message and status.condition("Ready").reason == "InvalidSpec"
    assert [n.reason for n in notices] == ["Invalid"]
    assert not [c for c in kube.calls if c[0] == "POST"] and kube.jobset() is None
    assert not [p for p in kube.objects if p.startswith(CONFIGMAPS.path("default"))]


@pytest.mark.parametrize(
    "resource, message",
    [(JOBSETS, WEBHOOK), (PODS, PODSECURITY), (CONFIGMAPS, 'admission webhook "cm.example" denied the request')],
)
def test_a_webhook_or_pod_security_denial_is_invalid_too_and_leaves_nothing(resource, message):
    kube = FakeKube()
    kube.refuse[resource] = ApiError(403, message, "POST")
    run_reconcile(kube, kube.add_job(tiny_job()))
    assert job_status(kube).phase == "Invalid" and message in job_status(kube).message
    left = [p for p in kube.objects if p.startswith((CONFIGMAPS.path("default"), SECRETS.path("default")))]
    assert left == [] and kube.jobset() is None


def test_rbac_or_quota_refusals_are_not_the_jobs():
    quota = FakeKube()
    quota.refuse[PODS] = ApiError(
        403, 'pods "x" is forbidden: exceeded quota: tpu, requested: google.com/tpu=4', "POST"
    )
    outcome, _ = run_reconcile(quota, quota.add_job(tiny_job()))
    assert outcome.result == "created" and quota.jobset() is not None  # the pods wait for quota, as before


def test_the_pre_flight_is_not_started_for_a_job_the_api_would_refuse():
    kube = FakeKube()
    kube.refuse[PODS] = ApiError(422, TOLERATION, "POST")
    kube.add_job(planned_job())
    outcome, _ = run(kube, "2026-01-01T00:00:00Z")
    assert outcome.result == "invalid" and TOLERATION in job_status(kube).message
    assert not [c for c in kube.calls if c[0] == "POST"]
    assert BATCH_JOBS.path("default", "tiny-plan-1") not in kube.objects

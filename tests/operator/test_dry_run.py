"""Before anything of a job is created, the API server is asked, in a dry run, to admit what it renders: the
ConfigMap, the JobSet and one pod per pod template (children.dry_run). What it refuses makes the job Invalid
with the API's words, and nothing is created. Over the in-memory API, which refuses as it is told."""

from __future__ import annotations

import pytest

from tests.conftest import operator_job as tiny_job
from tests.conftest import tiny_job as planned_job
from tests.fakes import FakeKube, job_status, run_reconcile
from tests.fakes import run_with_preflights as run
from tpu_operator.controller.kube import BATCH_JOBS, CONFIGMAPS, JOBSETS, PODS, ApiError

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


def test_everything_is_dry_run_first_then_created():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    outcome, _ = run_reconcile(kube, obj)
    assert outcome.result == "created"
    dry = [path for method, path in creates(kube) if method == "DRYRUN"]
    assert sorted(dry) == sorted([CONFIGMAPS.path("default"), JOBSETS.path("default"), PODS.path("default")])
    first_post = next(i for i, c in enumerate(creates(kube)) if c[0] == "POST")
    assert all(c[0] == "DRYRUN" for c in creates(kube)[:first_post])  # every dry run before the first create


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


@pytest.mark.parametrize("resource, message", [(JOBSETS, WEBHOOK), (PODS, PODSECURITY)])
def test_a_webhook_or_pod_security_denial_is_invalid_too(resource, message):
    kube = FakeKube()
    kube.refuse[resource] = ApiError(403, message, "POST")
    run_reconcile(kube, kube.add_job(tiny_job()))
    assert job_status(kube).phase == "Invalid" and message in job_status(kube).message


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

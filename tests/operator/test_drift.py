"""Owned objects stay as the operator made them (controller/drift.py): the pure comparison and status step, then
hand edits through the reconcile and the manager over the in-memory API. No processes."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml

from tests.conftest import operator_job as tiny_job
from tests.fakes import NOW, FakeKube, drain, job_status, manager_for, run_reconcile
from tpu_operator.api import names
from tpu_operator.api.status import ChildrenStatus, TPUTrainingJobStatus
from tpu_operator.api.validation import parse_job
from tpu_operator.controller import children, drift, preflight, reconcile
from tpu_operator.controller.kube import CONFIGMAPS, JOBS, JOBSETS, ApiError
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.rendering import placement
from tpu_operator.rendering.manifests import jobset_metadata, render

EXAMPLES = sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml"))
JOB_LABEL = drift.field("labels", names.LABEL_JOB)
APPLIED = drift.field("annotations", names.APPLIED_SPEC)


def job_of(doc: dict) -> object:
    return parse_job({**doc, "metadata": {**doc["metadata"], "namespace": "default", "uid": "job-uid"}})


def made(doc: dict) -> tuple[dict, dict, dict, str]:
    """(the rendered JobSet's metadata, the expected labels, annotations, and the digest it was made with)."""
    job = job_of(doc)
    labels, annotations = jobset_metadata(job)
    meta = copy.deepcopy(render(job)[1]["metadata"])
    return meta, labels, annotations, drift.spec_digest(annotations[names.APPLIED_SPEC])


# --- the comparison (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_jobset_is_as_made_without_rendering(path):
    """What drift computes from the job alone is what rendering puts on the JobSet, for every example."""
    doc = yaml.safe_load(path.read_text())
    meta, labels, annotations, digest = made(doc)
    assert meta["labels"] == labels and meta["annotations"] == annotations
    assert drift.compare(meta, labels, annotations, digest) == ({}, [], [], digest)


def test_a_removed_or_relabelled_job_label_is_put_back_in_one_patch():
    meta, labels, annotations, digest = made(tiny_job(queueName="team-a"))
    del meta["labels"][names.LABEL_JOB]
    meta["labels"][placement.KUEUE_QUEUE_LABEL] = "other-queue"
    patch, restored, left, _ = drift.compare(meta, labels, annotations, digest)
    assert patch == {"labels": {names.LABEL_JOB: "tiny", placement.KUEUE_QUEUE_LABEL: "team-a"}} and not left
    assert restored == [JOB_LABEL, drift.field("labels", placement.KUEUE_QUEUE_LABEL)]
    meta["labels"][names.LABEL_JOB] = "someone-else"
    assert drift.compare(meta, labels, annotations, digest)[0]["labels"][names.LABEL_JOB] == "tiny"


def test_what_others_add_and_the_preflight_gate_are_not_compared():
    meta, labels, annotations, digest = made(tiny_job())
    meta = preflight.with_gate({"metadata": meta})["metadata"]
    meta["labels"]["team"] = "x"
    meta["annotations"]["kueue.x-k8s.io/something"] = "y"
    assert drift.compare(meta, labels, annotations, digest)[:3] == ({}, [], [])


def test_the_applied_spec_is_put_back_only_from_the_spec_the_jobset_was_made_from():
    meta, labels, annotations, digest = made(tiny_job())
    meta["annotations"][names.APPLIED_SPEC] = '{"training": {"steps": 1}}'
    patch, restored, left, kept = drift.compare(meta, labels, annotations, digest)
    assert patch == {"annotations": {names.APPLIED_SPEC: annotations[names.APPLIED_SPEC]}} and restored == [APPLIED]
    assert kept == digest
    # After a refused spec change, the current spec is not the JobSet's: reported, never invented; and the keys
    # that follow the spec (Kueue's queue) are left alone, the fixed ones still put back.
    edited_spec = made(tiny_job(queueName="team-b"))
    del meta["labels"][names.LABEL_JOB]
    patch, restored, left, kept = drift.compare(meta, edited_spec[1], edited_spec[2], digest)
    assert patch == {"labels": {names.LABEL_JOB: "tiny"}} and restored == [JOB_LABEL] and kept == digest
    assert left == [f"{APPLIED} (the spec changed since the JobSet was made)"]


def test_a_jobset_made_before_the_digest_is_trusted_on_first_use_if_it_holds_a_spec():
    meta, labels, annotations, digest = made(tiny_job())
    assert drift.compare(meta, labels, annotations, None) == ({}, [], [], digest)
    meta["annotations"][names.APPLIED_SPEC] = "not json"
    patch, restored, left, kept = drift.compare(meta, labels, annotations, None)
    assert kept is None and patch == {} and left == [f"{APPLIED} (not a spec, and no record of the JobSet's)"]


def test_a_jobsets_owner_is_its_controller_reference_not_its_label():
    meta, *_ = made(tiny_job())
    assert children.owner_of({"metadata": meta}) == ("default", "tiny", "job-uid")
    meta["labels"][names.LABEL_JOB] = "another-job"
    assert children.owner_of({"metadata": meta}) == ("default", "tiny", "job-uid")
    del meta["labels"][names.LABEL_JOB]
    assert children.owner_of({"metadata": meta}) == ("default", "tiny", "job-uid")
    meta["ownerReferences"][0]["controller"] = False
    assert children.owner_of({"metadata": meta}) is None


def test_a_config_map_event_names_its_edit_or_deletion_and_nothing_else():
    config_map = render(job_of(tiny_job()))[0]
    name = config_map["metadata"]["name"]
    assert drift.config_map_edit(config_map, deleted=False) is None  # created or listed as made
    assert drift.config_map_edit(config_map, deleted=True) == (("default", "tiny"), (name, drift.DELETED))
    edited = copy.deepcopy(config_map)
    edited["metadata"]["labels"][names.LABEL_JOB] = "x"
    assert drift.config_map_edit(edited, deleted=False) == (("default", "tiny"), (name, (JOB_LABEL,)))
    del edited["metadata"]["labels"][names.LABEL_JOB]  # left the watch's selector: DELETED without the label
    assert drift.config_map_edit(edited, deleted=True) == (("default", "tiny"), (name, (JOB_LABEL,)))
    edited["metadata"]["ownerReferences"] = []
    assert drift.config_map_edit(edited, deleted=True) is None


# --- the status step (pure) -----------------------------------------------------------------------------------


def test_each_edit_is_one_event_and_one_left_as_found_is_reported_once():
    status = TPUTrainingJobStatus()
    status, notices = drift.recorded(status, drift.Found("abc"), NOW, 1)
    assert notices == [] and status.children == ChildrenStatus(applied_spec_digest="abc")
    assert status.condition(drift.CONDITION) is None  # nothing found: no condition, no write but the digest
    reverted = drift.Found("abc", reverted=(f"JobSet tiny {JOB_LABEL}",))
    for edits in (1, 2):  # the same edit twice: two edits, two Events
        status, notices = drift.recorded(status, reverted, NOW, 1)
        assert [n.reason for n in notices] == ["ChildEdited"] and status.children.edits == edits
        assert JOB_LABEL in notices[0].message
    condition = status.condition(drift.CONDITION)
    assert (condition.status, condition.reason) == ("True", "Reverted") and JOB_LABEL in condition.message
    left = drift.Found("abc", edited=(f"JobSet tiny {APPLIED} (why)",))
    status, notices = drift.recorded(status, left, NOW, 1)
    assert len(notices) == 1 and status.condition(drift.CONDITION).reason == "Edited"
    again, notices = drift.recorded(status, left, NOW, 1)
    assert notices == [] and again == status  # still there: no Event, no write
    back, notices = drift.recorded(status, drift.Found("abc"), NOW, 1)
    assert notices == [] and (back.condition(drift.CONDITION).status, back.condition(drift.CONDITION).reason) == (
        "True",
        "AsMade",
    )


def test_echoed_names_and_words_are_bounded():
    items = tuple(f"JobSet {drift.cut('x' * 10_000)} {JOB_LABEL}" for _ in range(50))
    status, notices = drift.recorded(TPUTrainingJobStatus(), drift.Found(reverted=items), NOW, 1)
    message = status.condition(drift.CONDITION).message
    assert len(message) < 2_000 and "and 42 more" in message and notices[0].message == message
    assert drift.cut("a\nb" + "c" * 500) == "a b" + "c" * 76 + "…"


# --- through the reconcile, over the in-memory API ------------------------------------------------------------


def created(kube: FakeKube, doc: dict | None = None) -> None:
    outcome, _ = run_reconcile(kube, kube.add_job(doc or tiny_job()))
    assert outcome.result == "created"
    kube.calls.clear()


def test_nothing_drifted_nothing_sent():
    kube = FakeKube()
    created(kube)
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())
    assert (outcome.result, notices, kube.calls) == ("followed", [], [])
    assert job_status(kube).children.applied_spec_digest == made(tiny_job())[3]  # recorded when created


def test_a_removed_job_label_is_put_back_reported_once_and_no_second_jobset_made():
    kube = FakeKube()
    created(kube)
    del kube.objects[JOBSETS.path("default", "tiny")]["metadata"]["labels"][names.LABEL_JOB]
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())
    assert [c for c in kube.calls if "jobsets" in c[1]] == [("PATCH", JOBSETS.path("default", "tiny"))]
    assert kube.jobset()["metadata"]["labels"][names.LABEL_JOB] == "tiny"
    assert outcome.jobset is not None  # kept by the manager until the watch has it again (`made`)
    assert [n.reason for n in notices] == ["ChildEdited"] and JOB_LABEL in notices[0].message
    status = job_status(kube)
    condition = status.condition(drift.CONDITION)
    assert (condition.status, condition.reason, status.children.edits) == ("True", "Reverted", 1)
    kube.calls.clear()
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())
    assert (notices, kube.calls) == ([], [])


def test_the_manager_finds_a_jobset_that_left_its_watch_with_one_get():
    """The watch says DELETED (without the label) and the index drops it: one GET by its name, one patch, no
    POST (no 409 adoption, no second JobSet)."""

    async def go() -> None:
        kube = FakeKube()
        manager, _, notices = manager_for(kube)
        jobs = {("default", "tiny"): [kube.add_job(tiny_job())]}
        manager.add(("default", "tiny"), "job")
        assert await drain(manager, jobs, {}) == ["created"]
        jobs = {("default", "tiny"): [kube.job()]}
        stored = kube.objects[JOBSETS.path("default", "tiny")]
        del stored["metadata"]["labels"][names.LABEL_JOB]
        manager.made.clear()
        kube.calls.clear()
        manager.jobset_seen(copy.deepcopy(stored), deleted=True)
        assert await drain(manager, jobs, {}) == ["adopted"]
        jobset_calls = [c for c in kube.calls if "jobsets" in c[1]]
        assert jobset_calls == [("GET", JOBSETS.path("default", "tiny")), ("PATCH", JOBSETS.path("default", "tiny"))]
        assert kube.jobset()["metadata"]["labels"][names.LABEL_JOB] == "tiny"
        assert [n.reason for n in notices if n.reason == "ChildEdited"] == ["ChildEdited"]
        kube.calls.clear()
        manager.add(("default", "tiny"), "job")  # its status write comes back before the JobSet's ADDED
        assert await drain(manager, jobs, {}) == ["followed"] and kube.calls == []  # `made`: no POST, no GET

    asyncio.run(go())


def test_a_jobset_relabelled_to_another_jobs_name_goes_back_to_its_owner_only():
    kube = FakeKube()
    created(kube)
    other = tiny_job()
    other["metadata"]["name"] = "other"
    run_reconcile(kube, kube.add_job(other, uid="other-uid"))
    stored = kube.objects[JOBSETS.path("default", "tiny")]
    stored["metadata"]["labels"][names.LABEL_JOB] = "other"
    assert children.owner_of(stored)[:2] == ("default", "tiny")  # the watch queues its true owner
    kube.calls.clear()
    run_reconcile(kube, kube.job("other"), kube.jobset("other"))  # the job it names: nothing to do with it
    assert [c for c in kube.calls if c[0] != "GET"] == []
    run_reconcile(kube, kube.job(), kube.jobset())
    assert kube.jobset()["metadata"]["labels"][names.LABEL_JOB] == "tiny"
    assert kube.jobset()["metadata"]["ownerReferences"][0]["uid"] == "job-uid"


def test_an_edited_applied_spec_is_put_back_or_after_a_refused_edit_reported():
    kube = FakeKube()
    created(kube)
    stored = kube.objects[JOBSETS.path("default", "tiny")]
    wanted = stored["metadata"]["annotations"][names.APPLIED_SPEC]
    stored["metadata"]["annotations"][names.APPLIED_SPEC] = "{}"
    run_reconcile(kube, kube.job(), kube.jobset())
    assert kube.jobset()["metadata"]["annotations"][names.APPLIED_SPEC] == wanted
    assert job_status(kube).condition("SpecChange").status == "True"
    # A refused spec change, then the annotation edited: not put back (the current spec is not the JobSet's).
    kube.objects[JOBS.path("default", "tiny")]["spec"]["training"]["steps"] = 20
    stored["metadata"]["annotations"][names.APPLIED_SPEC] = "not json"
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())
    assert kube.jobset()["metadata"]["annotations"][names.APPLIED_SPEC] == "not json"
    status = job_status(kube)
    condition = status.condition(drift.CONDITION)
    assert (condition.status, condition.reason) == ("False", "Edited") and APPLIED in condition.message
    assert status.condition("SpecChange").status == "False"  # the edit is still refused, the fields unknown
    assert sorted(n.reason for n in notices) == ["ChildEdited", "SpecChangeRefused"]


def test_a_restore_the_api_refuses_is_reported_not_held_as_a_refusal():
    kube = FakeKube()
    created(kube)
    del kube.objects[JOBSETS.path("default", "tiny")]["metadata"]["labels"][names.LABEL_JOB]
    patch = kube.patch

    async def webhook(resource, namespace, name, body, sub=None):  # a webhook that refuses JobSet edits
        if resource == JOBSETS:
            raise ApiError(403, "admission webhook denied the request: " + "x" * 5_000, "PATCH")
        return await patch(resource, namespace, name, body, sub)

    kube.patch = webhook  # type: ignore[method-assign]
    outcome, notices = run_reconcile(kube, kube.job(), kube.jobset())
    condition = job_status(kube).condition(drift.CONDITION)
    assert (condition.status, condition.reason) == (
        "False",
        "Edited",
    ) and "the API refused the restore" in condition.message
    assert len(condition.message) < 400 and [n.reason for n in notices] == ["ChildEdited"]
    assert job_status(kube).condition("Reconciled") is None  # not a refusal of the job's: it runs on


def test_a_config_maps_labels_are_put_back_and_a_deleted_one_made_again():
    async def go() -> None:
        kube = FakeKube()
        manager, _, notices = manager_for(kube)
        jobs = {("default", "tiny"): [kube.add_job(tiny_job())]}
        manager.add(("default", "tiny"), "job")
        await drain(manager, jobs, {})
        jobs = {("default", "tiny"): [kube.job()]}
        jobsets = {("default", "tiny"): [kube.jobset()]}
        name = children.config_map_of(kube.jobset())
        path = CONFIGMAPS.path("default", name)
        data = copy.deepcopy(kube.objects[path]["data"])
        manager.config_map_seen(copy.deepcopy(kube.objects[path]))  # as made (listed, created): nothing queued
        assert len(manager.queue) == 0
        del kube.objects[path]["metadata"]["labels"][names.LABEL_JOB]
        manager.config_map_seen(copy.deepcopy(kube.objects[path]), deleted=True)  # left the selector
        kube.calls.clear()
        assert await drain(manager, jobs, jobsets) == ["followed"]
        assert [c for c in kube.calls if "configmaps" in c[1]] == [("PATCH", path)]
        assert kube.objects[path]["metadata"]["labels"][names.LABEL_JOB] == "tiny"
        assert manager.config_map_edits == {}
        gone = copy.deepcopy(kube.objects[path])
        del kube.objects[path]
        manager.config_map_seen(gone, deleted=True)
        jobs = {("default", "tiny"): [kube.job()]}
        assert await drain(manager, jobs, jobsets) == ["followed"]
        assert kube.objects[path]["data"] == data and kube.objects[path]["immutable"] is True
        assert [n.reason for n in notices].count("ChildEdited") == 2
        status = job_status(kube)
        assert status.children.edits == 2 and "(deleted: made again)" in status.condition(drift.CONDITION).message
        manager.config_map_seen({**gone, "metadata": {**gone["metadata"], "name": "tiny-config-older"}}, deleted=True)
        assert len(manager.queue) == 0  # an earlier config's: no pod mounts it
        manager._drop(("default", "tiny"))

    asyncio.run(go())


def test_a_deleted_config_map_the_spec_no_longer_renders_is_reported_lost():
    kube = FakeKube()
    created(kube)
    js = kube.jobset()
    name = children.config_map_of(js)
    del kube.objects[CONFIGMAPS.path("default", name)]
    job = kube.objects[JOBS.path("default", "tiny")]
    job["spec"]["training"]["steps"] = 20  # a refused edit: the config it renders has another name
    kube.calls.clear()
    notices: list = []
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: notices.append(n), clock=lambda: NOW)
    asyncio.run(reconcile.reconcile(means, kube.job(), reconcile.Seen(js, config_map=(name, drift.DELETED))))
    assert not [c for c in kube.calls if c[0] == "POST"]
    condition = job_status(kube).condition(drift.CONDITION)
    assert (condition.status, condition.reason) == ("False", "ConfigMapLost") and name in condition.message

"""The in-memory API server (local/memory_api.py): what the controller relies on of a real one."""

import asyncio

import pytest

from tpu_operator.controller.kube import CONFIGMAPS, JOBS, JOBSETS, PODS, ApiError
from tpu_operator.local.memory_api import MemoryApi, selects


def _run(coro):
    return asyncio.run(coro)


def _watched(api, resource):
    seen = []
    api.watch(resource, lambda kind, obj: seen.append((kind, obj["metadata"]["name"])))
    return seen


def test_generation_moves_with_the_spec_only_and_status_is_a_subresource():
    api = MemoryApi()
    job = _run(api.create(JOBS, "ns", {"metadata": {"name": "j"}, "spec": {"steps": 1}, "status": {"phase": "X"}}))
    assert job["metadata"]["generation"] == 1 and job["metadata"]["uid"] and job["metadata"]["creationTimestamp"]
    rv = job["metadata"]["resourceVersion"]
    # Labels and a status in a patch of the object: the labels change, the status does not, nor the generation.
    same = _run(api.patch(JOBS, "ns", "j", {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "Y"}}))
    assert same["metadata"]["generation"] == 1 and same["metadata"]["labels"] == {"a": "b"}
    assert same["status"] == {"phase": "X"} and same["metadata"]["resourceVersion"] != rv
    edited = _run(api.patch(JOBS, "ns", "j", {"spec": {"steps": 2}}))
    assert edited["metadata"]["generation"] == 2
    # /status changes only the status, and the generation stays.
    written = _run(api.patch(JOBS, "ns", "j", {"status": {"phase": "Running"}, "spec": {"steps": 9}}, sub="status"))
    assert written["status"] == {"phase": "Running"} and written["spec"] == {"steps": 2}
    assert written["metadata"]["generation"] == 2
    # A stale resourceVersion is a conflict; None removes a field (merge patch).
    with pytest.raises(ApiError) as exc:
        _run(api.patch(JOBS, "ns", "j", {"metadata": {"resourceVersion": rv}, "status": {}}, sub="status"))
    assert exc.value.status == 409
    cleared = _run(api.patch(JOBS, "ns", "j", {"status": {"phase": None}}, sub="status"))
    assert cleared["status"] == {}
    assert "generation" not in _run(api.create(CONFIGMAPS, "ns", {"metadata": {"name": "c"}, "data": {}}))["metadata"]


def test_create_refuses_a_taken_name_and_a_dry_run_stores_and_tells_nothing():
    api = MemoryApi()
    seen = _watched(api, JOBSETS)
    answer = _run(api.create(JOBSETS, "ns", {"metadata": {"name": "js"}, "spec": {}}, dry_run=True))
    assert answer["metadata"]["name"] == "js" and api.objects == {} and seen == []
    _run(api.create(JOBSETS, "ns", {"metadata": {"name": "js"}, "spec": {}}))
    for dry_run in (True, False):
        with pytest.raises(ApiError) as exc:
            _run(api.create(JOBSETS, "ns", {"metadata": {"name": "js"}, "spec": {}}, dry_run=dry_run))
        assert exc.value.status == 409
    assert seen == [("ADDED", "js")]
    with pytest.raises(ApiError) as exc:
        _run(api.get(JOBSETS, "ns", "nope"))
    assert exc.value.status == 404
    with pytest.raises(ApiError) as exc:
        _run(api.patch(JOBSETS, "ns", "nope", {"spec": {}}))
    assert exc.value.status == 404


def _owned(name, owner, **more):
    ref = {"kind": "X", "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}
    return {"metadata": {"name": name, "ownerReferences": [ref]}, **more}


def test_deleting_the_job_deletes_its_children_and_theirs():
    api = MemoryApi()
    seen = _watched(api, PODS)
    job = _run(api.create(JOBS, "ns", {"metadata": {"name": "j"}, "spec": {}}))
    jobset = _run(api.create(JOBSETS, "ns", _owned("js", job, spec={})))
    _run(api.create(CONFIGMAPS, "ns", _owned("cm", job, data={})))
    _run(api.create(PODS, "ns", _owned("p", jobset, spec={})))
    _run(api.create(CONFIGMAPS, "ns", {"metadata": {"name": "mine"}, "data": {}}))
    _run(api.delete(JOBS, "ns", "j", {}))
    assert list(api.objects) == [CONFIGMAPS.path("ns", "mine")]
    assert seen == [("ADDED", "p"), ("DELETED", "p")]


def test_foreground_deletion_keeps_the_owner_until_its_running_pods_are_gone():
    """A pod on a node is only marked for deletion (its kubelet stops it); the JobSet deleted in the
    foreground waits for it, as a restart's replacement waits for the old pods to save."""
    api = MemoryApi()
    jobsets = _watched(api, JOBSETS)
    jobset = _run(api.create(JOBSETS, "ns", {"metadata": {"name": "js", "labels": {"a": "1"}}, "spec": {}}))
    pod = _owned("p", jobset, spec={"nodeName": "here", "terminationGracePeriodSeconds": 30})
    _run(api.create(PODS, "ns", pod))
    with pytest.raises(ApiError) as exc:
        _run(api.delete(JOBSETS, "ns", "js", {"preconditions": {"uid": "another"}}))
    assert exc.value.status == 409
    _run(api.delete(JOBSETS, "ns", "js", {"propagationPolicy": "Foreground"}))
    marked = _run(api.get(PODS, "ns", "p"))["metadata"]
    assert marked["deletionTimestamp"] and marked["deletionGracePeriodSeconds"] == 30
    assert _run(api.get(JOBSETS, "ns", "js"))["metadata"]["deletionTimestamp"]
    _run(api.delete(PODS, "ns", "p", {"gracePeriodSeconds": 0}))  # the kubelet's final delete
    assert api.objects == {} and jobsets[-1] == ("DELETED", "js")


def test_lists_and_deletecollection_select_by_label():
    api = MemoryApi()
    for name, labels in (("a", {"x": "1", "y": "2"}), ("b", {"x": "1"}), ("c", {})):
        _run(api.create(PODS, "ns", {"metadata": {"name": name, "labels": labels}, "spec": {}}))
    _run(api.create(PODS, "other", {"metadata": {"name": "d", "labels": {"x": "1"}}, "spec": {}}))

    def names(selector):
        return [p["metadata"]["name"] for p in _run(api.list(PODS, "ns", selector))]

    assert names("x=1") == ["a", "b"] and names("x=1,y=2") == ["a"] and names("x,!y") == ["b"]
    assert names("x!=1") == ["c"] and names("") == ["a", "b", "c"]
    _run(api.delete_all(PODS, "ns", "x==1", {"gracePeriodSeconds": 0}))
    assert names("") == ["c"] and _run(api.list(PODS, "other", "x=1"))
    assert selects("a=1", {"a": "1"}) and not selects("a", {})


def test_watchers_hear_every_change_until_they_stop():
    api = MemoryApi()
    seen = []
    stop = api.watch(JOBS, lambda kind, obj: seen.append((kind, obj.get("status"))))
    _run(api.create(JOBS, "ns", {"metadata": {"name": "j"}, "spec": {}}))
    _run(api.patch(JOBS, "ns", "j", {"status": {"phase": "Running"}}, sub="status"))
    _run(api.delete(JOBS, "ns", "j", {}))
    stop()
    _run(api.create(JOBS, "ns", {"metadata": {"name": "j"}, "spec": {}}))
    assert seen == [("ADDED", None), ("MODIFIED", {"phase": "Running"}), ("DELETED", {"phase": "Running"})]


def test_a_secret_is_stored_as_base64_data():
    api = MemoryApi()
    secret = _run(api.create(CONFIGMAPS, "ns", {"metadata": {"name": "s"}, "stringData": {"token": "abc"}}))
    assert secret["data"] == {"token": "YWJj"} and "stringData" not in secret

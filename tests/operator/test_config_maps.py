"""The ConfigMap the pods run is the spec's (children.py, rendering/manifests.py): named by a hash of what it
holds, immutable, adopted only with those contents, replaced otherwise. Over the in-memory API."""

from __future__ import annotations

import copy

from tests.conftest import operator_job as tiny_job
from tests.fakes import FakeKube, job_status, run_reconcile
from tpu_operator.api.validation import parse_job
from tpu_operator.controller.kube import CONFIGMAPS
from tpu_operator.rendering.manifests import render


def rendered(kube: FakeKube) -> dict:
    return render(parse_job({k: kube.job()[k] for k in ("apiVersion", "kind", "metadata", "spec")}))[0]


def config_maps(kube: FakeKube) -> dict[str, dict]:
    return {
        o["metadata"]["name"]: o
        for path, o in kube.objects.items()
        if path.startswith(CONFIGMAPS.path("default") + "/")
    }


def test_a_config_map_of_ours_with_other_contents_is_replaced_not_trusted():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    wanted = rendered(kube)
    forged = copy.deepcopy(wanted)
    forged["data"]["config.json"] = '{"training": {"steps": 1}}'
    forged["immutable"] = False
    kube.objects[CONFIGMAPS.path("default", wanted["metadata"]["name"])] = forged | {
        "metadata": forged["metadata"] | {"uid": "forged-uid", "resourceVersion": "1"}
    }
    outcome, notices = run_reconcile(kube, obj)
    assert outcome.result == "created" and [n.reason for n in notices] == ["Created"]
    name = wanted["metadata"]["name"]
    assert ("DELETE", CONFIGMAPS.path("default", name)) in kube.calls
    (only,) = config_maps(kube).values()
    assert only["data"] == wanted["data"] and only["immutable"] is True and only["metadata"]["uid"] != "forged-uid"
    assert name in notices[0].message  # "created ConfigMap <the hashed name> and JobSet tiny"


def test_a_config_map_of_ours_with_its_contents_is_adopted_as_it_is():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    wanted = rendered(kube)
    kube.objects[CONFIGMAPS.path("default", wanted["metadata"]["name"])] = copy.deepcopy(wanted) | {
        "metadata": wanted["metadata"] | {"uid": "ours", "resourceVersion": "1"}
    }
    outcome, _ = run_reconcile(kube, obj)
    assert outcome.result == "created" and not [c for c in kube.calls if c[0] == "DELETE"]
    assert config_maps(kube)[wanted["metadata"]["name"]]["metadata"]["uid"] == "ours"


def test_someone_elses_config_map_under_the_name_is_a_conflict_left_alone():
    kube = FakeKube()
    obj = kube.add_job(tiny_job())
    wanted = rendered(kube)
    theirs = copy.deepcopy(wanted)
    theirs["metadata"] = {"name": wanted["metadata"]["name"], "namespace": "default", "uid": "theirs"}
    kube.objects[CONFIGMAPS.path("default", wanted["metadata"]["name"])] = theirs
    outcome, _ = run_reconcile(kube, obj)
    assert outcome.result == "conflict" and "not owned" in job_status(kube).message
    assert config_maps(kube)[wanted["metadata"]["name"]]["metadata"]["uid"] == "theirs"

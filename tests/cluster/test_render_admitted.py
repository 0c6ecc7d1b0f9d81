"""What the operator renders, as the real API server and JobSet's own webhooks admit it: every example's and
every capacity mode's JobSet (and the ConfigMap beside it) is created with a server-side dry run, and comes
back with every field we set: nothing pruned by the JobSet CRD's schema, nothing refused or rewritten by
JobSet's validating and defaulting webhooks (exclusive placement, failure policy, `maxRestarts: 0`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.cluster.kube import Cluster
from tests.conftest import EXAMPLES, TEST_IMAGE, example
from tpu_operator.api.models import TPUTrainingJob
from tpu_operator.rendering.manifests import render

pytestmark = pytest.mark.cluster
CAPACITY = {
    "onDemand": {},
    "spot": {},
    "reservation": {"reservationName": "tpu7x-res"},
    "flexStart": {"maxRunDuration": "24h"},
}


def contained(sent: Any, got: Any, where: str) -> None:
    if isinstance(sent, dict):
        assert isinstance(got, dict), f"{where}: sent a mapping, stored {got!r}"
        for key, value in sent.items():
            assert key in got, f"{where}.{key} was pruned or dropped"
            contained(value, got[key], f"{where}.{key}")
    elif isinstance(sent, list):
        assert isinstance(got, list) and len(got) == len(sent), f"{where}: sent {sent!r}, stored {got!r}"
        for i, (a, b) in enumerate(zip(sent, got)):
            contained(a, b, f"{where}[{i}]")
    else:
        assert sent == got or str(sent) == str(got), f"{where}: sent {sent!r}, stored {got!r}"


def admitted(cluster: Cluster, ns: str, doc: dict[str, Any]) -> dict[str, Any]:
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": ns}}
    doc["metadata"].pop("ownerReferences", None)  # the owner does not exist in a dry run
    result = cluster.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    assert result.returncode == 0, f"{doc['kind']} {doc['metadata']['name']} refused:\n{result.stderr}"
    return json.loads(result.stdout)


def jobs() -> list[tuple[str, dict[str, Any]]]:
    out = [(p.name, example(p.name)) for p in sorted(EXAMPLES.glob("*.yaml"))]
    for mode, extra in CAPACITY.items():
        doc = example("quickstart.yaml")
        doc["metadata"]["name"] = f"capacity-{mode.lower()}"
        doc["spec"]["tpu"].update({"capacity": mode, **extra})
        if mode == "flexStart":
            doc["spec"]["queueName"] = "tpu-queue"
        out.append((f"capacity-{mode}", doc))
    return out


@pytest.mark.parametrize("name,doc", jobs(), ids=[n for n, _ in jobs()])
def test_rendered_jobset_is_admitted_by_jobset_as_rendered(cluster: Cluster, name: str, doc: dict[str, Any]):
    ns = cluster.namespace("render")
    job = TPUTrainingJob.model_validate(
        {**doc, "metadata": {**doc["metadata"], "namespace": ns, "uid": "00000000-0000-4000-8000-000000000001"}}
    )
    for manifest in render(job, default_image=TEST_IMAGE):  # the examples name no image
        stored = admitted(cluster, ns, manifest)
        sent = {k: v for k, v in manifest.items() if k != "metadata"}
        contained(sent, {k: v for k, v in stored.items() if k != "metadata"}, manifest["kind"])
        if manifest["kind"] == "JobSet":
            assert stored["spec"]["failurePolicy"]["maxRestarts"] == 0
            annotations = stored["metadata"]["annotations"]
            assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"

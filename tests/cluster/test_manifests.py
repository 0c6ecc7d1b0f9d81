"""JobSet's and Kueue's own manifests, from the pinned module versions, as the launcher installs them: every
webhook and CRD conversion calls a local process over loopback with our CA, the kustomize patches are
applied, and Kueue registers only what its configuration enables. No cluster needed, only the build."""

from __future__ import annotations

import base64

import pytest

from tests.cluster import manifests
from tests.cluster.build import build, unavailable
from tests.prerequisites import skip_or_fail

pytestmark = pytest.mark.cluster
CA = b"-----BEGIN CERTIFICATE-----\ntest\n-----END CERTIFICATE-----\n"


@pytest.fixture(scope="module")
def components():
    skip_or_fail(unavailable(), "CLUSTER_REQUIRED")
    return build().manifests


def test_every_webhook_calls_its_local_process_with_our_ca(components):
    configs = manifests.webhook_configs(components / "jobset", "jobset-", 9443, CA) + manifests.webhook_configs(
        components / "kueue", "kueue-", 9444, CA, manifests.kueue_kept
    )
    webhooks = [w for c in configs for w in c["webhooks"]]
    assert webhooks and all("service" not in w["clientConfig"] for w in webhooks)
    assert all(base64.b64decode(w["clientConfig"]["caBundle"]) == CA for w in webhooks)
    jobset = {w["name"]: w for c in configs if c["metadata"]["name"].startswith("jobset-") for w in c["webhooks"]}
    assert (
        jobset["mjobset.kb.io"]["clientConfig"]["url"]
        == "https://127.0.0.1:9443/mutate-jobset-x-k8s-io-v1alpha2-jobset"
    )
    # JobSet's kustomize patch: its pod webhooks see only JobSets' pods (failurePolicy Fail would block the rest).
    for name in ("mpod.kb.io", "vpod.kb.io"):
        assert jobset[name]["objectSelector"] == {
            "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
        }
    kueue = {w["name"] for c in configs if c["metadata"]["name"].startswith("kueue-") for w in c["webhooks"]}
    assert {"mjobset.kb.io", "vjobset.kb.io", "mworkload.kb.io", "vworkload.kb.io"} <= kueue
    assert not kueue & {"mpod.kb.io", "vpod.kb.io", "mjob.kb.io", "mdeployment.kb.io"}  # integrations not enabled


def test_crds_convert_through_their_local_webhook(components):
    crds = {c["metadata"]["name"]: c for c in manifests.crds(components / "kueue", 9444, CA)}
    converting = sorted(
        name for name, c in crds.items() if (c["spec"].get("conversion") or {}).get("strategy") == "Webhook"
    )
    assert converting == [
        "clusterqueues.kueue.x-k8s.io",
        "cohorts.kueue.x-k8s.io",
        "localqueues.kueue.x-k8s.io",
        "multikueueclusters.kueue.x-k8s.io",
        "workloads.kueue.x-k8s.io",
    ], converting
    config = crds["workloads.kueue.x-k8s.io"]["spec"]["conversion"]["webhook"]["clientConfig"]
    assert config["url"] == "https://127.0.0.1:9444/convert" and base64.b64decode(config["caBundle"]) == CA

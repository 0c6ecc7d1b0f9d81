"""`helm install` / `upgrade` / `uninstall` of the chart against the project's test API server (tests/kubeapi).

That server has no kubelet and no controllers, so the operator's Deployment never runs here: that
the operator installed this way reconciles a job is checked by the kind suite (tests/kind/).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kubeapi.harness import Server, kubectl, running_apiserver

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tpu-operator"
CRD_NAME = "tputrainingjobs.training.tpu-operator.dev"
NAMESPACE = "tpu-system"


@pytest.fixture
def server(tmp_path):
    # No CRD preloaded: helm installs the TPUTrainingJob CRD from the chart's crds/.
    with running_apiserver(tmp_path) as server:
        server.kubeconfig.chmod(0o600)  # helm warns about group/world-readable kubeconfigs
        yield server


@pytest.fixture
def helm_cli(helm, server, tmp_path):
    """`helm_cli(*args)` runs helm against `server`, with its own cache and config; fails unless it exits 0."""
    env = {**os.environ, "KUBECONFIG": str(server.kubeconfig), "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "helm-config"), "HELM_DATA_HOME": str(tmp_path / "helm-data")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60, env=env)
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    return run


def get(server: Server, path: str) -> dict | None:
    status, body = server.request("GET", path)
    assert status in (200, 404), (path, status, body)
    return body if status == 200 else None


def create_namespace(server: Server, name: str) -> None:
    status, body = server.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                                  "metadata": {"name": name}})
    assert status in (201, 409), body


def release_objects(server: Server, release: str) -> dict[str, dict | None]:
    name = f"{release}-tpu-operator"
    return {
        "ServiceAccount": get(server, f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}"),
        "ClusterRole": get(server, f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}"),
        "ClusterRoleBinding": get(server, f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}"),
        "Service": get(server, f"/api/v1/namespaces/{NAMESPACE}/services/{name}-metrics"),
        "Deployment": get(server, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"),
    }


def test_install_upgrade_uninstall(helm_cli, server):
    create_namespace(server, NAMESPACE)
    create_namespace(server, "team-a")
    helm_cli("install", "op", str(CHART), "-n", NAMESPACE)

    crd = get(server, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}")
    assert crd is not None and crd["spec"] == yaml.safe_load((CHART / "crds" / "tputrainingjob.yaml").read_text())["spec"]
    objects = release_objects(server, "op")
    assert all(objects.values()), {kind: bool(obj) for kind, obj in objects.items()}
    first_hash = objects["Deployment"]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert get(server, f"/api/v1/namespaces/{NAMESPACE}/secrets/sh.helm.release.v1.op.v1") is not None

    # The installed CRD serves jobs, and `kubectl get tpujobs` shows their MFU and step time.
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"]["namespace"] = "team-a"
    status, body = server.request("POST", "/apis/training.tpu-operator.dev/v1alpha1/namespaces/team-a/tputrainingjobs", job)
    assert status == 201, body
    header = kubectl(server, "get", "tpujobs", "-A", check=True).stdout.splitlines()[0]
    assert "MFU" in header and "STEP TIME" in header, header

    # Upgrade to namespace-scoped RBAC with a new default image: Roles appear, the pod's config hash moves.
    helm_cli("upgrade", "op", str(CHART), "-n", NAMESPACE,
         "--set", "rbac.namespaced=true", "--set", "operator.watchNamespaces={team-a}",
         "--set", "operator.defaultImage=example.com/workload:2")
    deployment = release_objects(server, "op")["Deployment"]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != first_hash
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--default-image=example.com/workload:2" in args
    assert get(server, "/apis/rbac.authorization.k8s.io/v1/namespaces/team-a/roles/op-tpu-operator") is not None
    assert get(server, "/apis/rbac.authorization.k8s.io/v1/namespaces/team-a/rolebindings/op-tpu-operator") is not None
    cluster_role = release_objects(server, "op")["ClusterRole"]
    assert [rule["resources"] for rule in cluster_role["rules"]] == [["customresourcedefinitions"]]
    assert "deployed" in helm_cli("status", "op", "-n", NAMESPACE).stdout

    helm_cli("uninstall", "op", "-n", NAMESPACE)
    assert not any(release_objects(server, "op").values())
    assert get(server, "/apis/rbac.authorization.k8s.io/v1/namespaces/team-a/roles/op-tpu-operator") is None
    assert get(server, f"/api/v1/namespaces/{NAMESPACE}/secrets/sh.helm.release.v1.op.v1") is None
    # Helm never deletes what it installed from crds/: the jobs survive an uninstall.
    assert get(server, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}") is not None
    assert get(server, "/apis/training.tpu-operator.dev/v1alpha1/namespaces/team-a/tputrainingjobs/"
                       + job["metadata"]["name"]) is not None


def test_install_with_create_namespace(helm_cli, server):
    # The README's command. helm validates the manifests, and the Namespace it creates, against the
    # server's /openapi/v2, which it reads as protobuf.
    helm_cli("install", "op", str(CHART), "--namespace", NAMESPACE, "--create-namespace")
    assert get(server, f"/api/v1/namespaces/{NAMESPACE}") is not None
    assert all(release_objects(server, "op").values())
    assert [r["status"] for r in server.requests_log()
            if r["path"] == "/openapi/v2" and r["userAgent"].startswith("helm/")][:1] == [200]

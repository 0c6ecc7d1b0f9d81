"""What the cluster suite's tests use to talk to the cluster: the pinned kubectl, the `kubernetes` client,
polling with a useful failure message, and the API server's audit log (which requests were made, by
whom, with which answer)."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from tests.cluster.build import kubectl as kubectl_path

JOBS = ("training.tpu-operator.dev", "v1alpha1", "tputrainingjobs")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")


@dataclass
class Cluster:
    kubeconfig: Path
    logs: Path | None = None  # the local cluster's component logs; None for a cluster a kubeconfig names
    audit_log: Path | None = None

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(str(self.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.batch = client.BatchV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.cache_dir = self.kubeconfig.parent / "kubectl-cache"
        self.created: list[str] = []  # namespaces made by the test running now (conftest deletes them after it)

    @property
    def local(self) -> bool:
        return self.logs is not None

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        command = [kubectl_path(), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.cache_dir}", *args]
        result = subprocess.run(command, capture_output=True, text=True, input=input, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def apply(
        self, *docs: dict[str, Any], namespace: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        extra = [f"--namespace={namespace}"] if namespace else []
        return self.kubectl("apply", *extra, "-f", "-", input=yaml.safe_dump_all(docs), check=check)

    def namespace(self, prefix: str) -> str:
        """A new namespace for the test running now; deleted when it ends, with everything in it (the node
        pools are small: a finished test's pods must not hold them)."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.core.create_namespace({"metadata": {"name": name}})
        self.created.append(name)
        return name

    def delete_namespaces(self) -> None:
        for name in self.created:
            self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        self.created.clear()

    def token_kubeconfig(self, namespace: str, service_account: str, path: Path) -> Path:
        """A kubeconfig for `service_account`: this one's server and CA (inlined: it may be read where that
        file is not, in an image), and a TokenRequest token."""
        token = self.kubectl("create", "token", service_account, "-n", namespace, "--duration=12h").stdout.strip()
        admin = yaml.safe_load(self.kubeconfig.read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        server = dict(next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"])
        if "certificate-authority" in server:
            ca = Path(server.pop("certificate-authority")).read_bytes()
            server["certificate-authority-data"] = base64.b64encode(ca).decode()
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "sa",
                    "clusters": [{"name": "c", "cluster": server}],
                    "users": [{"name": service_account, "user": {"token": token}}],
                    "contexts": [{"name": "sa", "context": {"cluster": "c", "user": service_account}}],
                }
            )
        )
        path.chmod(0o600)
        return path

    # --- objects -----------------------------------------------------------------------------------------

    def get(self, resource: tuple[str, str, str], namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(*resource[:2], namespace, resource[2], name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def items(self, resource: tuple[str, str, str], namespace: str, selector: str = "") -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(
            *resource[:2], namespace, resource[2], label_selector=selector
        )["items"]

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(JOBS, namespace, name)

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        return (self.job(namespace, name) or {}).get("status") or {}

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        return [
            self.api.sanitize_for_serialization(p)
            for p in self.core.list_namespaced_pod(namespace, label_selector=selector).items
        ]

    def events(self, namespace: str, name: str, kind: str = "TPUTrainingJob") -> list[dict[str, Any]]:
        items = self.api.sanitize_for_serialization(self.core.list_namespaced_event(namespace).items)
        return [e for e in items if e["involvedObject"].get("name") == name and e["involvedObject"].get("kind") == kind]

    # --- the audit log -------------------------------------------------------------------------------------

    def audit(self, since: float = 0.0) -> Iterator[dict[str, Any]]:
        """Audit events (one per request, stage ResponseComplete) received at or after `since` (epoch s);
        `objectRef` is {} for a request that names no object (discovery), `resource` is "pods/status" for a
        subresource."""
        if self.audit_log is None:
            return
        for path in audit_files(self.audit_log):
            with open(path, errors="replace") as lines:
                for line in lines:
                    event = json.loads(line)
                    if event.get("stage") != "ResponseComplete":
                        continue
                    if since and _epoch(event["requestReceivedTimestamp"]) < since:
                        continue
                    ref = event.setdefault("objectRef", {})
                    event["resource"] = ref.get("resource", "") + (
                        f"/{ref['subresource']}" if ref.get("subresource") else ""
                    )
                    yield event


def audit_files(log: Path) -> list[Path]:
    """The audit log's files, oldest first. The launcher turns rotation off (kube-apiserver rotates at 100 MB
    by default, and a whole cluster suite writes more: a request counted after rotation was missing from
    audit.log); a cluster started by an older launcher may still have rotated ones (audit-<time>.log)."""
    return [*sorted(log.parent.glob(f"{log.stem}-*{log.suffix}")), log]


def authorization(event: dict[str, Any]) -> str | None:
    """The authorizer's decision on an audited request ("allow" or "forbid"), from the audit annotations.
    A 403 can also come from admission (e.g. a namespace being deleted): only "forbid" is RBAC's."""
    return (event.get("annotations") or {}).get("authorization.k8s.io/decision")


def _epoch(stamp: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.5,
    diagnose: Callable[[], str] | None = None,
) -> Any:
    """Poll `condition()` until it returns something truthy; return it, or fail naming `what` with the
    last result and `diagnose()`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            extra = f"\n{diagnose()}" if diagnose else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last result: {result!r}{extra}")
        time.sleep(interval)


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})

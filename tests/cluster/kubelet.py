"""A process kubelet: it registers a few nodes with the real API server, heartbeats them, and runs the pods
the real scheduler binds to them as local processes (the real trainer, the real pre-flight compile).

    python -m tests.cluster.kubelet --kubeconfig K --workdir DIR --nodes tpu7x-2x2x2-0,tpu7x-2x2x2-1,cpu-0

The pods themselves are run by the product's process kubelet (tpu_operator/local/kubelet.py: the same one
`tpujob run --local` runs its pods with), over the real API server here; this module adds what a kubelet
does for its nodes, no more:
- registers its nodes (tests/cluster/nodes.py: labels, taints, capacity) and keeps them alive: their
  Lease in kube-node-lease every 10 s and their Ready condition every 40 s, so the node lifecycle
  controller never marks them NotReady;
- watches every pod and hands those bound to one of its nodes to the process kubelet, which reports the
  node's address as the pod's IP (host networking, as TPU pods have) and gives a pod that asks for
  `google.com/tpu` its node's chips as CPU devices.
Logs are under DIR/<namespace>/<pod>/log.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.cluster.nodes import cluster_nodes
from tpu_operator.local.kubelet import ACCELERATOR, Kubelet

LEASE_S, STATUS_S, LEASE_DURATION_S = 10, 40, 40
log = logging.getLogger("process-kubelet")


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProcessKubelet:
    def __init__(self, kubeconfig: str, workdir: Path, node_names: list[str], kubelet_version: str):
        self.api = config.new_client_from_config(kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.leases = client.CoordinationV1Api(self.api)
        self.workdir = workdir
        self.nodes = {n.name: n for n in cluster_nodes() if n.name in node_names}
        missing = set(node_names) - set(self.nodes)
        if missing:
            raise SystemExit(f"unknown nodes: {sorted(missing)}")
        self.kubelet_version = kubelet_version
        self.stop = threading.Event()
        self.pods = Kubelet(
            ApiServerHost(self.core),
            workdir,
            pod_ip=lambda pod: self.nodes[pod["spec"]["nodeName"]].ip,
            accelerator=lambda pod: self.nodes[pod["spec"]["nodeName"]].labels.get(ACCELERATOR),
        )

    # --- nodes ---------------------------------------------------------------------------------------

    def register(self) -> None:
        for node in self.nodes.values():
            manifest = node.manifest(self.kubelet_version)
            manifest["status"]["conditions"] = self._conditions()
            try:
                self.core.create_node(manifest)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.core.patch_node(
                    node.name, {"metadata": {"labels": manifest["metadata"]["labels"]}, "spec": manifest["spec"]}
                )
            self._post_status(node.name)
            log.info("registered node %s", node.name)

    def _conditions(self) -> list[dict[str, Any]]:
        now = _now()
        healthy = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return [
            {
                "type": t,
                "status": s,
                "reason": r,
                "message": "process kubelet",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, s, r in healthy
        ]

    def _post_status(self, name: str) -> None:
        node = self.nodes[name].manifest(self.kubelet_version)
        self.core.patch_node_status(name, {"status": {**node["status"], "conditions": self._conditions()}})

    def _renew_lease(self, name: str) -> None:
        now = dt.datetime.now(dt.UTC)
        body = {
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            },
        }
        try:
            self.leases.patch_namespaced_lease(name, "kube-node-lease", {"spec": body["spec"]})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.leases.create_namespaced_lease("kube-node-lease", body)

    def heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self.stop.wait(LEASE_S):
            for name in self.nodes:
                try:
                    self._renew_lease(name)
                    if time.monotonic() - last_status >= STATUS_S:
                        self._post_status(name)
                except Exception:  # noqa: BLE001 - the API server restarting: try again next beat
                    log.exception("heartbeat of %s failed", name)
            if time.monotonic() - last_status >= STATUS_S:
                last_status = time.monotonic()

    # --- pods --------------------------------------------------------------------------------------------

    def watch_pods(self) -> None:
        while not self.stop.is_set():
            try:
                for event in watch.Watch().stream(self.core.list_pod_for_all_namespaces, timeout_seconds=60):
                    pod = self.api.sanitize_for_serialization(event["object"])
                    if (pod.get("spec") or {}).get("nodeName") in self.nodes:
                        self.pods.sync(event["type"], pod)
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a dropped watch: watch again
                log.exception("pod watch ended")
                self.stop.wait(1)

    def shutdown(self, *_: Any) -> None:
        self.stop.set()
        self.pods.shutdown(0.0)


class ApiServerHost:
    """The process kubelet's API (tpu_operator.local.kubelet.PodHost) over the real API server."""

    def __init__(self, core: client.CoreV1Api):
        self.core = core

    def report(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
            )
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile has nothing to report on
                raise

    def remove(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(
                meta["name"],
                meta["namespace"],
                grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions={"uid": meta["uid"]}),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.exception("final delete of %s failed", meta["name"])

    def volumes(self, pod: dict[str, Any]) -> dict[str, dict[str, str]]:
        found = {}
        for volume in pod["spec"].get("volumes") or []:
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                found[name] = self.core.read_namespaced_config_map(name, pod["metadata"]["namespace"]).data or {}
            elif "secret" in volume:  # a JobSet made before the control key: its job's Secret
                name = volume["secret"]["secretName"]
                data = self.core.read_namespaced_secret(name, pod["metadata"]["namespace"]).data or {}
                found[name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
        return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--nodes", required=True, help="comma-separated node names (tests/cluster/nodes.py)")
    parser.add_argument("--kubelet-version", default="v0.0.0")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    kubelet = ProcessKubelet(args.kubeconfig, args.workdir, args.nodes.split(","), args.kubelet_version)
    signal.signal(signal.SIGTERM, lambda *_: (kubelet.shutdown(), sys.exit(0)))
    kubelet.register()
    threading.Thread(target=kubelet.heartbeat, daemon=True, name="heartbeat").start()
    kubelet.watch_pods()


if __name__ == "__main__":
    main()

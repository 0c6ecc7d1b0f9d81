"""A process kubelet: it registers a few nodes with the real API server, heartbeats them, and runs the pods
the real scheduler binds to them as local processes (the real trainer, the real pre-flight compile).

    python -m tests.cluster.kubelet --kubeconfig K --workdir DIR --nodes tpu7x-2x2x2-0,tpu7x-2x2x2-1,cpu-0

There is no container runtime here, so it does what a kubelet does with the parts that matter to the
operator, no more:
- registers its nodes (tests/cluster/nodes.py: labels, taints, capacity) and keeps them alive: their
  Lease in kube-node-lease every 10 s and their Ready condition every 40 s, so the node lifecycle
  controller never marks them NotReady;
- for each pod bound to one of its nodes: the container's command, args and env (`fieldRef`s resolved from
  the pod, ConfigMap volumes as directories; operator/local/pods.py) as one process in its own session,
  with `python` the project's interpreter. A pod that asks for `google.com/tpu` gets the host's chips as
  CPU devices (4 v7x chips: 8 devices), as `tpujob run --local` does; every pod of a JobSet on this kubelet
  reaches the others on loopback: their DNS names (`<jobset>-<job>-<i>-<j>.<subdomain>`) are rewritten to
  127.0.0.1 and the coordinator's port to one port per JobSet (all "hosts" share this machine);
- reports what a kubelet reports: Running and Ready with podIP/hostIP (the node's address: host
  networking, as TPU pods have) when the process starts; when it ends, the container's `terminated` state
  with its exit code and termination message (the file at terminationMessagePath, or with
  `FallbackToLogsOnError` and a non-zero exit, the log's last 2 KiB), and phase Succeeded or Failed;
- a pod being deleted has its process stopped (SIGTERM, SIGKILL after the grace period), then the object
  is deleted with grace 0, as the kubelet's final delete does.
Logs are under DIR/<namespace>/<pod>/log.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.cluster.nodes import TPU, cluster_nodes
from tpu_operator.api import catalogue
from tpu_operator.local.pods import free_port, job_process

LOG_TAIL = 2048  # bytes of the log a kubelet keeps as the message with FallbackToLogsOnError
LEASE_S, STATUS_S, LEASE_DURATION_S = 10, 40, 40
COORDINATOR_ENV = ("TPUJOB_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
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
        self.processes: dict[str, subprocess.Popen] = {}  # pod uid -> its process
        self.stopping: set[str] = set()  # pod uids being stopped for a deletion
        self.coordinator_ports: dict[str, int] = {}  # JobSet uid (from the pod's owner chain: its name) -> port
        self.lock = threading.Lock()
        self.stop = threading.Event()

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
                        self.sync(event["type"], pod)
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a dropped watch: watch again
                log.exception("pod watch ended")
                self.stop.wait(1)

    def sync(self, kind: str, pod: dict[str, Any]) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        if kind == "DELETED":
            self._kill(uid, 0)
            return
        if meta.get("deletionTimestamp"):
            with self.lock:
                if uid in self.stopping:
                    return
                self.stopping.add(uid)
            threading.Thread(target=self._delete, args=(pod,), daemon=True).start()
            return
        if status.get("phase") in ("Succeeded", "Failed"):
            return
        with self.lock:
            if uid in self.processes:
                return
            self.processes[uid] = None  # type: ignore[assignment] - claimed; the thread starts it
        threading.Thread(target=self._run, args=(pod,), daemon=True, name=f"pod-{meta['name']}").start()

    def _pod_dir(self, pod: dict[str, Any]) -> Path:
        return self.workdir / pod["metadata"]["namespace"] / f"{pod['metadata']['name']}-{pod['metadata']['uid'][:8]}"

    def _config_maps(self, pod: dict[str, Any]) -> dict[str, dict[str, str]]:
        found = {}
        for volume in pod["spec"].get("volumes") or []:
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                found[name] = self.core.read_namespaced_config_map(name, pod["metadata"]["namespace"]).data or {}
            elif "secret" in volume:  # the job's control credential (controller/control.py)
                name = volume["secret"]["secretName"]
                data = self.core.read_namespaced_secret(name, pod["metadata"]["namespace"]).data or {}
                found[name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
        return found

    def _process(self, pod: dict[str, Any]) -> tuple[list[str], dict[str, str], Path]:
        meta, spec = pod["metadata"], pod["spec"]
        pod_meta = {**meta, "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "TPUJOB_"))}
        argv, env, message = job_process(spec, self._config_maps(pod), self._pod_dir(pod), base, pod_meta)
        env["TPUJOB_TERMINATION_LOG"] = str(message)  # the trainer's /dev/termination-log
        chips = int(((spec["containers"][0].get("resources") or {}).get("limits") or {}).get(TPU, 0))
        if chips:  # a TPU host: its chips become CPU devices of this process
            node = self.nodes[spec["nodeName"]]
            devices = chips * catalogue.generation(node.labels["cloud.google.com/gke-tpu-accelerator"]).devices_per_chip
            env.update({"TPUJOB_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "TPUJOB_CPU_DEVICES": str(devices)})
            env.pop("XLA_FLAGS", None)  # TPU compiler flags abort the CPU backend
        jobset = (meta.get("labels") or {}).get(JOBSET_NAME)
        if jobset:  # the pods' DNS names (<jobset>-<job>-<i>-<j>[.<subdomain>]) in the container's env values
            subdomain = spec.get("subdomain") or jobset
            hosts = re.compile(
                rf"(?<![\w./-]){re.escape(jobset)}-[a-z0-9-]+-\d+-\d+(\.{re.escape(subdomain)})?(?![\w-])"
            )
            key = f"{meta['namespace']}/{jobset}/{(meta.get('labels') or {}).get('jobset.sigs.k8s.io/jobset-uid', '')}"
            with self.lock:
                port = self.coordinator_ports.setdefault(key, free_port())
            for name in {var["name"] for var in spec["containers"][0].get("env") or []} & set(env):
                value = hosts.sub("127.0.0.1", env[name])
                if name in COORDINATOR_ENV and value.startswith("127.0.0.1:"):
                    value = f"127.0.0.1:{port}"
                env[name] = value
        return argv, env, message

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
            )
        except ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile has nothing to report on
                raise

    def _run(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        node_ip = self.nodes[spec["nodeName"]].ip
        started = _now()
        workdir = self._pod_dir(pod)
        logfile = workdir / "log"
        try:
            argv, env, message = self._process(pod)
            if not argv:
                raise ValueError(
                    "the container has no command: a process kubelet has no image to take an entrypoint from"
                )
            workdir.mkdir(parents=True, exist_ok=True)
            with open(logfile, "ab") as out:
                process = subprocess.Popen(
                    argv, env=env, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
        except Exception as exc:  # noqa: BLE001 - what a kubelet reports as a container it cannot create
            log.exception("cannot start %s", meta["name"])
            self._patch_status(
                pod,
                {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": container["name"],
                            "image": container.get("image", ""),
                            "imageID": "",
                            "ready": False,
                            "restartCount": 0,
                            "state": {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}},
                        }
                    ],
                },
            )
            return
        with self.lock:
            self.processes[meta["uid"]] = process
        log.info("started %s/%s: pid %d: %s", meta["namespace"], meta["name"], process.pid, " ".join(argv)[:300])
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": started}
            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        self._patch_status(
            pod,
            {
                "phase": "Running",
                "podIP": node_ip,
                "podIPs": [{"ip": node_ip}],
                "hostIP": node_ip,
                "hostIPs": [{"ip": node_ip}],
                "startTime": started,
                "conditions": conditions,
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "restartCount": 0,
                        "ready": True,
                        "started": True,
                        "state": {"running": {"startedAt": started}},
                    }
                ],
            },
        )
        code = process.wait()
        if meta["uid"] in self.stopping and self.stop.is_set():
            return
        text = message.read_text(errors="replace") if message.exists() else ""
        if not text and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            text = logfile.read_bytes()[-LOG_TAIL:].decode(errors="replace")
        finished = _now()
        reason = "Completed" if code == 0 else ("Error" if code > 0 else "Error")
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a runtime reports it
        log.info("%s/%s exited with %d", meta["namespace"], meta["name"], exit_code)
        self._patch_status(
            pod,
            {
                "phase": "Succeeded" if exit_code == 0 else "Failed",
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
                    *(
                        {"type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": finished}
                        for t in ("Initialized", "ContainersReady", "Ready")
                    ),
                ],
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "restartCount": 0,
                        "ready": False,
                        "started": False,
                        "state": {
                            "terminated": {
                                "exitCode": exit_code,
                                "reason": reason,
                                "message": text[-4096:],
                                "startedAt": started,
                                "finishedAt": finished,
                            }
                        },
                    }
                ],
            },
        )

    def _kill(self, uid: str, grace: float) -> None:
        with self.lock:
            process = self.processes.get(uid)
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass

    def _delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        self._kill(meta["uid"], float(30 if grace is None else grace))
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

    def shutdown(self, *_: Any) -> None:
        self.stop.set()
        with self.lock:
            processes = [p for p in self.processes.values() if p is not None]
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


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

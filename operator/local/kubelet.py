"""A process kubelet: the pods bound to this machine's node run as local processes, and their state is
reported as a kubelet reports it. One kubelet for the local run (over the in-memory API, local_operator.py)
and the cluster suite (over the real API server, tests/cluster/kubelet.py, which adds node registration,
heartbeats and the real watch); what it needs of an API server is a `PodHost`.

There is no container runtime here, so it does what a kubelet does with the parts the operator reads:
- for each pod given to `sync`: the container's command, args and env (`fieldRef`s resolved from the pod,
  ConfigMap and Secret volumes as directories; pods.py) as one process in its own session (a signal to the
  group reaches the trainer and its children), with `python` this environment's interpreter. A pod that asks
  for `google.com/tpu` gets its host's chips as CPU devices (4 v7x chips: 8 devices); every pod of a JobSet
  reaches the others on loopback: their DNS names (`<jobset>-<job>-<i>-<j>.<subdomain>`) in env values are
  rewritten to 127.0.0.1, and the coordinator's port is one free port per JobSet (all "hosts" share this
  machine);
- reports Running and Ready with the pod's IP when the process starts; when it ends, the container's
  `terminated` state with its exit code (128 + N for signal N) and termination message (the file at
  terminationMessagePath, or with `FallbackToLogsOnError` and a non-zero exit, the last 2 KiB of this
  container's log), and phase Succeeded or Failed;
- a pod being deleted (deletionTimestamp) has its process stopped (SIGTERM to the group, SIGKILL after
  deletionGracePeriodSeconds), then the object is deleted with grace 0, as the kubelet's final delete does;
  a pod deleted outright (grace 0) has its process killed at once.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ..api import catalogue
from ..api.lifecycle import exit_code
from ..api.names import LABEL_JOBSET
from .pods import LOOPBACK, free_port, job_process

Obj = dict[str, Any]
LOG_TAIL = 2048  # bytes of the log a kubelet keeps as the message with FallbackToLogsOnError
MESSAGE_LIMIT = 4096  # bytes of a termination message a kubelet keeps
TPU = "google.com/tpu"
ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
COORDINATOR_ENV = ("TPUJOB_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")
LABEL_JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
log = logging.getLogger("process-kubelet")


class PodHost(Protocol):
    """What the kubelet needs of an API server; called from the kubelet's threads."""

    def report(self, pod: Obj, status: Obj) -> None: ...  # merge-patch the pod's status; a pod gone is no error
    def remove(self, pod: Obj) -> None: ...  # the final delete: grace 0, this uid only; a pod gone is no error
    def volumes(self, pod: Obj) -> dict[str, dict[str, str]]: ...  # the pod's ConfigMaps and Secrets by name, decoded


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    """Runs the pods given to `sync` (this module's docstring says how). `pod_ip(pod)`: the IP reported
    (loopback, or the node's address); `accelerator(pod)`: its node's GKE accelerator label (by default the
    pod's nodeSelector for it); `log_path(pod)`: where the container's output goes (appended);
    `prepare(pod, env)`: a last say on a process's environment (the local run's per-pod metrics port)."""

    def __init__(
        self,
        host: PodHost,
        workdir: Path,
        *,
        pod_ip: Callable[[Obj], str] = lambda pod: LOOPBACK,
        accelerator: Callable[[Obj], str | None] = lambda pod: (pod["spec"].get("nodeSelector") or {}).get(ACCELERATOR),
        log_path: Callable[[Obj], Path] | None = None,
        prepare: Callable[[Obj, dict[str, str]], None] | None = None,
        base_env: Mapping[str, str] | None = None,
    ):
        self.host, self.workdir, self.pod_ip, self.accelerator, self.prepare = (
            host,
            workdir,
            pod_ip,
            accelerator,
            prepare,
        )
        self.log_path = log_path or (lambda pod: self.pod_dir(pod) / "log")
        environ = os.environ if base_env is None else base_env
        self.base_env = {k: v for k, v in environ.items() if not k.startswith(("KUBECONFIG", "TPUJOB_"))}
        self.processes: dict[str, subprocess.Popen[bytes] | None] = {}  # pod uid -> its process (None: starting)
        self.stopping: set[str] = set()  # pod uids being stopped for a deletion
        self.coordinator_ports: dict[str, int] = {}  # namespace/JobSet/uid -> the port of its coordinator
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def pod_dir(self, pod: Obj) -> Path:
        meta = pod["metadata"]
        return self.workdir / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"

    # --- what the API says --------------------------------------------------------------------------------

    def sync(self, kind: str, pod: Obj) -> None:
        """One watch event of a pod bound to this kubelet's node."""
        meta, status = pod["metadata"], pod.get("status") or {}
        uid = meta["uid"]
        if kind == "DELETED":
            threading.Thread(target=self.kill, args=(uid, 0.0), daemon=True).start()
            return
        if meta.get("deletionTimestamp"):
            with self.lock:
                if uid in self.stopping:
                    return
                self.stopping.add(uid)
            threading.Thread(target=self._delete, args=(pod,), daemon=True).start()
            return
        if status.get("phase") in ("Succeeded", "Failed") or self.stopped.is_set():
            return
        with self.lock:
            if uid in self.processes:
                return
            self.processes[uid] = None  # claimed; the thread starts it
        threading.Thread(target=self._run, args=(pod,), daemon=True, name=f"pod-{meta['name']}").start()

    # --- a pod's process ----------------------------------------------------------------------------------

    def process(self, pod: Obj) -> tuple[list[str], dict[str, str], Path]:
        """The pod's container as (argv, env, the file standing for its terminationMessagePath)."""
        meta, spec = pod["metadata"], pod["spec"]
        pod_meta = {**meta, "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}}
        argv, env, message = job_process(spec, self.host.volumes(pod), self.pod_dir(pod), self.base_env, pod_meta)
        env["TPUJOB_TERMINATION_LOG"] = str(message)  # the trainer's /dev/termination-log
        chips = int(((spec["containers"][0].get("resources") or {}).get("limits") or {}).get(TPU, 0))
        accelerator = self.accelerator(pod)
        if chips and accelerator:  # a TPU host: its chips become CPU devices of this process
            devices = chips * catalogue.generation(accelerator).devices_per_chip
            env.update({"TPUJOB_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu", "TPUJOB_CPU_DEVICES": str(devices)})
            env.pop("XLA_FLAGS", None)  # TPU compiler flags abort the CPU backend
        jobset = pod_meta["labels"].get(LABEL_JOBSET)
        if jobset:  # the pods' DNS names (<jobset>-<job>-<i>-<j>[.<subdomain>]) in the container's env values
            subdomain = spec.get("subdomain") or jobset
            hosts = re.compile(
                rf"(?<![\w./-]){re.escape(jobset)}-[a-z0-9-]+-\d+-\d+(\.{re.escape(subdomain)})?(?![\w-])"
            )
            key = f"{meta['namespace']}/{jobset}/{pod_meta['labels'].get(LABEL_JOBSET_UID, '')}"
            with self.lock:
                port = self.coordinator_ports.setdefault(key, free_port())
            for name in {var["name"] for var in spec["containers"][0].get("env") or []} & set(env):
                value = hosts.sub(LOOPBACK, env[name])
                if name in COORDINATOR_ENV and value.startswith(f"{LOOPBACK}:"):
                    value = f"{LOOPBACK}:{port}"
                env[name] = value
        if self.prepare is not None:
            self.prepare(pod, env)
        return argv, env, message

    def _run(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        started = now()
        path = self.log_path(pod)
        try:
            argv, env, message = self.process(pod)
            if not argv:
                raise ValueError(
                    "the container has no command: a process kubelet has no image to take an entrypoint from"
                )
            self.pod_dir(pod).mkdir(parents=True, exist_ok=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            message.unlink(missing_ok=True)
            with open(path, "ab") as out:
                out.write(f"--- {meta['name']}\n".encode())
                out.flush()
                offset = out.tell()
                process = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=self.pod_dir(pod),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except Exception as exc:  # noqa: BLE001 - what a kubelet reports as a container it cannot create
            log.exception("cannot start %s", meta["name"])
            self.host.report(pod, _waiting(container, str(exc)))
            return
        with self.lock:
            self.processes[meta["uid"]] = process
        if self.stopped.is_set():  # shut down while it started
            _signal(process, signal.SIGKILL)
        log.info("started %s/%s: pid %d: %s", meta["namespace"], meta["name"], process.pid, " ".join(argv)[:300])
        self.host.report(pod, _running(container, self.pod_ip(pod), started))
        code = exit_code(process.wait())
        if self.stopped.is_set():
            return
        text = message.read_text(errors="replace") if message.exists() else ""
        if not text and code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            text = _tail(path, offset)
        log.info("%s/%s exited with %d", meta["namespace"], meta["name"], code)
        self.host.report(pod, _terminated(container, code, text[-MESSAGE_LIMIT:], started, now()))

    # --- stopping -----------------------------------------------------------------------------------------

    def kill(self, uid: str, grace: float) -> None:
        """SIGTERM to the pod's process group, SIGKILL after `grace` seconds; returns once it has exited."""
        with self.lock:
            process = self.processes.get(uid)
        if process is None or process.poll() is not None:
            return
        _signal(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL)
            process.wait()

    def _delete(self, pod: Obj) -> None:
        meta = pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        self.kill(meta["uid"], float(30 if grace is None else grace))
        self.host.remove(pod)

    def shutdown(self, grace: float = 0.0) -> None:
        """Stop every process: SIGTERM, SIGKILL after `grace`; nothing more is reported."""
        self.stopped.set()
        with self.lock:
            uids = [uid for uid, p in self.processes.items() if p is not None]
        threads = [threading.Thread(target=self.kill, args=(uid, grace), daemon=True) for uid in uids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()[-LOG_TAIL:].decode(errors="replace")


def _container(container: Obj, **fields: Any) -> Obj:
    return {"name": container["name"], "image": container.get("image", ""), "imageID": "", "restartCount": 0, **fields}


def _waiting(container: Obj, message: str) -> Obj:
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
    return {"phase": "Pending", "containerStatuses": [_container(container, ready=False, state=waiting)]}


def _running(container: Obj, ip: str, started: str) -> Obj:
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": started}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    state = {"running": {"startedAt": started}}
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": ip,
        "hostIPs": [{"ip": ip}],
        "startTime": started,
        "conditions": conditions,
        "containerStatuses": [_container(container, ready=True, started=True, state=state)],
    }


def _terminated(container: Obj, code: int, message: str, started: str, finished: str) -> Obj:
    state = {
        "terminated": {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "message": message,
            "startedAt": started,
            "finishedAt": finished,
        }
    }
    return {
        "phase": "Succeeded" if code == 0 else "Failed",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
            *(
                {"type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": finished}
                for t in ("Initialized", "ContainersReady", "Ready")
            ),
        ],
        "containerStatuses": [_container(container, ready=False, started=False, state=state)],
    }

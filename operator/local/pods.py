"""A pod's container as a local process, the way GKE would run it: `job_process` for one pod (the process
kubelet's, kubelet.py: the container's command and env, `fieldRef`s resolved from the pod's metadata, volumes
as directories, the termination message path as a file), and `local_pods` for every pod of a rendered JobSet
at once, with the indices JobSet and the Job controller put on each pod and every pod hostname on loopback
(the image tests run the trainer's container that way).
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..api.names import LABEL_COMPLETION_INDEX, LABEL_JOB_INDEX

LOOPBACK = "127.0.0.1"
_FIELD = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


@dataclass(frozen=True)
class LocalPod:
    hostname: str
    slice_index: int
    host_index: int
    argv: list[str]
    env: dict[str, str]
    termination_log: Path | None = None  # where the trainer writes its exit record

    @property
    def is_coordinator(self) -> bool:
        return self.slice_index == 0 and self.host_index == 0


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free loopback TCP port, never one this process handed out before: ports are picked back to
    back (coordinator, then metrics) and only bound later, so the kernel could offer one twice."""
    while True:
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def _materialise_volumes(
    pod_spec: dict[str, Any], config_maps: Mapping[str, Mapping[str, str]], volume_dir: Path
) -> dict[str, Path]:
    """Each volume becomes a directory; ConfigMap volumes get their files, and Secret volumes too where
    `config_maps` has them by name (files by key, decoded); a Secret not given stays an empty directory (the
    trainer then refuses control requests: its credential is missing). Returns mountPath → dir."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in pod_spec["containers"][0].get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = volume_dir / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            data = config_maps.get(volume["configMap"]["name"])
            if data is None:
                raise LookupError(f"ConfigMap {volume['configMap']['name']} of volume {mount['name']} not found")
            for key, text in data.items():
                (local / key).write_text(text)
        elif "secret" in volume:
            for key, text in (config_maps.get(volume["secret"].get("secretName")) or {}).items():
                (local / key).write_text(text)
        mounts[mount["mountPath"]] = local
    return mounts


def _rewrite_paths(value: str, mounts: Mapping[str, Path]) -> str:
    for mount_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + value[len(mount_path.rstrip("/")) :]
    return value


def _field_value(path: str, pod_meta: Mapping[str, Any]) -> str:
    if path == "metadata.name":
        return pod_meta["name"]
    if path == "metadata.namespace":
        return pod_meta["namespace"]
    if path in ("status.podIP", "status.hostIP"):
        return LOOPBACK
    m = _FIELD.match(path)
    if not m:
        raise ValueError(f"unsupported fieldRef {path!r}")
    return str(pod_meta[m.group(1)].get(m.group(2), ""))


def local_pods(
    jobset: Mapping[str, Any],
    config_maps: Mapping[str, Mapping[str, str]],
    workdir: Path,
    *,
    cpu_devices: int,
    coordinator_port: int,
    metrics_port: int,
    base_env: Mapping[str, str] | None = None,
) -> list[LocalPod]:
    """The pods of `jobset` as processes to start, in process-id order."""
    name = jobset["metadata"]["name"]
    namespace = jobset["metadata"].get("namespace", "default")
    subdomain = (jobset["spec"].get("network") or {}).get("subdomain") or name
    pods: list[LocalPod] = []
    for rjob in jobset["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        pod_spec = job_spec["template"]["spec"]
        container = pod_spec["containers"][0]
        mounts = _materialise_volumes(pod_spec, config_maps, workdir / "volumes")
        # Every pod hostname of this JobSet resolves to loopback: all "hosts" are on this machine.
        hosts = re.compile(rf"\b{re.escape(name)}-[a-z0-9-]+-\d+-\d+(\.{re.escape(subdomain)})?\b")
        for slice_index in range(rjob.get("replicas", 1)):
            for host_index in range(job_spec.get("completions", 1)):
                hostname = f"{name}-{rjob['name']}-{slice_index}-{host_index}"
                meta = {
                    "name": hostname,
                    "namespace": namespace,
                    "annotations": {LABEL_JOB_INDEX: str(slice_index), LABEL_COMPLETION_INDEX: str(host_index)},
                    "labels": {LABEL_JOB_INDEX: str(slice_index), LABEL_COMPLETION_INDEX: str(host_index)},
                }
                env = dict(base_env or {})
                for var in container.get("env", []):
                    if "valueFrom" in var:
                        env[var["name"]] = _field_value(var["valueFrom"]["fieldRef"]["fieldPath"], meta)
                    else:
                        env[var["name"]] = _rewrite_paths(hosts.sub(LOOPBACK, var.get("value", "")), mounts)
                env.update(
                    {
                        "TPUJOB_COORDINATOR_ADDRESS": f"{LOOPBACK}:{coordinator_port}",
                        "TPUJOB_METRICS_PORT": str(metrics_port),
                        # The host's TPU chips become virtual CPU devices of this process.
                        "TPUJOB_PLATFORM": "cpu",
                        "JAX_PLATFORMS": "cpu",
                        "TPUJOB_CPU_DEVICES": str(cpu_devices),
                    }
                )
                env.pop("XLA_FLAGS", None)  # TPU compiler flags abort the CPU backend
                termination = (workdir / "termination" / hostname).resolve()
                env["TPUJOB_TERMINATION_LOG"] = str(termination)
                argv = [_rewrite_paths(a, mounts) for a in [*container.get("command", []), *container.get("args", [])]]
                if argv and re.fullmatch(r"python(3(\.\d+)?)?", argv[0]):
                    argv[0] = sys.executable  # the image's python is this environment's
                pods.append(LocalPod(hostname, slice_index, host_index, argv, env, termination))
    return pods


def job_process(
    pod_spec: dict[str, Any],
    config_maps: Mapping[str, Mapping[str, str]],
    workdir: Path,
    base_env: Mapping[str, str] | None = None,
    pod_meta: Mapping[str, Any] | None = None,
) -> tuple[list[str], dict[str, str], Path]:
    """The single container of a pod as a process to start: (argv, env, the local file that stands for its
    terminationMessagePath). Volumes and the termination message path become files under `workdir`, and
    paths in the command and env are rewritten to them, as for a JobSet's pods. With the pod's metadata
    (name, namespace, labels, annotations), `fieldRef` env vars are resolved from it; without, left out."""
    container = pod_spec["containers"][0]
    mounts = _materialise_volumes(pod_spec, config_maps, workdir / "volumes")
    message = workdir / "termination-log"
    mounts[container.get("terminationMessagePath") or "/dev/termination-log"] = message
    env = dict(base_env or {})
    for var in container.get("env", []):
        if "valueFrom" not in var:
            env[var["name"]] = _rewrite_paths(var.get("value", ""), mounts)
        elif pod_meta is not None and "fieldRef" in var["valueFrom"]:
            env[var["name"]] = _field_value(var["valueFrom"]["fieldRef"]["fieldPath"], pod_meta)
    argv = [_rewrite_paths(a, mounts) for a in [*container.get("command", []), *container.get("args", [])]]
    if argv and re.fullmatch(r"python(3(\.\d+)?)?", argv[0]):
        argv[0] = sys.executable
    return argv, env, message

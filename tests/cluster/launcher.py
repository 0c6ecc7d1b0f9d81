"""Bring the local cluster up and down: the pinned components (scripts/build-cluster.sh) as processes on
this machine, no containers.

    python -m tests.cluster up      # prints the kubeconfig's path
    python -m tests.cluster down

- `kwokctl create cluster --runtime binary` starts etcd, kube-apiserver (RBAC, admission plugins, an audit
  log of every request), kube-controller-manager, kube-scheduler and the kwok controller from the built
  binaries, with the kwok Stages of stages.yaml;
- JobSet's and Kueue's controllers run as local processes, each with its own webhook, metrics and health
  ports, their webhook server's certificate from a CA made here (certs.py); their CRDs and webhook
  configurations come from the pinned module versions, each `service` rewritten to `url` + `caBundle`
  (manifests.py);
- the nodes of nodes.py: kwok's, then the process kubelet's, which it registers itself.
State (kubeconfig, logs, pids) lives in $TPUJOB_CLUSTER_STATE, by default
~/.cache/tpu-operator/cluster/run/tpujob: JobSet, Kueue and the process kubelet log to logs/<name>.log,
the control plane and kwok to kwok/clusters/tpujob/logs/<name>.log (with audit.log, the requests of
ServiceAccounts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import manifests
from tests.cluster.build import ROOT, Build, build, unavailable, versions
from tests.cluster.certs import make_webhook_certs
from tests.cluster.nodes import KWOK, cluster_nodes
from tpu_operator.local.pods import free_port

NAME = "tpujob"
STAGES = Path(__file__).with_name("stages.yaml")
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-delete.yaml",
)
# Kueue v0.19 reads its metrics server's certificate from this fixed path when its internal certificate
# management is off (cmd/kueue/main.go), whatever its configuration says.
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")
# The audit log records the requests of ServiceAccounts (the operators under test run as the chart's), not
# the control plane's own (kwokctl gives every component the admin certificate).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}],
}
START_TIMEOUT_S = 180


def state_dir() -> Path:
    return Path(os.environ.get("TPUJOB_CLUSTER_STATE") or build().dir.parent / "run" / NAME)


@dataclass(frozen=True)
class Running:
    """A cluster that is up: what tests and the `down` command need."""

    dir: Path

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def logs(self) -> Path:
        """JobSet's, Kueue's and the process kubelet's logs."""
        return self.dir / "logs"

    @property
    def control_plane_logs(self) -> Path:
        """kwokctl's: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok-controller."""
        return self.dir / "kwok" / "clusters" / NAME / "logs"

    @property
    def audit_log(self) -> Path:
        return self.control_plane_logs / "audit.log"

    def info(self) -> dict[str, Any]:
        return json.loads((self.dir / "state.json").read_text())


def _log(message: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _env(found: Build) -> dict[str, str]:
    # kwokctl runs `kubectl` from PATH for some steps: the pinned one comes first.
    return {
        **os.environ,
        "PATH": f"{found.bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "KWOK_WORKDIR": str(state_dir() / "kwok"),
        "KWOK_KUBE_VERSION": versions()["KUBERNETES"],
    }


def _run(found: Build, *args: str, input: str | None = None, timeout: float = 300) -> str:
    result = subprocess.run(list(args), env=_env(found), capture_output=True, text=True, input=input, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:6])} ... failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def kubectl(found: Build, kubeconfig: Path, *args: str, input: str | None = None) -> str:
    return _run(found, str(found.binary("kubectl")), f"--kubeconfig={kubeconfig}", *args, input=input)


def _spawn(name: str, argv: list[str], logs: Path, env: dict[str, str]) -> int:
    """Start a component in its own session (it outlives the `up` command); its pid."""
    with open(logs / f"{name}.log", "ab") as out:
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=logs.parent,
        )
    return process.pid


def _wait_healthy(name: str, port: int, pid: int, logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise RuntimeError(f"{name} exited at start-up; the end of logs/{name}.log:\n{_tail(logs / f'{name}.log')}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(
        f"{name} not ready after {START_TIMEOUT_S} s; the end of its log:\n{_tail(logs / f'{name}.log')}"
    )


def _wait_webhook(port: int) -> None:
    """Until the webhook server answers TLS on its port (it starts after the manager's caches)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"https://127.0.0.1:{port}/", timeout=2, context=context)
            return
        except urllib.error.HTTPError:
            return  # it answered (404 for /)
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"no webhook server on 127.0.0.1:{port} after {START_TIMEOUT_S} s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process (a test session's fixture) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} is missing)"


def _controller_config(
    kind: str, webhook_port: int, metrics_port: int, health_port: int, certs: Path
) -> dict[str, Any]:
    base = {
        "kind": "Configuration",
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }
    if kind == "jobset":
        return {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", **base}
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        **base,
        "namespace": "kueue-system",
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["jobset.x-k8s.io/jobset"]},
        # The visibility API is an aggregated API server of its own: not served here.
        "featureGates": {"VisibilityOnDemand": False},
    }


def up() -> Running:
    """Start the cluster (tearing down any previous one of this name first); return it."""
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    found, directory = build(), state_dir()
    down(quiet=True)
    logs = directory / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    pins = versions()

    # 1. The control plane and the kwok controller, through kwokctl.
    (directory / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    stages = [yaml.safe_load((found.manifests / "kwok" / "stage" / path).read_text()) for path in KWOK_STAGES]
    stages += manifests.documents(STAGES)
    # Every component listens on loopback only (kwokctl's binary runtime binds 0.0.0.0 otherwise).
    kwokctl_config = {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokctlConfiguration",
        "options": {"bindAddress": "127.0.0.1"},
    }
    (directory / "kwok.yaml").write_text(yaml.safe_dump_all([kwokctl_config, *stages]))
    kubeconfig = directory / "kubeconfig"
    _log(
        f"kwokctl create cluster --runtime binary (Kubernetes {pins['KUBERNETES']}, etcd {pins['ETCD']}, kwok {pins['KWOK']})"
    )
    _run(
        found,
        str(found.binary("kwokctl")),
        "create",
        "cluster",
        f"--name={NAME}",
        "--runtime=binary",
        f"--config={directory / 'kwok.yaml'}",
        f"--kubeconfig={kubeconfig}",
        f"--kube-apiserver-binary={found.binary('kube-apiserver')}",
        f"--kube-controller-manager-binary={found.binary('kube-controller-manager')}",
        f"--kube-scheduler-binary={found.binary('kube-scheduler')}",
        f"--etcd-binary={found.binary('etcd')}",
        f"--kwok-controller-binary={found.binary('kwok')}",
        f"--kube-apiserver-port={free_port()}",
        "--secure-port=true",
        "--kube-authorization=true",
        "--kube-admission=true",
        "--extra-args=etcd=unsafe-no-fsync=true",  # a test cluster: no fsync on a disk shared with builds
        # kwok plays the kubelet of its own nodes only: kwokctl starts it managing every node, and it then
        # raced the process kubelet on the CPU nodes' pods (both set a pod IP: the API refused one, 422).
        "--extra-args=kwok-controller=manage-all-nodes=false",
        f"--extra-args=kwok-controller=manage-nodes-with-annotation-selector={KWOK}=fake",
        f"--kube-audit-policy={directory / 'audit-policy.yaml'}",
        # No rotation: kube-apiserver rotates its audit log at 100 MB by default, a whole cluster suite writes
        # more, and a test that counts requests must see all of them (tests/cluster/kube.py reads audit.log).
        "--extra-args=kube-apiserver=audit-log-maxsize=0",
        "--wait=120s",
        timeout=600,
    )
    _log(f"control plane up in {time.monotonic() - started:.0f} s")

    # 2. JobSet and Kueue: CRDs, certificates, configuration, processes, webhooks.
    certs = directory / "certs"
    ca_bundle = make_webhook_certs(certs)
    ports = {
        name: {"webhook": free_port(), "metrics": free_port(), "health": free_port()} for name in ("jobset", "kueue")
    }
    crds = manifests.crds(found.manifests / "jobset", ports["jobset"]["webhook"], ca_bundle) + manifests.crds(
        found.manifests / "kueue", ports["kueue"]["webhook"], ca_bundle
    )
    kubectl(found, kubeconfig, "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(crds))
    kubectl(
        found,
        kubeconfig,
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        *[f"crd/{name}" for name in manifests.names(crds)],
    )
    kubectl(found, kubeconfig, "create", "namespace", "kueue-system")
    kubectl(found, kubeconfig, "create", "namespace", "jobset-system")
    try:
        KUEUE_METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            (KUEUE_METRICS_CERTS / name).write_bytes((certs / name).read_bytes())
    except OSError as exc:
        raise RuntimeError(
            f"Kueue {pins['KUEUE']} reads its metrics certificate from {KUEUE_METRICS_CERTS} "
            f"(fixed in its main.go) and it cannot be written here: {exc}"
        ) from None
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    pids = {}
    for name in ("jobset", "kueue"):
        config_path = directory / f"{name}-config.yaml"
        config_path.write_text(
            yaml.safe_dump(_controller_config(name, **{f"{k}_port": v for k, v in ports[name].items()}, certs=certs))
        )
        pids[name] = _spawn(
            name,
            [str(found.binary(name)), f"--config={config_path}", f"--kubeconfig={kubeconfig}", "--zap-log-level=info"],
            logs,
            env,
        )
    configs = manifests.webhook_configs(
        found.manifests / "jobset", "jobset-", ports["jobset"]["webhook"], ca_bundle
    ) + manifests.webhook_configs(
        found.manifests / "kueue", "kueue-", ports["kueue"]["webhook"], ca_bundle, manifests.kueue_kept
    )
    for name in ("jobset", "kueue"):
        _wait_healthy(name, ports[name]["health"], pids[name], logs)
        _wait_webhook(ports[name]["webhook"])
    kubectl(found, kubeconfig, "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(configs))
    _log(f"JobSet {pins['JOBSET']} and Kueue {pins['KUEUE']} up")

    # 3. Nodes: kwok's, and the process kubelet's (it registers its own).
    nodes = cluster_nodes()
    kwok_nodes = [n.manifest(pins["KUBERNETES"]) for n in nodes if n.kubelet == "kwok"]
    kubectl(found, kubeconfig, "create", "-f", "-", input=yaml.safe_dump_all(kwok_nodes))
    local = ",".join(n.name for n in nodes if n.kubelet == "process")
    pids["kubelet"] = _spawn(
        "kubelet",
        [
            sys.executable,
            "-m",
            "tests.cluster.kubelet",
            f"--kubeconfig={kubeconfig}",
            f"--workdir={directory / 'pods'}",
            f"--nodes={local}",
            f"--kubelet-version={pins['KUBERNETES']}",
        ],
        logs,
        {**env, "PYTHONPATH": str(ROOT)},
    )
    (directory / "state.json").write_text(json.dumps({"pids": pids, "ports": ports, "versions": pins}, indent=1))
    deadline = time.monotonic() + START_TIMEOUT_S
    while set(kubectl(found, kubeconfig, "get", "nodes", "-o", "name").split()) < {f"node/{n.name}" for n in nodes}:
        if not _alive(pids["kubelet"]) or time.monotonic() > deadline:
            raise RuntimeError(f"the process kubelet did not register its nodes:\n{_tail(logs / 'kubelet.log')}")
        time.sleep(0.5)
    kubectl(found, kubeconfig, "wait", "--for=condition=Ready", "--timeout=120s", *[f"node/{n.name}" for n in nodes])
    _log(f"{len(nodes)} nodes Ready; cluster up in {time.monotonic() - started:.0f} s; kubeconfig {kubeconfig}")
    return Running(directory)


def current() -> Running | None:
    """The cluster `up` left running, if its processes are all alive."""
    directory = state_dir()
    state = directory / "state.json"
    if not state.exists():
        return None
    pids = json.loads(state.read_text())["pids"]
    kwok_pids = [int(p.read_text()) for p in (directory / "kwok" / "clusters" / NAME / "pids").glob("*.pid")]
    return Running(directory) if kwok_pids and all(_alive(p) for p in [*pids.values(), *kwok_pids]) else None


@contextlib.contextmanager
def benchmark_cluster() -> Iterator[Any]:
    """For benchmarks/: the cluster `up` left running, else one brought up here and down at the end, with the
    TPUTrainingJob CRD as it is now applied; a tests.cluster.kube.Cluster."""
    from tests.cluster.kube import Cluster  # kube does not import the launcher

    running = current()
    started = running is None
    if running is None:
        running = up()
    try:
        cluster = Cluster(running.kubeconfig, running.logs, running.audit_log)
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "tputrainingjob.yaml"))
        cluster.kubectl("wait", "--for=condition=established", "crd/tputrainingjobs.training.tpu-operator.dev")
        yield cluster
    finally:
        if started:
            down()


def down(quiet: bool = False) -> None:
    """Stop the project's processes (by the pids it recorded) and delete the kwokctl cluster."""
    found, directory = build(), state_dir()
    state = directory / "state.json"
    if state.exists():
        for pid in json.loads(state.read_text())["pids"].values():
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    if not _alive(pid):
                        break
                    time.sleep(0.1)
                else:
                    os.kill(pid, signal.SIGKILL)
        state.unlink()
    if (directory / "kwok" / "clusters" / NAME).exists():
        _run(found, str(found.binary("kwokctl")), "delete", "cluster", f"--name={NAME}", timeout=120)
    if not quiet:
        _log("cluster down")

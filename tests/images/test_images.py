"""The built images, run as a cluster runs them: what the chart and the rendered pods expect of each
image, what each holds, and a smoke run of each.

- operator: its entrypoint, with the arguments, environment, user and read-only root of the chart's
  Deployment, reaches the local cluster's real API server (tests/cluster) on loopback through a kubeconfig
  holding the chart's ServiceAccount token; a TPUTrainingJob applied with kubectl gets its ConfigMap,
  its JobSet and its status.
- workload (CPU variant): the quickstart's rendered pods (command, environment, volumes) train a few
  steps as two processes; /status of process 0 says completed at the last step.

The images come from the `images` fixture (conftest.py: scripts/build-images.sh, once per session);
containers from container.py (run-in-image.sh). Opt-in: `pytest -m images` (tests/conftest.py keeps
them out of README's test command), skipped with the reason where podman cannot build.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.chart_helm import deployment_container
from tests.chart.chart_helm import render as render_chart
from tests.cluster.kube import Cluster, wait_for
from tests.conftest import EXAMPLES, ROOT, operator_job
from tests.images.container import Image, exec_in_image, own_dir, podman, process_status, root_mount_options, running
from tpu_operator.api.models import TPUTrainingJob
from tpu_operator.controller.children import config_map_of
from tpu_operator.local.pods import free_port, local_pods
from tpu_operator.rendering.manifests import render as render_job

pytestmark = [pytest.mark.images, pytest.mark.timeout(1800)]  # the first test may wait for the build

NAMESPACE = "tpu-system"  # the operator's release namespace
WAIT_S = 60.0
TRAIN_S = 600.0


def uid_gid(user: str) -> tuple[int, int]:
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def pod_container(jobset: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def render_quickstart(**spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The quickstart's ConfigMap and JobSet; keyword arguments update spec sections."""
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    for section, values in spec.items():
        doc["spec"].setdefault(section, {}).update(values)
    doc["metadata"]["namespace"] = "default"
    config_map, jobset = render_job(TPUTrainingJob.model_validate(doc))
    return config_map, jobset


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


# --- what the chart and the rendered pods expect of the images -------------------------------------------


def test_chart_starts_the_operator_image_as_built(images, helm, tmp_path):
    """The Deployment gives only args: the image's ENTRYPOINT must be `tpujob operator`; its USER the
    chart's runAsUser; its EXPOSE the chart's container ports; its HOME on the chart's writable /tmp."""
    deployment, container = deployment_container(render_chart(helm, tmp_path))
    pod = deployment["spec"]["template"]["spec"]
    image = images.operator
    assert "command" not in container and image.entrypoint == ["tpujob", "operator"]
    assert container["args"][0] == "--standalone"
    security = {**pod["securityContext"], **container["securityContext"]}
    assert uid_gid(image.user) == (security["runAsUser"], security["runAsGroup"]) == (65532, 65532)
    assert security["runAsUser"] != 0 and security["readOnlyRootFilesystem"] is True
    assert image.exposed_ports == {p["containerPort"] for p in container["ports"]} == {8080, 9090}
    # A read-only root: the only writable path is the chart's emptyDir, and the image's HOME is there.
    (tmp_mount,) = [
        m for m in container["volumeMounts"] if "emptyDir" in next(v for v in pod["volumes"] if v["name"] == m["name"])
    ]
    assert image.env["HOME"] == tmp_mount["mountPath"] == "/tmp"


def test_rendered_pods_start_the_workload_image_as_built(images):
    """The operator's pods run `python -m tpu_workload --config ...` on the CPU image: the image's
    entrypoint starts the same way, its EXPOSE lists the pod's ports, it runs as the chart's UID,
    and it stands in for a host of 4 chips (8 JAX devices) by itself."""
    config_map, jobset = render_quickstart()
    _, container = pod_container(jobset)
    config = json.loads(config_map["data"]["config.json"])
    image = images.workload
    assert container["command"][:3] == image.entrypoint == ["python", "-m", "tpu_workload"]
    assert image.exposed_ports == {p["containerPort"] for p in container["ports"]}
    assert uid_gid(image.user) == (65532, 65532)
    assert image.env["JAX_PLATFORMS"] == image.env["TPUJOB_PLATFORM"] == "cpu"
    assert int(image.env["TPUJOB_CPU_DEVICES"]) == config["devicesPerHost"] == 8


# --- what the images hold -----------------------------------------------------------------------------


PROBE = """
import importlib.util, json, os
def writable(path):
    try:
        open(os.path.join(path, ".probe"), "w").close()
        return True
    except OSError:
        return False
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "home_writable": writable(os.environ["HOME"]),
                  "root_writable": writable("/"),
                  "modules": {m: importlib.util.find_spec(m) is not None for m in %r}}))
"""


@pytest.mark.parametrize(
    "which, present, absent",
    [
        (
            "operator",
            ["tpu_operator.controller.handlers", "kopf", "kubernetes_asyncio", "jinja2"],
            ["jax", "jaxlib", "flax", "kubernetes"],
        ),
        (
            "workload",
            # libtpu: the pre-flight's compiler; jinja2: sft's chat templates (in its sandbox, workload/data/chat.py)
            ["tpu_workload", "jax", "flax", "orbax", "pydantic", "libtpu", "jinja2"],
            ["kopf", "kubernetes", "kubernetes_asyncio", "torch", "transformers"],
        ),
    ],
    ids=["operator", "workload"],
)
def test_image_holds_its_side_only_and_runs_as_non_root(images, which, present, absent):
    """The operator image carries no JAX and the workload image no cluster client (nor the tests' torch); both run as the
    fixed non-root UID with a writable HOME, also under a read-only root."""
    image: Image = getattr(images, which)
    result = exec_in_image(image, "-c", PROBE % (present + absent), entrypoint="python", read_only=True)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert (found["uid"], found["gid"]) == (65532, 65532)
    assert found["home_writable"] and not found["root_writable"]
    assert [m for m in present if not found["modules"][m]] == []
    assert [m for m in absent if found["modules"][m]] == []


def test_build_context_holds_only_what_the_images_install(images, tmp_path):
    """.dockerignore: the context is pyproject.toml, README.md and the four package folders, without
    bytecode; no runs/, .venv/, tests/ or anything else of the repository."""
    probe, tag, name = tmp_path / "probe.Dockerfile", "localhost/tpu-operator-context-probe:test", "context-probe"
    probe.write_text("FROM scratch\nCOPY . /context/\n")
    podman(
        "build", "--isolation", "chroot", "--layers=false", "-q", "-f", str(probe), "-t", tag, str(ROOT), timeout=300
    )
    try:
        podman("rm", "--force", name, check=False)
        podman("create", "--name", name, tag, "/none")
        context = Path(podman("mount", name).stdout.strip()) / "context"
        top = {p.name for p in context.iterdir()}
        files = {str(p.relative_to(context)) for p in context.rglob("*") if p.is_file()}
    finally:
        podman("rm", "--force", name, check=False)
        podman("image", "rm", tag, check=False)
    assert top == {"pyproject.toml", "README.md", "operator", "templates", "crds", "workload"}
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc") or ".egg-info" in f]
    assert {"templates/jobset.yaml.j2", "crds/tputrainingjob.yaml", "workload/__main__.py"} <= files


# --- smoke runs ---------------------------------------------------------------------------------------------


def chart_environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as a kubelet resolves it (the only fieldRefs are the pod's namespace and name)."""
    env = {}
    fields = {"metadata.namespace": NAMESPACE, "metadata.name": "tpu-images-operator-0"}
    for var in container["env"]:
        if "valueFrom" in var:
            assert set(var["valueFrom"]) == {"fieldRef"} and var["valueFrom"]["fieldRef"]["fieldPath"] in fields, var
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = var["value"]
    return env


def test_operator_image_turns_a_job_into_a_jobset_and_status(
    images, helm, cluster: Cluster, operator_kubeconfig, tmp_path
):
    """The chart's container (args, env, user, read-only root, /tmp) from the operator image, with a
    kubeconfig holding the chart's ServiceAccount token instead of the mounted one; kubectl apply of a job
    gets its children and status from the real API server."""
    health_port, metrics_port = free_port(), free_port()
    ns = cluster.namespace("image")
    values = {
        "operator": {
            "watchNamespaces": [ns],
            "healthPort": health_port,
            "metricsPort": metrics_port,
            "defaultImage": images.workload.tag,
            "metricsInterval": 2,
            "resyncInterval": 10,
            "extraEnv": [{"name": "KUBECONFIG", "value": "/etc/tpu-operator/kubeconfig"}],
        }
    }
    _, container = deployment_container(render_chart(helm, tmp_path, values, namespace=NAMESPACE))
    security = container["securityContext"]
    operator_kubeconfig.chmod(0o644)  # the image's user (65532) reads it
    with running(
        images.operator,
        *container["args"],
        name="tpu-images-operator",
        log_dir=tmp_path,
        user=f"{security['runAsUser']}:{security['runAsGroup']}",
        env=chart_environment(container),
        read_only=security["readOnlyRootFilesystem"],
        volumes=[f"{operator_kubeconfig}:/etc/tpu-operator/kubeconfig:ro"],
        grace=10,
    ) as operator:

        def healthy() -> bool:
            assert operator.process.poll() is None, f"the operator exited:\n{operator.log_tail()}"
            try:
                return get_json(f"http://127.0.0.1:{health_port}/healthz") is not None
            except OSError:
                return False

        wait_for(healthy, WAIT_S, "the operator's /healthz")
        pid = operator.main_process("tpujob")
        assert pid, operator.log_tail()
        status = process_status(pid)
        assert status["Uid"].split() == ["65532"] * 4 and status["Gid"].split() == ["65532"] * 4
        assert status["CapEff"] == "0000000000000000" and status["NoNewPrivs"] == "1"
        assert "ro" in root_mount_options(pid)

        imageless = operator_job()
        imageless["spec"].pop("image", None)  # the operator's --default-image (the chart's value) fills it in
        cluster.apply(imageless, namespace=ns)

        def job_status() -> dict[str, Any] | None:
            # Pending (Ready=False, PodsPending) comes first, with the JobSet's name; Ready once its pods run.
            status = cluster.status(ns, "tiny")
            ready = [c for c in status.get("conditions", []) if c["type"] == "Ready" and c["status"] == "True"]
            return status if status.get("jobSetName") and ready else None

        try:
            status = wait_for(job_status, WAIT_S, "a JobSet in the job's status, Ready")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nstatus: {cluster.status(ns, 'tiny')}\noperator log:\n{operator.log_tail()}"
            ) from None
        assert status["observedGeneration"] == 1, status
        jobset = json.loads(cluster.kubectl("get", "jobset", status["jobSetName"], "-n", ns, "-o", "json").stdout)
        _, trainer = pod_container(jobset)
        assert trainer["image"] == images.workload.tag  # the chart's --default-image
        config_map = json.loads(
            cluster.kubectl("get", "configmap", config_map_of(jobset), "-n", ns, "-o", "json").stdout
        )
        assert json.loads(config_map["data"]["config.json"])["name"] == "tiny"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert "tpu_operator_reconciles_total" in response.read().decode()
        assert operator.stop() == 0, operator.log_tail()  # SIGTERM: a clean exit, as on a pod's deletion


def test_workload_image_trains_the_quickstart_as_two_processes(images, tmp_path):
    """The quickstart's rendered JobSet, a few steps long, with its checkpoints on a PVC, as two pods
    of the CPU image: each pod gets the container's command and environment (fieldRefs resolved as
    JobSet would), its ConfigMap files and the PVC, and every pod hostname resolves to loopback."""
    steps, claim = 4, "quickstart-checkpoints"
    metrics_port = free_port()
    config_map, jobset = render_quickstart(
        training={"steps": steps},
        runtime={"metricsPort": metrics_port},
        checkpoint={"interval": 2, "persistentVolumeClaim": claim},
    )
    pod_spec, container = pod_container(jobset)
    pvc = own_dir(tmp_path / "pvc" / claim, 65532)  # a PVC the image's user can write, as with an fsGroup
    volumes = []
    for mount in container["volumeMounts"]:
        volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        if "configMap" in volume:
            assert volume["configMap"]["name"] == config_map["metadata"]["name"]
            host = tmp_path / "volumes" / mount["name"]
            host.mkdir(parents=True)
            for key, text in config_map["data"].items():
                (host / key).write_text(text)
        elif "persistentVolumeClaim" in volume:
            host = pvc
        elif volume["emptyDir"].get("medium") == "Memory":  # the container's own /dev/shm tmpfs
            assert mount["mountPath"] == "/dev/shm", mount
            continue
        else:  # a disk emptyDir (/tmp on the read-only root, checkpoints without a claim): writable by the pod
            host = own_dir(tmp_path / "volumes" / mount["name"], 65532)
        volumes.append(f"{host}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else ""))

    # Pod hostnames and fieldRefs as JobSet and the Job controller give them (tpu_operator.local.pods).
    pods = local_pods(
        jobset,
        {config_map["metadata"]["name"]: config_map["data"]},
        tmp_path / "local",
        cpu_devices=8,
        coordinator_port=0,
        metrics_port=metrics_port,
    )
    subdomain = jobset["metadata"]["name"]
    hosts = tmp_path / "hosts"
    hosts.write_text(
        Path("/etc/hosts").read_text()
        + "".join(f"127.0.0.1 {pod.hostname}.{subdomain} {pod.hostname}\n" for pod in pods)
    )
    literal = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    coordinator_host = literal["TPUJOB_COORDINATOR_ADDRESS"].rsplit(":", 1)[0]
    assert coordinator_host == f"{pods[0].hostname}.{subdomain}"
    coordinator = f"{coordinator_host}:{free_port()}"  # pods share this machine's network: not the fixed 8476
    with contextlib.ExitStack() as stack:
        trainers = []
        for i, pod in enumerate(pods):
            env = {
                **literal,
                **{var["name"]: pod.env[var["name"]] for var in container["env"] if "valueFrom" in var},
                "TPUJOB_COORDINATOR_ADDRESS": coordinator,
                # The image lingers 30 s for the operator's last read; the test polls every second.
                "TPUJOB_LINGER_SECONDS": "10",
                "HOSTNAME": pod.hostname,
            }
            command, *args = container["command"]  # a pod's command replaces the image's entrypoint
            trainers.append(
                stack.enter_context(
                    running(
                        images.workload,
                        *args,
                        entrypoint=command,
                        name=f"tpu-images-workload-{i}",
                        log_dir=tmp_path,
                        env=env,
                        grace=5,
                        volumes=[*volumes, f"{hosts}:/etc/hosts:ro"],
                        read_only=container["securityContext"]["readOnlyRootFilesystem"],
                    )
                )
            )

        def completed() -> dict[str, Any] | None:
            for t in trainers:
                assert t.process.poll() in (None, 0), f"{t.name} exited {t.process.returncode}:\n{t.log_tail()}"
            assert trainers[0].process.poll() is None, "process 0 exited before /status was read as completed"
            try:
                status = get_json(f"http://127.0.0.1:{metrics_port}/status")
            except OSError:
                return None
            return status if status.get("state") == "completed" else None

        try:
            status = wait_for(completed, TRAIN_S, "/status state completed", interval=1.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(t.log_tail(30) for t in trainers)) from None
        assert status["step"] == status["total_steps"] == steps and status["process_count"] == 2
        assert status["last_checkpoint_step"] == steps
        for t in trainers:  # both pods succeed: the linger ends, then the process exits 0
            assert t.process.wait(timeout=WAIT_S) == 0, t.log_tail()
    lines = [json.loads(line) for line in trainers[0].stdout_path.read_text().splitlines()]
    assert [r["step"] for r in lines if not r.get("summary")] == list(range(1, steps + 1))
    assert lines[-1]["summary"] is True and lines[-1]["step"] == steps
    written = list(pvc.rglob("*"))
    assert written and {p.stat().st_uid for p in written} == {65532}  # as the image's user, on the PVC

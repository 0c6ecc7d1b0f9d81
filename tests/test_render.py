"""Rendering: golden manifests, the real JobSet schema, hostile strings, names that must fit."""

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES, TEST_IMAGE, example, tiny_job
from tpu_operator.api.contract import TrainerConfig
from tpu_operator.api.validation import InvalidJob, parse_job
from tpu_operator.controller.children import refused_changes
from tpu_operator.rendering.manifests import render, to_yaml_stream
from tpu_operator.rendering.preflight import render_preflight

GOLDEN = Path(__file__).parent / "golden"


def _env(jobset) -> dict:
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _pod(jobset) -> dict:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", ["llama3-8b-fsdp.yaml", "multislice.yaml"])
def test_golden_render(name):
    """The exact manifests of the 4x4x4 and 2-slice examples. UPDATE_GOLDEN=1 rewrites them after a review."""
    doc = example(name)
    doc["metadata"]["uid"] = "00000000-0000-4000-8000-000000000001"  # as the API server would set it
    text = to_yaml_stream(render(parse_job(doc), default_image=TEST_IMAGE))  # the examples name no image
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"render of {name} changed; review and rerun with UPDATE_GOLDEN=1"


# One job per capacity mode, each with what that mode needs (reservation: a reservation; flexStart: a queue).
CAPACITY = {
    "onDemand": {"tpu": {"topology": "2x2x1"}},
    "spot": {"tpu": {"topology": "2x2x1", "capacity": "spot"}},
    "reservation": {
        "tpu": {
            "topology": "2x2x1",
            "capacity": "reservation",
            "reservationName": "tpu7x-res",
            "reservationProject": "shared-tpus",
        }
    },
    "flexStart": {
        "tpu": {"topology": "2x2x1", "capacity": "flexStart", "maxRunDuration": "1h30m"},
        "queueName": "dws-queue",
        "workloadPriorityClassName": "high",
        "priorityClassName": "batch",
    },
}


def _capacity_jobset(mode: str) -> dict:
    doc = tiny_job(**CAPACITY[mode])
    doc["metadata"]["uid"] = "00000000-0000-4000-8000-000000000001"
    return render(parse_job(doc))[1]


@pytest.mark.parametrize("mode", sorted(CAPACITY))
def test_golden_capacity_modes(mode):
    """The JobSet of each capacity mode. UPDATE_GOLDEN=1 rewrites them after a review."""
    text = to_yaml_stream([_capacity_jobset(mode)])
    golden = GOLDEN / f"capacity-{mode}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"render of capacity {mode} changed; review and rerun with UPDATE_GOLDEN=1"


@pytest.mark.parametrize("mode", sorted(CAPACITY))
def test_every_capacity_mode_renders_a_schema_valid_jobset(mode, jobset_schema):
    js = _capacity_jobset(mode)
    assert jobset_schema.admit(js, "JobSet", "jobset.x-k8s.io") == js, "the schema pruned a field we emit"


def test_capacity_modes_select_and_tolerate_their_nodes():
    tpu = {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    base = {"cloud.google.com/gke-tpu-accelerator": "tpu7x", "cloud.google.com/gke-tpu-topology": "2x2x1"}
    expected = {
        "onDemand": (base, [tpu]),
        "spot": (
            {"cloud.google.com/gke-spot": "true", **base},
            [tpu, {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
        ),
        "reservation": (
            {
                "cloud.google.com/reservation-name": "tpu7x-res",
                "cloud.google.com/reservation-affinity": "specific",
                "cloud.google.com/reservation-project": "shared-tpus",
                **base,
            },
            [tpu],
        ),
        "flexStart": (
            base,
            [tpu, {"key": "cloud.google.com/gke-queued", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
        ),
    }
    for mode, (selector, tolerations) in expected.items():
        pod = _pod(_capacity_jobset(mode))
        assert (pod["nodeSelector"], pod["tolerations"]) == (selector, tolerations), mode


def test_a_queued_job_is_created_suspended_with_kueue_labels_on_the_jobset_only():
    js = _capacity_jobset("flexStart")
    assert js["spec"]["suspend"] is True
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "dws-queue"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert js["metadata"]["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "5400"
    assert _pod(js)["priorityClassName"] == "batch"  # Kueue's priority without a WorkloadPriorityClass
    template = js["spec"]["replicatedJobs"][0]["template"]
    for labels in (template["metadata"]["labels"], template["spec"]["template"]["metadata"]["labels"]):
        assert not [k for k in labels if k.startswith("kueue.x-k8s.io/")]  # Kueue reads the JobSet's
    plain = _capacity_jobset("onDemand")
    assert plain["spec"]["suspend"] is False
    assert not [k for k in {**plain["metadata"]["labels"], **plain["metadata"]["annotations"]} if "kueue" in k]
    assert render(parse_job(tiny_job(queueName="q", suspend=True)))[1]["spec"]["suspend"] is True


def test_a_user_node_selector_cannot_move_the_job_off_its_capacity():
    _, js = render(
        parse_job(
            tiny_job(tpu={"topology": "2x2x1", "capacity": "spot"}, nodeSelector={"cloud.google.com/gke-spot": "false"})
        )
    )
    assert _pod(js)["nodeSelector"]["cloud.google.com/gke-spot"] == "true"


def test_4x4x4_shape():
    cm, js = render(parse_job(example("llama3-8b-fsdp.yaml")), default_image=TEST_IMAGE)
    rj = js["spec"]["replicatedJobs"][0]
    assert (rj["replicas"], rj["template"]["spec"]["parallelism"], rj["template"]["spec"]["completions"]) == (1, 16, 16)
    pod = _pod(js)
    assert pod["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu7x",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
    }
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["hostNetwork"] is False and "dnsPolicy" not in pod and pod["restartPolicy"] == "Never"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert (
        js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    )
    env = _env(js)
    assert env["TPUJOB_COORDINATOR_ADDRESS"] == "llama3-8b-slice-0-0.llama3-8b:8476"
    assert env["TPUJOB_NUM_PROCESSES"] == "16"
    assert (
        env["TPUJOB_HOST_ID"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert "MEGASCALE_NUM_SLICES" not in env
    flags = env["LIBTPU_INIT_ARGS"].split()
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert f"--xla_tpu_enable_sparse_core_collective_offload_{op}=true" in flags
    assert "--xla_tpu_scoped_vmem_limit_kib=65536" in flags
    # The operator restarts (api/failures.py): the JobSet fails at the first failed pod and never restarts itself.
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0} and "podFailurePolicy" not in rj["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120  # a step and this host's share of an 8B checkpoint
    assert pod["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    cfg = TrainerConfig.model_validate_json(cm["data"]["config.json"])
    assert cfg.mesh.fsdp == 128 and cfg.hosts_per_slice == 16 and cfg.model.layers == 32


def test_multislice_sets_megascale():
    _, js = render(parse_job(example("multislice.yaml")), default_image=TEST_IMAGE)
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 2
    env = _env(js)
    assert env["MEGASCALE_NUM_SLICES"] == "2" and env["TPUJOB_NUM_PROCESSES"] == "32"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "llama3-70b-2x-slice-0-0.llama3-70b-2x"
    assert env["MEGASCALE_SLICE_ID"]["fieldRef"]["fieldPath"] == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    # A user flag replaces ours rather than repeating it.
    assert env["LIBTPU_INIT_ARGS"].count("--xla_tpu_scoped_vmem_limit_kib=") == 1


def test_sparse_core_offload_can_be_turned_off_per_collective():
    _, js = render(parse_job(tiny_job(runtime={"sparseCoreOffload": {"allReduce": False}})))
    flags = _env(js)["LIBTPU_INIT_ARGS"]
    assert "offload_all_gather=true" in flags and "offload_all_reduce" not in flags


def test_v6e_gets_no_sparse_core_flags():
    _, js = render(
        parse_job(
            tiny_job(
                tpu={"generation": "v6e", "topology": "2x2"},
                training={"steps": 1, "globalBatch": 4, "sequenceLength": 128},
            )
        )
    )
    assert "LIBTPU_INIT_ARGS" not in _env(js)
    assert _pod(js)["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_renders_a_schema_valid_jobset(path, jobset_schema):
    for doc in yaml.safe_load_all(path.read_text()):
        manifests = render(parse_job(doc), default_image=TEST_IMAGE)
        jobsets = [m for m in manifests if m["kind"] == "JobSet"]
        assert len(jobsets) == 1
        for js in jobsets:
            assert jobset_schema.admit(js, "JobSet", "jobset.x-k8s.io") == js, "the schema pruned a field we emit"


HOSTILE = [
    "line1\nline2: injected\n- item",
    "quote\" and 'single' and `back`",
    "{{ config_json }} {% if true %}x{% endif %}",
    "key: value",
    "--- \n...\n",
    "tab\tand\x00nul\x85nel\u2028ls 😀",
    "&anchor *alias !!python/object:os.system",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_strings_never_change_structure(hostile, jobset_schema):
    doc = tiny_job(
        runtime={"env": [{"name": "USER_VALUE", "value": hostile}]},
        command=["sh", "-c", hostile],
        args=[hostile],
        nodeSelector={"example.com/pool": "p"},
        tolerations=[{"key": "example.com/x", "operator": "Equal", "value": "plain", "effect": "NoSchedule"}],
    )
    doc["metadata"]["labels"] = {"team": "a"}
    # A toleration's value is a label value to Kubernetes: a hostile one is refused, naming it, never rendered.
    refused = copy.deepcopy(doc)
    refused["spec"]["tolerations"][0]["value"] = hostile
    with pytest.raises(InvalidJob, match=r"spec\.tolerations\[0\]\.value"):
        parse_job(refused)
    cm, js = render(parse_job(doc))
    baseline_cm, baseline_js = render(
        parse_job(
            tiny_job(
                runtime={"env": [{"name": "USER_VALUE", "value": "plain"}]},
                command=["sh", "-c", "plain"],
                args=["plain"],
                nodeSelector={"example.com/pool": "p"},
                tolerations=[{"key": "example.com/x", "operator": "Equal", "value": "plain", "effect": "NoSchedule"}],
            )
        )
    )

    def shape(obj):
        if isinstance(obj, dict):
            return {k: shape(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [shape(v) for v in obj]
        return type(obj).__name__

    assert shape(js) == shape(baseline_js) and shape(cm) == shape(baseline_cm)
    container = _pod(js)["containers"][0]
    assert container["command"] == ["sh", "-c", hostile] and container["args"] == [hostile]
    assert _env(js)["USER_VALUE"] == hostile
    # The YAML stream round-trips exactly: two documents, same content.
    assert list(yaml.safe_load_all(to_yaml_stream([cm, js]))) == [cm, js]
    jobset_schema.admit(js, "JobSet", "jobset.x-k8s.io")


def test_names_must_fit_every_pod_hostname():
    # 4x4x8 = 32 hosts: longest pod name <name>-slice-0-31-abcde (JobSet's webhook counts the generated
    # suffix); 63 - len("-slice-0-31-abcde") = 46 characters.
    spec = {
        "tpu": {"generation": "v7x", "topology": "4x4x8"},
        "training": {"steps": 1, "globalBatch": 256, "sequenceLength": 128},
    }
    ok = tiny_job(**spec)
    ok["metadata"]["name"] = "a" * 46
    _, js = render(parse_job(ok))
    assert js["metadata"]["name"] == "a" * 46
    too_long = tiny_job(**spec)
    too_long["metadata"]["name"] = "a" * 47
    with pytest.raises(InvalidJob) as exc:
        parse_job(too_long)
    assert "metadata.name" in exc.value.problems[0] and "use at most 46" in exc.value.problems[0]


def test_owner_references_only_when_the_owner_is_known():
    doc = tiny_job()
    assert all("ownerReferences" not in m["metadata"] for m in render(parse_job(doc)))
    doc["metadata"]["uid"] = "1234"
    for m in render(parse_job(doc)):
        (ref,) = m["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "training.tpu-operator.dev/v1alpha1",
            "kind": "TPUTrainingJob",
            "name": "tiny",
            "uid": "1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_labels_find_every_object_and_pod():
    cm, js = render(parse_job(tiny_job()))
    for labels in (
        cm["metadata"]["labels"],
        js["metadata"]["labels"],
        js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"],
    ):
        assert labels["training.tpu-operator.dev/job"] == "tiny"


def test_user_node_selector_cannot_move_the_job_off_its_tpu():
    _, js = render(
        parse_job(
            tiny_job(
                nodeSelector={"cloud.google.com/gke-tpu-topology": "8x8x8", "cloud.google.com/gke-nodepool": "pool-a"}
            )
        )
    )
    assert _pod(js)["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    assert _pod(js)["nodeSelector"]["cloud.google.com/gke-nodepool"] == "pool-a"


def test_pvc_checkpoint_is_mounted_at_the_directory():
    _, js = render(parse_job(tiny_job(checkpoint={"directory": "/ckpt", "persistentVolumeClaim": "ckpt-pvc"})))
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt-pvc"}} in _pod(js)["volumes"]
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in _pod(js)["containers"][0]["volumeMounts"]


def test_config_map_is_the_trainer_config():
    cm, js = render(parse_job(tiny_job()))
    cfg = json.loads(cm["data"]["config.json"])
    assert cfg["mesh"] == {"data": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in _pod(js)["volumes"]
    assert _pod(js)["containers"][0]["command"][-1] == "/etc/tpujob/config.json"


def test_the_config_map_name_is_a_hash_of_what_it_holds_and_it_is_immutable():
    """Pods and the pre-flight mount the config by name: an edit renders a new name, the same job the same."""
    job = parse_job(tiny_job())
    cm, js = render(job)
    digest = hashlib.sha256(cm["data"]["config.json"].encode()).hexdigest()[:10]
    assert cm["metadata"]["name"] == f"tiny-config-{digest}" and cm["immutable"] is True
    assert render(parse_job(tiny_job()))[0] == cm  # deterministic: a restarted operator adopts it
    edited = tiny_job()
    edited["spec"]["training"]["steps"] = 7
    other, other_js = render(parse_job(edited))
    assert other["metadata"]["name"] != cm["metadata"]["name"]
    assert {"name": "config", "configMap": {"name": other["metadata"]["name"]}} in _pod(other_js)["volumes"]
    preflight_volumes = render_preflight(parse_job(edited), 2)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": other["metadata"]["name"]}} in preflight_volumes
    # An elastic job on fewer slices mounts the same ConfigMap: the trainer applies TPUJOB_SLICES to it.
    elastic = parse_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": "2x2x1", "slices": 3, "elastic": {"minSlices": 1}},
            training={"steps": 10, "globalBatch": 48, "sequenceLength": 128},
        )
    )
    assert render(elastic)[0] == render(elastic, None, 2)[0]


def test_a_jobset_records_the_spec_it_was_made_from_and_only_a_real_change_differs():
    """The operator refuses spec changes by comparing the job with its JobSet's applied-spec annotation:
    a job against its own JobSet shows no change (none invented by defaults or ordering), a changed field
    shows exactly its path, and spec.suspend (which the operator applies) never shows."""
    doc = example("moe.yaml")
    _, js = render(parse_job(doc))
    assert refused_changes(js, parse_job(copy.deepcopy(doc))) == []
    edited = copy.deepcopy(doc)
    edited["spec"]["training"]["steps"] += 1
    assert refused_changes(js, parse_job(edited)) == ["spec.training.steps"]
    edited["spec"]["suspend"] = True
    assert refused_changes(js, parse_job(edited)) == ["spec.training.steps"]


def test_operator_default_image_applies_only_where_the_job_names_none():
    imageless = tiny_job()
    del imageless["spec"]["image"]
    _, js = render(parse_job(imageless), default_image="registry.example/trainer:1")
    assert _pod(js)["containers"][0]["image"] == "registry.example/trainer:1"
    _, js = render(parse_job(tiny_job(image="mine:2")), default_image="registry.example/trainer:1")
    assert _pod(js)["containers"][0]["image"] == "mine:2"


@pytest.mark.parametrize(
    "spec,host_network",
    [
        ({}, False),  # one slice: pod networking
        (
            {
                "tpu": {"topology": "2x2x4", "slices": 2},
                "training": {"steps": 1, "globalBatch": 64, "sequenceLength": 128},
            },
            True,
        ),  # multislice: the node's network for DCN
        ({"runtime": {"hostNetwork": True}}, True),
        (
            {
                "tpu": {"topology": "2x2x4", "slices": 2},
                "training": {"steps": 1, "globalBatch": 64, "sequenceLength": 128},
                "runtime": {"hostNetwork": False},
            },
            False,
        ),
    ],
)
def test_host_networking_is_a_setting_on_for_multislice_by_default(spec, host_network):
    pod = _pod(render(parse_job(tiny_job(**spec)))[1])
    assert pod["hostNetwork"] is host_network
    assert ("dnsPolicy" in pod) is host_network and pod.get(
        "dnsPolicy", "ClusterFirstWithHostNet"
    ) == "ClusterFirstWithHostNet"


def test_the_trainer_runs_unprivileged_on_a_read_only_root():
    pod = _pod(render(parse_job(tiny_job()))[1])
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    (trainer,) = pod["containers"]
    assert trainer["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in trainer["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    paths = [m["mountPath"] for m in trainer["volumeMounts"]]
    assert len(paths) == len(set(paths))


def test_a_path_checkpoint_without_a_claim_stays_writable():
    pod = _pod(render(parse_job(tiny_job(checkpoint={"directory": "/ckpt"})))[1])
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in pod["containers"][0]["volumeMounts"]
    assert {"name": "checkpoints", "emptyDir": {}} in pod["volumes"]
    claimed = _pod(render(parse_job(tiny_job(checkpoint={"directory": "/ckpt", "persistentVolumeClaim": "c"})))[1])
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "c"}} in claimed["volumes"]
    assert [m["mountPath"] for m in claimed["containers"][0]["volumeMounts"]].count("/ckpt") == 1


def test_secrets_pass_by_reference_and_are_never_copied():
    from tpu_operator.rendering.preflight import render_preflight

    secret = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    field = {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    plain = {"name": "MODE", "value": "fast"}
    env_from = [{"secretRef": {"name": "aws"}, "prefix": "AWS_"}, {"configMapRef": {"name": "settings"}}]
    job = parse_job(tiny_job(runtime={"env": [secret, field, plain], "envFrom": env_from}))
    config_map, js = render(job)
    trainer = _pod(js)["containers"][0]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["HF_TOKEN"] == secret and env["NODE"] == field and env["MODE"] == plain
    assert trainer["envFrom"] == env_from
    # Only names of Secrets travel: no value is ever in the job, so none can be copied; and the ConfigMap and
    # the pre-flight's env hold no reference either.
    assert "hf" not in json.dumps(config_map) and "HF_TOKEN" not in json.dumps(config_map)
    preflight = render_preflight(job, 1)["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in preflight["env"]]
    assert "HF_TOKEN" not in names and "NODE" not in names and "MODE" in names and "envFrom" not in preflight

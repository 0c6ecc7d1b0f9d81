"""Hostile specs (issue 27) through `kubectl apply` and the operator on the real components: each is refused at
admission by the CRD's schema with kubectl's error naming the field, or admitted and then made phase Invalid by
the operator with status.message naming the field, with nothing made for it (no JobSet, ConfigMap, Secret,
pod or pre-flight Job; in the audit log, not one object created by the operator but Events and dry runs).
The cases are tests/hostile_cases.py's, the ones `tpujob validate` refuses (tests/test_hostile.py): all are
applied together, one namespace each, against one operator, then waited for in one loop."""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
import yaml

from tests.cluster.conftest import OPERATOR_NAMESPACE, SERVICE_ACCOUNT
from tests.cluster.kube import JOBS, JOBSETS, Cluster, wait_for
from tests.conftest import tiny_job
from tests.hostile_cases import CASES
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
WAIT_S = 90
PREFLIGHT_WAIT_S = 240  # the real pre-flight compile on the process kubelet's CPU node, on 2 busy cores
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{SERVICE_ACCOUNT}"

# The cases that are a job document kubectl can send (the YAML-level ones never leave `tpujob validate`:
# kubectl refuses them itself), and not one over the API's own request limits for client-side apply.
SENT = (
    "bool-as-int",
    "string-as-int",
    "2**63",
    "V7X",
    "padded-generation",
    "layers-10**400",
    "elastic-10**15-microbatches",
    "10000-env-entries",
    "huge-generation",
    "52-char-name-on-4x4x4",
    "bad-node-selector-value",
    "bad-toleration-key",
    "tolerationSeconds-on-NoSchedule",
    "bad-resource-name",
    "bad-image",
    "image-short-digest",
    "checkpoint-over-config",
    "relative-data-path",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "JAX_COORDINATOR_ADDRESS",
    "TPUJOB_NUM_PROCESSES",
    "duplicate-env",
    "raw-vmem-flag",
    "escape-in-generation",
    "escape-in-flag",
    "newline-in-env-name",
    "yaml-in-image",
    "secret-and-value",
    "fieldRef-to-anything",
    "envFrom-reserved-prefix",
    "request-over-limit",
    "overcommitted-extended-resource",
    "grow-back-probe-name",
)


def made_for(cluster: Cluster, ns: str) -> dict[str, list[str]]:
    """What exists in `ns` besides what Kubernetes puts in every namespace."""
    configmaps = [
        c.metadata.name
        for c in cluster.core.list_namespaced_config_map(ns).items
        if c.metadata.name != "kube-root-ca.crt"
    ]
    found = {
        "JobSets": [j["metadata"]["name"] for j in cluster.items(JOBSETS, ns)],
        "ConfigMaps": configmaps,
        "Secrets": [s.metadata.name for s in cluster.core.list_namespaced_secret(ns).items],
        "Pods": [p["metadata"]["name"] for p in cluster.pods(ns)],
        "Jobs": [j.metadata.name for j in cluster.batch.list_namespaced_job(ns).items],
    }
    return {kind: names for kind, names in found.items() if names}


def operator_creates(cluster: Cluster, namespaces: set[str]) -> list[str]:
    """The operator's successful create requests in `namespaces` (the audit log), less Events and dry runs."""
    return [
        f"{e['objectRef'].get('namespace')}/{e['resource']} {e['requestURI']}"
        for e in cluster.audit()
        if e["verb"] == "create"
        and e["user"].get("username") == OPERATOR_USER
        and e["objectRef"].get("namespace") in namespaces
        and e["resource"] != "events"
        and "dryRun=All" not in e["requestURI"]
        and e.get("responseStatus", {}).get("code", 0) < 300
    ]


def test_hostile_specs_are_refused_at_admission_or_invalid_with_nothing_created(
    local_cluster: Cluster, operator: Operator
):
    cluster = local_cluster
    cases = {case: (text, named) for case, text, named in CASES if case in SENT}
    assert sorted(cases) == sorted(SENT), set(SENT) - set(cases)
    refused: dict[str, str] = {}
    admitted: dict[str, tuple[str, str, str]] = {}  # case: (namespace, job name, what the error names)
    wrong: list[str] = []
    for i, (case, (text, named)) in enumerate(cases.items()):
        ns = cluster.namespace(f"hostile-{i}")
        result = cluster.kubectl("apply", "-n", ns, "-o", "json", "-f", "-", input=text, check=False)
        if result.returncode != 0:
            refused[case] = result.stderr
            # The schema names a map's field, not the bad key in it (spec.resources.requests for .nvidia).
            if not any(f"{field}:" in result.stderr for field in (named, named.rsplit(".", 1)[0])):
                wrong.append(f"{case}: kubectl's error does not name {named}: {result.stderr[:1000]}")
        else:
            admitted[case] = (ns, json.loads(result.stdout)["metadata"]["name"], named)

    def invalid() -> dict[str, Any] | None:
        statuses = {case: cluster.status(ns, name) for case, (ns, name, _) in admitted.items()}
        return statuses if all(s.get("phase") == "Invalid" for s in statuses.values()) else None

    statuses = wait_for(
        invalid,
        WAIT_S,
        "every admitted hostile job to be phase Invalid",
        diagnose=lambda: (
            json.dumps({c: cluster.status(ns, n).get("phase") for c, (ns, n, _) in admitted.items()})
            + operator.log_tail(20)
        ),
    )
    for case, (ns, _name, named) in admitted.items():
        if named not in statuses[case].get("message", ""):
            wrong.append(f"{case}: status.message does not name {named}: {statuses[case].get('message')}")
        if made := made_for(cluster, ns):
            wrong.append(f"{case}: made {made}")
    assert not wrong, "\n".join(wrong)
    assert operator_creates(cluster, {ns for ns, _, _ in admitted.values()}) == []
    # Both paths are taken: what the schema can say, it says at admission; the rest is the operator's.
    assert refused and admitted, (sorted(refused), sorted(admitted))
    print(f"\nrefused at admission: {sorted(refused)}\nInvalid by the operator: {sorted(admitted)}")


def everything_in(cluster: Cluster, ns: str, but_secret: str) -> str:
    """Every object in `ns` as JSON text (the job, its children, the pre-flight Job, pods, Events), and every
    Secret but `but_secret`."""
    core, batch = cluster.core, cluster.batch
    found = [
        cluster.items(JOBS, ns),
        cluster.items(JOBSETS, ns),
        cluster.pods(ns),
        *(
            cluster.api.sanitize_for_serialization(x.items)
            for x in (
                core.list_namespaced_config_map(ns),
                batch.list_namespaced_job(ns),
                core.list_namespaced_event(ns),
            )
        ),
    ]
    secrets = [
        s
        for s in cluster.api.sanitize_for_serialization(core.list_namespaced_secret(ns).items)
        if s["metadata"]["name"] != but_secret
    ]
    return json.dumps([found, secrets])


def test_secret_reaches_the_trainer_by_reference_and_no_other_object(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("secretref")
    value = f"s3cr3t-{uuid.uuid4().hex}"
    cluster.core.create_namespaced_secret(ns, {"metadata": {"name": "creds"}, "stringData": {"token": value}})
    # The real pre-flight runs first (its Job is searched too), then the JobSet's pod on one of kwok's nodes.
    doc = tiny_job(
        runtime={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}]}
    )
    cluster.apply(doc, namespace=ns)
    (pod,) = wait_for(
        lambda: cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=tiny"),
        PREFLIGHT_WAIT_S,
        "the JobSet's pod",
        diagnose=lambda: json.dumps(cluster.status(ns, "tiny")) + operator.log_tail(20),
    )
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    (env,) = [e for e in trainer["env"] if e["name"] == "HF_TOKEN"]
    assert env == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}, env
    assert cluster.batch.list_namespaced_job(ns).items, "the pre-flight Job"
    dump = everything_in(cluster, ns, but_secret="creds")
    assert value not in dump and base64.b64encode(value.encode()).decode() not in dump


def test_a_job_edited_before_its_jobset_exists_mounts_the_edited_config(local_cluster: Cluster, operator: Operator):
    cluster, ns = local_cluster, local_cluster.namespace("edited")
    doc = tiny_job()
    cluster.apply(doc, namespace=ns)
    # While its pre-flight compiles there is no JobSet: the API server lets the spec change.
    first = wait_for(
        lambda: [
            c.metadata.name
            for c in cluster.core.list_namespaced_config_map(ns).items
            if c.metadata.name.startswith("tiny-config-")
        ],
        PREFLIGHT_WAIT_S,
        "the first ConfigMap",
    )
    edited = copy.deepcopy(doc)
    edited["spec"]["training"]["steps"] = 12
    result = cluster.apply(edited, namespace=ns, check=False)
    assert result.returncode == 0, f"edit refused (the JobSet came first?):\n{result.stderr}"
    (pod,) = wait_for(
        lambda: cluster.pods(ns, "jobset.sigs.k8s.io/jobset-name=tiny"),
        2 * PREFLIGHT_WAIT_S,
        "the JobSet's pod",
        diagnose=lambda: json.dumps(cluster.status(ns, "tiny")) + operator.log_tail(20),
    )
    (mounted,) = [v["configMap"]["name"] for v in pod["spec"]["volumes"] if v["name"] == "config"]
    config = json.loads(cluster.core.read_namespaced_config_map(mounted, ns).data["config.json"])
    assert config["training"]["steps"] == 12, config
    assert mounted not in first, (mounted, first)


# Valid for the CRD and `tpujob validate`, refused by the API server in the pod only: huge pages need a cpu or
# memory request, and the trainer's container requests google.com/tpu alone.
HUGE_PAGES = {"resources": {"requests": {"hugepages-2Mi": "2Mi"}, "limits": {"hugepages-2Mi": "2Mi"}}}


def test_what_only_a_pod_can_be_refused_for_makes_the_job_invalid_before_any_pod(
    local_cluster: Cluster, operator: Operator
):
    cluster, ns = local_cluster, local_cluster.namespace("hugepages")
    cluster.apply(tiny_job(**HUGE_PAGES), namespace=ns)
    status = wait_for(
        lambda: (s := cluster.status(ns, "tiny")).get("phase") == "Invalid" and s,
        WAIT_S,
        "phase Invalid",
        diagnose=lambda: json.dumps(cluster.status(ns, "tiny")) + operator.log_tail(20),
    )
    assert "the API server refuses Pod tiny-slice-" in status["message"], status
    assert "hugepages" in status["message"].lower(), status
    assert made_for(cluster, ns) == {}, made_for(cluster, ns)


def validate_server(cluster: Cluster, tmp_path, ns: str, doc: dict[str, Any]) -> subprocess.CompletedProcess:
    path = tmp_path / f"{uuid.uuid4().hex}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "validate", "--server", "-n", ns, "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
    )


def test_validate_server_is_the_operators_dry_run_against_the_kubeconfigs_cluster(local_cluster: Cluster, tmp_path):
    cluster, ns = local_cluster, local_cluster.namespace("validate")
    admitted = validate_server(cluster, tmp_path, ns, tiny_job())
    assert admitted.returncode == 0, admitted.stderr
    assert f"admits {ns}/tiny in a dry run" in admitted.stdout, admitted.stdout
    refused = validate_server(cluster, tmp_path, ns, tiny_job(**HUGE_PAGES))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith(f"error: {ns}/tiny: the API server refuses Pod tiny-slice-"), refused.stderr
    assert "hugepages" in refused.stderr.lower() and "Traceback" not in refused.stderr, refused.stderr
    assert made_for(cluster, ns) == {}  # a dry run: nothing stored

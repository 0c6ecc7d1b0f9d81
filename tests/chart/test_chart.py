"""The Helm chart, rendered with `helm template` (no cluster): RBAC, security, names, schema, config hash.

helm comes from the `helm` fixture (conftest.py): .tools/bin/helm or PATH; without it every test
that needs it is skipped with that instruction.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.chart.chart_helm import CHART, REQUIRED, ROOT, deployment_container, one, render, run_helm
from tpu_operator.controller.rbac import RBAC_RULES

# The operator's permissions, exactly as the operator declares them (`tpujob operator --print-rbac`),
# split by where the chart grants them: (apiGroup, resource) -> verbs.
_OPERATOR = {(r["apiGroups"][0], res): set(r["verbs"]) for r in RBAC_RULES for res in r["resources"]}
PROXY_RULES = {k: v for k, v in _OPERATOR.items() if k[1] == "pods/proxy"}
CRD_RULES = {k: v for k, v in _OPERATOR.items() if k[1] == "customresourcedefinitions"}
NAMESPACE_RULES = {k: v for k, v in _OPERATOR.items() if k[1] in ("namespaces", "nodes")}  # cluster-scoped reads
PEERING = {k for k in _OPERATOR if k[0] == "kopf.dev"}  # the chart runs --standalone: no peering
LEASE_RULES = {k: v for k, v in _OPERATOR.items() if k == ("coordination.k8s.io", "leases")}  # its own namespace only
KEY_RULES = {k: v for k, v in _OPERATOR.items() if k == ("", "secrets")}  # the control key: its own namespace only
NAMESPACED_RULES = {
    k: v
    for k, v in _OPERATOR.items()
    if k not in {**PROXY_RULES, **CRD_RULES, **NAMESPACE_RULES, **LEASE_RULES, **KEY_RULES} and k not in PEERING
}

LONG_RELEASE = "a-release-name-that-is-exactly-fifty-three-characters"  # helm's maximum
assert len(LONG_RELEASE) == 53


def rules_of(role: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs; fails on wildcards, on a resource granted twice, on any other rule field."""
    result: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert not any("*" in item for item in rule[field]), f"wildcard in {role['metadata']['name']}: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource)
                assert key not in result, f"{key} granted twice in {role['metadata']['name']}"
                result[key] = set(rule["verbs"])
    return result


def is_leader_rbac(doc: dict) -> bool:
    return doc["metadata"]["name"].endswith("-leader")


def is_control_key_rbac(doc: dict) -> bool:
    return doc["metadata"]["name"].endswith("-control-key")


def is_own_namespace_rbac(doc: dict) -> bool:
    """The Roles (and bindings) in the operator's own namespace: the leader Lease and the control key."""
    return is_leader_rbac(doc) or is_control_key_rbac(doc)


def config_hash(docs: list[dict]) -> str:
    return one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


# --- the chart itself -----------------------------------------------------------------------------


def test_lint_default_and_non_default_values(helm, tmp_path):
    for values in (
        {},
        {
            "operator": {"watchNamespaces": ["team-a", "team-b"], "metricsAccess": "proxy"},
            "rbac": {"namespaced": True},
            "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        },
    ):
        result = run_helm(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_crd_is_a_byte_identical_copy_of_the_generated_one():
    assert (CHART / "crds" / "tputrainingjob.yaml").read_bytes() == (
        ROOT / "crds" / "tputrainingjob.yaml"
    ).read_bytes(), "charts/tpu-operator/crds/ drifted: cp crds/tputrainingjob.yaml charts/tpu-operator/crds/"


def test_rendered_crd_is_the_generated_one(helm, tmp_path):
    crds = [d for d in render(helm, tmp_path, include_crds=True) if d["kind"] == "CustomResourceDefinition"]
    assert crds == [yaml.safe_load((ROOT / "crds" / "tputrainingjob.yaml").read_text())]


def values_docs() -> tuple[list[tuple[str, Any, str]], list[str]]:
    """([(dotted path, default, `# --` description)], [undocumented leaf paths]) of values.yaml."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    stack: list[tuple[int, str]] = []
    documented, undocumented, doc = [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            doc = stripped[4:].strip()
            continue
        match = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not match:  # a comment, a blank line or a list item: a description must sit right above its key
            doc = None if not stripped or not stripped.startswith("#") else doc
            continue
        indent = len(match.group(1))
        stack = [(i, key) for i, key in stack if i < indent] + [(indent, match.group(2))]
        path = ".".join(key for _, key in stack)
        value = values
        for _, key in stack:
            value = value[key]
        if doc:
            documented.append((path, value, doc))
        elif not any(path.startswith(p + ".") for p, _, _ in documented) and not (isinstance(value, dict) and value):
            undocumented.append(path)
        doc = None
    return documented, undocumented


def values_table() -> str:
    documented, _ = values_docs()
    return "\n".join(
        f"| `{path}` | `{json.dumps(value)}` | {doc.replace('|', chr(92) + '|')} |" for path, value, doc in documented
    )


def test_every_value_is_documented():
    documented, undocumented = values_docs()
    assert not undocumented, f"values without a `# --` description: {undocumented}"
    assert len(documented) > 30


def test_chart_readme_lists_every_value():
    readme_rows = [line for line in (CHART / "README.md").read_text().splitlines() if line.startswith("| `")]
    assert readme_rows == values_table().splitlines(), (
        "charts/tpu-operator/README.md's values table drifted from values.yaml; paste the table printed by "
        "`.venv/bin/python tests/chart/test_chart.py`"
    )


# --- RBAC ---------------------------------------------------------------------------------------


def test_default_rbac_is_cluster_wide_least_privilege(helm, tmp_path):
    docs = render(helm, tmp_path)
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and not is_own_namespace_rbac(d)]
    role = one(docs, "ClusterRole")
    assert rules_of(role) == {**NAMESPACED_RULES, **CRD_RULES, **NAMESPACE_RULES}
    # Kueue's Workloads are followed through a watch and only ever patched for spec.active (a queued job's
    # suspend); pods are listed, never watched, and a failed or hung attempt's pods deleted as a collection;
    # created only in a dry run (children.dry_run).
    assert rules_of(role)[("kueue.x-k8s.io", "workloads")] == {"list", "watch", "patch"}
    assert rules_of(role)[("", "pods")] == {"list", "create", "deletecollection"}
    # The pre-flight compile: a batch Job per job spec generation, watched through a kopf index.
    assert rules_of(role)[("batch", "jobs")] == {"get", "list", "watch", "create"}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    account = one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "tpu-system"}
    ]
    _, container = deployment_container(docs)
    assert "--all-namespaces" in container["args"]


def test_proxy_metrics_access_adds_pods_proxy_only(helm, tmp_path):
    docs = render(helm, tmp_path, {"operator": {"metricsAccess": "proxy"}})
    assert rules_of(one(docs, "ClusterRole")) == {**NAMESPACED_RULES, **PROXY_RULES, **CRD_RULES, **NAMESPACE_RULES}
    assert "--metrics-access=proxy" in deployment_container(docs)[1]["args"]


def test_watched_namespaces_keep_the_namespaces_permission(helm, tmp_path):
    # kopf lists and watches namespaces even for named ones (a 403 there is retried for as long as it runs).
    docs = render(helm, tmp_path, {"operator": {"watchNamespaces": ["team-a"]}})
    assert rules_of(one(docs, "ClusterRole")) == {**NAMESPACED_RULES, **CRD_RULES, **NAMESPACE_RULES}
    args = deployment_container(docs)[1]["args"]
    assert "--namespace=team-a" in args and "--all-namespaces" not in args


def test_namespace_scoped_rbac(helm, tmp_path):
    docs = render(
        helm,
        tmp_path,
        {"rbac": {"namespaced": True}, "operator": {"watchNamespaces": ["team-a", "team-b"], "metricsAccess": "proxy"}},
    )
    roles = [d for d in docs if d["kind"] == "Role" and not is_own_namespace_rbac(d)]
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and not is_own_namespace_rbac(d)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert rules_of(role) == {**NAMESPACED_RULES, **PROXY_RULES}
        assert ("kueue.x-k8s.io", "workloads") in rules_of(role)  # kopf watches Workloads per namespace too
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == "tpu-system"
    # Only reads of CRDs and namespaces stay cluster-wide (kopf scans both).
    assert rules_of(one(docs, "ClusterRole")) == {**CRD_RULES, **NAMESPACE_RULES}
    args = deployment_container(docs)[1]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def test_namespace_scoped_rbac_needs_watched_namespaces(helm, tmp_path):
    result = run_helm(helm, "template", "t", str(CHART), values={"rbac": {"namespaced": True}}, tmp=tmp_path)
    assert result.returncode != 0
    assert "rbac.namespaced=true needs operator.watchNamespaces" in result.stderr


def test_jobset_install_true_is_refused_with_instructions(helm, tmp_path):
    result = run_helm(helm, "template", "t", str(CHART), values={"jobset": {"install": True}}, tmp=tmp_path)
    assert result.returncode != 0
    assert "kubernetes-sigs/jobset/releases" in result.stderr


# --- the Deployment ---------------------------------------------------------------------------------


def test_deployment_is_two_hardened_replicas_electing_a_leader(helm, tmp_path):
    deployment, container = deployment_container(render(helm, tmp_path))
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    # Two replicas; a roll starts a new one before it stops an old one, so a standby is always there.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert container["image"] == "registry.example/tpu-operator:0.1.0"
    assert container["args"] == [
        "--standalone",
        "--leader-elect",
        "--leader-elect-resource-name=t-tpu-operator-leader",
        "--leader-elect-resource-namespace=tpu-system",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
        "--all-namespaces",
        "--control-key-namespace=tpu-system",
        "--health-port=8080",
        "--metrics-port=9090",
        "--default-image=registry.example/tpu-operator-workload:0.1.0",
        "--metrics-access=direct",
        "--metrics-interval=15",
        "--resync-interval=60",
    ]
    # The Lease's holderIdentity starts with the pod's name (the downward API).
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert {"name": "TPUJOB_LOG_LEVEL", "value": "INFO"} in container["env"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert set(container["resources"]) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) & set(container["resources"]["limits"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    tmp_mounts = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp_mounts) == 1
    volume = next(v for v in pod["volumes"] if v["name"] == tmp_mounts[0]["name"])
    assert "emptyDir" in volume


def test_metrics_service_and_monitors(helm, tmp_path):
    docs = render(helm, tmp_path)
    service = one(docs, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]

    docs = render(
        helm,
        tmp_path,
        {
            "metrics": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "podMonitor": {"enabled": True},
            }
        },
    )
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service")["metadata"]["labels"].items()
    assert one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_names_fit_63_characters_with_a_long_release_name(helm, tmp_path):
    docs = render(
        helm,
        tmp_path,
        {
            "operator": {"watchNamespaces": ["team-a"]},
            "rbac": {"namespaced": True},
            "metrics": {"serviceMonitor": {"enabled": True}},
        },
        release=LONG_RELEASE,
    )
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind, name in names:
        assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), (kind, name)
    for doc in docs:
        for value in (doc["metadata"].get("labels") or {}).values():
            assert len(value) <= 63 and not value.endswith("-"), value
    service, deployment = one(docs, "Service")["metadata"]["name"], one(docs, "Deployment")["metadata"]["name"]
    assert service.endswith("-metrics") and service != deployment


def test_config_hash_rolls_the_pod_on_config_changes_only(helm, tmp_path):
    base = config_hash(render(helm, tmp_path))
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert config_hash(render(helm, tmp_path)) == base  # deterministic
    assert config_hash(render(helm, tmp_path, {"podAnnotations": {"team": "ml"}})) == base
    changes = [
        {"operator": {"defaultImage": "example.com/workload:2"}},
        {"operator": {"logLevel": "DEBUG"}},
        {"operator": {"metricsInterval": 30}},
        {"operator": {"resyncInterval": 120}},
        {"operator": {"watchNamespaces": ["team-a"]}},
        {"image": {"tag": "0.1.1"}},
    ]
    hashes = {config_hash(render(helm, tmp_path, change)) for change in changes}
    assert base not in hashes and len(hashes) == len(changes)


@pytest.mark.parametrize("missing", ["image.repository", "operator.defaultImage"])
def test_the_images_are_required_with_how_to_build_them(helm, tmp_path, missing):
    section, key = missing.split(".")
    values = {**REQUIRED, section: {**REQUIRED[section], key: ""}}
    result = run_helm(helm, "template", "t", str(CHART), values=values, tmp=tmp_path, required=False)
    assert result.returncode != 0, f"installed without {missing}"
    assert f"{missing} is required" in result.stderr and "docs/operations.md, Images" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "values, field",
    [
        ({"operator": {"metricsInterval": "often"}}, "operator.metricsInterval"),
        ({"operator": {"resyncInterval": 0}}, "operator.resyncInterval"),
        ({"operator": {"watchNamespaces": "default"}}, "operator.watchNamespaces"),
        ({"operator": {"metricsAccess": "sideways"}}, "operator.metricsAccess"),
        ({"rbac": {"namespaced": "yes"}}, "rbac.namespaced"),
        ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
        ({"metrics": {"service": {"port": "http"}}}, "metrics.service.port"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"replicaCount": "two"}, "replicaCount"),
        ({"leaderElection": {"leaseDuration": "15s"}}, "leaseDuration"),
        ({"leaderElection": {"elect": True}}, "elect"),
    ],
)
def test_schema_rejects_wrong_values(helm, tmp_path, values, field):
    result = run_helm(helm, "template", "t", str(CHART), values=values, tmp=tmp_path)
    assert result.returncode != 0, f"{values} was accepted"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert field.split(".")[-1] in result.stderr, result.stderr


# --- replicas and the leader ------------------------------------------------------------------------


def test_the_lease_is_granted_by_a_role_in_the_release_namespace_only(helm, tmp_path):
    for values in ({}, {"rbac": {"namespaced": True}, "operator": {"watchNamespaces": ["team-a"]}}):
        docs = render(helm, tmp_path, values)
        role, binding = (one([d for d in docs if is_leader_rbac(d)], kind) for kind in ("Role", "RoleBinding"))
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "tpu-system"
        assert rules_of(role) == LEASE_RULES == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": one(docs, "ServiceAccount")["metadata"]["name"],
                "namespace": "tpu-system",
            }
        ]
        for cluster_role in (d for d in docs if d["kind"] == "ClusterRole"):
            assert ("coordination.k8s.io", "leases") not in rules_of(cluster_role)


def test_the_control_key_is_granted_by_a_role_in_the_release_namespace_only(helm, tmp_path):
    """get on the one Secret by its name, create (RBAC cannot limit a create by name), in the release namespace;
    no Secret anywhere else, with cluster-wide RBAC or Roles per watched namespace."""
    from tpu_operator.controller.control import KEY_SECRET

    for values in (
        {},
        {"leaderElection": {"enabled": False}, "replicaCount": 1},
        {"rbac": {"namespaced": True}, "operator": {"watchNamespaces": ["team-a"]}},
    ):
        docs = render(helm, tmp_path, values)
        role, binding = (one([d for d in docs if is_control_key_rbac(d)], kind) for kind in ("Role", "RoleBinding"))
        assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "tpu-system"
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [KEY_SECRET], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        ]
        assert {("", "secrets"): {v for r in role["rules"] for v in r["verbs"]}} == KEY_RULES
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        account = one(docs, "ServiceAccount")["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "tpu-system"}]
        others = [d for d in docs if d["kind"] in ("Role", "ClusterRole") and not is_control_key_rbac(d)]
        assert others and not [d for d in others if ("", "secrets") in rules_of(d)]


def test_replicas_spread_across_nodes_and_a_drain_leaves_one(helm, tmp_path):
    docs = render(helm, tmp_path)
    deployment = one(docs, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    # A user's own affinity replaces the default; one replica needs no budget.
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    docs = render(helm, tmp_path, {"affinity": mine, "replicaCount": 1})
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["affinity"] == mine
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]


def test_one_replica_without_election_is_allowed_two_are_refused(helm, tmp_path):
    docs = render(helm, tmp_path, {"replicaCount": 1, "leaderElection": {"enabled": False}})
    assert not [a for a in deployment_container(docs)[1]["args"] if a.startswith("--leader-elect")]
    assert not [d for d in docs if is_leader_rbac(d)]
    result = run_helm(helm, "template", "t", str(CHART), values={"leaderElection": {"enabled": False}}, tmp=tmp_path)
    assert result.returncode != 0 and "replicaCount > 1 needs leaderElection.enabled=true" in result.stderr
    result = run_helm(helm, "template", "t", str(CHART), values={"leaderElection": {"renewDeadline": 15}}, tmp=tmp_path)
    assert result.returncode != 0 and "renewDeadline must be below leaderElection.leaseDuration" in result.stderr


def test_the_chart_arguments_are_flags_the_operator_takes(helm, tmp_path):
    """Every argument the chart renders parses with `tpujob operator`'s own parser, and the election's
    timings reach the operator's options as the values say."""
    from tpu_operator.cli import build_parser, operator_options

    values = {"leaderElection": {"leaseDuration": 20, "renewDeadline": 12, "retryPeriod": 3}}
    args = deployment_container(render(helm, tmp_path, values))[1]["args"]
    options = operator_options(build_parser().parse_args(["operator", *args]))
    assert options.leader_elect and options.standalone
    assert (options.lease_name, options.lease_namespace) == ("t-tpu-operator-leader", "tpu-system")
    assert options.control_key_namespace == "tpu-system"  # where the chart's Role lets it read and make the key
    timing = options.leader_timing
    assert (timing.lease_duration_s, timing.renew_deadline_s, timing.retry_period_s) == (20, 12, 3)


if __name__ == "__main__":  # print the values table of charts/tpu-operator/README.md
    print("| Key | Default | Description |\n|---|---|---|")
    print(values_table())

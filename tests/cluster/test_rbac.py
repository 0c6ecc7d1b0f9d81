"""The chart on the real API server: `helm install`, then operators authorized only by the chart's own RBAC
(they run as local processes with a token of the chart's ServiceAccount). The API server's audit log
says what each one asked for and what it was answered.

Each test makes what it checks (its namespaces, its release or ClusterRole, its own operator and job) and
removes what it made, so it passes alone and in any order. conftest.py still runs this module last: the
check of the chart's ServiceAccount then covers every request the suite's operators made, not only its own.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.cluster.conftest import CHART, NO_NODE, OPERATOR_NAMESPACE, RELEASE, chart_args, helm_run
from tests.cluster.jobs import WAIT_S, job_doc, namespaced, reconciles, status_where, watch_ended
from tests.cluster.kube import JOBSETS, Cluster, authorization, condition, wait_for
from tests.conftest import operator_job
from tests.operator_process import Operator

pytestmark = pytest.mark.cluster
SESSION_START = time.time()  # collection: before any test of the session ran


def test_a_namespaced_install_acts_only_in_its_namespaces(local_cluster: Cluster, helm: str, tmp_path):
    cluster = local_cluster
    team_a, team_b = cluster.namespace("team-a"), cluster.namespace("team-b")
    home = cluster.namespace("scoped-system")
    release = home  # unique: its ClusterRole's name is cluster-wide
    helm_run(
        helm,
        cluster,
        "install",
        release,
        str(CHART),
        "-n",
        home,
        "--set",
        "rbac.namespaced=true",
        "--set",
        f"operator.watchNamespaces={{{team_a}}}",
        *NO_NODE,
    )
    try:
        scoped_operator_acts_only_in(cluster, team_a, team_b, home, release, tmp_path)
    finally:
        helm_run(helm, cluster, "uninstall", release, "-n", home)


def scoped_operator_acts_only_in(cluster: Cluster, team_a: str, team_b: str, home: str, release: str, tmp_path) -> None:
    roles = cluster.kubectl("get", "roles,rolebindings", "-n", team_a, "-o", "name").stdout.split()
    assert f"role.rbac.authorization.k8s.io/{release}-tpu-operator" in roles, roles
    deployment = json.loads(
        cluster.kubectl("get", "deployment", f"{release}-tpu-operator", "-n", home, "-o", "json").stdout
    )
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    namespaces = [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
    assert namespaces == [team_a], args
    kubeconfig = cluster.token_kubeconfig(home, f"{release}-tpu-operator", tmp_path / "kubeconfig")
    user = f"system:serviceaccount:{home}:{release}-tpu-operator"
    since = time.time()
    op = Operator(kubeconfig, tmp_path, *chart_args(cluster, home, release)).start()
    try:
        for ns in (team_b, team_a):  # the unwatched namespace's job first: there before the operator acts
            cluster.apply(job_doc("scoped"), namespace=ns)
        wait_for(
            lambda: cluster.status(team_a, "scoped").get("jobSetName"),
            60,
            "the JobSet in the watched namespace",
            diagnose=op.log_tail,
        )
    finally:
        op.kill(signal.SIGTERM)
    # Not a wait for something not to happen: the operator has ended, and once the end of its watch of the jobs in
    # team_a is in the audit log, so is every request it made. It could only have seen team_b's job through a
    # request in team_b or a cluster-wide read of the jobs (asserted below: none), and made nothing there.
    wait_for(
        lambda: watch_ended(cluster, since, user, team_a, "tputrainingjobs"),
        30,
        "the end of the operator's watch in the audit log",
    )
    assert cluster.get(JOBSETS, team_b, "scoped") is None and not cluster.status(team_b, "scoped")
    requests = [e for e in cluster.audit(since) if e["user"]["username"] == user]
    assert requests, "no request from the namespaced operator in the audit log"
    assert any(authorization(e) == "allow" for e in requests), "the audit log has no authorization decisions"
    forbidden = [(e["verb"], e["requestURI"]) for e in requests if authorization(e) == "forbid"]
    assert not forbidden, forbidden
    # Elsewhere only its control key, in its own namespace (controller/control.py).
    key = (home, "secrets")
    elsewhere = sorted(
        {
            e["requestURI"]
            for e in requests
            if e["objectRef"].get("namespace") not in (None, team_a)
            and (e["objectRef"].get("namespace"), e["objectRef"].get("resource")) != key
        }
    )
    assert not elsewhere, elsewhere
    # Cluster-wide it only reads: the CRDs and namespaces kopf scans, discovery, and the nodes whose TPU
    # health it follows (controller/health.py; nodes belong to no namespace).
    cluster_scoped = {
        (e["verb"], e["objectRef"].get("resource")) for e in requests if "namespace" not in e["objectRef"]
    }
    assert cluster_scoped <= {
        ("list", "customresourcedefinitions"),
        ("watch", "customresourcedefinitions"),
        ("list", "namespaces"),
        ("watch", "namespaces"),
        ("list", "nodes"),
        ("watch", "nodes"),
        ("get", None),
    }, cluster_scoped


def test_a_verb_missing_from_the_rbac_shows_as_a_403_on_the_job_and_is_not_retried(
    local_cluster: Cluster, chart: str, tmp_path
):
    """An operator whose ClusterRole is the chart's less `create` on JobSets: the API's 403 is on the job
    (Reconciled=False, reason Forbidden, the API's words) with one Warning Event, the create is not sent
    again while nothing changes, and once the verb is granted and the job edited, the JobSet is made."""
    cluster, ns = local_cluster, local_cluster.namespace("no-create")
    name = ns  # cluster-wide objects, unique per run
    role = json.loads(cluster.kubectl("get", "clusterrole", chart, "-o", "json").stdout)
    full = role["rules"]
    less = [
        {**r, "verbs": [v for v in r["verbs"] if v != "create"]} if "jobsets" in r.get("resources", []) else r
        for r in full
    ]
    assert less != full
    cluster.kubectl("create", "serviceaccount", "op", "-n", ns)
    cluster.apply(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name},
            "rules": less,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": ns}],
        },
    )
    # The control key, where the chart's operator keeps it (its args say): the chart's Role there, bound to op too.
    key_role = f"{RELEASE}-tpu-operator-control-key"
    cluster.kubectl(
        "create", "rolebinding", name, f"--role={key_role}", f"--serviceaccount={ns}:op", "-n", OPERATOR_NAMESPACE
    )
    args = namespaced(chart_args(cluster, OPERATOR_NAMESPACE, RELEASE), ns)
    op = Operator(cluster.token_kubeconfig(ns, "op", tmp_path / "kubeconfig"), tmp_path, *args)
    try:
        op.start()
        since = time.time()
        doc = operator_job()
        cluster.apply(doc, namespace=ns)
        refused = wait_for(
            lambda: condition(cluster.status(ns, "tiny"), "Reconciled"),
            60,
            "Reconciled on the job",
            diagnose=op.log_tail,
        )
        assert refused["status"] == "False" and refused["reason"] == "Forbidden", refused
        assert "403" in refused["message"] and "jobsets" in refused["message"] and "create" in refused["message"]
        assert refused["observedGeneration"] == 1
        wait_for(
            lambda: any(e["reason"] == "Forbidden" and e["type"] == "Warning" for e in cluster.events(ns, "tiny")),
            30,
            "a Warning Event Forbidden",
        )
        # Not a wait for the create not to come again: the operator's own count of reconciles it held back. Its
        # refusal's status write comes back as a job event (one held reconcile); an annotation, which moves no
        # generation, makes another. A retrying operator would have sent the create in each.
        wait_for(lambda: reconciles(op, "held") >= 1, 30, "a held reconcile after the refusal", diagnose=op.log_tail)
        cluster.kubectl("annotate", "tpujob", "tiny", "-n", ns, "test.tpu-operator.dev/poke=1")
        wait_for(
            lambda: reconciles(op, "held") >= 2,
            30,
            "a held reconcile after an edit of the metadata only",
            diagnose=op.log_tail,
        )
        user = f"system:serviceaccount:{ns}:op"
        creates = [
            e
            for e in cluster.audit(since)
            if e["user"]["username"] == user and e["verb"] == "create" and e["objectRef"].get("resource") == "jobsets"
        ]
        # The server-side dry run before it (children.dry_run) is a create too, refused alike: one of each.
        dry = [e for e in creates if "dryRun=All" in e.get("requestURI", "")]
        assert len(dry) <= 1 and len(creates) - len(dry) == 1, creates
        assert all(authorization(e) == "forbid" for e in creates), creates
        assert len([e for e in cluster.events(ns, "tiny") if e["reason"] == "Forbidden"]) == 1
        # The verb granted and the job edited (its generation moves): tried at once, and it goes through.
        cluster.apply({**role, "metadata": {"name": name}, "rules": full})
        wait_for(
            lambda: (
                cluster.kubectl(
                    "auth", "can-i", "create", "jobsets.jobset.x-k8s.io", "-n", ns, f"--as={user}", check=False
                ).stdout.strip()
                == "yes"
            ),
            30,
            "the verb granted",
        )
        cluster.apply({**doc, "spec": {**doc["spec"], "suspend": True}}, namespace=ns)
        status = wait_for(
            lambda: (
                (s := cluster.status(ns, "tiny")).get("jobSetName")
                and condition(s, "Reconciled").get("status") == "True"
                and s
            ),
            60,
            "the JobSet after the fix",
            diagnose=op.log_tail,
        )
        assert condition(status, "Reconciled")["observedGeneration"] == 2
    finally:
        op.kill(signal.SIGTERM)
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", name, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "rolebinding", name, "-n", OPERATOR_NAMESPACE, "--ignore-not-found", check=False)


def test_no_request_of_the_charts_operator_was_forbidden_in_the_whole_suite(
    local_cluster: Cluster, chart: str, operator_kubeconfig, operator_args, tmp_path
):
    """Every operator of the suite (the lifecycle with its pre-flight, restarts, Kueue, kills) ran with the
    chart's ServiceAccount: not one of its requests was refused. This test runs one of its own, on a job of
    its own to its first Event, so the check has requests to look at however the suite is ordered or cut."""
    cluster, ns = local_cluster, local_cluster.namespace("rbac-own")
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart}"
    op = Operator(operator_kubeconfig, tmp_path, *namespaced(operator_args, ns)).start()
    try:
        cluster.apply(job_doc("own"), namespace=ns)
        status_where(cluster, ns, "own", lambda s: s.get("jobSetName"), "a JobSet", op)
        wait_for(lambda: any(e["reason"] == "Created" for e in cluster.events(ns, "own")), WAIT_S, "the Event Created")
    finally:
        op.kill(signal.SIGTERM)
    wait_for(
        lambda: watch_ended(cluster, SESSION_START, user, ns, "tputrainingjobs"),
        30,
        "the end of the operator's watch in the audit log",
    )
    requests = [e for e in local_cluster.audit(SESSION_START) if e["user"]["username"] == user]
    used = sorted({(e["objectRef"].get("apiGroup", ""), e["resource"], e["verb"]) for e in requests if e["resource"]})
    print("requests of the chart's operator (group, resource, verb):", used)
    assert ("jobset.x-k8s.io", "jobsets", "create") in used and ("", "events", "create") in used, used
    assert any(authorization(e) == "allow" for e in requests), "the audit log has no authorization decisions"
    forbidden = [
        (e["verb"], e["requestURI"], e["responseStatus"].get("message", ""))
        for e in requests
        if authorization(e) == "forbid"
    ]
    assert not forbidden, forbidden
    # Other refusals are admission's, not RBAC's (Events for a job whose test namespace is being deleted).
    print(
        "refused by admission:",
        sorted(
            {
                e["responseStatus"].get("message", "")[:120]
                for e in requests
                if e["responseStatus"]["code"] == 403 and authorization(e) != "forbid"
            }
        ),
    )


def test_the_leader_lease_is_granted_in_the_release_namespace_only(local_cluster: Cluster, chart: str):
    """The chart's Role for the leader election: get, create and update on Leases in the release namespace, and
    nothing on Leases anywhere else (the API server's own answer, `kubectl auth can-i`)."""
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart}"

    def can(verb: str, namespace: str) -> bool:
        answer = local_cluster.kubectl(
            "auth", "can-i", verb, "leases.coordination.k8s.io", "-n", namespace, f"--as={user}", check=False
        )
        return answer.stdout.strip() == "yes"

    assert all(can(verb, OPERATOR_NAMESPACE) for verb in ("get", "create", "update"))
    assert not any(can(verb, OPERATOR_NAMESPACE) for verb in ("delete", "list", "watch", "patch"))
    assert not any(can(verb, "default") for verb in ("get", "create", "update"))


def test_the_control_key_is_the_only_secret_the_operator_may_read(local_cluster: Cluster, chart: str):
    """The chart's Role for the control key (controller/control.py): get on that one Secret, create (RBAC cannot
    limit a create by name) in the release namespace; no other Secret readable, no Secret anywhere else (the API
    server's own answer, `kubectl auth can-i`)."""
    from tpu_operator.controller.control import KEY_SECRET

    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart}"

    def can(verb: str, what: str, namespace: str) -> bool:
        answer = local_cluster.kubectl("auth", "can-i", verb, what, "-n", namespace, f"--as={user}", check=False)
        return answer.stdout.strip() == "yes"

    assert can("get", f"secret/{KEY_SECRET}", OPERATOR_NAMESPACE) and can("create", "secrets", OPERATOR_NAMESPACE)
    assert not can("get", "secret/another", OPERATOR_NAMESPACE) and not can("list", "secrets", OPERATOR_NAMESPACE)
    assert not any(can(verb, "secrets", OPERATOR_NAMESPACE) for verb in ("update", "patch", "delete", "watch"))
    assert not any(
        can(verb, what, "default") for verb in ("get", "create") for what in ("secrets", f"secret/{KEY_SECRET}")
    )

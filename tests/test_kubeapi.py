"""Black-box tests of the fake API server (tests/kubeapi) over real HTTP, in a subprocess."""

import json
import pathlib
import urllib.error
import urllib.request

import kubernetes
import pytest
import yaml

from tests.conftest import NO_REAL_JOBSET_CRD, REAL_JOBSET_CRD
from tests.kubeapi.harness import kubectl, kubectl_background, read_until, running_apiserver, wait_for

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CM = "/api/v1/namespaces/default/configmaps"
WIDGETS = "/apis/example.com/v1/namespaces/default/widgets"

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "additionalPrinterColumns": [
                {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "required": ["size"], "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "port": {"x-kubernetes-int-or-string": True},
                        "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    }},
                    "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                },
            }},
        }],
    },
}


def widget(name: str, size: int = 1, **meta) -> dict:
    return {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": name, **meta}, "spec": {"size": size}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One server for the module keeps the file fast; tests use distinct object names.
    with running_apiserver(tmp_path_factory.mktemp("kubeapi")) as srv:
        status, body = srv.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD)
        assert status == 201, body
        yield srv


def test_core_discovery(server):
    status, api = server.request("GET", "/api")
    assert status == 200 and api["versions"] == ["v1"]
    status, core = server.request("GET", "/api/v1")
    assert status == 200 and core["groupVersion"] == "v1"
    names = {r["name"] for r in core["resources"]}
    assert {"namespaces", "configmaps", "services", "pods", "pods/status", "events", "secrets", "serviceaccounts"} <= names
    status, groups = server.request("GET", "/apis")
    group_versions = {v["groupVersion"] for g in groups["groups"] for v in g["versions"]}
    assert {"apiextensions.k8s.io/v1", "coordination.k8s.io/v1", "events.k8s.io/v1", "apps/v1",
            "rbac.authorization.k8s.io/v1", "example.com/v1"} <= group_versions
    status, widgets = server.request("GET", "/apis/example.com/v1")
    assert {r["name"] for r in widgets["resources"]} == {"widgets", "widgets/status"}
    assert server.request("GET", "/version")[1]["major"] == "1"


def test_namespace_and_configmap_create(server):
    status, ns = server.request("POST", "/api/v1/namespaces", {"metadata": {"name": "team-a"}})
    assert status == 201 and ns["status"]["phase"] == "Active"
    status, cm = server.request("POST", "/api/v1/namespaces/team-a/configmaps",
                                {"metadata": {"name": "cfg"}, "data": {"k": "v"}})
    assert status == 201
    assert cm["metadata"]["uid"] and cm["metadata"]["creationTimestamp"]
    assert int(cm["metadata"]["resourceVersion"]) > int(ns["metadata"]["resourceVersion"])
    status, again = server.request("POST", "/api/v1/namespaces/team-a/configmaps", {"metadata": {"name": "cfg"}})
    assert status == 409 and again["kind"] == "Status" and again["reason"] == "AlreadyExists"
    status, missing = server.request("POST", "/api/v1/namespaces/nowhere/configmaps", {"metadata": {"name": "x"}})
    assert status == 404, missing
    status, listed = server.request("GET", "/api/v1/namespaces/team-a/configmaps")
    assert listed["kind"] == "ConfigMapList" and listed["apiVersion"] == "v1"
    assert [item["metadata"]["name"] for item in listed["items"]] == ["cfg"]


def test_put_with_stale_resource_version_conflicts(server):
    _, cm = server.request("POST", CM, {"metadata": {"name": "stale"}, "data": {"a": "1"}})
    stale = json.loads(json.dumps(cm))
    cm["data"]["a"] = "2"
    status, updated = server.request("PUT", f"{CM}/stale", cm)
    assert status == 200 and updated["data"] == {"a": "2"}
    stale["data"]["a"] = "3"
    status, conflict = server.request("PUT", f"{CM}/stale", stale)
    assert status == 409 and conflict["reason"] == "Conflict"


def test_generation_bumps_on_spec_changes_only(server):
    _, created = server.request("POST", WIDGETS, widget("gen", size=1))
    assert created["metadata"]["generation"] == 1
    merge = "application/merge-patch+json"
    _, labelled = server.request("PATCH", f"{WIDGETS}/gen", {"metadata": {"labels": {"a": "b"}}}, content_type=merge)
    assert labelled["metadata"]["generation"] == 1
    _, statused = server.request("PATCH", f"{WIDGETS}/gen/status", {"status": {"phase": "Up"}}, content_type=merge)
    assert statused["metadata"]["generation"] == 1
    _, resized = server.request("PATCH", f"{WIDGETS}/gen", [{"op": "replace", "path": "/spec/size", "value": 2}],
                                content_type="application/json-patch+json")
    assert resized["metadata"]["generation"] == 2
    rv = resized["metadata"]["resourceVersion"]
    _, same = server.request("PATCH", f"{WIDGETS}/gen", {"spec": {"size": 2}}, content_type=merge)
    assert same["metadata"]["resourceVersion"] == rv, "a no-op patch must not create a new resourceVersion"


def test_status_subresource_isolation(server):
    body = widget("iso", size=1)
    body["status"] = {"phase": "Ignored"}
    _, created = server.request("POST", WIDGETS, body)
    assert "status" not in created, "a create cannot set the status of a resource with a status subresource"
    merge = "application/merge-patch+json"
    _, main = server.request("PATCH", f"{WIDGETS}/iso", {"spec": {"size": 5}, "status": {"phase": "X"}}, content_type=merge)
    assert main["spec"]["size"] == 5 and "status" not in main
    _, sub = server.request("PATCH", f"{WIDGETS}/iso/status", {"spec": {"size": 9}, "status": {"phase": "Y"}},
                            content_type=merge)
    assert sub["spec"]["size"] == 5 and sub["status"] == {"phase": "Y"}


def test_table_from_printer_columns(server):
    server.request("POST", WIDGETS, widget("tabled", size=7))
    server.request("PATCH", f"{WIDGETS}/tabled/status", {"status": {"phase": "On"}},
                   content_type="application/merge-patch+json")
    accept = {"Accept": "application/json;as=Table;g=meta.k8s.io;v=v1, application/json"}
    status, table = server.request("GET", f"{WIDGETS}?fieldSelector=metadata.name%3Dtabled", headers=accept)
    assert status == 200 and (table["kind"], table["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Phase", "Age"]
    [row] = table["rows"]
    assert row["cells"][:3] == ["tabled", 7, "On"] and row["cells"][3].endswith("s")
    assert row["object"]["metadata"]["name"] == "tabled"


def test_schema_prunes_unknown_fields_and_rejects_invalid(server):
    body = widget("pruned", size=2)
    body["spec"].update(junk=1, port="http", extra={"free": {"form": 1}})
    status, created = server.request("POST", WIDGETS, body)
    assert status == 201, created
    assert "junk" not in created["spec"] and created["spec"]["extra"] == {"free": {"form": 1}}
    status, invalid = server.request("POST", WIDGETS, widget("bad", size=0))
    assert status == 422 and invalid["reason"] == "Invalid"
    assert [c["field"] for c in invalid["details"]["causes"]] == ["spec.size"]


def test_metadata_is_checked_as_the_real_server_does(server):
    status, bad_name = server.request("POST", CM, {"metadata": {"name": "Not_A_Name"}})
    assert status == 422 and bad_name["details"]["causes"][0]["field"] == "metadata.name"
    status, bad_label = server.request("POST", CM, {"metadata": {"name": "ok-name", "labels": {"a": "x" * 64}}})
    assert status == 422 and bad_label["details"]["causes"][0]["field"] == "metadata.labels"
    status, wrong_kind = server.request("POST", CM, {"kind": "Secret", "metadata": {"name": "ok-name"}})
    assert status == 400, wrong_kind
    status, generated = server.request("POST", CM, {"metadata": {"generateName": "gen-"}})
    assert status == 201 and generated["metadata"]["name"].startswith("gen-")


def test_label_and_field_selectors(server):
    for name, labels in (("sel-a", {"tier": "web", "env": "prod"}), ("sel-b", {"tier": "db"}), ("sel-c", {})):
        server.request("POST", CM, {"metadata": {"name": name, "labels": labels}})

    def names(query: str) -> set[str]:
        status, body = server.request("GET", f"{CM}?{query}")
        assert status == 200, body
        return {item["metadata"]["name"] for item in body["items"] if item["metadata"]["name"].startswith("sel-")}

    assert names("labelSelector=tier%3Dweb") == {"sel-a"}
    assert names("labelSelector=tier!%3Dweb") == {"sel-b", "sel-c"}
    assert names("labelSelector=tier+in+(web,db)") == {"sel-a", "sel-b"}
    assert names("labelSelector=tier+notin+(web)") == {"sel-b", "sel-c"}
    assert names("labelSelector=env") == {"sel-a"}
    assert names("labelSelector=!tier") == {"sel-c"}
    assert names("fieldSelector=metadata.name%3Dsel-b") == {"sel-b"}
    status, everywhere = server.request("GET", "/api/v1/configmaps?fieldSelector=metadata.namespace%3Ddefault")
    assert status == 200 and {"sel-a", "sel-b"} <= {i["metadata"]["name"] for i in everywhere["items"]}


def test_watch_replays_from_resource_version(server):
    _, first = server.request("POST", CM, {"metadata": {"name": "w-1", "labels": {"watch": "me"}}})
    since = first["metadata"]["resourceVersion"]
    server.request("PATCH", f"{CM}/w-1", {"data": {"x": "1"}}, content_type="application/merge-patch+json")
    server.request("DELETE", f"{CM}/w-1")
    url = f"{server.url}{CM}?watch=true&labelSelector=watch%3Dme&resourceVersion={since}&timeoutSeconds=1"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        events = [json.loads(line) for line in response.read().splitlines() if line.strip()]
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[0]["object"]["data"] == {"x": "1"}
    status, _ = server.request("GET", f"{CM}?watch=true&resourceVersion=1&timeoutSeconds=1")
    assert status == 200


def test_kubernetes_client_watch_stream(server):
    client = kubernetes.config.new_client_from_config(config_file=str(server.kubeconfig))
    core = kubernetes.client.CoreV1Api(client)
    core.create_namespaced_config_map("default", {"metadata": {"name": "kc-watch", "labels": {"kc": "1"}}})
    listed = core.list_namespaced_config_map("default", label_selector="kc=1")
    core.patch_namespaced_config_map("kc-watch", "default", {"data": {"a": "b"}})
    seen = []
    for since in ("", listed.metadata.resource_version):  # the current state, then a replay
        watcher = kubernetes.watch.Watch()
        for event in watcher.stream(core.list_namespaced_config_map, "default", label_selector="kc=1",
                                    resource_version=since, timeout_seconds=5):
            seen.append((event["type"], event["object"].metadata.name, event["object"].data))
            watcher.stop()
    assert seen == [("ADDED", "kc-watch", {"a": "b"}), ("MODIFIED", "kc-watch", {"a": "b"})]
    with pytest.raises(kubernetes.client.ApiException) as info:
        core.create_namespaced_config_map("default", {"metadata": {"name": "kc-watch"}})
    assert info.value.status == 409
    client.close()


def test_kubectl_crd_objects_table_watch_delete(server, tmp_path):
    crd = {**WIDGET_CRD, "metadata": {"name": "gadgets.example.org"},
           "spec": {**WIDGET_CRD["spec"], "group": "example.org",
                    "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"}}}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(crd))
    gadget = {"apiVersion": "example.org/v1", "kind": "Gadget", "metadata": {"name": "g1"}, "spec": {"size": 3}}
    (tmp_path / "g1.yaml").write_text(yaml.safe_dump(gadget))
    kubectl(server, "apply", "-f", str(tmp_path / "crd.yaml"), check=True)
    kubectl(server, "apply", "-f", str(tmp_path / "g1.yaml"), check=True)
    table = kubectl(server, "get", "gadgets", check=True).stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "PHASE", "AGE"] and table[1].split()[:2] == ["g1", "3"]
    with kubectl_background(server, "get", "gadgets", "-w") as watching:
        read_until(watching, "g1", timeout=15)
        server.request("PATCH", "/apis/example.org/v1/namespaces/default/gadgets/g1/status",
                       {"status": {"phase": "Running"}}, content_type="application/merge-patch+json")
        read_until(watching, "Running", timeout=15)
    # kubectl's generators post protobuf, decoded for the simple core kinds.
    kubectl(server, "create", "namespace", "generated", check=True)
    kubectl(server, "create", "configmap", "gen-cm", "-n", "generated", "--from-literal=k=v", check=True)
    assert server.request("GET", "/api/v1/namespaces/generated/configmaps/gen-cm")[1]["data"] == {"k": "v"}
    deleted = kubectl(server, "delete", "gadget", "g1", check=True)
    assert 'gadget.example.org "g1" deleted' in deleted.stdout
    assert "No resources found" in kubectl(server, "get", "gadgets", check=True).stderr


# A CRD whose schema has each case the OpenAPI v2 conversion changes.
SPROCKET_CRD = {**WIDGET_CRD, "metadata": {"name": "sprockets.example.net"},
                "spec": {**WIDGET_CRD["spec"], "group": "example.net",
                         "names": {"plural": "sprockets", "singular": "sprocket", "kind": "Sprocket"},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                             "type": "object", "properties": {"spec": {
                                 "type": "object", "required": ["size", "note"],
                                 "properties": {
                                     "size": {"type": "integer", "minimum": 1, "maximum": 9, "default": 1},
                                     "note": {"type": "string", "nullable": True},
                                     "mode": {"type": "string", "enum": ["a", "b"], "oneOf": [{"pattern": "a"}]},
                                     "free": {"type": "array", "x-kubernetes-preserve-unknown-fields": True,
                                              "items": {"type": "string"}},
                                     "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                                 }}}}}}]}}


def openapi_v2(server, accept: str) -> tuple[int, str, bytes]:
    request = urllib.request.Request(server.url + "/openapi/v2", headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_openapi_v2_publishes_crd_schemas_as_json_and_protobuf(server):
    from tests.kubeapi.protobuf import _fields

    status, body = server.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", SPROCKET_CRD)
    assert status == 201, body
    status, content_type, raw = openapi_v2(server, "application/json")
    assert (status, content_type) == (200, "application/json")
    doc = json.loads(raw)
    assert doc["swagger"] == "2.0" and doc["paths"] == {}
    # CRD kinds only, named as kube-apiserver names them; built-in kinds have no schema here.
    assert {"com.example.v1.Widget", "net.example.v1.Sprocket"} <= set(doc["definitions"])
    assert not [name for name in doc["definitions"] if name.startswith("io.k8s.")]
    sprocket = doc["definitions"]["net.example.v1.Sprocket"]
    assert sprocket["x-kubernetes-group-version-kind"] == [{"group": "example.net", "version": "v1", "kind": "Sprocket"}]
    assert {"apiVersion", "kind", "metadata", "spec"} <= set(sprocket["properties"])
    spec = sprocket["properties"]["spec"]
    assert spec["required"] == ["size"]  # a nullable field is never required in v2
    assert spec["properties"]["size"] == {"type": "integer", "minimum": 1, "maximum": 9, "default": 1}
    assert spec["properties"]["note"] == {}  # nullable: no type in v2
    assert spec["properties"]["mode"] == {"type": "string", "enum": ["a", "b"]}  # oneOf dropped
    assert spec["properties"]["free"] == {"x-kubernetes-preserve-unknown-fields": True}  # no items, so no type
    assert spec["properties"]["tags"] == {"type": "object", "additionalProperties": {"type": "string"}}

    # What client-go asks for (helm, kubectl): gnostic's openapi.v2.Document in protobuf.
    status, content_type, raw = openapi_v2(server, "application/com.github.proto-openapi.spec.v2@v1.0+protobuf")
    assert (status, content_type) == (200, "application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
    fields = dict(_fields(raw))
    assert fields[1] == b"2.0"
    names = [dict(_fields(entry))[1].decode() for number, entry in _fields(fields[9]) if number == 1]
    assert names == list(doc["definitions"])
    assert openapi_v2(server, "text/html")[0] == 406


def test_kubectl_validates_crd_objects_against_openapi_v2(server, tmp_path):
    bad = yaml.safe_dump({**widget("strict-1"), "spec": {"size": 2, "bogus": True}})
    result = kubectl(server, "apply", "--validate=strict", "-f", "-", input=bad)
    assert result.returncode != 0
    assert 'unknown field "bogus" in com.example.v1.Widget.spec' in result.stderr, result.stderr
    assert server.request("GET", f"{WIDGETS}/strict-1")[0] == 404
    kubectl(server, "apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(widget("strict-2")), check=True)
    explained = kubectl(server, "explain", "widgets.spec", check=True).stdout
    assert "size" in explained and "<integer>" in explained


def test_owner_reference_cascade(server):
    _, owner = server.request("POST", WIDGETS, widget("owner"))
    ref = {"apiVersion": "example.com/v1", "kind": "Widget", "name": "owner", "uid": owner["metadata"]["uid"]}
    _, child = server.request("POST", CM, {"metadata": {"name": "child", "ownerReferences": [ref]}})
    child_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "child", "uid": child["metadata"]["uid"]}
    server.request("POST", CM, {"metadata": {"name": "grandchild", "ownerReferences": [child_ref]}})
    server.request("POST", CM, {"metadata": {"name": "bystander"}})
    status, _ = server.request("DELETE", f"{WIDGETS}/owner")
    assert status == 200
    wait_for(lambda: server.request("GET", f"{CM}/child")[0] == 404, message="the child to be collected")
    wait_for(lambda: server.request("GET", f"{CM}/grandchild")[0] == 404, message="the grandchild to be collected")
    assert server.request("GET", f"{CM}/bystander")[0] == 200


def test_finalizers_hold_deletion(server):
    server.request("POST", CM, {"metadata": {"name": "final", "finalizers": ["example.com/hold"]}})
    status, deleting = server.request("DELETE", f"{CM}/final")
    assert status == 200 and deleting["metadata"]["deletionTimestamp"]
    status, still = server.request("GET", f"{CM}/final")
    assert status == 200 and still["metadata"]["deletionTimestamp"]
    server.request("PATCH", f"{CM}/final", {"metadata": {"finalizers": None}},
                   content_type="application/merge-patch+json")
    assert server.request("GET", f"{CM}/final")[0] == 404


def test_fault_injection_and_request_log(server):
    server.clear_requests_log()
    server.inject_fault(r"/configmaps/flaky$", 503, method="GET", count=2)
    server.request("POST", CM, {"metadata": {"name": "flaky"}})
    codes = [server.request("GET", f"{CM}/flaky")[0] for _ in range(3)]
    assert codes == [503, 503, 200]
    log = [(e["method"], e["path"], e["status"]) for e in server.requests_log()]
    assert log == [("POST", CM, 201)] + [("GET", f"{CM}/flaky", code) for code in codes]

    url = f"{server.url}{CM}?watch=true&timeoutSeconds=30"
    with urllib.request.urlopen(url, timeout=10) as response:
        response.readline()  # the first ADDED event: the watch is open
        wait_for(lambda: server.drop_watches() >= 1, message="the open watch to be dropped")
        response.read()  # returns at once: the server ended the stream


@pytest.mark.skipif(not REAL_JOBSET_CRD.exists(), reason=NO_REAL_JOBSET_CRD)
def test_jobset_schema_validation(tmp_path):
    with running_apiserver(tmp_path, crds=[REAL_JOBSET_CRD]) as srv:
        jobsets = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"
        pod = {"spec": {"containers": [{"name": "main", "image": "busybox", "resources": {"limits": {"cpu": 1}}}],
                        "restartPolicy": "Never"}}
        good = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "ok"},
                "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2,
                                             "template": {"spec": {"parallelism": 1, "template": pod}}}]}}
        status, created = srv.request("POST", jobsets, good)
        assert status == 201, created
        bad = json.loads(json.dumps(good))
        bad["metadata"]["name"] = "bad"
        bad["spec"]["replicatedJobs"][0]["replicas"] = "two"
        status, rejected = srv.request("POST", jobsets, bad)
        assert status == 422, rejected
        assert "spec.replicatedJobs[0].replicas" in [c["field"] for c in rejected["details"]["causes"]]
        table = kubectl(srv, "get", "jobsets", check=True).stdout.split()
        assert table[:6] == ["NAME", "TERMINALSTATE", "RESTARTS", "COMPLETED", "SUSPENDED", "AGE"]


def test_watch_from_a_compacted_resource_version_is_gone(tmp_path):
    with running_apiserver(tmp_path, extra_args=("--history", "3")) as srv:
        for index in range(6):
            srv.request("POST", CM, {"metadata": {"name": f"churn-{index}"}})
        with urllib.request.urlopen(f"{srv.url}{CM}?watch=1&resourceVersion=2", timeout=10) as response:
            events = [json.loads(line) for line in response.read().splitlines() if line.strip()]
        assert [(e["type"], e["object"]["code"], e["object"]["reason"]) for e in events] == [("ERROR", 410, "Expired")]


def test_events_and_leases(server):
    status, _ = server.request("POST", "/api/v1/namespaces/default/events", {
        "metadata": {"name": "ev-1"}, "involvedObject": {"kind": "Widget", "name": "x"},
        "reason": "Tested", "message": "hello", "type": "Normal"})
    assert status == 201
    status, _ = server.request("POST", "/apis/events.k8s.io/v1/namespaces/default/events", {
        "metadata": {"name": "ev-2"}, "regarding": {"kind": "Widget", "name": "x"}, "reason": "Tested",
        "note": "hello", "type": "Normal", "action": "Test", "eventTime": "2026-01-01T00:00:00.000000Z"})
    assert status == 201
    assert [e["message"] for e in server.request("GET", "/api/v1/events")[1]["items"]] == ["hello"]
    leases = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
    _, lease = server.request("POST", leases, {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "a"}})
    lease["spec"]["holderIdentity"] = "b"
    assert server.request("PUT", f"{leases}/leader", lease)[0] == 200
    lease["spec"]["holderIdentity"] = "c"  # a second candidate with the stale copy loses the election
    assert server.request("PUT", f"{leases}/leader", lease)[0] == 409


OPERATOR = '''
import kopf

@kopf.on.login()
def login(**kwargs):
    # kopf reads $KUBECONFIG when it logs in; the kubernetes client read it at import time.
    return kopf.login_with_kubeconfig(**kwargs)

@kopf.on.create("example.com", "v1", "widgets")
def created(patch, **_):
    patch.status["phase"] = "Ready"

@kopf.on.update("example.com", "v1", "widgets", field="spec.size")
def resized(new, patch, **_):
    patch.status["phase"] = f"Size{new}"

@kopf.on.delete("example.com", "v1", "widgets")
def deleted(**_):
    pass
'''


def test_kopf_operator_handles_create_update_delete(server, tmp_path, monkeypatch):
    kopf_testing = pytest.importorskip("kopf.testing")
    (tmp_path / "operator.py").write_text(OPERATOR)
    monkeypatch.setenv("KUBECONFIG", str(server.kubeconfig))
    path = f"{WIDGETS}/kopfed"

    def phase():
        return (server.request("GET", path)[1].get("status") or {}).get("phase")

    with kopf_testing.KopfRunner(["run", "--standalone", "-n", "default", str(tmp_path / "operator.py")],
                                 timeout=30) as runner:
        server.request("POST", WIDGETS, widget("kopfed", size=1))
        wait_for(lambda: phase() == "Ready", timeout=15, message="kopf's create handler to set the status")
        assert server.request("GET", path)[1]["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        wait_for(lambda: server.drop_watches(), message="kopf's watch to be open")  # kopf must re-watch
        server.request("PATCH", path, {"spec": {"size": 4}}, content_type="application/merge-patch+json")
        wait_for(lambda: phase() == "Size4", timeout=15, message="kopf's update handler to set the status")
        server.request("DELETE", path)
        wait_for(lambda: server.request("GET", path)[0] == 404, timeout=15,
                 message="kopf's delete handler to release its finalizer")
    assert runner.exception is None and runner.exit_code == 0, runner.output
    assert "Handler 'deleted' succeeded" in runner.output

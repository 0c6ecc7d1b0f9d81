"""The job's control credential (controller/control.py, workload/process/serving.py): one key per installation in a
Secret of the operator's namespace, loaded (or made) at start-up; a job's token derived from it; its pods given only
the token's SHA-256. The trainer's own server (a real one, in this process) takes a control request only with the
token, and the operator's reader sends it, derived with no API request."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from tests.conftest import operator_job as tiny_job
from tests.fakes import NOW, PREFLIGHT_TIMING, FakeKube, add_pod0, job_status, run_reconcile
from tpu_operator.api.profiling import CONTROL_REFUSED
from tpu_operator.controller import control, preflight, reconcile
from tpu_operator.controller.kube import CONFIGMAPS, JOBSETS, SECRETS, ApiError, AsyncKube
from tpu_operator.controller.metrics_reader import MetricsReader, Unreachable
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_workload.process import metrics, serving

REPORT = {"requested": "2-3", "steps": "2-3", "state": "pending"}
OLD_REFUSAL = (
    "a control request needs the job's control credential (the Secret <job>-control)"  # before the control key
)
KEY = bytes(range(32))
TOKENS = control.Tokens(KEY)
TOKEN = TOKENS.token("ml", "job", "uid-1")
assert TOKEN is not None


# --- the token -----------------------------------------------------------------------------------------------


def test_a_token_is_the_jobs_own_and_the_same_for_every_operator_with_the_key():
    tokens = {control.derive(KEY, ns, name, uid) for ns, name, uid in [("ml", "job", "u1"), ("ml2", "job", "u1")]}
    tokens |= {control.derive(KEY, "ml", "job2", "u1"), control.derive(KEY, "ml", "job", "u2")}  # a new incarnation
    tokens |= {control.derive(bytes(32), "ml", "job", "u1")}  # another installation
    assert len(tokens) == 5
    # the fields are length-prefixed: moving a character from one to the next makes another token
    assert control.derive(KEY, "a", "bc", "u") != control.derive(KEY, "ab", "c", "u")
    # a restarted operator (or another replica) with the same key: the same token, with no API request
    assert control.Tokens(bytes(KEY)).token("ml", "job", "u1") == control.derive(KEY, "ml", "job", "u1")
    token = control.derive(KEY, "ml", "job", "u1")
    assert len(token) == 43 and "=" not in token and base64.urlsafe_b64decode(token + "=")  # 32 bytes, base64url
    assert TOKENS.digest("ml", "job", "uid-1") == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert control.Tokens().token("ml", "job", "u1") is None and control.Tokens().digest("ml", "job", "u1") is None
    assert "set" in repr(TOKENS) and KEY.hex() not in repr(TOKENS)


# --- the key -------------------------------------------------------------------------------------------------


def _load(kube: FakeKube, namespace: str = "tpu-system") -> bytes:
    return asyncio.run(control.load_key(kube, namespace))


def test_the_key_is_made_on_first_start_and_read_on_every_later_one():
    kube = FakeKube()
    first = _load(kube)
    secret = kube.objects[SECRETS.path("tpu-system", control.KEY_SECRET)]
    assert len(first) == control.KEY_BYTES and secret["immutable"] is True
    assert base64.b64decode(secret["data"][control.KEY_FIELD]) == first
    kube.calls.clear()
    assert _load(kube) == first and kube.calls == [("GET", SECRETS.path("tpu-system", control.KEY_SECRET))]


class RacingKube(FakeKube):
    """Another replica makes the key between this one's GET (404) and its create."""

    def __init__(self, rival: bytes):
        super().__init__()
        self.rival = rival

    async def create(self, resource, namespace, body, dry_run=False):
        if resource == SECRETS and self.rival:
            rival, self.rival = self.rival, b""
            await super().create(resource, namespace, control.key_secret(namespace, rival))
        return await super().create(resource, namespace, body, dry_run)


def test_two_replicas_starting_at_once_share_the_key_that_was_made_first():
    rival = bytes(range(100, 132))
    kube = RacingKube(rival)
    assert _load(kube) == rival
    path = SECRETS.path("tpu-system", control.KEY_SECRET)
    made = ("POST", SECRETS.path("tpu-system"))
    # its GET (404), the rival's create, its own (409), its GET of the rival's key
    assert kube.calls == [("GET", path), made, made, ("GET", path)]


@pytest.mark.parametrize("data", [{}, {"key": "not base64!"}, {"key": base64.b64encode(b"short").decode()}])
def test_a_malformed_key_stops_the_start_and_says_where_never_what(data):
    kube = FakeKube()
    kube.objects[SECRETS.path("tpu-system", control.KEY_SECRET)] = {
        "metadata": {"name": control.KEY_SECRET, "namespace": "tpu-system"},
        "data": data,
    }
    with pytest.raises(control.KeyUnavailable, match=f"tpu-system/{control.KEY_SECRET}") as raised:
        _load(kube)
    assert not any(v and v in str(raised.value) for v in data.values())


class Forbidden(FakeKube):
    async def get(self, resource, namespace, name):
        raise ApiError(403, 'secrets "tpu-operator-control-key" is forbidden', "GET")


def test_a_key_the_operator_may_not_read_stops_the_start_with_what_it_needs():
    with pytest.raises(control.KeyUnavailable, match="HTTP 403.*get and create on Secrets in its own namespace"):
        _load(Forbidden())


def test_the_keys_namespace_is_the_flags_else_the_pods_else_the_service_accounts(tmp_path):
    account = tmp_path / "namespace"
    assert control.key_namespace("flag", {"POD_NAMESPACE": "pod"}, account) == "flag"
    assert control.key_namespace("", {"POD_NAMESPACE": "pod"}, account) == "pod"
    assert control.key_namespace("", {}, account) == "default"  # no file: not in a pod
    account.write_text("tpu-system\n")
    assert control.key_namespace("", {}, account) == "tpu-system"


# --- the trainer ---------------------------------------------------------------------------------------------


@pytest.fixture
def trainer():
    """The trainer's server holding TOKEN's digest, as its pod does; it counts the profile requests that got
    through."""
    got: list[bytes] = []

    def profile(body: bytes):
        got.append(body)
        return 200, REPORT

    digest = serving.control_digest({serving.CONTROL_DIGEST: control.digest(TOKEN)})
    server = metrics.serve(metrics.Status(10, 1), 0, profile=profile, control_digest=digest)
    assert server is not None
    yield server.server_address[1], got
    server.shutdown()
    server.server_close()


def post(port: int, headers: dict[str, str]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/profile",
        data=b'{"steps": "2-3"}',
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_control_requests_need_the_token_reads_do_not(trainer):
    port, got = trainer
    digest = control.digest(TOKEN)
    for refused in ({}, {"X-Tpujob-Control-Token": ""}, {"X-Tpujob-Control-Token": "guess"}):
        assert post(port, refused) == 401
    assert post(port, {"X-Tpujob-Control-Token": digest}) == 401  # what the pod spec shows is not the token
    assert post(port, {"Authorization": f"Bearer {TOKEN[:-1]}"}) == 401
    assert post(port, {"X-Tpujob-Control-Token": TOKEN + "x" * serving.MAX_TOKEN_CHARS}) == 401  # oversized
    assert got == []
    assert post(port, {"X-Tpujob-Control-Token": TOKEN}) == 200
    assert post(port, {"Authorization": f"Bearer {TOKEN}"}) == 200 and len(got) == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        assert json.loads(response.read())["total_steps"] == 10


def test_without_a_usable_credential_every_control_request_is_refused(tmp_path):
    # `tpujob render` without an operator: no digest, no file; nothing matches "".
    for environ in ({}, {serving.CONTROL_DIGEST: "not-hex"}, {serving.CONTROL_TOKEN_FILE: str(tmp_path / "missing")}):
        assert serving.control_digest(environ) == ""
    assert not serving.authorized({serving.CONTROL_HEADER: ""}, "")
    assert not serving.authorized({serving.CONTROL_HEADER: TOKEN}, "")


def test_a_pod_of_the_previous_version_keeps_its_token_file(tmp_path):
    # A JobSet made by an operator before the control key mounts its Secret and names the file: still taken, as its digest.
    (tmp_path / "token").write_text("s3cret\n")
    digest = serving.control_digest({serving.CONTROL_TOKEN_FILE: str(tmp_path / "token")})
    assert digest == hashlib.sha256(b"s3cret").hexdigest()
    assert serving.authorized({serving.CONTROL_HEADER: "s3cret"}, digest)
    assert not serving.authorized({serving.CONTROL_HEADER: "s3cre"}, digest)


# --- the operator --------------------------------------------------------------------------------------------


def _reconcile_with_key(kube: FakeKube, obj: dict[str, Any]) -> None:
    reader = MetricsReader(kube, "direct", tokens=TOKENS)
    means = reconcile.Means(kube, OperatorConfig(), lambda o, n: None, reader, clock=lambda: NOW)
    assert asyncio.run(reconcile.reconcile(means, obj)).result == "created"


def test_the_pods_get_the_tokens_digest_and_no_secret_is_made():
    kube = FakeKube()
    _reconcile_with_key(kube, kube.add_job(tiny_job()))
    assert not [c for c in kube.calls if "/secrets" in c[1]]  # no request about a Secret at all
    pod = kube.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[serving.CONTROL_DIGEST] == TOKENS.digest("default", "tiny", "job-uid")
    assert serving.CONTROL_TOKEN_FILE not in env and not [v for v in pod["volumes"] if "secret" in v]
    # the ConfigMap (named by its content's hash) is the one an operator without the key makes
    plain = FakeKube()
    run_reconcile(plain, plain.add_job(tiny_job()))
    assert [p for p in kube.objects if "/configmaps/" in p] == [p for p in plain.objects if "/configmaps/" in p]
    env = plain.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert serving.CONTROL_DIGEST not in {e["name"] for e in env}
    # a job made again under the name (another uid) has another digest
    again = FakeKube()
    _reconcile_with_key(again, again.add_job(tiny_job(), uid="job-uid-2"))
    env = again.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {e["name"]: e.get("value") for e in env}[serving.CONTROL_DIGEST] != TOKENS.digest(
        "default", "tiny", "job-uid"
    )


def test_a_queued_jobs_jobset_made_beside_its_preflight_gets_the_digest_too():
    # Held by the pre-flight's gate while it compiles, that JobSet is the one that runs once the gate is lifted.
    kube = FakeKube()
    obj = kube.add_job(tiny_job(queueName="tpu-queue", plan={"preflight": "compile"}))
    reader = MetricsReader(kube, "direct", tokens=TOKENS)
    config = OperatorConfig(preflight=PREFLIGHT_TIMING)
    means = reconcile.Means(kube, config, lambda o, n: None, reader, clock=lambda: NOW)
    assert asyncio.run(reconcile.reconcile(means, obj)).result == "planning"
    env = kube.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert preflight.gated(kube.jobset())
    assert {e["name"]: e.get("value") for e in env}[serving.CONTROL_DIGEST] == TOKENS.digest(
        "default", "tiny", "job-uid"
    )


def test_a_config_map_never_made_beside_its_jobset_is_made_by_the_next_reconcile():
    # The ConfigMap and the JobSet are created side by side; an operator that fails (or is killed) between them
    # finds the JobSet without its record in the job's status (jobSetName) and makes sure of both: the pods,
    # waiting for their volume, start.
    kube = FakeKube()
    kube.refuse[CONFIGMAPS] = ApiError(500, "etcdserver: request timed out", "POST")
    obj = kube.add_job(tiny_job())
    with pytest.raises(ApiError):
        run_reconcile(kube, obj)
    assert kube.jobset() is not None and not job_status(kube).job_set_name
    assert not [p for p in kube.objects if p.startswith(CONFIGMAPS.path("default"))]
    del kube.refuse[CONFIGMAPS]
    kube.calls.clear()
    outcome, _ = run_reconcile(kube, kube.job(), kube.jobset())  # the watch has the JobSet
    assert outcome.result == "adopted" and job_status(kube).job_set_name == "tiny"
    assert [p for p in kube.objects if p.startswith(CONFIGMAPS.path("default"))]
    assert [c for c in kube.calls if c[0] == "POST"] == [
        ("POST", CONFIGMAPS.path("default")),
        ("POST", JOBSETS.path("default")),
    ]
    # Recorded now: the next reconcile makes nothing.
    kube.calls.clear()
    run_reconcile(kube, kube.job(), kube.jobset())
    assert not [c for c in kube.calls if c[0] in ("POST", "DRYRUN")]


def test_the_reader_sends_the_jobs_derived_token(trainer):
    port, got = trainer
    kube = FakeKube()
    add_pod0(kube, jobset_name="job", ip="127.0.0.1")  # in namespace ml

    async def send(tokens: control.Tokens, uid: str) -> str:
        reader = MetricsReader(kube, "direct", tokens=tokens)
        try:
            return (await reader.post_profile("ml", "job", port, "2-3", uid)).state
        finally:
            await reader.close()

    assert asyncio.run(send(TOKENS, "uid-1")) == "pending" and len(got) == 1
    assert asyncio.run(send(TOKENS, "uid-0")) == "failed" and len(got) == 1  # an earlier job of that name
    assert asyncio.run(send(control.Tokens(bytes(32)), "uid-1")) == "failed" and len(got) == 1  # another key
    assert asyncio.run(send(control.Tokens(), "uid-1")) == "failed" and len(got) == 1  # no key: none sent
    assert not [c for c in kube.calls if "/secrets" in c[1]]


class ApiServer:
    """Just the API server paths the reader uses, over a real socket: the pod list and the pod proxy's
    POST /profile, answering as the trainer would (the token checked; 400 for a bad range)."""

    def __init__(self, expired: bool = False):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if "/pods?" in self.path:
                    return self._json(
                        200,
                        {
                            "items": [
                                {
                                    "metadata": {"name": "job-slice-0-0-x"},
                                    "status": {"phase": "Running", "podIP": "10.0.0.1"},
                                }
                            ]
                        },
                    )
                return self._json(404, {"message": "not found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.seen.append(self.headers.get("X-Tpujob-Control-Token"))
                if not self.path.endswith("/pods/job-slice-0-0-x:9431/proxy/profile"):
                    return self._json(404, {"message": "not found"})
                if expired:  # as if the operator's own credential were
                    return self._json(401, {"kind": "Status", "status": "Failure", "message": "Unauthorized"})
                if not serving.authorized(
                    {serving.CONTROL_HEADER: self.headers.get("X-Tpujob-Control-Token") or ""}, control.digest(TOKEN)
                ):
                    return self._json(401, {"error": CONTROL_REFUSED})
                if body["steps"] == "old":  # a trainer from before the control key: its words
                    return self._json(401, {"error": OLD_REFUSAL})
                if body["steps"] == "9-1":
                    return self._json(
                        400,
                        {
                            "error": "bad",
                            "requested": "9-1",
                            "state": "failed",
                            "message": "steps: the first step (9) is after the last (1)",
                        },
                    )
                return self._json(200, REPORT)

            def _json(self, code: int, value: Any) -> None:
                data = json.dumps(value).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.seen: list[str | None] = []
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def post(self, steps: str, uid: str) -> Any:
        async def send():
            kube = AsyncKube(k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{self.http.server_address[1]}")))
            reader = MetricsReader(kube, "proxy", tokens=TOKENS)
            try:
                return await reader.post_profile("ml", "job", 9431, steps, uid)
            finally:
                await reader.close()
                await kube.close()

        return asyncio.run(send())


@pytest.mark.parametrize(
    "uid, steps, state, message",
    [
        ("uid-1", "2-3", "pending", ""),
        ("uid-1", "old", "failed", "the Secret <job>-control"),  # an older trainer's refusal is one too
        ("uid-1", "9-1", "failed", "the first step (9) is after the last (1)"),  # the trainer's refusal, passed on
        ("uid-0", "2-3", "failed", "control credential"),  # not this job's token
    ],
)
def test_through_the_pod_proxy_the_token_goes_in_its_own_header(uid, steps, state, message):
    api = ApiServer()
    try:
        report = api.post(steps, uid)
    finally:
        api.http.shutdown()
        api.http.server_close()
    assert report.state == state and message in report.message and api.seen == [TOKENS.token("ml", "job", uid)]


def test_the_api_servers_own_401_is_not_the_trainers_refusal():
    # Unreachable: the request is sent again later, and the profile is not recorded as refused.
    api = ApiServer(expired=True)
    try:
        with pytest.raises(Unreachable, match="Unauthorized"):
            api.post("2-3", "uid-1")
    finally:
        api.http.shutdown()
        api.http.server_close()

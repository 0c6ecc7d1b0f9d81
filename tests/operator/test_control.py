"""The job's control credential (controller/control.py, workload/process/serving.py): the operator makes the Secret
with the JobSet and the pods mount it; the trainer's own server (a real one, in this process) takes a control
request only with the token, and the operator's reader sends it, read back from the Secret."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from tests.conftest import operator_job as tiny_job
from tests.fakes import FakeKube, add_pod0, run_reconcile
from tpu_operator.api.profiling import CONTROL_REFUSED
from tpu_operator.controller.kube import JOBSETS, SECRETS, ApiError, AsyncKube
from tpu_operator.controller.metrics_reader import MetricsReader, Unreachable
from tpu_workload.process import metrics, serving

REPORT = {"requested": "2-3", "steps": "2-3", "state": "pending"}


@pytest.fixture
def trainer():
    """The trainer's server with the token "s3cret", counting the profile requests that got through."""
    got: list[bytes] = []

    def profile(body: bytes):
        got.append(body)
        return 200, REPORT

    server = metrics.serve(metrics.Status(10, 1), 0, profile=profile, token="s3cret")
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
    assert post(port, {}) == 401 and post(port, {"X-Tpujob-Control-Token": "guess"}) == 401
    assert post(port, {"Authorization": "Bearer s3cre"}) == 401 and got == []
    assert post(port, {"X-Tpujob-Control-Token": "s3cret"}) == 200
    assert post(port, {"Authorization": "Bearer s3cret"}) == 200 and len(got) == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        assert json.loads(response.read())["total_steps"] == 10


def test_an_unreadable_token_file_refuses_every_control_request(tmp_path):
    assert serving.control_token({}) is None  # a local run: nothing named
    assert serving.control_token({serving.CONTROL_TOKEN_FILE: str(tmp_path / "missing")}) == ""
    assert not serving.authorized({serving.CONTROL_HEADER: ""}, "")
    (tmp_path / "token").write_text("s3cret\n")
    assert serving.control_token({serving.CONTROL_TOKEN_FILE: str(tmp_path / "token")}) == "s3cret"


def test_the_operator_makes_the_secret_the_pods_mount_and_sends_its_token(trainer):
    port, got = trainer
    kube = FakeKube()
    outcome, _ = run_reconcile(kube, kube.add_job(tiny_job()))
    assert outcome.result == "created"
    secret = kube.objects[SECRETS.path("default", "tiny-control")]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "job-uid" and secret["immutable"] is True
    pod = kube.jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "control", "secret": {"secretName": "tiny-control", "defaultMode": 0o444, "optional": True}} in pod[
        "volumes"
    ]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TPUJOB_CONTROL_TOKEN_FILE"] == "/var/run/tpujob-control/token"
    again = FakeKube()
    again.objects = kube.objects  # a restarted operator: the Secret is adopted with its token, not made anew
    run_reconcile(again, kube.job())
    assert again.objects[SECRETS.path("default", "tiny-control")]["data"] == secret["data"]


def test_no_jobset_is_made_before_the_secret_and_config_map_it_mounts():
    # An operator that fails (or is killed) between them finds no JobSet and makes all three again; a JobSet
    # made first would never be looked at again, and its pods would wait for a volume for good.
    kube = FakeKube()
    kube.refuse[SECRETS] = ApiError(500, "etcdserver: request timed out", "POST")
    obj = kube.add_job(tiny_job())
    with pytest.raises(ApiError):
        run_reconcile(kube, obj)
    assert kube.jobset() is None and ("POST", JOBSETS.path("default")) not in kube.calls
    del kube.refuse[SECRETS]
    assert run_reconcile(kube, kube.job())[0].result == "created"
    assert SECRETS.path("default", "tiny-control") in kube.objects and kube.jobset() is not None


def test_the_reader_sends_the_token_of_the_jobs_secret(trainer):
    port, got = trainer
    kube = FakeKube()
    add_pod0(kube, jobset_name="tiny", ip="127.0.0.1")  # in namespace ml

    async def send(token: str) -> str:
        kube.objects[SECRETS.path("ml", "tiny-control")] = {
            "metadata": {"name": "tiny-control"},
            "data": {"token": base64.b64encode(token.encode()).decode()},
        }
        reader = MetricsReader(kube, "direct")
        try:
            return (await reader.post_profile("ml", "tiny", port, "2-3")).state
        finally:
            await reader.close()

    assert asyncio.run(send("s3cret")) == "pending" and len(got) == 1
    assert asyncio.run(send("not-it")) == "failed" and len(got) == 1


class ApiServer:
    """Just the API server paths the reader uses, over a real socket: the pod list, the job's Secret, and the
    pod proxy's POST /profile, answering as the trainer would (the token checked; 400 for a bad range)."""

    def __init__(self, token: str):
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
                if self.path.endswith("/secrets/job-control"):
                    return self._json(200, {"data": {"token": base64.b64encode(token.encode()).decode()}})
                return self._json(404, {"message": "not found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.seen.append(self.headers.get("X-Tpujob-Control-Token"))
                if not self.path.endswith("/pods/job-slice-0-0-x:9431/proxy/profile"):
                    return self._json(404, {"message": "not found"})
                if self.headers.get("X-Tpujob-Control-Token") == "expired":  # as if the operator's own were
                    return self._json(401, {"kind": "Status", "status": "Failure", "message": "Unauthorized"})
                if self.headers.get("X-Tpujob-Control-Token") != "s3cret":
                    return self._json(401, {"error": CONTROL_REFUSED})
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

    def post(self, steps: str) -> Any:
        async def send():
            kube = AsyncKube(k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{self.http.server_address[1]}")))
            reader = MetricsReader(kube, "proxy")
            try:
                return await reader.post_profile("ml", "job", 9431, steps)
            finally:
                await reader.close()
                await kube.close()

        return asyncio.run(send())


@pytest.mark.parametrize(
    "token, steps, state, message",
    [
        ("s3cret", "2-3", "pending", ""),
        ("s3cret", "9-1", "failed", "the first step (9) is after the last (1)"),  # the trainer's refusal, passed on
        ("other", "2-3", "failed", "control credential"),  # a Secret that is not the trainer's
    ],
)
def test_through_the_pod_proxy_the_token_goes_in_its_own_header(token, steps, state, message):
    api = ApiServer(token)
    try:
        report = api.post(steps)
    finally:
        api.http.shutdown()
        api.http.server_close()
    assert report.state == state and message in report.message and api.seen == [token]


def test_the_api_servers_own_401_is_not_the_trainers_refusal():
    # Unreachable: the request is sent again later, and the profile is not recorded as refused.
    api = ApiServer("expired")
    try:
        with pytest.raises(Unreachable, match="Unauthorized"):
            api.post("2-3")
    finally:
        api.http.shutdown()
        api.http.server_close()

"""`tpujob operator` imports kubernetes_asyncio without its generated classes (controller/slim_client.py),
and everything the controller asks of the client still works: the kubeconfig loader, the generic calls of
kube.py and the Lease calls of leader.py, over a real socket to a stand-in API server (stdlib HTTP, a
thread). Each check runs in a fresh interpreter: the test process itself has the whole client imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.operator_process import ROOT


class ApiServer:
    """Answers every GET with a JSON object naming its path; a Lease path it does not know is a 404."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                status = 404 if "/leases/" in self.path else 200
                body = json.dumps({"kind": "Thing", "path": self.path, "auth": self.headers.get("Authorization")})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


PROGRAM = """
import asyncio, sys
from tpu_operator.controller import slim_client
assert slim_client.install()
import tpu_operator.controller.main  # everything the operator process imports
from tpu_operator.controller.kube import JOBS, AsyncKube, api_client, configuration
from tpu_operator.controller.leader import ApiLeaseStore

async def main():
    cfg = await configuration()  # the kubeconfig loader, from the real config package
    kube = AsyncKube(api_client(cfg))
    found = await kube.get(JOBS, "ml", "tiny")
    leases = ApiLeaseStore(api_client(cfg), "ops", "tpu-operator", 5.0)
    lease = await leases.get()
    await kube.close(); await leases.close()
    return found, lease

found, lease = asyncio.run(main())
models = [m for m in sys.modules if m.startswith("kubernetes_asyncio.client.models.")]
apis = [m for m in sys.modules if m.startswith("kubernetes_asyncio.client.api.")]
print(found["path"], found["auth"].replace(" ", "_"), lease, len(models), len(apis))
"""


def test_the_operator_process_has_a_working_client_without_the_generated_classes(tmp_path):
    server = ApiServer()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        textwrap.dedent(f"""
        apiVersion: v1
        kind: Config
        clusters: [{{name: c, cluster: {{server: "{server.url}"}}}}]
        users: [{{name: u, user: {{token: s3cret}}}}]
        contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
        current-context: x
        """)
    )
    env = {"KUBECONFIG": str(kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    server.server.shutdown()
    assert p.returncode == 0, p.stderr[-3000:]
    path, auth, lease, models, apis = p.stdout.split()
    assert path == "/apis/training.tpu-operator.dev/v1alpha1/namespaces/ml/tputrainingjobs/tiny"
    assert auth == "Bearer_s3cret" and lease == "None"  # the token went with it; the Lease's 404 read as absent
    assert (models, apis) == ("0", "0")

"""Start the fake API server as a subprocess from tests, and talk to it.

    with running_apiserver(tmp_path, crds=[JOBSET_CRD]) as server:
        status, body = server.request("GET", "/api/v1/namespaces")
        kubectl(server, "get", "namespaces")

The server process is always killed when the `with` block ends, failing or not.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBECTL = "/usr/bin/kubectl"


@dataclasses.dataclass
class Server:
    url: str
    kubeconfig: pathlib.Path
    process: subprocess.Popen
    cache_dir: pathlib.Path  # kubectl's discovery cache, private to this server
    log_path: pathlib.Path  # the server's stderr

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        """One HTTP call; returns (status, decoded JSON body, or text if it is not JSON)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode("utf-8", "replace")

    def inject_fault(self, path: str, status: int, *, method: str = "*", count: int = 1, message: str = "") -> dict:
        """Fail the next `count` requests whose method matches and whose path+query re.search-es `path`."""
        code, fault = self.request("POST", "/_test/faults", {"path": path, "status": status, "method": method,
                                                             "count": count, "message": message})
        assert code == 201, f"could not inject a fault: {code} {fault}"
        return fault

    def clear_faults(self) -> None:
        self.request("DELETE", "/_test/faults")

    def drop_watches(self) -> int:
        """End every open watch stream; returns how many there were."""
        return self.request("POST", "/_test/watches/drop")[1]["dropped"]

    def requests_log(self) -> list[dict[str, Any]]:
        """[{method, path, query, status, userAgent}, ...] of every non-/_test/ request so far."""
        return self.request("GET", "/_test/requests")[1]["items"]

    def clear_requests_log(self) -> None:
        self.request("DELETE", "/_test/requests")


def _read_url(process: subprocess.Popen, timeout: float) -> str:
    """The first stdout line of the server, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or process.poll() is not None:
            break
        ready, _, _ = select.select([process.stdout], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(process.stdout.fileno(), 1)
            if not chunk:
                break
            line += chunk
    return line.decode().strip()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            pipe.close()


@contextlib.contextmanager
def running_apiserver(tmp_path: pathlib.Path, crds: Sequence[os.PathLike | str] = (),
                      start_timeout: float = 30.0, extra_args: Sequence[str] = ()) -> Iterator[Server]:
    """Run `python -m tests.kubeapi` in a subprocess for the duration of the block.

    `extra_args` go to the server's command line, e.g. ("--history", "5").
    """
    workdir = pathlib.Path(tmp_path) / "kubeapi"
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig, log_path = workdir / "kubeconfig", workdir / "server.log"
    command = [sys.executable, "-m", "tests.kubeapi", "--port", "0", "--kubeconfig", str(kubeconfig),
               "--exit-with-stdin"]
    for crd in crds:
        command += ["--crd", str(crd)]
    command += list(extra_args)
    with open(log_path, "wb") as log:
        # stdin stays open for the server's life: it exits on EOF, should this process die unannounced.
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    try:
        url = _read_url(process, start_timeout)
        if not url.startswith("http://"):
            stop(process)
            raise RuntimeError(f"the fake API server did not print its URL within {start_timeout}s "
                               f"(exit code {process.returncode}); its log:\n{log_path.read_text()}")
        yield Server(url=url, kubeconfig=kubeconfig, process=process, cache_dir=workdir / "kubectl-cache",
                     log_path=log_path)
    finally:
        stop(process)


def kubectl(server: Server, *args: str, timeout: float = 30.0, input: str | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """Run kubectl against `server`; apply/create/replace get `--validate=false` unless the args say otherwise
    (the server's /openapi/v2 has the CRD kinds only, so kubectl would validate those alone)."""
    command = [KUBECTL, f"--kubeconfig={server.kubeconfig}", f"--cache-dir={server.cache_dir}", *args]
    if args and args[0] in ("apply", "create", "replace") and not any(a.startswith("--validate") for a in args):
        command.insert(4, "--validate=false")
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, input=input)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@contextlib.contextmanager
def kubectl_background(server: Server, *args: str) -> Iterator[subprocess.Popen]:
    """A long-running kubectl (e.g. `get -w`), killed when the block ends; stdout is a text pipe."""
    command = [KUBECTL, f"--kubeconfig={server.kubeconfig}", f"--cache-dir={server.cache_dir}", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield process
    finally:
        stop(process)
        if process.stderr is not None:
            process.stderr.close()


def read_until(process: subprocess.Popen, wanted: str, timeout: float) -> str:
    """Read a process's stdout until `wanted` appears; fail with what was read if it does not in time."""
    deadline, seen = time.monotonic() + timeout, b""
    while wanted.encode() not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{wanted!r} did not appear within {timeout}s; got:\n{seen.decode()}")
        ready, _, _ = select.select([process.stdout], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"the process ended before {wanted!r} appeared; got:\n{seen.decode()}")
            seen += chunk
    return seen.decode()


def wait_for(condition, timeout: float = 10.0, interval: float = 0.05, message: str = "condition"):  # noqa: ANN001
    """Poll `condition()` until it returns something truthy; return it, or fail naming `message`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last result: {result!r}")
        time.sleep(interval)

"""`tpujob operator` as a subprocess for black-box tests, logging JSON lines to a file."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from tests.conftest import ROOT, TEST_IMAGE
from tpu_operator.local.pods import free_port

WAIT_S = 30.0


class Operator:
    """`tpujob operator` in a subprocess, logging JSON lines to a file."""

    def __init__(self, kubeconfig: pathlib.Path, workdir: pathlib.Path, *args: str):
        self.kubeconfig, self.health_port, self.metrics_port = kubeconfig, free_port(), free_port()
        self.log_path = workdir / f"operator-{time.monotonic_ns()}.log"
        self.command = [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "operator",
            "--standalone",
            "--default-image",
            TEST_IMAGE,  # as the chart passes operator.defaultImage
            "--health-port",
            str(self.health_port),
            "--health-host",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-host",
            "127.0.0.1",
            *args,
        ]
        self.process: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # beside the test's own environment (e.g. PYTHONPATH: another version's code)

    def start(self, wait: bool = True) -> Operator:
        """Start it; with `wait`, until its liveness endpoint answers."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.env}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if not wait:
            return self
        deadline = time.monotonic() + WAIT_S
        while self.process.poll() is None and not self.healthy():
            assert time.monotonic() < deadline, f"no liveness from the operator in {WAIT_S} s:\n{self.log_tail()}"
            time.sleep(0.1)
        assert self.process.poll() is None, f"the operator exited at start-up:\n{self.log_tail()}"
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_operator(kubeconfig: pathlib.Path, workdir: pathlib.Path, *args: str) -> Iterator[Operator]:
    op = Operator(kubeconfig, workdir, *args)
    try:
        yield op.start()
    finally:
        op.kill(signal.SIGTERM)

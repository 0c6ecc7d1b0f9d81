"""`tpujob validate --server` where no server answers: exit 3 (not checked), with the reason, after the same
validation as without --server (a bad job is still exit 2 without asking anyone). Real `tpujob` processes:
the kubeconfig's default path is read from $KUBECONFIG when the client library is imported. The dry run against a
real API server is in tests/cluster/test_hostile.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import yaml

from tests.conftest import tiny_job
from tpu_operator import cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: a connection is refused


def _kubeconfig(tmp_path, server: str):
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "x",
                "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


def tpujob(tmp_path, kubeconfig, job) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    return subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "validate", "--server", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "KUBECONFIG": str(kubeconfig)},
    )


def test_a_server_that_cannot_be_reached_is_exit_3(tmp_path):
    server = f"https://127.0.0.1:{_closed_port()}"
    result = tpujob(tmp_path, _kubeconfig(tmp_path, server), tiny_job())
    assert result.returncode == cli.EXIT_NOT_CHECKED, result.stderr
    assert "job:" in result.stdout  # the validation's summary came first
    assert f"default/tiny: not checked by the server {server}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_no_kubeconfig_is_exit_3(tmp_path):
    result = tpujob(tmp_path, tmp_path / "no-such-kubeconfig", tiny_job())
    assert result.returncode == cli.EXIT_NOT_CHECKED, result.stderr
    assert "not checked by a server: no kubeconfig" in result.stderr and "Traceback" not in result.stderr


def test_an_invalid_job_is_exit_2_before_any_server_is_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job(tpu={"generation": "v7x", "topology": "3x3x3"})))
    assert cli.main(["validate", "--server", "-f", str(job)]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.tpu.topology" in err and "server" not in err, err

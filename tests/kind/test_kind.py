"""The kind end-to-end suite: `bash tests/kind/run.sh` must end with the job Succeeded and its MFU in status.

Needs a Docker engine, kind, kubectl and curl (helm is installed by scripts/install-helm.sh when
missing) and network access for JobSet's release manifest and the base images; skipped with the
reason otherwise (failed instead when KIND_REQUIRED=1, as in CI). It takes several minutes: `pytest -m kind tests/kind`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.prerequisites import missing, skip_or_fail

RUN = Path(__file__).resolve().parent / "run.sh"


@pytest.mark.kind
@pytest.mark.timeout(3600)
def test_operator_runs_a_job_to_success_on_kind():
    skip_or_fail(
        missing(("docker", "kind", "kubectl", "curl"), ("docker", "info"), timeout=30, probe_failed="no Docker engine"),
        "KIND_REQUIRED",
    )
    result = subprocess.run(["bash", str(RUN)], capture_output=True, text=True, timeout=3500)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20000:]
    assert "PASSED: kind-smoke Succeeded with mfu=" in output, output[-20000:]

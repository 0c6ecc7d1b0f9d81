"""Rendering the Helm chart with `helm template` (no cluster), for the tests that read what it renders
(tests/chart/test_chart.py, tests/images/test_images.py): a helper module, not a test module."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tpu-operator"


# The values the chart requires (no image is published): an installer names the images it built and pushed.
REQUIRED = {
    "image": {"repository": "registry.example/tpu-operator"},
    "operator": {"defaultImage": "registry.example/tpu-operator-workload:0.1.0"},
}


def run_helm(
    helm: str, *args: str, values: dict[str, Any] | None = None, tmp: Path | None = None, required: bool = True
) -> subprocess.CompletedProcess:
    """helm with REQUIRED (unless `required` is false) and then `values` as values files."""
    command = [helm, *args]
    for given in ([REQUIRED] if required and values is not None else []) + ([values] if values is not None else []):
        assert tmp is not None
        path = tmp / f"values-{hashlib.sha1(repr(given).encode()).hexdigest()[:8]}.yaml"
        path.write_text(yaml.safe_dump(given))
        command += ["-f", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def render(
    helm: str,
    tmp_path: Path,
    values: dict[str, Any] | None = None,
    release: str = "t",
    namespace: str = "tpu-system",
    include_crds: bool = False,
) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    result = run_helm(helm, *args, values=values or {}, tmp=tmp_path)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def deployment_container(docs: list[dict]) -> tuple[dict, dict]:
    deployment = one(docs, "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return deployment, containers[0]

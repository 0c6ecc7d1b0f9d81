"""Where the tests find the real JobSet CRD, at the version the local cluster pins (scripts/cluster-versions.env,
read by tests/cluster/build.py: one place), for the strict schema checks of what the operator renders. It is
never copied into the repository; it is looked for, in order:

1. the cluster build's cache (`bash scripts/build-cluster.sh` copies JobSet's CRDs there);
2. the Go module cache (`go env GOMODCACHE`), where any build of that JobSet version left the module;
3. `go mod download -json sigs.k8s.io/jobset@VERSION` (the Go module proxy), whose `Dir` is the module;
4. `../shared/schemas/` beside the repository (a copy some checkouts have; not necessarily the pinned version).

`find()` returns the path and where it came from, or None and why every place failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.cluster.build import ROOT, build, versions

MODULE = "sigs.k8s.io/jobset"
IN_MODULE = Path("config") / "components" / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml"
IN_BUILD = Path("jobset") / "crd" / "bases" / IN_MODULE.name  # build-cluster.sh copies config/components/crd
SHARED = ROOT.parent / "shared" / "schemas" / IN_MODULE.name
DOWNLOAD_TIMEOUT_S = 180


def version() -> str:
    """The pinned JobSet version (v0.12.0 when this was written)."""
    return versions()["JOBSET"]


def _go(*args: str, timeout: float = 30) -> subprocess.CompletedProcess | None:
    go = shutil.which("go")
    if go is None:
        return None
    # Outside any module (the repository has none, but a directory above it might).
    with tempfile.TemporaryDirectory(prefix="jobset-crd-") as cwd:
        env = {**os.environ, "GO111MODULE": "on"}
        try:
            return subprocess.run([go, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
        except subprocess.TimeoutExpired:
            return None


def in_build_cache() -> Path | None:
    path = build().manifests / IN_BUILD
    return path if path.is_file() else None


def in_module_cache() -> Path | None:
    result = _go("env", "GOMODCACHE")
    if result is None or result.returncode != 0 or not result.stdout.strip():
        return None
    path = Path(result.stdout.strip()) / f"{MODULE}@{version()}" / IN_MODULE
    return path if path.is_file() else None


def downloaded() -> tuple[Path | None, str]:
    """The CRD from `go mod download -json`, or None and why not."""
    result = _go("mod", "download", "-json", f"{MODULE}@{version()}", timeout=DOWNLOAD_TIMEOUT_S)
    if result is None:
        return None, "no Go on PATH (or `go mod download` timed out)"
    try:
        answer = json.loads(result.stdout)
    except json.JSONDecodeError:
        return None, f"`go mod download` failed: {(result.stderr or result.stdout).strip()[:300]}"
    if answer.get("Error") or not answer.get("Dir"):
        return None, f"`go mod download` failed: {answer.get('Error') or 'no Dir in its answer'}"
    path = Path(answer["Dir"]) / IN_MODULE
    return (path, "") if path.is_file() else (None, f"{path} is not in the downloaded module")


def find() -> tuple[Path | None, str]:
    """(the CRD's path, where it was found) or (None, why it was found nowhere)."""
    if (path := in_build_cache()) is not None:
        return path, f"the cluster build's cache (JobSet {version()})"
    if (path := in_module_cache()) is not None:
        return path, f"the Go module cache (JobSet {version()})"
    path, why = downloaded()
    if path is not None:
        return path, f"go mod download (JobSet {version()})"
    if SHARED.is_file():
        return SHARED, f"{SHARED} (not necessarily JobSet {version()})"
    return None, (
        f"the JobSet {version()} CRD was found nowhere: not in the cluster build's cache "
        f"({build().manifests / IN_BUILD}), not in the Go module cache, not from the module proxy ({why}), "
        f"and {SHARED} is absent; install Go (1.26) so `go mod download` can fetch it"
    )

"""Where `scripts/build-cluster.sh` put the pinned components, and why the cluster suite cannot run here.

The pins live in scripts/cluster-versions.env; the build's cache directory is named after them, so a test
finds exactly the binaries of the pinned versions or none.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSIONS_FILE = ROOT / "scripts" / "cluster-versions.env"
BINARIES = (
    "kubectl",
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kwokctl",
    "jobset",
    "kueue",
)


def versions() -> dict[str, str]:
    """The pins: {"KUBERNETES": "v1.36.3", "ETCD": ..., "JOBSET": ..., "KUEUE": ..., "KWOK": ...}."""
    pins = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, value = line.split("=", 1)
            pins[key] = value
    return pins


@dataclass(frozen=True)
class Build:
    dir: Path

    @property
    def bin(self) -> Path:
        return self.dir / "bin"

    @property
    def manifests(self) -> Path:
        return self.dir / "manifests"

    def binary(self, name: str) -> Path:
        return self.bin / name

    def missing(self) -> list[str]:
        return [name for name in BINARIES if not os.access(self.binary(name), os.X_OK)] + [
            part for part in ("jobset", "kueue", "kwok") if not (self.manifests / part).is_dir()
        ]


def build() -> Build:
    """The cache directory of the pinned versions (it may not exist yet)."""
    pins = versions()
    root = Path(os.environ.get("TPUJOB_CLUSTER_CACHE") or Path.home() / ".cache" / "tpu-operator" / "cluster")
    name = f"k8s-{pins['KUBERNETES']}-etcd-{pins['ETCD']}-jobset-{pins['JOBSET']}-kueue-{pins['KUEUE']}-kwok-{pins['KWOK']}"
    return Build(root / name)


def unavailable() -> str | None:
    """Why the local cluster cannot be started here, or None when the pinned build is complete."""
    found = build()
    missing = found.missing()
    if not missing:
        return None
    if shutil.which("go") is None:
        return (
            "no Go on PATH: the cluster's components build from the Go module proxy "
            "(install Go 1.26, then `bash scripts/build-cluster.sh`)"
        )
    return f"the pinned cluster is not built ({', '.join(missing)} missing in {found.dir}): run `bash scripts/build-cluster.sh`"


def kubectl() -> str:
    """The kubectl tests use: $TPUJOB_KUBECTL, else the pinned build's, else one on PATH (a stopgap:
    Debian's kubernetes-client), else the pinned build's path (which says it is missing when run)."""
    given = os.environ.get("TPUJOB_KUBECTL")
    if given:
        return given
    built = build().binary("kubectl")
    if os.access(built, os.X_OK):
        return str(built)
    return shutil.which("kubectl") or str(built)

"""The two images, built once per session with scripts/build-images.sh (podman), for tests/images.

The build script keeps a tag whose inputs did not change, so after `.ci/run`'s build, or a previous
session, this costs a second; otherwise it builds what is missing or stale (about 4 minutes from
nothing on 2 cores). Without root, podman or debootstrap the tests skip with that reason; with
IMAGES_REQUIRED=1 (CI) they fail instead, as a skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

# The cluster suite's fixtures, for the operator image's tests (imported to be found: used by name only).
from tests.cluster.conftest import (  # noqa: F401
    chart,
    cluster,
    operator_args,
    operator_kubeconfig,
)
from tests.conftest import ROOT
from tests.images.container import Image
from tests.prerequisites import missing, skip_or_fail

BUILD = ROOT / "scripts" / "build-images.sh"
BUILD_TIMEOUT_S = 1500
OPERATOR_IMAGE = os.environ.get("OPERATOR_IMAGE", "localhost/tpu-operator:dev")
WORKLOAD_IMAGE = os.environ.get("WORKLOAD_IMAGE", "localhost/tpu-workload:dev-cpu")


@dataclass(frozen=True)
class Images:
    operator: Image
    workload: Image  # the CPU variant


def missing_prerequisites() -> str | None:
    """Why podman cannot build and run the images here, or None."""
    if not sys.platform.startswith("linux"):
        return f"the image tests need Linux (podman, mount namespaces, chroot), not {sys.platform}"
    if os.geteuid() != 0:
        return "the image tests need root: rootful podman builds, debootstrap, mount namespaces and chroot"
    return missing(
        ("podman", "debootstrap", "unshare", "setpriv", "chroot", "mount"),
        ("podman", "info"),
        timeout=60,
        install="apt-get install -y podman debootstrap",
    )


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    skip_or_fail(missing_prerequisites(), "IMAGES_REQUIRED")
    env = {
        **os.environ,
        "ENGINE": "podman",
        "VARIANT": "cpu",
        "OPERATOR_IMAGE": OPERATOR_IMAGE,
        "WORKLOAD_IMAGE": WORKLOAD_IMAGE,
        "LOG_DIR": str(tmp_path_factory.mktemp("build-images")),
    }
    result = subprocess.run(["bash", str(BUILD)], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"scripts/build-images.sh failed:\n{result.stdout}\n{result.stderr[-10000:]}"
    return Images(Image.inspect(OPERATOR_IMAGE), Image.inspect(WORKLOAD_IMAGE))

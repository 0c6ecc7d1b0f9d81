"""Tests that need tools this machine may lack (Docker and kind, podman): say which one is missing,
then skip with that reason, or fail where a skip would hide a broken set-up (CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

import pytest


def missing(
    tools: Sequence[str], probe: Sequence[str], *, timeout: float, install: str = "", probe_failed: str = ""
) -> str | None:
    """Why the tools cannot be used here, or None: one not on PATH, or `probe` (e.g. `docker info`)
    not answering or failing. `install` and `probe_failed` are added to those reasons."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH" + (f" ({install})" if install else "")
    shown = " ".join(probe)
    try:
        result = subprocess.run(list(probe), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"`{shown}` did not answer within {timeout:.0f} s"
    if result.returncode != 0:
        return (
            f"`{shown}` failed"
            + (f" ({probe_failed})" if probe_failed else "")
            + f": {(result.stderr or result.stdout).strip()[:300]}"
        )
    return None


def skip_or_fail(reason: str | None, required_variable: str) -> None:
    """Skip with `reason`; fail instead when the environment sets `required_variable`=1 (as CI does)."""
    if reason and os.environ.get(required_variable) == "1":
        pytest.fail(f"{required_variable}=1 but {reason}")
    if reason:
        pytest.skip(reason)

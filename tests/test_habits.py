"""The project's habits, checked like its behaviour: the linter, the formatter and the type checker.

They run as README's test command runs everything else, from the pinned tools of the test extra and the
settings in pyproject.toml's [tool.ruff] and [tool.mypy]. To fix what they find: `.venv/bin/ruff format .`
and `.venv/bin/ruff check --fix .`; mypy's errors are fixed by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def _mypy(tmp_path: Path, *packages: str) -> subprocess.CompletedProcess[str]:
    """mypy on `packages` of tpu_operator, run where the import name resolves to operator/.

    The source folder is operator/ but the package is tpu_operator (pyproject's package-dir), and mypy does
    not follow the editable install's import finder: it looks packages up on its search path, where the
    current folder comes first. So it runs in a fresh folder holding one link, tpu_operator -> operator/,
    with --config-file naming the repository's pyproject.toml (otherwise mypy would take any config file in
    a parent folder of that temporary one) and its cache in pytest's tmp_path (none is left in the
    repository). Error paths read tpu_operator/...; the message maps them back to operator/...
    """
    root = tmp_path / "mypy"
    root.mkdir()
    (root / "tpu_operator").symlink_to(REPO / "operator", target_is_directory=True)
    args = [sys.executable, "-m", "mypy", "--config-file", str(PYPROJECT), "--cache-dir", str(tmp_path / "cache")]
    for package in packages:
        args += ["-p", f"tpu_operator.{package}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=540, check=False)


def _in_repo_terms(output: str) -> str:
    return "\n".join(
        "operator/" + line.removeprefix("tpu_operator/") if line.startswith("tpu_operator/") else line
        for line in output.splitlines()
    )


def test_the_operators_api_and_controller_type_check_strictly(tmp_path: Path) -> None:
    """Strict on api/ and controller/ ([tool.mypy]'s override), and rendering/ (which they import) checked
    with mypy's defaults."""
    run = _mypy(tmp_path, "api", "controller", "rendering")
    output = _in_repo_terms(run.stdout + run.stderr)
    assert run.returncode == 0, f"mypy (strict on tpu_operator.api and .controller) found problems:\n{output}"
    assert "Success: no issues found" in run.stdout, output


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", str(REPO)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ruff_finds_nothing():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_every_file_is_formatted():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `.venv/bin/ruff format .`:\n" + result.stdout[-4000:] + result.stderr[-2000:]

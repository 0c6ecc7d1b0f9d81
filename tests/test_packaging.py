"""Installs: the wheel carries the templates and the CRD and renders from any directory; the trainer
installs without the operator's dependencies."""

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp / "dist").glob("tpu_operator-*.whl")
    venv.create(tmp / "venv", with_pip=True)
    python = tmp / "venv" / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return python, tmp


def test_installed_wheel_renders_and_prints_the_crd(wheel_venv):
    python, tmp = wheel_venv
    # Dependencies come from the test environment; the package itself only from the wheel. Plain
    # PYTHONPATH entries do not run .pth files, so the editable install of this checkout stays out.
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": "/usr/bin:/bin"}
    where = subprocess.run(
        [str(python), "-c", "import tpu_operator.rendering.manifests as r; print(r.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
    )
    assert str(tmp / "venv") in where.stdout, where.stdout + where.stderr
    render = subprocess.run(
        [
            str(python),
            "-m",
            "tpu_operator.cli",
            "render",
            "-f",
            str(ROOT / "examples" / "llama3-8b-fsdp.yaml"),
            "--default-image",
            "registry.example/w:1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=60,
    )
    assert render.returncode == 0, render.stderr
    assert "kind: JobSet" in render.stdout and "kind: ConfigMap" in render.stdout
    crd = subprocess.run(
        [str(python), "-m", "tpu_operator.cli", "crd"], capture_output=True, text=True, cwd=tmp, env=env, timeout=60
    )
    assert crd.stdout == (ROOT / "crds" / "tputrainingjob.yaml").read_text()


@pytest.mark.long  # a fresh venv from PyPI (about 1 minute)
def test_the_workload_installs_without_the_operator_side(tmp_path):
    """`pip install '.[workload]'` (what the trainer image does) into a fresh venv: the trainer imports,
    and kopf and kubernetes are not there (jinja2 is: `objective: sft` renders chat templates with it)."""
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{ROOT}[workload]"], capture_output=True, text=True, timeout=900
    )
    assert install.returncode == 0, install.stderr[-3000:]
    probe = (
        "import importlib.util, json, tpu_workload.loop.train, tpu_workload.__main__; "
        "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
        "['kopf', 'kubernetes', 'jinja2', 'jax', 'pydantic']}))"
    )
    result = subprocess.run(
        [str(python), "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "kopf": False,
        "kubernetes": False,
        "jinja2": True,
        "jax": True,
        "pydantic": True,
    }

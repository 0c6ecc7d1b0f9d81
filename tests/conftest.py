"""Shared fixtures: paths of the repository, the shared schemas, and job documents."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHARED = ROOT.parent / "shared"
JOBSET_CRD = SHARED / "schemas" / "jobset.x-k8s.io_jobsets.yaml"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


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
        },
    }
    doc["spec"].update(copy.deepcopy(spec_overrides))
    return doc


@pytest.fixture(scope="session")
def jobset_schema():
    """The real JobSet CRD's v1alpha2 schema as a validator; skipped when ../shared is absent."""
    if not JOBSET_CRD.exists():
        pytest.skip(f"{JOBSET_CRD} is absent: the JobSet schema lives in ../shared/schemas beside the repo")
    from tests.kubeapi.schema import CrdSchema

    crd = yaml.safe_load(JOBSET_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    return CrdSchema(version["schema"]["openAPIV3Schema"])

"""The CRD is generated from the models and admits exactly what they describe (offline, with the schema
validator of tests/crd_schema.py; tests/cluster/test_crd.py checks the same on a real kube-apiserver, CEL
rules included)."""

import pytest
import yaml

from tests.conftest import EXAMPLES, tiny_job
from tests.crd_schema import CrdSchema, SchemaError
from tests.hostile_cases import SCHEMA_REFUSED
from tpu_operator.api import crd

CRD_PATH = EXAMPLES.parent / "crds" / crd.CRD_FILE


def test_committed_crd_matches_the_models():
    assert CRD_PATH.read_text() == crd.to_yaml(), (
        "crds/ drifted from the models: run `tpujob crd > crds/tputrainingjob.yaml`"
    )
    assert crd.committed() == crd.to_yaml()  # and the packaged copy is the same file


def test_crd_identity_columns_and_status():
    doc = yaml.safe_load(crd.to_yaml())
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "tputrainingjobs.training.tpu-operator.dev"
    assert spec["names"]["shortNames"] == ["tpujob", "tpujobs"] and spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Topology", "Slices", "Step", "MFU", "Step Time", "Age"]


def _schema():
    doc = yaml.safe_load(crd.to_yaml())
    return CrdSchema(doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_crd_admits_every_example_unchanged(path):
    doc = yaml.safe_load(path.read_text())
    assert _schema().admit(doc, "TPUTrainingJob", "training.tpu-operator.dev") == doc


@pytest.mark.parametrize("patch,field", SCHEMA_REFUSED)
def test_crd_rejects_at_admission(patch, field):
    with pytest.raises(SchemaError) as exc:
        _schema().admit(tiny_job(**patch), "TPUTrainingJob", "training.tpu-operator.dev")
    assert field in str(exc.value.causes), exc.value.causes


def test_parallelism_auto_or_integer_is_admitted():
    doc = tiny_job(parallelism={"fsdp": "auto", "tensor": 2})
    assert _schema().admit(doc, "TPUTrainingJob", "training.tpu-operator.dev")["spec"]["parallelism"]["tensor"] == 2


def _unbounded(node, path):
    """Paths under `node` that the API server would admit at any size: a number without a maximum, a string
    without a length (an enum is bounded), a list or a map without a size."""
    kind = "int-or-string" if node.get("x-kubernetes-int-or-string") else node.get("type")
    if kind in ("integer", "number", "int-or-string") and "maximum" not in node:
        yield path
    if kind == "string" and "maxLength" not in node and "enum" not in node:
        yield path
    if kind == "array":
        if "maxItems" not in node:
            yield path
        yield from _unbounded(node["items"], path + "[]")
    if kind == "object":
        if isinstance(node.get("additionalProperties"), dict):
            if "maxProperties" not in node:
                yield path
            yield from _unbounded(node["additionalProperties"], path + ".*")
        for name, child in node.get("properties", {}).items():
            yield from _unbounded(child, f"{path}.{name}")


def test_every_spec_value_is_bounded_in_the_crd():
    spec = yaml.safe_load(crd.to_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert list(_unbounded(spec, "spec")) == []
    assert spec["properties"]["training"]["properties"]["microbatches"]["maximum"] == 4096

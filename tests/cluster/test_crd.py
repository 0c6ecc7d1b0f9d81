"""The generated CRD on a real kube-apiserver: accepted as a structural schema, its printer columns in
`kubectl get -o wide`, hostile specs refused at admission by the schema, every example admitted, and
immutable fields refused by its CEL rules once the job has its JobSet."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from tests.cluster.kube import JOBS, Cluster
from tests.conftest import EXAMPLES, ROOT, tiny_job
from tests.hostile_cases import SCHEMA_REFUSED

pytestmark = pytest.mark.cluster
CRD = ROOT / "crds" / "tputrainingjob.yaml"
CRD_NAME = "tputrainingjobs.training.tpu-operator.dev"


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> Cluster:
    """The CRD installed the way README says (`kubectl apply --server-side`), and established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=established", "--timeout=60s", f"crd/{CRD_NAME}")
    return cluster


def job(name: str, **spec) -> dict:
    doc = tiny_job(**spec)
    doc["metadata"]["name"] = name
    return doc


def test_generated_crd_is_accepted_with_its_columns_and_schema(crd: Cluster):
    served = json.loads(crd.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in served["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NonStructuralSchema") != "True", conditions
    expected = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]
    (version,) = served["spec"]["versions"]
    assert version["additionalPrinterColumns"] == expected["additionalPrinterColumns"]
    assert (
        version["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
        == expected["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    )


def test_kubectl_get_wide_prints_the_columns(crd: Cluster):
    ns = crd.namespace("columns")
    crd.apply(job("columns"), namespace=ns)
    table = crd.kubectl("get", "tpujobs", "-n", ns, "-o", "wide").stdout.splitlines()
    header = re.split(r"\s{2,}", table[0].strip())
    assert header == [
        "NAME",
        "PHASE",
        "TOPOLOGY",
        "SLICES",
        "STEP",
        "MFU",
        "STEP TIME",
        "TOKENS/S",
        "RESTARTS",
        "PREEMPTIONS",
        "GOODPUT",
        "AGE",
        "MESSAGE",
    ], table[0]
    assert table[1].split()[:2] == ["columns", "2x2x1"], table  # no status yet: Phase is empty
    short = crd.kubectl("get", "tpujob", "-n", ns).stdout.splitlines()[0].split()
    assert short == ["NAME", "PHASE", "TOPOLOGY", "SLICES", "STEP", "MFU", "STEP", "TIME", "AGE"], short


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_admitted_with_what_it_says(crd: Cluster, path):
    doc = yaml.safe_load(path.read_text())
    doc["metadata"].pop("namespace", None)
    ns = crd.namespace("example")
    result = crd.kubectl("create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=yaml.safe_dump(doc))
    admitted = json.loads(result.stdout)["spec"]

    def contained(sent, got, where="spec"):  # everything sent comes back; the API server may add defaults
        if isinstance(sent, dict):
            for key, value in sent.items():
                assert key in got, f"{where}.{key} was pruned"
                contained(value, got[key], f"{where}.{key}")
        else:
            assert sent == got, f"{where}: sent {sent!r}, stored {got!r}"

    contained(doc["spec"], admitted)


# SCHEMA_REFUSED, and what only the API server checks: a CEL rule (a structural schema has no patternProperties).
@pytest.mark.parametrize(
    "patch,field", [*SCHEMA_REFUSED, ({"nodeSelector": {"not a label key!": "x"}}, "spec.nodeSelector")]
)
def test_hostile_spec_is_refused_at_admission(crd: Cluster, patch, field):
    ns = crd.namespace("hostile")
    result = crd.apply(job("hostile", **patch), namespace=ns, check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr
    assert crd.job(ns, "hostile") is None


def _has_jobset(crd: Cluster, ns: str, name: str) -> None:
    """Stands in for the operator: the status names the JobSet, as the operator writes it once it made one."""
    crd.custom.patch_namespaced_custom_object_status(
        *JOBS[:2], ns, JOBS[2], name, {"status": {"jobSetName": name, "phase": "Pending"}}
    )


def test_immutable_fields_are_refused_by_cel_once_the_job_has_its_jobset(crd: Cluster):
    ns = crd.namespace("frozen")
    doc = job("frozen")
    crd.apply(doc, namespace=ns)
    # Before the JobSet exists the spec may be fixed (an Invalid job, a pre-flight that does not fit).
    fixed = copy.deepcopy(doc)
    fixed["spec"]["training"]["steps"] = 20
    crd.apply(fixed, namespace=ns)
    _has_jobset(crd, ns, "frozen")

    changed = copy.deepcopy(fixed)
    changed["spec"]["training"]["steps"] = 99
    changed["spec"]["image"] = "example.com/other:1"
    result = crd.apply(changed, namespace=ns, check=False)
    assert result.returncode != 0, result.stdout
    assert "spec.training: Forbidden: spec.training cannot change once the job has its JobSet" in result.stderr, (
        result.stderr
    )
    assert "spec.image: Forbidden" in result.stderr and "delete the job and create it again" in result.stderr
    assert crd.job(ns, "frozen")["spec"]["training"]["steps"] == 20

    # A field that was not set cannot be added either; spec.suspend stays mutable.
    added = copy.deepcopy(fixed)
    added["spec"]["queueName"] = "tpu-queue"
    result = crd.apply(added, namespace=ns, check=False)
    assert result.returncode != 0 and "spec.queueName: Forbidden" in result.stderr, result.stderr
    crd.kubectl("patch", "tpujob", "frozen", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    assert crd.job(ns, "frozen")["spec"]["suspend"] is True


def test_an_unset_image_stays_unset_for_the_operators_default(crd: Cluster):
    # The API server fills in the CRD's defaults; spec.image has none, so the operator's --default-image
    # (the chart's operator.defaultImage) still applies to a job that names no image.
    ns = crd.namespace("image")
    imageless = job("imageless")
    imageless["spec"].pop("image", None)
    stored = json.loads(
        crd.kubectl(
            "create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-", input=yaml.safe_dump(imageless)
        ).stdout
    )
    assert "image" not in stored["spec"] and stored["spec"]["imagePullPolicy"] == "IfNotPresent", stored["spec"]

"""Hostile and careless inputs (issue 27), each through `tpujob validate`: refused with one clear error naming
the field or the place in the file, exit 2, no traceback, nothing on stdout, every line short and free of
terminal control characters. In-process through the CLI's entry point (2 cores: a process per case would
cost seconds each); the last test runs a few through a real `tpujob` process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.conftest import tiny_job
from tpu_operator import cli


def _spec(**overrides):
    return yaml.safe_dump(tiny_job(**overrides), width=1 << 20)


def _named(name):
    doc = tiny_job(tpu={"topology": "4x4x4"}, training={"steps": 1, "globalBatch": 128, "sequenceLength": 128})
    doc["metadata"]["name"] = name
    return yaml.safe_dump(doc)


def _replace(old, new, **overrides):
    text = _spec(**overrides)
    assert old in text, (old, text)
    return text.replace(old, new, 1)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))
MICRO = 10**15 + 37

# (id, the file's text (str) or bytes, what the error names)
CASES = [
    # The file and its YAML
    ("alias-bomb", BOMB, "(yaml): more than 100000 values"),
    ("deep-flow-nesting", "spec: " + "[" * 20000 + "]" * 20000 + "\n", "(yaml): nested more than 64"),
    ("deep-block-nesting", "".join("  " * i + f"k{i}:\n" for i in range(2000)) + "  " * 2000 + "v\n",
     "(yaml): nested more than 64"),
    ("deep-but-parsable", "spec: " + "[" * 100 + "]" * 100 + "\n", "(yaml): nested more than 64"),
    ("5000-digit-integer", _replace("steps: 10", "steps: " + "9" * 5000, training={
        "steps": 10, "globalBatch": 8, "sequenceLength": 128}), "(yaml): an integer of 5000 digits"),
    ("duplicate-key", _replace("kind: TPUTrainingJob\n", "kind: TPUTrainingJob\nkind: TPUTrainingJob\n"),
     "key kind is given twice"),
    ("duplicate-nested-key", _replace("steps: 10\n", "steps: 10\n    steps: 11\n"), "key steps is given twice"),
    ("not-utf8", b"apiVersion: \xff\xfe\n", "not a text file"),
    ("python-tag", "spec: !!python/object/apply:os.system [echo hi]\n", "(yaml)"),
    ("empty", "", "(yaml): no document found"),
    ("scalar", "just a string\n", "expected a TPUTrainingJob mapping"),
    ("too-big", "# " + "x" * (5 * 1024 * 1024) + "\n", "more than 4194304 bytes"),
    ("date-as-name", _replace("name: tiny", "name: 2024-01-01"), "metadata.name"),
    ("name-with-trailing-newline", _replace("name: tiny", 'name: "tiny\\n"'), "metadata.name"),
    # Types and bounds as the API server has them
    ("layers-10**400", _spec(model={"preset": "tiny", "layers": 10**400}), "spec.model.layers"),
    ("bool-as-int", _replace("steps: 10", "steps: true"), "spec.training.steps"),
    ("string-as-int", _replace("steps: 10", "steps: '10'"), "spec.training.steps"),
    ("2**63", _replace("steps: 10", f"steps: {2**63}"), "spec.training.steps"),
    ("inf", _replace("steps: 10", "steps: 10\n    learningRate: {peak: .inf}"), "spec.training.learningRate.peak"),
    ("nan", _replace("steps: 10", "steps: 10\n    gradClip: .nan"), "spec.training.gradClip"),
    ("V7X", _replace("generation: v7x", "generation: V7X"), "spec.tpu.generation"),
    ("padded-generation", _replace("generation: v7x", "generation: ' v7x '"), "spec.tpu.generation"),
    ("elastic-10**15-microbatches", _spec(
        tpu={"topology": "2x2x1", "slices": 3, "elastic": {"minSlices": 2}},
        training={"steps": 10, "globalBatch": 48 * MICRO, "microbatches": MICRO, "sequenceLength": 128}),
     "spec.training.microbatches"),
    ("10000-env-entries", _spec(runtime={"env": [{"name": f"E{i}"} for i in range(10000)]}), "spec.runtime.env"),
    ("huge-generation", _replace("generation: v7x", "generation: " + "v" * 1_000_000), "spec.tpu.generation"),
    # Names, labels, tolerations, resources, images, paths: what Kubernetes or JobSet refuse later
    ("52-char-name-on-4x4x4", _named("a" * 52), "metadata.name"),
    ("bad-node-selector-value", _spec(nodeSelector={"pool": "a b"}), "spec.nodeSelector.pool"),
    ("bad-toleration-key", _spec(tolerations=[{"key": "a b", "operator": "Exists"}]), "spec.tolerations[0].key"),
    ("tolerationSeconds-on-NoSchedule", _spec(tolerations=[
        {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 1}]),
     "spec.tolerations[0].tolerationSeconds"),
    ("bad-resource-name", _spec(resources={"requests": {"nvidia": "1"}}), "spec.resources.requests.nvidia"),
    ("bad-image", _spec(image="ghcr.io/Team/trainer:latest"), "spec.image"),
    ("image-short-digest", _spec(image="ghcr.io/t/trainer@sha256:1234"), "spec.image"),
    ("checkpoint-over-config", _spec(checkpoint={"directory": "/etc/tpujob", "persistentVolumeClaim": "c"}),
     "spec.checkpoint.directory"),
    ("relative-data-path", _spec(training={"steps": 1, "globalBatch": 8, "sequenceLength": 128,
                                           "data": {"source": "files", "path": "data"}}),
     "spec.training.data.path"),
    ("annotations-over-256KiB", _spec(runtime={"env": [{"name": f"E{i}", "value": "v" * 1100} for i in range(250)]}),
     "spec: "),
    # Identity and flags
    ("TPU_WORKER_ID", _spec(runtime={"env": [{"name": "TPU_WORKER_ID", "value": "0"}]}), "spec.runtime.env[0].name"),
    ("TPU_WORKER_HOSTNAMES", _spec(runtime={"env": [{"name": "TPU_WORKER_HOSTNAMES", "value": "x"}]}),
     "spec.runtime.env[0].name"),
    ("JAX_COORDINATOR_ADDRESS", _spec(runtime={"env": [{"name": "JAX_COORDINATOR_ADDRESS", "value": "evil:1"}]}),
     "spec.runtime.env[0].name"),
    ("TPUJOB_NUM_PROCESSES", _spec(runtime={"env": [{"name": "TPUJOB_NUM_PROCESSES", "value": "1"}]}),
     "spec.runtime.env[0].name"),
    ("duplicate-env", _spec(runtime={"env": [{"name": "A"}, {"name": "A"}]}), "spec.runtime.env"),
    ("raw-vmem-flag", _spec(runtime={"libtpuInitArgs": ["--xla_tpu_scoped_vmem_limit_kib=1048576"]}),
     "spec.runtime.libtpuInitArgs"),
    # Injection: terminal escapes and newlines in values are escaped when repeated, and refused by patterns
    ("escape-in-generation", _replace("generation: v7x", 'generation: "\\e]0;owned\\a\\e[2J"'), "spec.tpu.generation"),
    ("escape-in-flag", _spec(runtime={"libtpuInitArgs": ["--x=\x1b[31m"]}), "spec.runtime.libtpuInitArgs[0]"),
    ("escape-in-selector-key", _spec(nodeSelector={"\x1b[2Jkey": "v"}), "spec.nodeSelector"),
    ("newline-in-env-name", _spec(runtime={"env": [{"name": "A\nB"}]}), "spec.runtime.env[0].name"),
    ("yaml-in-image", _spec(image="x\nkind: Secret"), "spec.image"),
    # Secrets, resources, names of what the operator makes later
    ("secret-and-value", _spec(runtime={"env": [{"name": "T", "value": "leak", "valueFrom": {
        "secretKeyRef": {"name": "s", "key": "k"}}}]}), "spec.runtime.env[0].valueFrom"),
    ("fieldRef-to-anything", _spec(runtime={"env": [{"name": "T", "valueFrom": {
        "fieldRef": {"fieldPath": "spec.containers[0].env"}}}]}), "spec.runtime.env[0].valueFrom.fieldRef.fieldPath"),
    ("envFrom-reserved-prefix", _spec(runtime={"envFrom": [{"prefix": "MEGASCALE_", "secretRef": {"name": "s"}}]}),
     "spec.runtime.envFrom[0].prefix"),
    ("request-over-limit", _spec(resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
     "spec.resources.requests.memory"),
    ("overcommitted-extended-resource", _spec(resources={"requests": {"example.com/fpga": "1"}}),
     "spec.resources.limits.example.com/fpga"),
    ("grow-back-probe-name", _spec(tpu={"topology": "2x2x4", "slices": 2, "elastic": {"minSlices": 1, "growBack": True}},
                                   training={"steps": 1, "globalBatch": 64, "sequenceLength": 128}).replace(
        "name: tiny", "name: " + "a" * 47), "metadata.name"),
]

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@pytest.mark.parametrize("text,named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_is_one_clear_error(text, named, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    code = cli.main(["validate", "-f", str(path)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and "Traceback" not in err
    assert named in err, err[:2000]
    lines = err.splitlines()
    assert all(line.startswith("error: ") for line in lines), lines[:5]
    assert len(lines) <= cli.MAX_PROBLEMS_SHOWN + 1 and all(len(line) <= 1100 for line in lines), \
        [len(line) for line in lines][:10]
    assert not CONTROL.search(err), repr(CONTROL.search(err))


@pytest.mark.parametrize("text,named", [c[1:] for c in CASES if c[0] in (
    "alias-bomb", "deep-flow-nesting", "duplicate-key", "layers-10**400", "elastic-10**15-microbatches",
    "annotations-over-256KiB", "escape-in-flag")], ids=lambda v: str(v)[:20])
def test_render_refuses_them_too(text, named, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert cli.main(["render", "-f", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and named in err and "Traceback" not in err


def test_an_escape_is_shown_escaped_not_acted_on(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(_replace("generation: v7x", 'generation: "\\e[31mred"'))
    assert cli.main(["validate", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[31mred" in err, err


def test_every_valid_example_still_validates():
    # The bounds are chosen from real jobs: none of the shipped examples is near one.
    from tests.conftest import EXAMPLES

    for path in sorted(EXAMPLES.glob("*.yaml")):
        assert cli.main(["validate", "-f", str(path)]) == 0, path


@pytest.mark.parametrize("case", ["alias-bomb", "deep-flow-nesting", "5000-digit-integer", "layers-10**400"])
def test_a_real_tpujob_process_exits_2_without_a_traceback(case, tmp_path):
    (text, named), = [c[1:] for c in CASES if c[0] == case]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "validate", "-f", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and named in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""

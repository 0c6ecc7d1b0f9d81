"""Bad input: every problem is reported with its field path and a reason, nothing is rendered."""

import subprocess
import sys

import pytest
import yaml

from tests.conftest import tiny_job
from tpu_operator.api.validation import InvalidJob, parse_job


def _with(path: str, value):
    """tiny_job() with the dotted `path` under spec set to `value` (None deletes it)."""
    doc = tiny_job()
    node = doc
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return doc


BAD = [
    # (where, value, expected field path, a word of the reason)
    ("spec.tpu.topology", "3x3x3", "spec.tpu.topology", "not a v7x topology"),
    ("spec.tpu.topology", "8x4x4", "spec.tpu.topology", "A <= B <= C"),
    ("spec.tpu.topology", "4x4", "spec.tpu.topology", "3 dimensions"),
    ("spec.tpu.topology", "four", "spec.tpu.topology", "pattern"),
    ("spec.tpu.topology", "16x24x28", "spec.tpu.topology", "full v7x pod"),
    ("spec.tpu.generation", "v4", "spec.tpu.generation", "not a supported TPU generation"),
    ("spec.tpu.slices", 0, "spec.tpu.slices", "greater than or equal to 1"),
    ("spec.tpu.extra", 1, "spec.tpu.extra", "unknown field"),
    ("spec.model.preset", "gpt5", "spec.model.preset", "is not allowed"),
    ("spec.model", {"layers": 2}, "spec.model", "modelDim"),
    ("spec.model", {"preset": "tiny", "kvHeads": 3}, "spec.model.kvHeads", "does not divide heads"),
    ("spec.model", {"preset": "tiny", "experts": 4}, "spec.model.expertsPerToken", "required when experts"),
    ("spec.model", {"preset": "tiny-moe", "expertsPerToken": 8}, "spec.model.expertsPerToken", "more than experts"),
    ("spec.training.steps", 0, "spec.training.steps", "greater than or equal to 1"),
    ("spec.training.globalBatch", 12, "spec.training.globalBatch", "multiple of data x fsdp x expert = 8"),
    ("spec.training.microbatches", 3, "spec.training.microbatches", "globalBatch must be a multiple of 24"),
    ("spec.training.microbatches", 0, "spec.training.microbatches", "greater than or equal to 1"),
    ("spec.training.precision", "fp4", "spec.training.precision", "is not allowed"),
    ("spec.training.remat", {"policy": "full", "tensors": {"qkv_proj": "offload"}}, "spec.training.remat.tensors",
     "only used with policy custom"),
    ("spec.training.remat", {"policy": "custom", "tensors": {"bogus": "offload"}}, "spec.training.remat.tensors.bogus",
     "is not allowed"),
    ("spec.training.data", {"source": "files"}, "spec.training.data.path", "required when source is files"),
    ("spec.training.data", {"source": "files", "path": "/d", "format": "bin", "packing": True},
     "spec.training.data.eosId", "required when packing bin files"),
    ("spec.training.data", {"source": "files", "path": "/d", "format": "arrayrecord"}, "spec.training.data.packing",
     "required with format arrayrecord"),
    ("spec.training.data", {"packing": True, "eosId": 1 << 20}, "spec.training.data.eosId", "not a token of model.vocab"),
    ("spec.training.data", {"prefetch": 0}, "spec.training.data.prefetch", "greater than or equal to 1"),
    ("spec.training.learningRate", {"peak": -1}, "spec.training.learningRate.peak", "greater than 0"),
    ("spec.parallelism", {"fsdp": "auto", "context": "auto"}, "spec.parallelism", "only one axis may be auto"),
    ("spec.parallelism", {"fsdp": 3}, "spec.parallelism", "one slice has 8 devices"),
    ("spec.parallelism", {"fsdp": "auto", "expert": 2}, "spec.parallelism.expert", "needs an MoE model"),
    ("spec.parallelism", {"fsdp": "auto", "tensor": 8}, "spec.parallelism.tensor", "does not divide model.heads"),
    ("spec.parallelism", {"fsdp": "many"}, "spec.parallelism.fsdp", "'auto'"),
    ("spec.parallelism", {"fsdp": 2, "context": 4}, "spec.kernels.attention", None),  # splash below
    ("spec.kernels.splash", {"blockQ": 100}, "spec.kernels.splash.blockQ", "multiple of 128"),
    ("spec.kernels.splash", {"blockKv": 512, "blockKvCompute": 384}, "spec.kernels.splash.blockKvCompute",
     "does not divide blockKv"),
    ("spec.kernels.moeMatmul", "cutlass", "spec.kernels.moeMatmul", "is not allowed"),
    ("spec.model", {"preset": "tiny-moe"}, "spec.kernels.moeMatmul", "model.modelDim (64) is less; use ragged_dot"),
    ("spec.runtime.scopedVmemLimitKiB", 98304, "spec.runtime.scopedVmemLimitKiB", "at most 65536"),
    ("spec.runtime.libtpuInitArgs", ["--ok=1", "rm -rf /"], "spec.runtime.libtpuInitArgs[1]", "pattern"),
    ("spec.runtime.env", [{"name": "TPUJOB_PROCESS_ID", "value": "0"}], "spec.runtime.env[0].name",
     "set by the operator"),
    ("spec.runtime.env", [{"name": "LIBTPU_INIT_ARGS", "value": "x"}], "spec.runtime.env[0].name",
     "set by the operator"),
    ("spec.runtime.metricsPort", 80, "spec.runtime.metricsPort", "greater than or equal to 1024"),
    ("spec.checkpoint.directory", "s3://bucket/x", "spec.checkpoint.directory", "pattern"),
    ("spec.checkpoint", {"persistentVolumeClaim": "ckpt"}, "spec.checkpoint.directory", "required when"),
    ("spec.checkpoint", {"directory": "gs://bkt/c", "persistentVolumeClaim": "ckpt"},
     "spec.checkpoint.persistentVolumeClaim", "gs://"),
    ("spec.failurePolicy.restartOnExitCodes", [0], "spec.failurePolicy.restartOnExitCodes[0]", "greater than"),
    ("spec.failurePolicy.maxRestarts", -1, "spec.failurePolicy.maxRestarts", "greater than or equal to 0"),
    ("spec.image", "my image:latest", "spec.image", "pattern"),
    ("spec.resources", {"limits": {"google.com/tpu": "8"}}, "spec.resources.limits", "derived from the topology"),
    ("spec.resources", {"requests": {"memory": "lots"}}, "spec.resources.requests.memory", "pattern"),
    ("spec.nodeSelector", {"bad key!": "x"}, "spec.nodeSelector.bad key!", "pattern"),
    ("spec.tolerations", [{"effect": "Sometimes"}], "spec.tolerations[0].effect", "is not allowed"),
    ("spec.suspend", "maybe", "spec.suspend", "boolean"),
    ("spec.tpu.capacity", "cheap", "spec.tpu.capacity", "is not allowed"),
    ("spec.tpu.capacity", "reservation", "spec.tpu.reservationName", "required with capacity reservation"),
    ("spec.tpu.reservationName", "res-1", "spec.tpu.reservationName", "only used with capacity reservation"),
    ("spec.tpu.reservationName", "Res_1", "spec.tpu.reservationName", "pattern"),
    ("spec.tpu.capacity", "flexStart", "spec.queueName", "required with tpu.capacity flexStart"),
    ("spec.tpu.maxRunDuration", "2h", "spec.tpu.maxRunDuration", "only used with capacity flexStart"),
    ("spec.tpu.maxRunDuration", "169h", "spec.tpu.maxRunDuration", "at most 7 days"),
    ("spec.tpu.maxRunDuration", "0m", "spec.tpu.maxRunDuration", "not a positive duration"),
    ("spec.tpu.maxRunDuration", "two days", "spec.tpu.maxRunDuration", "pattern"),
    ("spec.queueName", "Team_A", "spec.queueName", "pattern"),
    ("spec.workloadPriorityClassName", "high", "spec.workloadPriorityClassName", "set queueName too"),
    ("metadata.name", "My_Job", "metadata.name", "DNS-1035"),
    ("metadata.name", "a" * 60, "metadata.name", "use at most"),
    ("kind", "Job", "kind", "is not allowed"),
    ("spec.training", None, "spec.training", "Field required"),
]


@pytest.mark.parametrize("where,value,path,reason", BAD, ids=[f"{b[0]}={b[1]!r}"[:60] for b in BAD])
def test_bad_input_names_the_field(where, value, path, reason):
    doc = _with(where, value)
    if where == "spec.parallelism" and value == {"fsdp": 2, "context": 4}:
        doc["spec"]["kernels"] = {"attention": "splash"}  # 128 tokens / context 4 = 32 per shard
        reason = "multiple of 128"
    if value == {"preset": "tiny-moe"}:  # the tiny MoE on the Mosaic grouped matmul: every width below 128
        doc["spec"]["kernels"] = {"attention": "xla", "moeMatmul": "gmm"}
        doc["spec"]["parallelism"] = {"fsdp": "auto", "tensor": 1}
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    matching = [p for p in exc.value.problems if p.startswith(f"{path}: ")]
    assert matching, f"no problem at {path}; got {exc.value.problems}"
    assert reason in matching[0], matching


def test_slice_specific_rules():
    # No SparseCore on v6e, no native fp8 on v5p, VMEM bounds per generation.
    cases = [
        (tiny_job(tpu={"generation": "v6e", "topology": "2x2"}, runtime={"sparseCoreOffload": {"allGather": True}},
                  training={"steps": 1, "globalBatch": 4, "sequenceLength": 128}),
         "spec.runtime.sparseCoreOffload: v6e has no SparseCore"),
        (tiny_job(tpu={"generation": "v5p", "topology": "2x2x1"},
                  training={"steps": 1, "globalBatch": 4, "sequenceLength": 128, "precision": "fp8"}),
         "spec.training.precision: v5p has no native fp8"),
        (tiny_job(tpu={"generation": "v5p", "topology": "2x2x1"}, runtime={"scopedVmemLimitKiB": 1024},
                  training={"steps": 1, "globalBatch": 4, "sequenceLength": 128}),
         "spec.runtime.scopedVmemLimitKiB"),
    ]
    for doc, expected in cases:
        with pytest.raises(InvalidJob) as exc:
            parse_job(doc)
        assert any(p.startswith(expected) for p in exc.value.problems), exc.value.problems


def test_v6e_accepts_its_own_vmem_limit():
    job = parse_job(tiny_job(tpu={"generation": "v6e", "topology": "2x2"}, runtime={"scopedVmemLimitKiB": 98304},
                             training={"steps": 1, "globalBatch": 4, "sequenceLength": 128}))
    assert job.spec.runtime.scoped_vmem_limit_kib == 98304


@pytest.mark.parametrize("tpu,extra", [
    ({"capacity": "onDemand"}, {}),
    ({"capacity": "spot"}, {}),
    ({"capacity": "reservation", "reservationName": "tpu-res", "reservationProject": "shared-project"}, {}),
    ({"capacity": "flexStart", "maxRunDuration": "168h"}, {"queueName": "dws"}),
    ({"capacity": "onDemand"}, {"queueName": "team-a", "workloadPriorityClassName": "high", "priorityClassName": "p"}),
])
def test_every_capacity_mode_validates(tpu, extra):
    job = parse_job(tiny_job(tpu={"topology": "2x2x1", **tpu}, **extra))
    assert job.spec.tpu.capacity == tpu["capacity"] and job.spec.queue_name == extra.get("queueName")


def test_every_problem_is_listed_at_once():
    doc = tiny_job(tpu={"generation": "v7x", "topology": "3x3x3"})
    doc["spec"]["training"]["steps"] = 0
    doc["spec"]["image"] = "has space"
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    paths = {p.split(":")[0] for p in exc.value.problems}
    assert {"spec.tpu.topology", "spec.training.steps", "spec.image"} <= paths


def _tpujob(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "tpu_operator.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_cli_exits_2_with_problems_on_stderr_and_nothing_on_stdout():
    doc = tiny_job(tpu={"generation": "v7x", "topology": "3x3x3"})
    for command in ("render", "validate"):
        result = _tpujob(command, "-f", "-", stdin=yaml.safe_dump(doc))
        assert result.returncode == 2
        assert result.stdout == ""
        assert "error: spec.tpu.topology: 3x3x3 is not a v7x topology; valid examples: 2x2x1, 4x4x4, 4x4x8" \
            in result.stderr.replace(": beyond 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4 every dimension is a multiple of 4 "
                                     "and A <= B <= C", "")


def test_cli_reports_unreadable_and_malformed_input():
    assert "cannot read" in _tpujob("validate", "-f", "/nonexistent.yaml").stderr
    result = _tpujob("render", "-f", "-", stdin="spec: [unclosed")
    assert result.returncode == 2 and "(yaml)" in result.stderr and result.stdout == ""
    result = _tpujob("render", "-f", "-", stdin="- a\n- b\n")
    assert result.returncode == 2 and "expected a TPUTrainingJob mapping" in result.stderr


# Independent problems in different sections, each listed: a section that fails keeps the spec's
# cross-field rules from running in pydantic, so validation runs those whose inputs are valid.
MULTI = [
    # (spec overrides, the problems expected, as (path, a word of the reason))
    ({"tpu": {"topology": "3x3x3"}, "parallelism": {"fsdp": 8},
      "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128}},
     [("spec.tpu.topology", "not a v7x topology"), ("spec.training.globalBatch", "multiple of data x fsdp x expert = 8")]),
    ({"tpu": {"topology": "2x2x1"}, "model": {"preset": "tiny", "kvHeads": 3},
      "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128}},
     [("spec.model.kvHeads", "does not divide heads"), ("spec.training.globalBatch", "= 8")]),
    ({"tpu": {"topology": "2x2x1"}, "image": "has space", "parallelism": {"fsdp": "auto", "tensor": 8},
      "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128}},
     [("spec.image", "pattern"), ("spec.parallelism.tensor", "does not divide model.heads (4)")]),
    ({"tpu": {"generation": "v5p", "topology": "2x2x3"}, "runtime": {"sparseCoreOffload": {"allGather": True}},
      "training": {"steps": 10, "globalBatch": 4, "sequenceLength": 100, "precision": "fp8"},
      "kernels": {"attention": "splash"}},
     [("spec.tpu.topology", "not a v5p topology"), ("spec.kernels.attention", "multiple of 128, got 100")]),
    ({"tpu": {"generation": "v5p", "topology": "2x2x1"}, "runtime": {"sparseCoreOffload": {"allGather": True}},
      "training": {"steps": 10, "globalBatch": 4, "sequenceLength": 128, "precision": "fp8"}, "suspend": "maybe"},
     [("spec.suspend", "boolean"), ("spec.runtime.sparseCoreOffload", "no SparseCore"),
      ("spec.training.precision", "no native fp8")]),
    # The capacity rules read spec.tpu's capacity fields and spec.queueName, not the topology.
    ({"tpu": {"topology": "3x3x3", "capacity": "flexStart", "reservationName": "r"}},
     [("spec.tpu.topology", "not a v7x topology"), ("spec.tpu.reservationName", "only used with capacity reservation"),
      ("spec.queueName", "required with tpu.capacity flexStart")]),
    ({"tpu": {"topology": "2x2x1", "capacity": "flexStart"}, "queueName": "Bad_Queue"},
     [("spec.queueName", "pattern")]),  # a queue is named, if badly: not also "required"
    # All sections valid: the spec's own validator lists every cross-field problem, not the first.
    ({"tpu": {"generation": "v5p", "topology": "2x2x1"}, "runtime": {"sparseCoreOffload": {"allGather": True}},
      "training": {"steps": 10, "globalBatch": 3, "sequenceLength": 128, "precision": "fp8"}},
     [("spec.runtime.sparseCoreOffload", "no SparseCore"), ("spec.training.precision", "no native fp8"),
      ("spec.training.globalBatch", "= 4")]),
]


@pytest.mark.parametrize("spec,expected", MULTI, ids=[", ".join(p for p, _ in m[1]) for m in MULTI])
def test_independent_problems_are_all_listed(spec, expected):
    doc = tiny_job(**spec)
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    got = exc.value.problems
    for path, word in expected:
        matching = [p for p in got if p.startswith(f"{path}: ")]
        assert matching and word in matching[0], f"{path} ({word}) not in {got}"
    assert len(got) == len(expected), got  # nothing twice, nothing made up


def test_a_long_name_is_reported_beside_a_bad_section():
    doc = tiny_job(training={"steps": 0, "globalBatch": 8, "sequenceLength": 128})
    doc["metadata"]["name"] = "a" * 60
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    assert [p.split(":")[0] for p in exc.value.problems] == ["spec.training.steps", "metadata.name"]


@pytest.mark.parametrize("command", [["validate"], ["render"], ["run", "--local"]])
def test_a_file_that_is_not_text_is_an_error_naming_it(command, tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00")
    result = _tpujob(*command, "-f", str(binary))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {binary}: not a text file"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    result = _tpujob(*command, "-f", str(tmp_path))  # a directory
    assert result.returncode == 2 and result.stderr.startswith(f"error: {tmp_path}: cannot read"), result.stderr

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
    (
        "spec.training.remat",
        {"policy": "full", "tensors": {"qkv_proj": "offload"}},
        "spec.training.remat.tensors",
        "only used with policy custom",
    ),
    (
        "spec.training.remat",
        {"policy": "custom", "tensors": {"bogus": "offload"}},
        "spec.training.remat.tensors.bogus",
        "is not allowed",
    ),
    ("spec.training.data", {"source": "files"}, "spec.training.data.path", "required when source is files"),
    (
        "spec.training.data",
        {"source": "files", "path": "/d", "format": "bin", "packing": True},
        "spec.training.data.eosId",
        "required when packing bin files",
    ),
    (
        "spec.training.data",
        {"source": "files", "path": "/d", "format": "arrayrecord"},
        "spec.training.data.packing",
        "required with format arrayrecord",
    ),
    (
        "spec.training.data",
        {"packing": True, "eosId": 1 << 20},
        "spec.training.data.eosId",
        "not a token of model.vocab",
    ),
    ("spec.training.data", {"prefetch": 0}, "spec.training.data.prefetch", "greater than or equal to 1"),
    ("spec.training.learningRate", {"peak": -1}, "spec.training.learningRate.peak", "greater than 0"),
    ("spec.parallelism", {"fsdp": "auto", "context": "auto"}, "spec.parallelism", "only one axis may be auto"),
    ("spec.parallelism", {"fsdp": 3}, "spec.parallelism", "one slice has 8 devices"),
    ("spec.parallelism", {"fsdp": "auto", "expert": 2}, "spec.parallelism.expert", "needs an MoE model"),
    ("spec.parallelism", {"fsdp": "auto", "tensor": 8}, "spec.parallelism.tensor", "does not divide model.heads"),
    ("spec.parallelism", {"fsdp": "many"}, "spec.parallelism.fsdp", "'auto'"),
    ("spec.parallelism", {"fsdp": 2, "context": 4}, "spec.kernels.attention", None),  # splash below
    ("spec.kernels.splash", {"blockQ": 100}, "spec.kernels.splash.blockQ", "multiple of 128"),
    (
        "spec.kernels.splash",
        {"blockKv": 512, "blockKvCompute": 384},
        "spec.kernels.splash.blockKvCompute",
        "does not divide blockKv",
    ),
    ("spec.kernels.moeMatmul", "cutlass", "spec.kernels.moeMatmul", "is not allowed"),
    ("spec.model", {"preset": "tiny-moe"}, "spec.kernels.moeMatmul", "model.modelDim (64) is less; use ragged_dot"),
    ("spec.runtime.scopedVmemLimitKiB", 98304, "spec.runtime.scopedVmemLimitKiB", "at most 65536"),
    ("spec.runtime.libtpuInitArgs", ["--ok=1", "rm -rf /"], "spec.runtime.libtpuInitArgs[1]", "pattern"),
    (
        "spec.runtime.env",
        [{"name": "TPUJOB_PROCESS_ID", "value": "0"}],
        "spec.runtime.env[0].name",
        "set by the operator",
    ),
    (
        "spec.runtime.env",
        [{"name": "LIBTPU_INIT_ARGS", "value": "x"}],
        "spec.runtime.env[0].name",
        "set by the operator",
    ),
    ("spec.runtime.env", [{"name": "TPU_WORKER_ID", "value": "0"}], "spec.runtime.env[0].name", "set by the operator"),
    (
        "spec.runtime.env",
        [{"name": "TPU_WORKER_HOSTNAMES", "value": "0"}],
        "spec.runtime.env[0].name",
        "set by the operator",
    ),
    ("spec.runtime.env", [{"name": "TPU_TOPOLOGY", "value": "0"}], "spec.runtime.env[0].name", "set by the operator"),
    (
        "spec.runtime.env",
        [{"name": "JAX_COORDINATOR_ADDRESS", "value": "0"}],
        "spec.runtime.env[0].name",
        "set by the operator",
    ),
    ("spec.runtime.env", [{"name": "JAX_PROCESS_ID", "value": "0"}], "spec.runtime.env[0].name", "set by the operator"),
    (
        "spec.runtime.env",
        [{"name": "MEGASCALE_SLICE_ID", "value": "0"}],
        "spec.runtime.env[0].name",
        "set by the operator",
    ),
    ("spec.runtime.env", [{"name": "TPUJOB_HOST_ID", "value": "0"}], "spec.runtime.env[0].name", "set by the operator"),
    ("spec.runtime.metricsPort", 80, "spec.runtime.metricsPort", "greater than or equal to 1024"),
    ("spec.checkpoint.directory", "s3://bucket/x", "spec.checkpoint.directory", "pattern"),
    ("spec.checkpoint", {"persistentVolumeClaim": "ckpt"}, "spec.checkpoint.directory", "required when"),
    (
        "spec.checkpoint",
        {"directory": "gs://bkt/c", "persistentVolumeClaim": "ckpt"},
        "spec.checkpoint.persistentVolumeClaim",
        "gs://",
    ),
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
    # Bounds (api/limits.py): the CRD carries the same maximums, so the API server refuses these first.
    ("spec.training.microbatches", 10**15 + 37, "spec.training.microbatches", "less than or equal to 4096"),
    ("spec.model", {"preset": "tiny", "layers": 10**400}, "spec.model.layers", "less than or equal to 1024"),
    ("spec.training.steps", 2**63, "spec.training.steps", "less than or equal to 100000000"),
    ("spec.training.globalBatch", 2**21, "spec.training.globalBatch", "less than or equal to 1048576"),
    ("spec.training.learningRate", {"peak": float("inf")}, "spec.training.learningRate.peak", "less than or equal"),
    ("spec.training.learningRate", {"peak": float("nan")}, "spec.training.learningRate.peak", "less than or equal"),
    ("spec.training.gradClip", float("inf"), "spec.training.gradClip", "less than or equal"),
    ("spec.model", {"preset": "tiny", "ropeTheta": float("inf")}, "spec.model.ropeTheta", "less than or equal"),
    ("spec.runtime.env", [{"name": "A", "value": "x" * 40000}], "spec.runtime.env[0].value", "at most 32768"),
    ("spec.args", ["x"] * 300, "spec.args", "at most 256"),
    # Types as the API server has them (strict): no bool for an integer, no string for a number.
    ("spec.training.steps", True, "spec.training.steps", "valid integer"),
    ("spec.training.steps", "10", "spec.training.steps", "valid integer"),
    ("spec.training.steps", 10.0, "spec.training.steps", "valid integer"),
    ("spec.suspend", 1, "spec.suspend", "valid boolean"),
    ("spec.tpu.generation", "V7X", "spec.tpu.generation", "not a supported TPU generation"),
    ("spec.tpu.generation", " v7x", "spec.tpu.generation", "not a supported TPU generation"),
    # What Kubernetes refuses in the rendered pods, refused here naming the spec field.
    ("spec.nodeSelector", {"pool": "not a label value!"}, "spec.nodeSelector.pool", "pattern"),
    (
        "spec.nodeSelector",
        {"a" * 254 + "/b": "x"},
        "spec.nodeSelector." + "a" * 100 + "... (156 more characters)",
        "at most 253",
    ),  # a key in a path is shown capped
    ("spec.tolerations", [{"key": "bad key!", "operator": "Exists"}], "spec.tolerations[0].key", "pattern"),
    (
        "spec.tolerations",
        [{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}],
        "spec.tolerations[0].tolerationSeconds",
        "only with effect NoExecute",
    ),
    (
        "spec.tolerations",
        [{"key": "k", "operator": "Exists", "value": "v"}],
        "spec.tolerations[0].value",
        "empty when operator is Exists",
    ),
    ("spec.tolerations", [{"operator": "Equal", "value": "v"}], "spec.tolerations[0].operator", "must be Exists"),
    ("spec.resources", {"requests": {"gpu": "1"}}, "spec.resources.requests.gpu", "pattern"),
    ("spec.resources", {"limits": {"memory": "1" * 100}}, "spec.resources.limits.memory", "at most 64"),
    (
        "spec.resources",
        {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}},
        "spec.resources.requests.memory",
        "more than limits.memory",
    ),
    (
        "spec.resources",
        {"requests": {"cpu": "1500m"}, "limits": {"cpu": "1.4"}},
        "spec.resources.requests.cpu",
        "more than limits.cpu",
    ),
    (
        "spec.resources",
        {"requests": {"example.com/fpga": "1"}},
        "spec.resources.limits.example.com/fpga",
        "not overcommitted",
    ),
    (
        "spec.resources",
        {"requests": {"example.com/fpga": "1"}, "limits": {"example.com/fpga": "2"}},
        "spec.resources.requests.example.com/fpga",
        "must equal",
    ),
    (
        "spec.resources",
        {"limits": {"example.com/fpga": "500m"}},
        "spec.resources.limits.example.com/fpga",
        "whole number",
    ),
    ("spec.image", "ghcr.io/Upper/case:tag", "spec.image", "pattern"),
    ("spec.image", "ghcr.io/x/y@sha256:abc", "spec.image", "pattern"),
    ("spec.image", "ghcr.io/x/y:" + "t" * 129, "spec.image", "pattern"),
    (
        "spec.checkpoint",
        {"directory": "/dev/shm", "persistentVolumeClaim": "c"},
        "spec.checkpoint.directory",
        "would hide a volume",
    ),
    (
        "spec.checkpoint",
        {"directory": "/etc/tpujob/", "persistentVolumeClaim": "c"},
        "spec.checkpoint.directory",
        "would hide a volume",
    ),
    (
        "spec.checkpoint",
        {"directory": "/", "persistentVolumeClaim": "c"},
        "spec.checkpoint.directory",
        "would hide a volume",
    ),
    (
        "spec.checkpoint",
        {"directory": "/ckpt/../etc", "persistentVolumeClaim": "c"},
        "spec.checkpoint.directory",
        "no . or .. parts",
    ),
    ("spec.training.data", {"source": "files", "path": "data/train"}, "spec.training.data.path", "pattern"),
    ("spec.training.data", {"source": "files", "path": "s3://b/x"}, "spec.training.data.path", "pattern"),
    (
        "spec.runtime.libtpuInitArgs",
        ["--xla_tpu_scoped_vmem_limit_kib=98304"],
        "spec.runtime.libtpuInitArgs",
        "spec.runtime.scopedVmemLimitKiB",
    ),
    (
        "spec.runtime.xlaFlags",
        ["--xla_tpu_scoped_vmem_limit_kib=98304"],
        "spec.runtime.xlaFlags",
        "spec.runtime.scopedVmemLimitKiB",
    ),
    ("spec.runtime.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "spec.runtime.env", "set twice"),
    ("spec.runtime.env", [{"name": f"E{i}", "value": "v" * 1000} for i in range(256)], "spec", "bytes as JSON"),
    ("metadata.namespace", "Team_A", "metadata.namespace", "pattern"),
    ("spec.priorityClassName", "system-node-critical", "spec.priorityClassName", "reserved for the cluster"),
    # Secrets by reference: as a container's env and envFrom, each refused where the API server would refuse it.
    (
        "spec.runtime.env",
        [{"name": "T", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "spec.runtime.env[0].valueFrom",
        "not with a non-empty value",
    ),
    (
        "spec.runtime.env",
        [
            {
                "name": "T",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {"fieldPath": "metadata.name"}},
            }
        ],
        "spec.runtime.env[0].valueFrom",
        "exactly one of",
    ),
    ("spec.runtime.env", [{"name": "T", "valueFrom": {}}], "spec.runtime.env[0].valueFrom", "exactly one of"),
    (
        "spec.runtime.env",
        [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}],
        "spec.runtime.env[0].valueFrom.secretKeyRef.name",
        "pattern",
    ),
    (
        "spec.runtime.env",
        [{"name": "T", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "a b"}}}],
        "spec.runtime.env[0].valueFrom.configMapKeyRef.key",
        "pattern",
    ),
    (
        "spec.runtime.env",
        [{"name": "T", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}],
        "spec.runtime.env[0].valueFrom.fieldRef.fieldPath",
        "pattern",
    ),
    (
        "spec.runtime.envFrom",
        [{"secretRef": {"name": "s"}, "configMapRef": {"name": "c"}}],
        "spec.runtime.envFrom[0]",
        "exactly one of",
    ),
    (
        "spec.runtime.envFrom",
        [{"prefix": "TPU_", "secretRef": {"name": "s"}}],
        "spec.runtime.envFrom[0].prefix",
        "the operator or GKE set",
    ),
    ("spec.runtime.envFrom", [{"secretRef": {"name": "s"}}] * 17, "spec.runtime.envFrom", "at most 16"),
    ("spec.training", None, "spec.training", "Field required"),
    # A rewind restores the latest checkpoint and reads its skip beside it: no directory, no rewind.
    ("spec.failurePolicy", {"onDivergence": "Rewind"}, "spec.failurePolicy.onDivergence", "checkpoint.directory"),
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
        (
            tiny_job(
                tpu={"generation": "v6e", "topology": "2x2"},
                runtime={"sparseCoreOffload": {"allGather": True}},
                training={"steps": 1, "globalBatch": 4, "sequenceLength": 128},
            ),
            "spec.runtime.sparseCoreOffload: v6e has no SparseCore",
        ),
        (
            tiny_job(
                tpu={"generation": "v5p", "topology": "2x2x1"},
                training={"steps": 1, "globalBatch": 4, "sequenceLength": 128, "precision": "fp8"},
            ),
            "spec.training.precision: v5p has no native fp8",
        ),
        (
            tiny_job(
                tpu={"generation": "v5p", "topology": "2x2x1"},
                runtime={"scopedVmemLimitKiB": 1024},
                training={"steps": 1, "globalBatch": 4, "sequenceLength": 128},
            ),
            "spec.runtime.scopedVmemLimitKiB",
        ),
    ]
    for doc, expected in cases:
        with pytest.raises(InvalidJob) as exc:
            parse_job(doc)
        assert any(p.startswith(expected) for p in exc.value.problems), exc.value.problems


def test_v6e_accepts_its_own_vmem_limit():
    job = parse_job(
        tiny_job(
            tpu={"generation": "v6e", "topology": "2x2"},
            runtime={"scopedVmemLimitKiB": 98304},
            training={"steps": 1, "globalBatch": 4, "sequenceLength": 128},
        )
    )
    assert job.spec.runtime.scoped_vmem_limit_kib == 98304


@pytest.mark.parametrize(
    "tpu,extra",
    [
        ({"capacity": "onDemand"}, {}),
        ({"capacity": "spot"}, {}),
        ({"capacity": "reservation", "reservationName": "tpu-res", "reservationProject": "shared-project"}, {}),
        ({"capacity": "flexStart", "maxRunDuration": "168h"}, {"queueName": "dws"}),
        (
            {"capacity": "onDemand"},
            {"queueName": "team-a", "workloadPriorityClassName": "high", "priorityClassName": "p"},
        ),
    ],
)
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
    return subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def test_cli_exits_2_with_problems_on_stderr_and_nothing_on_stdout():
    doc = tiny_job(tpu={"generation": "v7x", "topology": "3x3x3"})
    for command in ("render", "validate"):
        result = _tpujob(command, "-f", "-", stdin=yaml.safe_dump(doc))
        assert result.returncode == 2
        assert result.stdout == ""
        assert (
            "error: spec.tpu.topology: 3x3x3 is not a v7x topology; valid examples: 2x2x1, 4x4x4, 4x4x8"
            in result.stderr.replace(
                ": beyond 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4 every dimension is a multiple of 4 and A <= B <= C", ""
            )
        )


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
    (
        {
            "tpu": {"topology": "3x3x3"},
            "parallelism": {"fsdp": 8},
            "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128},
        },
        [
            ("spec.tpu.topology", "not a v7x topology"),
            ("spec.training.globalBatch", "multiple of data x fsdp x expert = 8"),
        ],
    ),
    (
        {
            "tpu": {"topology": "2x2x1"},
            "model": {"preset": "tiny", "kvHeads": 3},
            "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128},
        },
        [("spec.model.kvHeads", "does not divide heads"), ("spec.training.globalBatch", "= 8")],
    ),
    (
        {
            "tpu": {"topology": "2x2x1"},
            "image": "has space",
            "parallelism": {"fsdp": "auto", "tensor": 8},
            "training": {"steps": 10, "globalBatch": 12, "sequenceLength": 128},
        },
        [("spec.image", "pattern"), ("spec.parallelism.tensor", "does not divide model.heads (4)")],
    ),
    (
        {
            "tpu": {"generation": "v5p", "topology": "2x2x3"},
            "runtime": {"sparseCoreOffload": {"allGather": True}},
            "training": {"steps": 10, "globalBatch": 4, "sequenceLength": 100, "precision": "fp8"},
            "kernels": {"attention": "splash"},
        },
        [("spec.tpu.topology", "not a v5p topology"), ("spec.kernels.attention", "multiple of 128, got 100")],
    ),
    (
        {
            "tpu": {"generation": "v5p", "topology": "2x2x1"},
            "runtime": {"sparseCoreOffload": {"allGather": True}},
            "training": {"steps": 10, "globalBatch": 4, "sequenceLength": 128, "precision": "fp8"},
            "suspend": "maybe",
        },
        [
            ("spec.suspend", "boolean"),
            ("spec.runtime.sparseCoreOffload", "no SparseCore"),
            ("spec.training.precision", "no native fp8"),
        ],
    ),
    # The capacity rules read spec.tpu's capacity fields and spec.queueName, not the topology.
    (
        {"tpu": {"topology": "3x3x3", "capacity": "flexStart", "reservationName": "r"}},
        [
            ("spec.tpu.topology", "not a v7x topology"),
            ("spec.tpu.reservationName", "only used with capacity reservation"),
            ("spec.queueName", "required with tpu.capacity flexStart"),
        ],
    ),
    (
        {"tpu": {"topology": "2x2x1", "capacity": "flexStart"}, "queueName": "Bad_Queue"},
        [("spec.queueName", "pattern")],
    ),  # a queue is named, if badly: not also "required"
    (
        {"tpu": {"topology": "3x3x3"}, "failurePolicy": {"onDivergence": "Rewind", "skipBatches": 100}},
        [
            ("spec.tpu.topology", "not a v7x topology"),
            ("spec.failurePolicy.onDivergence", "checkpoint.directory is not set"),
        ],
    ),
    # All sections valid: the spec's own validator lists every cross-field problem, not the first.
    (
        {
            "tpu": {"generation": "v5p", "topology": "2x2x1"},
            "runtime": {"sparseCoreOffload": {"allGather": True}},
            "training": {"steps": 10, "globalBatch": 3, "sequenceLength": 128, "precision": "fp8"},
        },
        [
            ("spec.runtime.sparseCoreOffload", "no SparseCore"),
            ("spec.training.precision", "no native fp8"),
            ("spec.training.globalBatch", "= 4"),
        ],
    ),
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


def test_the_issue_27_elastic_job_is_refused_by_its_bounds():
    # It passed the CRD and counted 10**15 integers on the operator's event loop; now both the CRD and the
    # models stop it at training.microbatches (and the batch at training.globalBatch).
    micro = 10**15 + 37
    doc = tiny_job(
        tpu={"topology": "2x2x1", "slices": 3, "elastic": {"minSlices": 2}},
        training={"steps": 10, "globalBatch": 48 * micro, "microbatches": micro, "sequenceLength": 128},
    )
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    paths = {p.split(":")[0] for p in exc.value.problems}
    assert {"spec.training.microbatches", "spec.training.globalBatch"} <= paths, exc.value.problems


def _fewest_by_counting(global_batch, microbatches, slices, running, shards_per_slice):
    """The definition microbatches_at had, counting up: the reference on small inputs."""
    shards = running * shards_per_slice
    if global_batch % shards:
        return None
    least = -(-microbatches * slices // running)
    return next((m for m in range(least, global_batch // shards + 1) if global_batch % (shards * m) == 0), None)


def test_microbatches_at_is_the_fewest_divisor_without_counting():
    from tpu_operator.api.contract import microbatches_at, splits_at

    for batch in (1, 8, 12, 36, 48, 96, 97, 360, 1024):
        for micro in (1, 2, 3, 5):
            for slices in (1, 2, 3, 4):
                for running in range(1, slices + 1):
                    for shards in (1, 2, 4):
                        want = _fewest_by_counting(batch, micro, slices, running, shards)
                        assert microbatches_at(batch, micro, slices, running, shards) == want
                        assert splits_at(batch, micro, slices, running, shards) == (want is not None)
    # At the bounds: a prime number of rows per shard has only 1 and itself; the answer is found among the
    # divisor pairs up to its square root (1024 steps at most), not by counting up to it.
    from tpu_operator.api import limits

    prime = 1048573  # the largest prime below limits.MAX_GLOBAL_BATCH
    assert prime <= limits.MAX_GLOBAL_BATCH
    assert microbatches_at(prime, 2, 1, 1, 1) == prime
    assert microbatches_at(limits.MAX_GLOBAL_BATCH, limits.MAX_MICROBATCHES, 256, 128, 1) == 8192


def test_the_derived_grace_period_is_at_most_a_day():
    from tpu_operator.api.derived import MAX_GRACE_S, Plan

    big = {
        "layers": 1024,
        "modelDim": 131072,
        "heads": 1024,
        "kvHeads": 1024,
        "headDim": 1024,
        "mlpDim": 1048576,
        "vocab": 4194304,
    }
    job = parse_job(tiny_job(model=big))
    assert Plan(job).termination_grace_period_seconds == MAX_GRACE_S


def test_a_spec_at_the_size_bound_renders_within_the_api_servers_limits():
    import json

    from tpu_operator.api import limits, names
    from tpu_operator.rendering.manifests import render

    env = [{"name": f"E{i}", "value": "v" * 700} for i in range(256)]  # about 190 KiB: just under the bound
    job = parse_job(tiny_job(runtime={"env": env}))
    config_map, jobset = render(job)
    annotations = jobset["metadata"]["annotations"]
    assert len(annotations[names.APPLIED_SPEC]) <= limits.MAX_SPEC_BYTES
    assert sum(len(k) + len(v) for k, v in annotations.items()) <= limits.MAX_ANNOTATIONS_BYTES
    assert len(json.dumps(config_map["data"])) <= limits.MAX_CONFIG_MAP_BYTES


def test_the_bounds_table_lists_every_bound():
    import re
    from pathlib import Path

    from tpu_operator.api import limits

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    table = dict(re.findall(r"^\| `(MAX_[A-Z0-9_]+)` \| ([^|]+) \|", text, re.M))
    for name in dir(limits):
        if name.startswith("MAX_") and name not in ("MAX_ANNOTATIONS_BYTES", "MAX_CONFIG_MAP_BYTES"):
            assert name in table, f"docs/api.md, Bounds: {name} is missing"
            assert float(table[name]) == getattr(limits, name), f"docs/api.md, Bounds: {name} is not {table[name]}"


def test_render_needs_an_image_from_the_job_or_the_default(tmp_path):
    imageless = tiny_job()
    del imageless["spec"]["image"]
    result = _tpujob("render", "-f", "-", stdin=yaml.safe_dump(imageless))
    assert result.returncode == 2 and result.stdout == ""
    assert "error: spec.image: not set, and the operator has no --default-image" in result.stderr, result.stderr
    result = _tpujob("render", "-f", "-", "--default-image", "registry.example/w:1", stdin=yaml.safe_dump(imageless))
    assert result.returncode == 0 and "image: registry.example/w:1" in result.stdout, result.stderr
    result = _tpujob("validate", "-f", "-", stdin=yaml.safe_dump(imageless))
    assert result.returncode == 0 and "image: not set: the operator's --default-image" in result.stdout


def test_a_local_run_refuses_values_it_cannot_read():
    doc = tiny_job(runtime={"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]})
    result = _tpujob("run", "--local", "-f", "-", stdin=yaml.safe_dump(doc))
    assert result.returncode == 2 and "spec.runtime: a local run has no Secrets" in result.stderr, result.stderr


def test_a_growing_back_job_leaves_room_for_its_probes_pod_names():
    from tpu_operator.api import names
    from tpu_operator.controller import growback

    assert growback.PROBE_JOB == names.GROWBACK_REPLICATED_JOB
    # 2x2x4: 4 hosts; slices 2, minSlices 1: the probe asks for 1 slice, pods <name>-grow-g-0-3 (+ "-abcde").
    spec = {
        "tpu": {"topology": "2x2x4", "slices": 2, "elastic": {"minSlices": 1, "growBack": True}},
        "training": {"steps": 1, "globalBatch": 64, "sequenceLength": 128},
    }
    longest = 63 - len("-grow-g-0-3-abcde")
    doc = tiny_job(**spec)
    doc["metadata"]["name"] = "a" * longest
    parse_job(doc)
    doc["metadata"]["name"] = "a" * (longest + 1)  # its own pods (<name>-slice-1-3) would still fit
    with pytest.raises(InvalidJob) as exc:
        parse_job(doc)
    assert exc.value.problems[0].startswith("metadata.name: ") and "-grow-g-0-3" in exc.value.problems[0]
    doc["spec"]["tpu"]["elastic"]["growBack"] = False
    parse_job(doc)


def test_quantities_compare_exactly():
    from tpu_operator.api.spec import quantity

    assert quantity("1500m") == quantity("1.5") and quantity("1Gi") == 1024**3 and quantity("1e3") == quantity("1k")
    parse_job(
        tiny_job(
            resources={
                "requests": {"cpu": "1500m", "memory": "1Gi"},
                "limits": {"cpu": "1.5", "memory": "1024Mi", "example.com/fpga": "2"},
            }
        )
    )

"""Hostile and careless job files (issue 27), shared by the tests that send them somewhere: `tpujob validate`
(tests/test_hostile.py) and `kubectl apply` to the real API server and operator (tests/cluster/test_hostile.py).

CASES: (id, the file's text (str) or bytes, what the error names). SCHEMA_REFUSED: (spec patch, the field the
CRD's schema names when it refuses it), for tests/test_crd.py and tests/cluster/test_crd.py."""

from __future__ import annotations

import yaml

from tests.conftest import tiny_job


def spec_text(**overrides):
    return yaml.safe_dump(tiny_job(**overrides), width=1 << 20)


def named_text(name):
    doc = tiny_job(tpu={"topology": "4x4x4"}, training={"steps": 1, "globalBatch": 128, "sequenceLength": 128})
    doc["metadata"]["name"] = name
    return yaml.safe_dump(doc)


def replaced(old, new, **overrides):
    text = spec_text(**overrides)
    assert old in text, (old, text)
    return text.replace(old, new, 1)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)
)
MICRO = 10**15 + 37

# (id, the file's text (str) or bytes, what the error names)
CASES = [
    # The file and its YAML
    ("alias-bomb", BOMB, "(yaml): more than 100000 values"),
    ("deep-flow-nesting", "spec: " + "[" * 20000 + "]" * 20000 + "\n", "(yaml): nested more than 64"),
    (
        "deep-block-nesting",
        "".join("  " * i + f"k{i}:\n" for i in range(2000)) + "  " * 2000 + "v\n",
        "(yaml): nested more than 64",
    ),
    ("deep-but-parsable", "spec: " + "[" * 100 + "]" * 100 + "\n", "(yaml): nested more than 64"),
    (
        "5000-digit-integer",
        replaced("steps: 10", "steps: " + "9" * 5000, training={"steps": 10, "globalBatch": 8, "sequenceLength": 128}),
        "(yaml): an integer of 5000 digits",
    ),
    (
        "duplicate-key",
        replaced("kind: TPUTrainingJob\n", "kind: TPUTrainingJob\nkind: TPUTrainingJob\n"),
        "key kind is given twice",
    ),
    ("duplicate-nested-key", replaced("steps: 10\n", "steps: 10\n    steps: 11\n"), "key steps is given twice"),
    ("not-utf8", b"apiVersion: \xff\xfe\n", "not a text file"),
    ("python-tag", "spec: !!python/object/apply:os.system [echo hi]\n", "(yaml)"),
    ("empty", "", "(yaml): no document found"),
    ("scalar", "just a string\n", "expected a TPUTrainingJob mapping"),
    ("too-big", "# " + "x" * (5 * 1024 * 1024) + "\n", "more than 4194304 bytes"),
    ("date-as-name", replaced("name: tiny", "name: 2024-01-01"), "metadata.name"),
    ("name-with-trailing-newline", replaced("name: tiny", 'name: "tiny\\n"'), "metadata.name"),
    # Types and bounds as the API server has them
    ("layers-10**400", spec_text(model={"preset": "tiny", "layers": 10**400}), "spec.model.layers"),
    ("bool-as-int", replaced("steps: 10", "steps: true"), "spec.training.steps"),
    ("string-as-int", replaced("steps: 10", "steps: '10'"), "spec.training.steps"),
    ("2**63", replaced("steps: 10", f"steps: {2**63}"), "spec.training.steps"),
    ("inf", replaced("steps: 10", "steps: 10\n    learningRate: {peak: .inf}"), "spec.training.learningRate.peak"),
    ("nan", replaced("steps: 10", "steps: 10\n    gradClip: .nan"), "spec.training.gradClip"),
    ("V7X", replaced("generation: v7x", "generation: V7X"), "spec.tpu.generation"),
    ("padded-generation", replaced("generation: v7x", "generation: ' v7x '"), "spec.tpu.generation"),
    (
        "elastic-10**15-microbatches",
        spec_text(
            tpu={"topology": "2x2x1", "slices": 3, "elastic": {"minSlices": 2}},
            training={"steps": 10, "globalBatch": 48 * MICRO, "microbatches": MICRO, "sequenceLength": 128},
        ),
        "spec.training.microbatches",
    ),
    ("10000-env-entries", spec_text(runtime={"env": [{"name": f"E{i}"} for i in range(10000)]}), "spec.runtime.env"),
    ("huge-generation", replaced("generation: v7x", "generation: " + "v" * 1_000_000), "spec.tpu.generation"),
    # Names, labels, tolerations, resources, images, paths: what Kubernetes or JobSet refuse later
    ("52-char-name-on-4x4x4", named_text("a" * 52), "metadata.name"),
    ("bad-node-selector-value", spec_text(nodeSelector={"pool": "a b"}), "spec.nodeSelector.pool"),
    ("bad-toleration-key", spec_text(tolerations=[{"key": "a b", "operator": "Exists"}]), "spec.tolerations[0].key"),
    (
        "tolerationSeconds-on-NoSchedule",
        spec_text(tolerations=[{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 1}]),
        "spec.tolerations[0].tolerationSeconds",
    ),
    ("bad-resource-name", spec_text(resources={"requests": {"nvidia": "1"}}), "spec.resources.requests.nvidia"),
    ("bad-image", spec_text(image="ghcr.io/Team/trainer:latest"), "spec.image"),
    ("image-short-digest", spec_text(image="ghcr.io/t/trainer@sha256:1234"), "spec.image"),
    (
        "checkpoint-over-config",
        spec_text(checkpoint={"directory": "/etc/tpujob", "persistentVolumeClaim": "c"}),
        "spec.checkpoint.directory",
    ),
    (
        "relative-data-path",
        spec_text(
            training={"steps": 1, "globalBatch": 8, "sequenceLength": 128, "data": {"source": "files", "path": "data"}}
        ),
        "spec.training.data.path",
    ),
    (
        "annotations-over-256KiB",
        spec_text(runtime={"env": [{"name": f"E{i}", "value": "v" * 1100} for i in range(250)]}),
        "spec: ",
    ),
    # Identity and flags
    (
        "TPU_WORKER_ID",
        spec_text(runtime={"env": [{"name": "TPU_WORKER_ID", "value": "0"}]}),
        "spec.runtime.env[0].name",
    ),
    (
        "TPU_WORKER_HOSTNAMES",
        spec_text(runtime={"env": [{"name": "TPU_WORKER_HOSTNAMES", "value": "x"}]}),
        "spec.runtime.env[0].name",
    ),
    (
        "JAX_COORDINATOR_ADDRESS",
        spec_text(runtime={"env": [{"name": "JAX_COORDINATOR_ADDRESS", "value": "evil:1"}]}),
        "spec.runtime.env[0].name",
    ),
    (
        "TPUJOB_NUM_PROCESSES",
        spec_text(runtime={"env": [{"name": "TPUJOB_NUM_PROCESSES", "value": "1"}]}),
        "spec.runtime.env[0].name",
    ),
    ("duplicate-env", spec_text(runtime={"env": [{"name": "A"}, {"name": "A"}]}), "spec.runtime.env"),
    (
        "raw-vmem-flag",
        spec_text(runtime={"libtpuInitArgs": ["--xla_tpu_scoped_vmem_limit_kib=1048576"]}),
        "spec.runtime.libtpuInitArgs",
    ),
    # Injection: terminal escapes and newlines in values are escaped when repeated, and refused by patterns
    ("escape-in-generation", replaced("generation: v7x", 'generation: "\\e]0;owned\\a\\e[2J"'), "spec.tpu.generation"),
    ("escape-in-flag", spec_text(runtime={"libtpuInitArgs": ["--x=\x1b[31m"]}), "spec.runtime.libtpuInitArgs[0]"),
    ("escape-in-selector-key", spec_text(nodeSelector={"\x1b[2Jkey": "v"}), "spec.nodeSelector"),
    ("newline-in-env-name", spec_text(runtime={"env": [{"name": "A\nB"}]}), "spec.runtime.env[0].name"),
    ("yaml-in-image", spec_text(image="x\nkind: Secret"), "spec.image"),
    # Secrets, resources, names of what the operator makes later
    (
        "secret-and-value",
        spec_text(
            runtime={"env": [{"name": "T", "value": "leak", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
        ),
        "spec.runtime.env[0].valueFrom",
    ),
    (
        "fieldRef-to-anything",
        spec_text(runtime={"env": [{"name": "T", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers[0].env"}}}]}),
        "spec.runtime.env[0].valueFrom.fieldRef.fieldPath",
    ),
    (
        "envFrom-reserved-prefix",
        spec_text(runtime={"envFrom": [{"prefix": "MEGASCALE_", "secretRef": {"name": "s"}}]}),
        "spec.runtime.envFrom[0].prefix",
    ),
    (
        "request-over-limit",
        spec_text(resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
        "spec.resources.requests.memory",
    ),
    (
        "overcommitted-extended-resource",
        spec_text(resources={"requests": {"example.com/fpga": "1"}}),
        "spec.resources.limits.example.com/fpga",
    ),
    (
        "grow-back-probe-name",
        spec_text(
            tpu={"topology": "2x2x4", "slices": 2, "elastic": {"minSlices": 1, "growBack": True}},
            training={"steps": 1, "globalBatch": 64, "sequenceLength": 128},
        ).replace("name: tiny", "name: " + "a" * 47),
        "metadata.name",
    ),
]


# Spec patches the CRD's schema refuses, each with the field the refusal names: offline (tests/test_crd.py, the
# schema validator of tests/crd_schema.py) and on a real kube-apiserver (tests/cluster/test_crd.py).
SCHEMA_REFUSED = [
    ({"tpu": {"generation": "v9", "topology": "4x4x4"}}, "spec.tpu.generation"),
    ({"tpu": {"topology": "four"}}, "spec.tpu.topology"),
    ({"tpu": {"topology": "2x2x1", "slices": 0}}, "spec.tpu.slices"),
    ({"parallelism": {"fsdp": "most"}}, "spec.parallelism.fsdp"),
    ({"parallelism": {"fsdp": 0}}, "spec.parallelism.fsdp"),
    ({"kernels": {"attention": "flash"}}, "spec.kernels.attention"),
    ({"runtime": {"libtpuInitArgs": ["not a flag"]}}, "spec.runtime.libtpuInitArgs[0]"),
    (
        {
            "training": {
                "steps": 1,
                "globalBatch": 8,
                "sequenceLength": 128,
                "remat": {"policy": "custom", "tensors": {"qkv_proj": "elsewhere"}},
            }
        },
        "spec.training.remat.tensors.qkv_proj",
    ),
    # Bounds (api/limits.py): issue 27's elastic job never reaches the operator.
    (
        {
            "training": {
                "steps": 1,
                "globalBatch": 48 * (10**15 + 37),
                "microbatches": 10**15 + 37,
                "sequenceLength": 128,
            }
        },
        "spec.training.microbatches",
    ),
    ({"model": {"preset": "tiny", "layers": 2**62}}, "spec.model.layers"),
    ({"runtime": {"env": [{"name": f"E{i}"} for i in range(257)]}}, "spec.runtime.env"),
    ({"image": "ghcr.io/Team/trainer"}, "spec.image"),
    (
        {
            "training": {
                "steps": 1,
                "globalBatch": 8,
                "sequenceLength": 128,
                "data": {"source": "files", "path": "relative/dir"},
            }
        },
        "spec.training.data.path",
    ),
]

"""Each layer's weights cross the interconnect once per pass, at every example's shape and remat policy.

Each example (and the dense one under every remat policy) is scaled down to a small model on a TPU7x
2x2x2 slice (two, for the multi-slice one) that keeps what shapes its step: its parallelism (FSDP,
context, expert), precision (fp8), remat policy, Splash and the grouped matmul, and, with the size
thresholds lowered (step_costs_child.py), the dense MLP and the experts over slices of F and the LM
head over vocabulary tiles as at full size. The plan's own compile (libtpu) is walked by hlo_costs
(every loop at its trip count), and the bytes gathered per step (all-gathers, and the all-reduces of
packed values the compiler gathers fp8 weights with) are held against what one pass must gather: every layer's weights
as the layer uses them (whole along the FSDP dimension, split over tensor and expert; fp8 where the
matmul quantises them before the gather), the LM head once, and context parallelism's K/V. The step
gathers at least that, and no more than each layer's MLP (or expert) weights and the head once per
pass, forward and backward: gathering a layer's weights per chunk of its activations, as sequence
chunks did, fails (the 8B's MLP weights went 4 times per pass). The attention weights may go a third
time, in the backward pass: XLA may gather them again rather than keep them over the attention
kernel's backward (the MoE example's step does so at full size too, its all-gathers still under
MaxText's: `benchmarks/vs_maxtext.py`), and under fp8 the transposed matmul quantises a weight along its
other dimension, another tensor to gather.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT
from tpu_operator.api.contract import TrainerConfig
from tpu_operator.api.derived import Plan
from tpu_operator.api.models import TPUTrainingJob
from tpu_workload.performance import hlo_costs

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu is not installed (bash scripts/setup.sh installs it)",
    ),
    pytest.mark.long,  # six example shapes compiled for tpu7x (about 2 minutes): a compile at scale, CI's `pytest -m long`
]

SMALL = dict(layers=3, modelDim=256, heads=2, kvHeads=1, headDim=128, mlpDim=1024, vocab=2048)
BLOCKS = {
    k: 128
    for k in (
        "blockQ",
        "blockKv",
        "blockKvCompute",
        "blockQDkv",
        "blockKvDkv",
        "blockKvDkvCompute",
        "blockQDq",
        "blockKvDq",
    )
}


def scaled(example: str, remat: dict | None = None) -> TrainerConfig:
    """The example on a 2x2x2 slice (x2 for several), small dimensions, 512 tokens a sequence."""
    doc = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    spec = doc["spec"]
    moe = "mixtral" in spec["model"].get("preset", "")
    spec["tpu"] = {"generation": "v7x", "topology": "2x2x2", "slices": min(spec["tpu"].get("slices", 1), 2)}
    spec["model"] = SMALL | ({"experts": 4, "expertsPerToken": 2} if moe else {})
    par = spec.get("parallelism", {})
    spec["parallelism"] = {
        "fsdp": "auto",
        "context": min(par.get("context", 1), 2),
        "expert": min(par.get("expert", 1), 2),
    }
    spec["kernels"] = {**spec.get("kernels", {}), "splash": BLOCKS}
    spec["kernels"].pop("tuningCache", None)
    training = spec["training"]
    training.update(globalBatch=16 * spec["tpu"]["slices"], sequenceLength=512, microbatches=1)
    training.pop("data", None), training.pop("eval", None)
    if remat is not None:
        training["remat"] = remat
    for key in ("checkpoint", "serviceAccountName"):
        spec.pop(key, None)
    return Plan(TPUTrainingJob.model_validate(doc)).trainer_config()


def gathered_per_pass(cfg: TrainerConfig) -> tuple[float, float]:
    """Bytes one device must gather in one pass: (the layers' attention weights and context parallelism's
    K/V; the layers' MLP or expert weights and the LM head's weight), weights whole along their FSDP
    dimension, split over tensor and, for experts, expert."""
    m, mesh = cfg.model, cfg.mesh
    dense = 1 if cfg.training.precision == "fp8" else 2  # the dense matmuls quantise before the gather
    attention = (
        dense * (2 * m.model_dim * m.heads * m.head_dim + 2 * m.model_dim * m.kv_heads * m.head_dim) / mesh.tensor
    )
    if m.is_moe:
        mlp = 2 * (3 * m.experts // mesh.expert * m.model_dim * m.mlp_dim / mesh.tensor) + 2 * m.model_dim * m.experts
    else:
        mlp = dense * 3 * m.model_dim * m.mlp_dim / mesh.tensor
    per_device = cfg.training.global_batch // (mesh.data * mesh.fsdp * mesh.expert)
    kv = (
        2 * 2 * per_device * cfg.training.sequence_length * m.kv_heads * m.head_dim / mesh.tensor
        if mesh.context > 1
        else 0
    )
    return m.layers * (attention + kv), m.layers * mlp + 2 * m.model_dim * m.vocab / mesh.tensor


def gathered(costs: hlo_costs.Costs) -> float:
    """Bytes gathered per step: all-gathers of floating-point values (not the int32 token ids and group
    sizes), and the all-reduces of packed (u32) or fp8 values the compiler gathers fp8 weights with (not
    the partial sums and scales the other all-reduces add up; reduce-scatters are gradients)."""

    def counted(what: str) -> bool:
        kind, dtype = what.split()[0], what.split()[1]
        return (kind == "all-gather" and not dtype.startswith("s32")) or (
            kind == "all-reduce" and dtype.startswith(("u32", "f8"))
        )

    return sum(
        site.value for (category, what, _), site in costs.sites.items() if category in ("ici", "dcn") and counted(what)
    )


CASES = {
    "llama3-8b-fsdp": ("llama3-8b-fsdp", None),
    "llama3-8b-fsdp, remat minimal": ("llama3-8b-fsdp", {"policy": "minimal"}),
    "llama3-8b-fsdp, remat none": ("llama3-8b-fsdp", {"policy": "none"}),
    "multislice (fp8)": ("multislice", None),
    "long-context (context 2)": ("long-context", None),
    "moe (expert 2)": ("moe", None),
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, hlo_costs.Costs]:
    """Every case compiled in one child (libtpu loads once), its step walked."""
    root = tmp_path_factory.mktemp("step-costs")
    args = []
    for i, case in enumerate(CASES):
        config = root / f"case{i}.json"
        config.write_text(scaled(*CASES[case]).model_dump_json(by_alias=True))
        args.append(f"case{i}={config}")
    child = subprocess.run(
        [sys.executable, "-m", "tests.workload.step_costs_child", str(root), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert child.returncode == 0, (child.stdout + child.stderr)[-4000:]
    verdicts = json.loads(child.stdout.strip().splitlines()[-1])
    assert set(verdicts.values()) == {"Fits"}, verdicts
    return {case: hlo_costs.dump_costs(str(root / f"case{i}")) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES)
def test_each_layer_is_gathered_once_per_pass(case, compiled):
    cfg, costs = scaled(*CASES[case]), compiled[case]
    assert costs is not None and not costs.unknown_loops
    (attention, rest), got = gathered_per_pass(cfg), gathered(costs)
    detail = json.dumps(
        {
            "attention": attention,
            "mlp and head": rest,
            "gathered": got,
            "sites": {f"{s.what} {s.op_name[-60:]}": [s.count, s.value] for s in costs.top("ici", 12)},
        },
        indent=1,
    )
    assert 0.95 * (attention + rest) <= got <= 1.02 * (3 * attention + 2 * rest), detail

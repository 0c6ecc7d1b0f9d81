"""`tpujob plan` and `python -m tpu_workload.performance.plan`: the job's train step compiled by the TPU compiler
(libtpu from PyPI, no TPU) for its slice, against the HBM of its devices.

The compiles here are kept small (seconds each on 2 cores; the full-size examples are `slow`):
the quickstart on its 2-host v7x slice, a multi-host Splash step shaped like the 8B example, a
job whose state cannot fit one chip, a Splash block whose kernel overflows VMEM, and flags.
Skipped, with the reason, where libtpu is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import yaml

from tests.conftest import EXAMPLES, ROOT, example, tiny_job
from tpu_operator.api import roofline
from tpu_operator.api.catalogue import generation
from tpu_operator.api.contract import TERMINATION_MESSAGE_BYTES, PlanResult, StepResources
from tpu_operator.api.validation import parse_job

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (bash scripts/setup.sh installs it)"
)


def plan(tmp_path, doc: dict, *extra: str) -> tuple[int, dict, str]:
    """`tpujob plan --json` on `doc`: (exit status, the result, stderr)."""
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path), "--json", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return p.returncode, (json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else {}), p.stderr


def small_8b(**spec) -> dict:
    """The 8B example's job (Splash with its blocks, remat full, FSDP over the slice, its flags) at a size
    that compiles in seconds, on a 2-host v7x slice: the cheapest real multi-host compile."""
    doc = example("llama3-8b-fsdp.yaml")
    doc["spec"]["tpu"]["topology"] = "2x2x2"
    doc["spec"]["model"] = {
        "layers": 2,
        "modelDim": 256,
        "heads": 2,
        "kvHeads": 2,
        "headDim": 128,
        "mlpDim": 512,
        "vocab": 4096,
    }
    doc["spec"]["training"].update(globalBatch=16, sequenceLength=1024)
    doc["spec"].update(spec)
    return doc


@needs_libtpu
@pytest.mark.e2e  # a `tpujob plan` process compiling for v7x
def test_the_quickstart_plans_and_fits(tmp_path):
    code, result, _ = plan(tmp_path, example("quickstart.yaml"))
    assert code == 0, result
    assert result["verdict"] == "Fits" and result["deviceKind"] == "TPU7x" and result["devices"] == 16
    assert result["hbmCapacityGiB"] == 96 and result["headroom"] == 0.1 and result["libtpuVersion"]
    assert 0 < result["hbmPerDeviceGiB"] < 1 and result["compileSeconds"] > 0


@needs_libtpu
@pytest.mark.long  # a multi-host v7x step compiled: a compile at scale
def test_a_multi_host_splash_step_compiles_for_v7x_and_prints_the_breakdown(tmp_path):
    path = tmp_path / "small-8b.yaml"
    path.write_text(yaml.safe_dump(small_8b()))
    p = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "v7x 2x2x2 x 1 slice(s), 16 TPU7x devices" in out and "compiler:    libtpu" in out
    assert "parameters + optimizer state" in out and "activations/temporaries" in out
    assert "96 GiB per device, 86.4 GiB with 10% headroom: fits" in out and "verdict:     fits" in out


@needs_libtpu
@pytest.mark.long  # a full step compiled and walked (about 1 minute): a compile at scale
def test_the_plan_reports_the_steps_flops_collectives_hbm_traffic_and_its_time_bound(tmp_path):
    code, result, _ = plan(tmp_path, small_8b())
    assert code == 0, result
    r = result["resources"]
    # By hand, per device (16 devices: one 1,024-token sequence each). Per layer forward: q, k, v, o
    # 2·T·E·(H + 2K)·d + 2·T·H·d·E and the SwiGLU MLP 3·2·T·E·F; remat full runs it twice and the backward
    # twice over, less the recomputed down projection, whose output the backward never reads. The
    # unembedding 3·2·T·E·V. Splash, causal (half the blocks): 2 matmuls forward, again in the recompute,
    # 3 for dQ, 4 for dK/dV, each 2·H·T·T·d / 2.
    T, E, H, K, d, F, V, L = 1024, 256, 2, 2, 128, 512, 4096, 2
    layer = 2 * T * E * (H + 2 * K) * d + 2 * T * H * d * E + 3 * 2 * T * E * F
    xla = L * (4 * layer - 2 * T * F * E) + 3 * 2 * T * E * V
    splash = L * (2 + 2 + 3 + 4) * 2 * H * T * T * d / 2
    assert r["matmulTFLOP"] == float(f"{(xla + splash) / 1e12:.6g}") and r["fp8TFLOP"] == 0
    assert r["kernelCalls"] == L * 4 and r["unknownLoops"] == 0
    assert r["modelTFLOP"] < r["matmulTFLOP"]  # MFU's count: no remat, attention halved
    # FSDP: weights gathered, gradients reduce-scattered, all inside the one slice.
    assert r["iciGiB"]["all-gather"] > 0 and r["iciGiB"]["reduce-scatter"] > 0 and r["dcnGiB"] == {}
    assert r["iciSentGiB"] > 0 and r["hbmTrafficGiB"] > 0
    bounds = r["boundSeconds"]
    assert set(bounds) == {"compute", "hbm", "ici", "dcn"} and bounds["dcn"] == 0
    assert r["stepTimeBoundSeconds"] == max(bounds.values()) and bounds[r["binding"]] == max(bounds.values())
    assert bounds["compute"] == pytest.approx(r["matmulTFLOP"] * 1e12 / (2307e12 / 2), rel=1e-3)
    assert 0 < r["mfuCeiling"] <= 1
    lines = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(tmp_path / "llama3-8b.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    for head in ("matmuls:", "collectives: ICI", "HBM traffic:", "step time:   at least", "MFU ceiling:"):
        assert head in lines, lines
    assert f"bound by {r['binding']}" in lines and "all-gather" in lines


def test_each_resources_bound_is_its_cost_over_the_chips_peak_shared_by_its_devices():
    v7x = generation("v7x")
    r = StepResources(
        matmul_tflop=1000,
        fp8_tflop=400,
        model_tflop=500,
        hbm_traffic_gib=2000,
        ici_sent_gib=150,
        dcn_sent_gib=10,
        ici_gib={"all-gather": 100},
        dcn_gib={"all-reduce": 10},
    )
    b = roofline.bound(r, v7x, "fp8")
    per_device = 2  # a v7x chip's two devices share its peaks
    assert b.bound_seconds["compute"] == pytest.approx(
        600e12 / (2307e12 / per_device) + 400e12 / (4614e12 / per_device), rel=1e-3
    )
    assert b.bound_seconds["hbm"] == pytest.approx(2000 * 2**30 / (7380e9 / per_device), rel=1e-3)
    assert b.bound_seconds["ici"] == pytest.approx(150 * 2**30 / (1200e9 / 2 / per_device), rel=1e-3)  # one direction
    assert b.bound_seconds["dcn"] == pytest.approx(10 * 2**30 / (100e9 / 8 / per_device), rel=1e-3)
    assert b.binding == "dcn" and b.step_time_bound_s == b.bound_seconds["dcn"]
    assert b.mfu_ceiling == pytest.approx(500e12 / b.step_time_bound_s / (4614e12 / per_device), rel=1e-3)
    compute_bound = roofline.bound(
        r.model_copy(update={"dcn_sent_gib": 0, "ici_sent_gib": 1, "hbm_traffic_gib": 1}), v7x, "bf16"
    )
    assert compute_bound.binding == "compute"
    assert compute_bound.mfu_ceiling == pytest.approx(500 / 1000 * 2307 / (0.6 * 2307 + 0.4 * 2307 / 2), rel=1e-3)


@needs_libtpu
@pytest.mark.e2e  # a `tpujob plan` process compiling for v7x
def test_a_job_that_cannot_fit_exits_2_with_the_numbers_and_what_to_change(tmp_path):
    # One layer, but a 1M-token vocabulary at d=16384 on one chip: 197 GiB of weights and Adam per device.
    doc = tiny_job(
        tpu={"generation": "v7x", "topology": "1x1x1"},
        training={"steps": 1, "globalBatch": 2, "sequenceLength": 128},
        model={
            "layers": 1,
            "modelDim": 16384,
            "heads": 4,
            "kvHeads": 4,
            "headDim": 64,
            "mlpDim": 16384,
            "vocab": 1 << 20,
        },
    )
    doc["metadata"]["name"] = "too-wide"
    code, result, _ = plan(tmp_path, doc)
    assert code == 2, result
    assert result["verdict"] == "DoesNotFit" and result["stateGiB"] > 96
    assert "CompileTimeHbmOom" in result["message"] and "exceeds available HBM" in result["message"]
    assert result["change"][0] == "tpu.topology"  # the state alone does not fit: shard it over more chips
    assert "training.globalBatch" in result["change"]
    assert result["largest"] and "GiB" in result["largest"][0]


@needs_libtpu
@pytest.mark.e2e  # a `tpujob plan` process compiling for v7x
def test_a_splash_block_that_overflows_vmem_names_the_blocks_and_the_limit(tmp_path):
    blocks = dict.fromkeys(
        (
            "blockQ",
            "blockKv",
            "blockKvCompute",
            "blockQDkv",
            "blockKvDkv",
            "blockKvDkvCompute",
            "blockQDq",
            "blockKvDq",
        ),
        1024,
    )
    doc = small_8b(kernels={"attention": "splash", "splash": blocks}, runtime={"scopedVmemLimitKiB": 2048})
    doc["spec"]["tpu"]["topology"] = "2x2x1"
    doc["spec"]["training"]["globalBatch"] = 8
    doc["spec"]["model"]["layers"] = 1
    code, result, _ = plan(tmp_path, doc)
    assert code == 2, result
    assert result["verdict"] == "VmemOverflow" and result["change"] == ["kernels.splash", "runtime.scopedVmemLimitKiB"]
    assert "splash_mha" in result["message"] and "exceeded scoped vmem limit" in result["message"]


@needs_libtpu
def test_every_examples_libtpu_init_args_are_accepted():
    from tpu_operator.rendering.preflight import plan_env
    from tpu_workload.performance import libtpu_flags

    sets = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        job = parse_job(yaml.safe_load(path.read_text()))
        sets.setdefault((job.spec.tpu.generation, plan_env(job)["LIBTPU_INIT_ARGS"]), []).append(path.name)
    assert len(sum(sets.values(), [])) >= 6
    for (gen, flags), names in sets.items():
        assert len(flags.split()) >= 14
        assert libtpu_flags.rejected(flags.split(), gen) == [], names


@needs_libtpu
@pytest.mark.e2e  # a `tpujob plan` process compiling for v7x
def test_a_misspelt_flag_is_refused_with_its_field_path(tmp_path):
    doc = tiny_job(
        runtime={
            "libtpuInitArgs": ["--xla_tpu_enable_latency_hiding_scheduler=true", "--xla_tpu_scoped_vmem_limt_kib=4096"]
        }
    )
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    refused = [line.strip() for line in p.stdout.splitlines() if "refuses" in line]
    assert len(refused) == 1 and refused[0].startswith("spec.runtime.libtpuInitArgs[1]: libtpu"), p.stdout
    assert "--xla_tpu_scoped_vmem_limt_kib=4096" in refused[0]
    assert "Unknown command line flag 'xla_tpu_scoped_vmem_limt_kib'" in refused[0]
    assert "verdict:     REFUSED FLAGS" in p.stdout


def test_without_libtpu_the_plan_says_so_and_exits_3(monkeypatch, tmp_path):
    from tpu_workload.performance import plan as plan_lib

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    from tpu_operator.api.derived import Plan

    result = plan_lib.check(Plan(parse_job(tiny_job())).trainer_config(), capacity_gib=96, headroom=0.1)
    assert result.verdict == "NoLibtpu" and result.exit_code == 3 and result.fits is None
    assert "libtpu is not installed" in result.message and "tpu-operator[plan]" in result.message


def test_a_result_always_fits_a_termination_message():
    result = PlanResult(
        verdict="DoesNotFit", message="x" * 6000, largest=["y" * 160] * 40, change=["training.globalBatch"]
    )
    text = result.to_termination_message()
    assert len(text.encode()) <= TERMINATION_MESSAGE_BYTES
    back = PlanResult.model_validate_json(text)
    assert back.verdict == "DoesNotFit" and back.change == ["training.globalBatch"] and back.message.endswith("...")


@pytest.mark.slow
@needs_libtpu
def test_llama3_70b_on_one_2x2x1_slice_does_not_fit(tmp_path):
    doc = example("multislice.yaml")
    doc["spec"]["tpu"].update(topology="2x2x1", slices=1)
    doc["spec"]["training"]["globalBatch"] = 8
    code, result, _ = plan(tmp_path, doc)
    assert code == 2 and result["verdict"] == "DoesNotFit" and "exceeds available HBM" in result["message"]


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize(
    "name",
    [
        "llama3-8b-fsdp.yaml",
        "long-context.yaml",
        "moe.yaml",
        "multislice.yaml",
        "continue-llama3-8b.yaml",
        "sft-llama3-8b.yaml",
    ],
)
def test_every_full_size_example_fits(tmp_path, name):
    code, result, _ = plan(tmp_path, example(name))
    assert code == 0 and result["verdict"] == "Fits", result
    if name in ("llama3-8b-fsdp.yaml", "continue-llama3-8b.yaml", "sft-llama3-8b.yaml"):
        assert result["hbmPerDeviceGiB"] <= 14.5


@needs_libtpu
@pytest.mark.long  # one compile per slice count: a compile at scale
def test_an_elastic_job_plans_every_slice_count_it_may_run_on(tmp_path):
    doc = tiny_job(
        tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1}},
        training={"steps": 10, "globalBatch": 16, "sequenceLength": 128},
    )
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    # Two slices (16 devices), then one (8 devices: the same batch in twice the microbatches).
    assert [(r["verdict"], r["devices"]) for r in results] == [("Fits", 16), ("Fits", 8)], results
    # Two slices sum their gradients over DCN; one slice sends nothing between slices.
    assert results[0]["resources"]["dcnGiB"]["all-reduce"] > 0 and results[0]["resources"]["dcnSentGiB"] > 0
    assert results[1]["resources"]["dcnGiB"] == {} and results[1]["resources"]["boundSeconds"]["dcn"] == 0

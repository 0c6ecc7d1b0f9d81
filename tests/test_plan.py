"""`tpujob plan` and `python -m tpu_workload.plan`: the job's train step compiled by the TPU compiler
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
from tpu_operator.api.contract import TERMINATION_MESSAGE_BYTES, PlanResult
from tpu_operator.api.validation import parse_job

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (bash scripts/setup.sh installs it)")


def plan(tmp_path, doc: dict, *extra: str) -> tuple[int, dict, str]:
    """`tpujob plan --json` on `doc`: (exit status, the result, stderr)."""
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path), "--json", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    return p.returncode, (json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else {}), p.stderr


def small_8b(**spec) -> dict:
    """The 8B example's job (Splash with its blocks, remat full, FSDP over the slice, its flags) at a size
    that compiles in seconds, on a 2-host v7x slice: the cheapest real multi-host compile."""
    doc = example("llama3-8b-fsdp.yaml")
    doc["spec"]["tpu"]["topology"] = "2x2x2"
    doc["spec"]["model"] = {"layers": 2, "modelDim": 256, "heads": 2, "kvHeads": 2, "headDim": 128, "mlpDim": 512,
                            "vocab": 4096}
    doc["spec"]["training"].update(globalBatch=16, sequenceLength=1024)
    doc["spec"].update(spec)
    return doc


@needs_libtpu
def test_the_quickstart_plans_and_fits(tmp_path):
    code, result, _ = plan(tmp_path, example("quickstart.yaml"))
    assert code == 0, result
    assert result["verdict"] == "Fits" and result["deviceKind"] == "TPU7x" and result["devices"] == 16
    assert result["hbmCapacityGiB"] == 96 and result["headroom"] == 0.1 and result["libtpuVersion"]
    assert 0 < result["hbmPerDeviceGiB"] < 1 and result["compileSeconds"] > 0


@needs_libtpu
def test_a_multi_host_splash_step_compiles_for_v7x_and_prints_the_breakdown(tmp_path):
    path = tmp_path / "small-8b.yaml"
    path.write_text(yaml.safe_dump(small_8b()))
    p = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "v7x 2x2x2 x 1 slice(s), 16 TPU7x devices" in out and "compiler:    libtpu" in out
    assert "parameters + optimizer state" in out and "activations/temporaries" in out
    assert "96 GiB per device, 86.4 GiB with 10% headroom: fits" in out and "verdict:     fits" in out


@needs_libtpu
def test_a_job_that_cannot_fit_exits_2_with_the_numbers_and_what_to_change(tmp_path):
    # One layer, but a 1M-token vocabulary at d=16384 on one chip: 197 GiB of weights and Adam per device.
    doc = tiny_job(tpu={"generation": "v7x", "topology": "1x1x1"}, training={"steps": 1, "globalBatch": 2,
                   "sequenceLength": 128}, model={"layers": 1, "modelDim": 16384, "heads": 4, "kvHeads": 4,
                                                  "headDim": 64, "mlpDim": 16384, "vocab": 1 << 20})
    doc["metadata"]["name"] = "too-wide"
    code, result, _ = plan(tmp_path, doc)
    assert code == 2, result
    assert result["verdict"] == "DoesNotFit" and result["stateGiB"] > 96
    assert "CompileTimeHbmOom" in result["message"] and "exceeds available HBM" in result["message"]
    assert result["change"][0] == "tpu.topology"  # the state alone does not fit: shard it over more chips
    assert "training.globalBatch" in result["change"]
    assert result["largest"] and "GiB" in result["largest"][0]


@needs_libtpu
def test_a_splash_block_that_overflows_vmem_names_the_blocks_and_the_limit(tmp_path):
    blocks = dict.fromkeys(("blockQ", "blockKv", "blockKvCompute", "blockQDkv", "blockKvDkv", "blockKvDkvCompute",
                            "blockQDq", "blockKvDq"), 1024)
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
    from tpu_workload import libtpu_flags

    sets = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        job = parse_job(yaml.safe_load(path.read_text()))
        sets.setdefault((job.spec.tpu.generation, plan_env(job)["LIBTPU_INIT_ARGS"]), []).append(path.name)
    assert len(sum(sets.values(), [])) >= 6
    for (gen, flags), names in sets.items():
        assert len(flags.split()) >= 14
        assert libtpu_flags.rejected(flags.split(), gen) == [], names


@needs_libtpu
def test_a_misspelt_flag_is_refused_with_its_field_path(tmp_path):
    doc = tiny_job(runtime={"libtpuInitArgs": ["--xla_tpu_enable_latency_hiding_scheduler=true",
                                               "--xla_tpu_scoped_vmem_limt_kib=4096"]})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    refused = [line.strip() for line in p.stdout.splitlines() if "refuses" in line]
    assert len(refused) == 1 and refused[0].startswith("spec.runtime.libtpuInitArgs[1]: libtpu"), p.stdout
    assert "--xla_tpu_scoped_vmem_limt_kib=4096" in refused[0]
    assert "Unknown command line flag 'xla_tpu_scoped_vmem_limt_kib'" in refused[0]
    assert "verdict:     REFUSED FLAGS" in p.stdout


def test_without_libtpu_the_plan_says_so_and_exits_3(monkeypatch, tmp_path):
    from tpu_workload import plan as plan_lib

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    from tpu_operator.api.plan import Plan

    result = plan_lib.check(Plan(parse_job(tiny_job())).trainer_config(), capacity_gib=96, headroom=0.1)
    assert result.verdict == "NoLibtpu" and result.exit_code == 3 and result.fits is None
    assert "libtpu is not installed" in result.message and "tpu-operator[plan]" in result.message


def test_a_result_always_fits_a_termination_message():
    result = PlanResult(verdict="DoesNotFit", message="x" * 6000, largest=["y" * 160] * 40, change=["training.globalBatch"])
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
@pytest.mark.parametrize("name", ["llama3-8b-fsdp.yaml", "long-context.yaml", "moe.yaml", "multislice.yaml"])
def test_every_full_size_example_fits(tmp_path, name):
    code, result, _ = plan(tmp_path, example(name))
    assert code == 0 and result["verdict"] == "Fits", result
    if name == "llama3-8b-fsdp.yaml":
        assert result["hbmPerDeviceGiB"] <= 14.5


@needs_libtpu
def test_an_elastic_job_plans_every_slice_count_it_may_run_on(tmp_path):
    doc = tiny_job(tpu={"generation": "v7x", "topology": "2x2x1", "slices": 2, "elastic": {"minSlices": 1}},
                   training={"steps": 10, "globalBatch": 16, "sequenceLength": 128})
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run([sys.executable, "-m", "tpu_operator.cli", "plan", "-f", str(path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    # Two slices (16 devices), then one (8 devices: the same batch in twice the microbatches).
    assert [(r["verdict"], r["devices"]) for r in results] == [("Fits", 16), ("Fits", 8)], results

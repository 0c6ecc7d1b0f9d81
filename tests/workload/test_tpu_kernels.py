"""The production Pallas kernels compiled by the TPU compiler for TPU7x (libtpu, no TPU): Splash
forward + backward and the MoE experts (Megablox gmm) forward + backward, through Mosaic with
`interpret=False`, at small shapes with our default block sizes. Interpret mode (the other kernel
tests) never meets Mosaic's VMEM or layout limits; this does.

The compiles run in one child process (tpu_compile_child.py: libtpu loaded into the pytest process
would crash the tuning tests' profiler), which reports what each case found. Skipped, with the
reason, where libtpu is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import trainer_config
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (bash scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    config = tmp_path_factory.mktemp("tpu") / "trainer.json"
    config.write_text(trainer_config().model_dump_json())
    child = subprocess.run([sys.executable, "-m", "tests.workload.tpu_compile_child", str(config)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-4000:]
    found = json.loads(child.stdout.strip().splitlines()[-1])
    assert found["devices"]["kinds"] == ["TPU7x"] * 8, found["devices"]
    return found


def _case(compiled: dict, name: str) -> dict:
    case = compiled[name]
    assert "error" not in case, case.get("error")
    return case


def test_splash_forward_and_backward_compile_for_tpu7x_with_default_blocks(compiled):
    case = _case(compiled, "splash")
    assert case["custom_call"]  # the Mosaic kernels, not an XLA fallback
    assert 0 < case["temp_bytes"] < 1 << 30


def test_moe_experts_megablox_forward_and_backward_compile_for_tpu7x(compiled):
    case = _case(compiled, "megablox")
    assert case["custom_call"] and case["temp_bytes"] > 0


def test_a_generation_libtpu_cannot_target_is_said_so_not_raised(compiled):
    case = _case(compiled, "unknown_generation")
    assert case["verdict"] == "Unsupported" and case["fits"] is None and case["exit_code"] == 3
    assert "cannot make a v2x 2x2x1" in case["message"] and "Invalid TPU external name" in case["message"]

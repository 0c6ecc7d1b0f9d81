"""The production Pallas kernels compiled by the TPU compiler for TPU7x (libtpu, no TPU): Splash
forward + backward (JAX's, and tokamax's for maxLogitConst) and the MoE experts (tokamax's Mosaic
grouped matmul, with expert parallelism's ragged all-to-all) forward + backward, through Mosaic with
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

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu is not installed (bash scripts/setup.sh installs it)",
    ),
    pytest.mark.long,  # Mosaic compiles of Splash and the grouped matmul at TPU block sizes (about 1.5 minutes): a compile at scale, CI's `pytest -m long`
]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    config = tmp_path_factory.mktemp("tpu") / "trainer.json"
    config.write_text(trainer_config().model_dump_json())
    child = subprocess.run(
        [sys.executable, "-m", "tests.workload.tpu_compile_child", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
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


def test_jax_splash_backward_keeps_no_per_block_dq_and_tokamax_still_compiles(compiled):
    """4096 tokens in 8 key/value blocks, per device 8 heads x 128: JAX's Splash writes dQ once (8 MiB
    in bf16, with dK and dV); tokamax's fused backward (maxLogitConst) writes a f32 dQ per key/value
    block (8 x 16 MiB). Measured with libtpu 0.0.52: 55 MiB of temporaries against 154 MiB."""
    case = _case(compiled, "splash_long")
    jax_bytes, tokamax_bytes = case["jax"]["temp_bytes"], case["tokamax"]["temp_bytes"]
    assert case["jax"]["custom_call"] and case["tokamax"]["custom_call"]
    assert tokamax_bytes > 2 * jax_bytes and tokamax_bytes - jax_bytes > 64 << 20, (jax_bytes, tokamax_bytes)


def test_moe_experts_on_the_mosaic_grouped_matmul_compile_for_tpu7x(compiled):
    case = _case(compiled, "megablox")
    assert case["custom_call"] and case["temp_bytes"] > 0 and not case["ragged_all_to_all"]


def test_expert_parallelism_exchanges_rows_with_ragged_all_to_all_on_tpu(compiled):
    case = _case(compiled, "expert_parallel")
    for degree in ("expert2", "expert4"):
        assert case[degree]["ragged_all_to_all"] and case[degree]["custom_call"], degree


def test_no_mlp_wide_buffer_grows_with_the_expert_degree(compiled):
    """From expert 2 to 4 the receive buffer doubles (+1024 rows of D 128); were the [rows, F 2048]
    activations not sliced, each would grow by 1024 x 2048 x 2 B = 4 MiB, and there are several."""
    case = _case(compiled, "expert_degree_growth")
    growth = case["expert4"]["temp_bytes"] - case["expert2"]["temp_bytes"]
    assert growth < 1024 * 2048 * 2, growth


def test_a_generation_libtpu_cannot_target_is_said_so_not_raised(compiled):
    case = _case(compiled, "unknown_generation")
    assert case["verdict"] == "Unsupported" and case["fits"] is None and case["exit_code"] == 3
    assert "cannot make a v2x 2x2x1" in case["message"] and "Invalid TPU external name" in case["message"]

"""The HLO walk of hlo_costs.py on modules of the TPU compiler (libtpu, TPU7x, no TPU): its loops carry no
trip count, its collectives run asynchronously (some on the SparseCores), it fuses gathers into
matmuls (windowed einsums), it sends what crosses slices through the megascale runtime, and the Splash
and grouped-matmul kernels are Mosaic custom calls. Every figure is checked against a hand count.

The compiles run in one child process (hlo_costs_child.py), as in test_tpu_kernels.py. Skipped, with the
reason, where libtpu is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (bash scripts/setup.sh installs it)"
)

LAYERS, OUTER, INNER, B, D = 4, 2, 3, 256, 1024  # as in hlo_costs_child.py
T, N, K, H = 1024, 8, 2, 128
M, G, K_, N_ = 1024, 4, 256, 512
BF16, F32 = 2, 4


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    dump = tmp_path_factory.mktemp("hlo")
    child = subprocess.run(
        [sys.executable, "-m", "tests.workload.hlo_costs_child", str(dump)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def _case(found: dict, name: str) -> dict:
    case = found[name]
    assert "error" not in case, case.get("error")
    return case


def test_a_scanned_layer_gather_is_counted_per_layer_though_the_compiler_writes_no_trip_count(found):
    case = _case(found, "scan")
    assert not case["known_trip_count_in_module"] and case["while_loops"] == 1 and case["unknown_loops"] == []
    assert case["matmul_flops"] == LAYERS * 2 * (B // 8) * D * D
    assert case["ici_bytes"]["all-gather"] == LAYERS * D * D * BF16 and case["gathers"] == [LAYERS]


def test_nested_scans_multiply_on_tpu(found):
    case = _case(found, "nested")
    assert case["while_loops"] == 2 and case["unknown_loops"] == []
    assert case["matmul_flops"] == OUTER * INNER * 2 * (B // 8) * D * D
    assert case["ici_bytes"]["all-gather"] == OUTER * INNER * D * D * BF16 and case["gathers"] == [OUTER * INNER]


def test_a_windowed_einsums_permutes_count_as_the_gather_they_implement(found):
    case = _case(found, "windowed")
    assert case["matmul_flops"] == 2 * 1024 * D * 4 * D  # x [1024, D] @ w [D, 4D] on each of 16 devices
    weight = D * 4 * D * BF16
    moved = case["ici_bytes"].get("all-gather", 0) + case["ici_bytes"].get("collective-permute", 0)
    # Every device receives the 15 shards it lacks (the bidirectional loop moves one more).
    assert 15 / 16 * weight <= moved <= 17 / 16 * weight
    assert case["ici_bytes"]["all-gather"] >= 15 / 16 * weight  # most of it in the loop, as an all-gather


def test_what_crosses_slices_is_counted_as_dcn_bytes(found):
    case = _case(found, "two_slices")
    assert case["matmul_flops"] == 2 * (B // 16) * D * D
    # The [D, D] f32 sum: reduce-scattered in each slice (ICI), each device's 1/8 summed across the two
    # slices (DCN, a megascale all-reduce), gathered again in the slice.
    assert case["ici_bytes"] == {"reduce-scatter": D * D * F32, "all-gather": D * D * F32}
    assert case["dcn_bytes"] == {"all-reduce": D * D * F32 / 8}


def test_splash_kernels_are_counted_as_causal_attention_from_their_shapes(found):
    case = _case(found, "splash")
    assert case["kernel_calls"] == {
        "splash_mha_fwd_residuals": 1,
        "splash_mha_dq_no_residuals": 1,
        "splash_mha_dkv_no_residuals": 1,
    }
    one_matmul = 2 * 1 * N * T * T * H / 2  # one sequence a device, causal: half of the dense count
    assert case["kernel_flops"] == {"splash": (2 + 3 + 4) * one_matmul}
    assert case["matmul_flops"] == 0


def test_grouped_matmul_kernels_are_counted_from_their_rows(found):
    case = _case(found, "grouped_matmul")
    assert case["kernel_calls"] == {"gmm_megablox": 1, "gmm_megablox_transpose_rhs": 1, "tgmm_megablox": 1}
    # Forward, lhs gradient and rhs gradient: each 2·M·K·N over the M rows a device holds.
    assert case["kernel_flops"] == {"grouped_matmul": 3 * 2 * M * K_ * N_}
    assert case["ici_bytes"] == {"all-reduce": G * K_ * N_ * BF16}  # the replicated rhs's gradient, summed

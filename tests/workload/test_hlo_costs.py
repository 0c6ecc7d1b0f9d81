"""The HLO walk of hlo_costs.py on hand-built steps whose FLOPs and bytes are counted by hand: scans of
matmuls over 8 CPU devices with FSDP-sharded weights, each layer's weight all-gathered inside the loop
body, nested scans, a weight gathered once before the loop, and the backward's gradient sums.

CPU modules carry `known_trip_count`; the TPU compiler's do not, so each case is walked twice: as
compiled, and with the loops' backend configs removed, where the counts are derived from the loops.
The TPU compiler's own forms (SparseCore async collectives, windowed einsums, megascale DCN transfers,
the Splash and grouped-matmul kernels) are checked on its modules in test_hlo_costs_tpu.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_workload.performance import hlo_costs

DEVICES = 8
B, D = 64, 128  # batch (sharded over the 8 devices), model dim
F32 = 4


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:DEVICES]), ("fsdp",))


def _walks(fn, *args) -> list[hlo_costs.Costs]:
    """The costs of `fn` compiled for the arguments: as compiled, and with every loop's backend config
    (its known_trip_count) removed, as the TPU compiler writes loops."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert "known_trip_count" in text
    bare = re.sub(r"(while\([^)]*\)[^\n]*?), backend_config=\{[^\n]*\}", r"\1", text)
    assert "known_trip_count" not in bare
    return [hlo_costs.module_costs(text), hlo_costs.module_costs(bare)]


def _args(mesh, *shapes_specs):
    return [
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec)) for shape, spec in shapes_specs
    ]


def _gather(mesh, w):
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))


def _layers(mesh, layers: int):
    """A scan over `layers` FSDP-sharded [D, D] weights, each gathered in the loop body."""

    def step(w, x):
        def layer(x, w_i):
            return jnp.tanh(x @ _gather(mesh, w_i)), None

        return jax.lax.scan(layer, x, w)[0].sum()

    return step, _args(mesh, ((layers, D, D), P(None, "fsdp", None)), ((B, D), P("fsdp", None)))


@pytest.mark.parametrize("layers", [2, 5])
def test_a_weight_gathered_in_the_loop_body_is_counted_once_per_layer(mesh, layers):
    step, args = _layers(mesh, layers)
    for costs in _walks(step, *args):
        assert costs.unknown_loops == []
        # Each device multiplies its 8 rows by the whole [D, D] weight, once per layer.
        assert costs.matmul_flops == layers * 2 * (B // DEVICES) * D * D
        # Each layer's gather ends with the whole weight on every device: D·D f32, layers times;
        # every device sends the 7/8 it does not hold. The final sum is an all-reduce of one f32.
        assert costs.ici_bytes["all-gather"] == layers * D * D * F32
        gathers = [s for s in costs.top("ici", 20) if s.what.startswith("all-gather")]
        assert [s.count for s in gathers] == [layers] and gathers[0].what == f"all-gather f32[1,{D},{D}]"
        assert costs.ici_bytes["all-reduce"] == F32
        assert costs.ici_wire_bytes == pytest.approx(layers * D * D * F32 * 7 / 8 + F32 * 2 * 7 / 8)
        assert costs.dcn_bytes == {} and costs.kernel_calls == {}


def test_a_weight_gathered_once_before_the_loop_is_counted_once(mesh):
    layers = 4

    def step(w, x):
        w = _gather(mesh, w)  # the whole stack, once
        return jax.lax.scan(lambda x, w_i: (jnp.tanh(x @ w_i), None), x, w)[0].sum()

    _, args = _layers(mesh, layers)
    for costs in _walks(step, *args):
        assert costs.ici_bytes["all-gather"] == layers * D * D * F32
        assert [s.count for s in costs.top("ici", 20) if s.what.startswith("all-gather")] == [1]
        assert costs.matmul_flops == layers * 2 * (B // DEVICES) * D * D


def test_nested_loops_multiply_their_trip_counts(mesh):
    outer, inner = 2, 3

    def step(w, v, x):
        def block(x, wv):
            w_j, v_j = wv
            x = jax.lax.scan(lambda x, w_i: (jnp.tanh(x @ _gather(mesh, w_i)), None), x, w_j)[0]
            return x @ _gather(mesh, v_j), None  # once per outer iteration

        return jax.lax.scan(block, x, (w, v))[0].sum()

    args = _args(
        mesh,
        ((outer, inner, D, D), P(None, None, "fsdp", None)),
        ((outer, D, D), P(None, "fsdp", None)),
        ((B, D), P("fsdp", None)),
    )
    for costs in _walks(step, *args):
        assert costs.unknown_loops == []
        assert costs.matmul_flops == (outer * inner + outer) * 2 * (B // DEVICES) * D * D
        assert costs.ici_bytes["all-gather"] == (outer * inner + outer) * D * D * F32
        assert sorted(s.count for s in costs.top("ici", 20) if s.what.startswith("all-gather")) == [
            outer,
            outer * inner,
        ]


def test_the_backward_sums_each_layers_gradient_by_its_full_size(mesh):
    layers = 3
    step, args = _layers(mesh, layers)
    for costs in _walks(jax.grad(step), *args):
        # Forward: x @ w per layer; backward: dx = g @ wᵀ and dw = xᵀ @ g, each the same size.
        assert costs.matmul_flops == 3 * layers * 2 * (B // DEVICES) * D * D
        # Each layer's [D, D] gradient is summed over the devices whole (the CPU compiler all-reduces it, then
        # slices; the TPU compiler reduce-scatters): D·D f32 a layer, each device sending 2·7/8 of it.
        assert costs.ici_bytes == {"all-gather": layers * D * D * F32, "all-reduce": layers * D * D * F32}
        assert costs.ici_wire_bytes == pytest.approx(layers * D * D * F32 * (7 / 8 + 2 * 7 / 8))


def test_a_scan_reads_each_layers_slice_of_the_stacked_weights_not_the_stack(mesh):
    """HBM traffic per layer is the same with 4, 8 or 16 layers stacked: each iteration's fusion that slices
    the [layers, D, D] stack is counted for its slice (were the whole stack counted, each layer would cost
    more the more layers there are)."""
    traffic = {}
    for layers in (4, 8, 16):
        step, args = _layers(mesh, layers)
        (costs, _) = _walks(jax.grad(step), *args)  # the backward also writes each layer's gradient in place
        traffic[layers] = costs.hbm_bytes
    per_layer = [(traffic[8] - traffic[4]) / 4, (traffic[16] - traffic[8]) / 8]
    # The whole stack read per layer would add 12 and 24 stacks' shards (8 KiB each) to these: 8 % and 15 %.
    assert per_layer[0] > 0 and per_layer[1] == pytest.approx(per_layer[0], rel=0.02), traffic


def test_the_walk_reads_an_xla_dump_and_prints_a_table(tmp_path, mesh, capsys):
    step, args = _layers(mesh, 4)
    path = tmp_path / "module_0001.jit_train_step.after_optimizations.txt"
    path.write_text(jax.jit(step).lower(*args).compile().as_text())
    assert hlo_costs.step_module(str(tmp_path)) == str(path)
    assert hlo_costs.main([str(tmp_path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "all-gather" in out and f"4 x all-gather f32[1,{D},{D}]" in out
    assert hlo_costs.main([str(path), "--json"]) == 0
    summary = __import__("json").loads(capsys.readouterr().out)
    assert summary["ici_gib"]["all-gather"] == round(4 * D * D * F32 / (1 << 30), 4)


@pytest.mark.parametrize(
    "text,groups",
    [
        ("replica_groups={{0,1},{2,3}}, dimensions={0}", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[4], dimensions={0}", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'b'}, dimensions={0}", [[0, 1], [2, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}, dimensions={0}", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=8,'axis_2'=1] {'axis_1'}", [list(range(8))]),
    ],
)
def test_replica_groups_in_each_of_xlas_spellings(text, groups):
    inst = hlo_costs.Instruction("ag", "all-gather", hlo_costs.Array("f32", (4,)), [], text, text)
    assert hlo_costs.replica_groups(inst) == groups


def test_shapes_with_layouts_memory_spaces_and_tuples():
    assert hlo_costs.parse_shape("bf16[4096,16]{0,1:T(8,128)(2,1)}") == hlo_costs.Array("bf16", (4096, 16))
    vmem = hlo_costs.parse_shape("bf16[2,2,1024,128]{3,2,1,0:T(16,128)(2,1)S(1)}")
    assert vmem.space == 1 and hlo_costs.hbm_bytes(vmem) == 0 and vmem.bytes == 2 * 2 * 1024 * 128 * 2
    nested = hlo_costs.parse_shape("((bf16[8,128]{1,0}, f32[]), /*index=2*/u32[]{:S(2)}, f8e4m3fn[3])")
    assert [str(a) for a in hlo_costs.arrays(nested)] == ["bf16[8,128]", "f32[]", "u32[]", "f8e4m3fn[3]"]
    assert hlo_costs.hbm_bytes(nested) == 8 * 128 * 2 + 4 + 3

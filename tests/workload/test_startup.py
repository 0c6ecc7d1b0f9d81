"""Start-up paths that only a TPU cluster exercises, checked on the CPU.

Multi-slice meshes are built from stand-in TPU devices (the attributes mesh_utils reads:
platform, device_kind, coords, core_on_chip, slice_index). How a process joins the others is a
pure function of an env mapping and a stand-in `glob`; `start` itself runs with
jax.distributed.initialize replaced by a recorder, so no test joins a cluster.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import jax
import numpy as np
import pytest

from tpu_workload.model import sharding
from tpu_workload.process import runtime


@dataclasses.dataclass(frozen=True, eq=False)
class FakeTpu:
    """What jax.experimental.mesh_utils reads from a TPU device."""

    id: int
    slice_index: int
    coords: tuple[int, int, int]
    core_on_chip: int
    process_index: int
    platform: str = "tpu"
    device_kind: str = "TPU7x"


def fake_slices(slices: int, chips: tuple[int, int, int], cores: int, kind: str) -> list[FakeTpu]:
    """`slices` slices of a chips[0] x chips[1] x chips[2] torus, 4 chips per host, in jax.devices() order."""
    out = []
    for s in range(slices):
        for i, (z, y, x) in enumerate(np.ndindex(chips[2], chips[1], chips[0])):
            for k in range(cores):
                out.append(
                    FakeTpu(
                        id=len(out),
                        slice_index=s,
                        coords=(x, y, z),
                        core_on_chip=k,
                        process_index=s * (int(np.prod(chips)) // 4) + i // 4,
                        device_kind=kind,
                    )
                )
    return out


def mesh_dims(data=1, fsdp=1, context=1, expert=1, tensor=1) -> tuple[int, ...]:
    return data, fsdp, context, expert, tensor


def assert_data_spans_slices(grid: np.ndarray, devices: list[FakeTpu], slices: int) -> None:
    """Every data index holds one slice only; each slice fills data // slices consecutive indices."""
    slice_of = np.vectorize(lambda d: d.slice_index)(grid)
    per = grid.shape[0] // slices
    for i in range(grid.shape[0]):
        assert np.all(slice_of[i] == slice_of[i].flat[0]), f"data index {i} mixes slices {np.unique(slice_of[i])}"
    for s in range(slices):
        assert {d.id for d in grid[s * per : (s + 1) * per].flat} == {d.id for d in devices if d.slice_index == s}
    assert sorted(d.id for d in grid.flat) == [d.id for d in devices]  # each device exactly once


@pytest.mark.parametrize(
    "kind, chips, cores, dims, split",
    [
        ("TPU7x", (2, 2, 1), 2, mesh_dims(data=2, fsdp=2, tensor=4), False),  # mesh_utils' v7x ring handler
        ("TPU7x", (2, 2, 1), 2, mesh_dims(data=4, fsdp=4), False),  # two data indices inside each slice
        ("TPU v4", (2, 2, 4), 1, mesh_dims(data=2, fsdp=4, tensor=4), False),  # generic torus assignment
        # 2 x 2 x 2 x 2 over a 2x2x4 torus: the 4-long axis must be split (warned, not fatal)
        ("TPU v4", (2, 2, 4), 1, mesh_dims(data=2, fsdp=2, context=2, expert=2, tensor=2), True),
    ],
)
def test_tpu_grid_puts_data_across_slices(kind, chips, cores, dims, split, caplog):
    devices = fake_slices(2, chips, cores, kind)
    grid = sharding.tpu_grid(dims, 2, devices)
    assert grid.shape == dims
    assert_data_spans_slices(grid, devices, 2)
    assert ("splitting physical axes" in caplog.text) == split


def test_single_slice_tpu_mesh(monkeypatch):
    devices = fake_slices(1, (2, 2, 4), 1, "TPU v4")
    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=1, expert=1, tensor=4))
    assert sorted(d.id for d in mesh.devices.flat) == list(range(16))
    two = fake_slices(2, (2, 2, 1), 2, "TPU7x")
    with pytest.raises(ValueError, match=r"says 1 slice\(s\) but the devices report slice_index \[0, 1\]"):
        sharding.tpu_grid(mesh_dims(data=2, fsdp=8), 1, two)


def test_tpu_grid_orders_slices_by_slice_index():
    devices = fake_slices(3, (2, 2, 1), 2, "TPU7x")
    grid = sharding.tpu_grid(mesh_dims(data=3, fsdp=8), 3, devices[8:] + devices[:8])  # slice 0 listed last
    assert [grid[i, 0, 0, 0, 0].slice_index for i in range(3)] == [0, 1, 2]
    assert_data_spans_slices(grid, devices, 3)


def test_make_mesh_on_multislice_tpu(monkeypatch):
    """make_mesh routes a multi-slice TPU through tpu_grid (jax.devices() replaced by stand-ins)."""
    devices = fake_slices(2, (2, 2, 1), 2, "TPU7x")
    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, context=1, expert=1, tensor=4), slices=2)
    assert mesh.axis_names == sharding.MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert_data_spans_slices(mesh.devices, devices, 2)


@pytest.mark.parametrize("dims", [mesh_dims(data=1, fsdp=6), mesh_dims(data=3, fsdp=2)])
def test_data_must_be_a_multiple_of_slices(dims):
    devices = fake_slices(2, (3, 1, 1), 1, "TPU v4")  # 2 slices x 3 chips
    with pytest.raises(ValueError, match=rf"data={dims[0]} must be a multiple of slices=2"):
        sharding.tpu_grid(dims, 2, devices)


def test_slice_count_must_match_the_devices():
    one_slice = fake_slices(1, (2, 2, 4), 1, "TPU v4")  # 16 devices that all report slice_index 0
    with pytest.raises(ValueError, match=r"says 2 slice\(s\) but the devices report slice_index \[0\].*MEGASCALE"):
        sharding.tpu_grid(mesh_dims(data=2, fsdp=8), 2, one_slice)
    no_index = [dataclasses.replace(d) for d in one_slice]
    object.__setattr__(no_index[0], "slice_index", None)
    with pytest.raises(ValueError, match=r"slice_index \[0, None\]"):
        sharding.tpu_grid(mesh_dims(data=2, fsdp=8), 2, no_index)


def test_mesh_size_must_match_device_count():
    with pytest.raises(ValueError, match=r"needs 16 devices, but there are 8"):
        sharding.make_mesh(dict(data=2, fsdp=8, context=1, expert=1, tensor=1), slices=2)


def test_cpu_emulated_slices_keep_data_slowest():
    """On the CPU (8 virtual devices, no slice_index) slices > 1 builds a plain mesh, data outermost."""
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, context=1, expert=1, tensor=2), slices=2)
    assert mesh.shape == dict(data=2, fsdp=2, context=1, expert=1, tensor=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids[0].max() < ids[1].min()  # data index 0 holds the first half of jax.devices()
    with pytest.raises(ValueError, match=r"data=1 must be a multiple of slices=2"):
        sharding.make_mesh(dict(data=1, fsdp=8, context=1, expert=1, tensor=1), slices=2)


# --- joining the other processes ---------------------------------------------------------------------


def no_nodes(pattern: str) -> list[str]:
    return []


def nodes(*paths: str):
    """A stand-in for glob.glob over /dev that knows only `paths`."""
    return lambda pattern: [p for p in paths if fnmatch.fnmatch(p, pattern)]


EXPLICIT = {"TPUJOB_COORDINATOR_ADDRESS": "job-slice-0-0.job:8476", "TPUJOB_NUM_PROCESSES": "8"}


def plan(env: dict, glob=no_nodes) -> runtime.Join:
    return runtime.join_plan(runtime.read_env(env, glob=glob))


def test_explicit_coordinator_derives_process_id_from_slice_and_host():
    # What a rendered pod of slice 1, host 2 carries (MEGASCALE_* too, for a multi-slice job).
    env = {
        **EXPLICIT,
        "TPUJOB_SLICE_ID": "1",
        "TPUJOB_HOST_ID": "2",
        "TPUJOB_HOSTS_PER_SLICE": "4",
        "MEGASCALE_COORDINATOR_ADDRESS": "job-slice-0-0.job",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        "TPU_WORKER_ID": "2",
        "TPU_WORKER_HOSTNAMES": "a,b,c,d",
    }
    p = plan(env, glob=nodes("/dev/vfio/0"))
    assert p.kind == "explicit"
    assert p.kwargs == dict(coordinator_address="job-slice-0-0.job:8476", num_processes=8, process_id=6)
    assert plan({**EXPLICIT, "TPUJOB_PROCESS_ID": "3", "TPUJOB_PLATFORM": "cpu"}).kwargs["process_id"] == 3


@pytest.mark.parametrize(
    "env, message",
    [
        (EXPLICIT, "needs TPUJOB_NUM_PROCESSES and TPUJOB_PROCESS_ID"),
        ({"TPUJOB_COORDINATOR_ADDRESS": "h:1", "TPUJOB_PROCESS_ID": "0"}, "needs TPUJOB_NUM_PROCESSES"),
        ({**EXPLICIT, "TPUJOB_SLICE_ID": "1", "TPUJOB_HOST_ID": "0"}, "TPUJOB_HOSTS_PER_SLICE is not"),
        ({**EXPLICIT, "TPUJOB_PROCESS_ID": "8"}, r"process id 8 is outside 0\.\.7"),
        ({**EXPLICIT, "TPUJOB_PROCESS_ID": "x"}, r"TPUJOB_PROCESS_ID='x' is not an integer"),
    ],
)
def test_explicit_coordinator_needs_a_complete_contract(env, message):
    with pytest.raises(ValueError, match=message):
        plan(env)


@pytest.mark.parametrize(
    "env, glob, reason",
    [
        ({"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "1"}, no_nodes, "TPU_WORKER_HOSTNAMES, TPU_WORKER_ID"),
        ({"TPU_PROCESS_ADDRESSES": "h0:8471,h1:8471"}, no_nodes, "TPU_PROCESS_ADDRESSES"),
        (
            {"MEGASCALE_COORDINATOR_ADDRESS": "h0", "MEGASCALE_NUM_SLICES": "2"},
            no_nodes,
            "MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES",
        ),
        ({}, nodes("/dev/accel0", "/dev/accel1"), "/dev/accel0, /dev/accel1"),
        ({}, nodes("/dev/vfio/vfio", "/dev/vfio/3"), "/dev/vfio/3"),
        ({"TPUJOB_PLATFORM": "tpu,cpu"}, nodes("/dev/vfio/0"), "/dev/vfio/0"),
    ],
)
def test_tpu_host_is_auto_detected(env, glob, reason):
    p = plan(env, glob)
    assert (p.kind, p.kwargs, p.reason) == ("tpu-auto", {}, reason)


@pytest.mark.parametrize(
    "env, glob",
    [
        ({}, no_nodes),
        ({}, nodes("/dev/vfio/vfio")),  # the VFIO container node: any host with the vfio module
        (
            {"TPUJOB_PLATFORM": "cpu", "TPU_WORKER_HOSTNAMES": "h0,h1", "MEGASCALE_NUM_SLICES": "2"},
            nodes("/dev/accel0"),
        ),
    ],
)
def test_otherwise_a_single_process(env, glob):
    assert plan(env, glob).kind == "single"


def test_read_env_does_not_look_at_os_environ(monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1")
    monkeypatch.setenv("TPUJOB_COORDINATOR_ADDRESS", "h0:1")
    env = runtime.read_env({}, glob=no_nodes)
    assert (env.coordinator, env.tpu_signs, runtime.on_tpu_host(env)) == (None, (), False)


@pytest.fixture
def recorded(monkeypatch):
    """Replace jax.distributed.initialize and jax.config.update by recorders: start() joins nothing."""
    calls = {"initialize": [], "config": []}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls["initialize"].append(kw))
    monkeypatch.setattr(jax.config, "update", lambda name, value: calls["config"].append((name, value)))
    return calls


def test_start_records_explicit_initialize_call(recorded):
    runtime.start(
        runtime.read_env(
            {**EXPLICIT, "TPUJOB_PROCESS_ID": "5", "TPUJOB_PLATFORM": "cpu", "TPUJOB_CPU_DEVICES": "4"}, glob=no_nodes
        )
    )
    assert recorded["initialize"] == [
        dict(
            coordinator_address=EXPLICIT["TPUJOB_COORDINATOR_ADDRESS"],
            num_processes=8,
            process_id=5,
            initialization_timeout=330,
        )
    ]
    assert recorded["config"] == [("jax_platforms", "cpu"), ("jax_num_cpu_devices", 4)]


def test_start_records_argless_initialize_call_on_tpu(recorded):
    runtime.start(
        runtime.read_env(
            {"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "0", "TPUJOB_INIT_TIMEOUT_SECONDS": "60"}, glob=no_nodes
        )
    )
    # JAX's own limit comes after the trainer's watchdog (exits.deadline), which exits 42 with a message.
    assert recorded["initialize"] == [{"initialization_timeout": 90}] and recorded["config"] == []


def test_start_single_process_records_no_initialize_call(recorded):
    runtime.start(runtime.read_env({"TPUJOB_PLATFORM": "cpu"}, glob=nodes("/dev/accel0")))
    assert recorded["initialize"] == [] and recorded["config"] == [("jax_platforms", "cpu")]


def test_start_fails_before_touching_jax_on_a_bad_contract(recorded):
    with pytest.raises(ValueError, match="needs TPUJOB_NUM_PROCESSES"):
        runtime.start(runtime.read_env({**EXPLICIT, "TPUJOB_PLATFORM": "cpu"}, glob=no_nodes))
    assert recorded == {"initialize": [], "config": []}

"""The slice catalogue and the plan arithmetic: chips, hosts, devices, mesh, peak FLOP/s."""

import pytest

from tests.conftest import tiny_job
from tpu_operator.api import catalogue
from tpu_operator.api.derived import Plan
from tpu_operator.api.validation import InvalidJob, parse_job
from tpu_operator.rendering.summary import summary


@pytest.mark.parametrize(
    "generation,topology",
    [
        ("v7x", "1x1x1"),
        ("v7x", "2x2x1"),
        ("v7x", "2x2x2"),
        ("v7x", "2x2x4"),
        ("v7x", "2x4x4"),
        ("v7x", "4x4x4"),
        ("v7x", "4x4x8"),
        ("v7x", "8x8x8"),
        ("v7x", "12x16x24"),
        ("tpu7x", "4x8x12"),
        ("v6e", "2x2"),
        ("v6e", "4x4"),
        ("v6e", "16x16"),
        ("tpu-v6e-slice", "8x16"),
        ("v5p", "2x2x1"),
        ("v5p", "4x4x4"),
        ("v5p", "8x8x16"),
    ],
)
def test_valid_topologies(generation, topology):
    gen = catalogue.generation(generation)
    assert gen.topology_error(topology) is None


@pytest.mark.parametrize(
    "generation,topology,reason",
    [
        ("v7x", "3x3x3", "multiple of 4"),
        ("v7x", "8x4x4", "A <= B <= C"),
        ("v7x", "4x4", "3 dimensions"),
        ("v7x", "16x24x28", "full v7x pod"),  # 10,752 chips > 9,216
        ("v7x", "4x4x4x4", "not a topology"),
        ("v7x", "0x4x4", "not a topology"),
        ("v6e", "4x4x4", "2 dimensions"),
        ("v6e", "3x3", "not a v6e topology"),
        ("v5p", "6x6x6", "multiple of 4"),
    ],
)
def test_invalid_topologies(generation, topology, reason):
    assert reason in catalogue.generation(generation).topology_error(topology)


@pytest.mark.parametrize(
    "generation,topology,chips,hosts,devices",
    [
        ("v7x", "4x4x4", 64, 16, 128),
        ("v7x", "2x2x2", 8, 2, 16),
        ("v7x", "2x2x1", 4, 1, 8),
        ("v7x", "1x1x1", 1, 1, 2),
        ("v7x", "12x16x24", 4608, 1152, 9216),
        ("v6e", "16x16", 256, 64, 256),
        ("v5p", "4x4x4", 64, 16, 64),
    ],
)
def test_slice_arithmetic(generation, topology, chips, hosts, devices):
    sl = catalogue.Slice(catalogue.generation(generation), topology)
    assert (sl.chips, sl.hosts, sl.devices) == (chips, hosts, devices)


def test_plan_of_a_two_slice_job():
    job = parse_job(
        tiny_job(
            tpu={"generation": "tpu7x", "topology": "4x4x4", "slices": 2},
            training={"steps": 1, "globalBatch": 512, "sequenceLength": 256},
            parallelism={"fsdp": "auto", "tensor": 2},
        )
    )
    plan = Plan(job)
    assert job.spec.tpu.generation == "v7x"  # the GKE spelling is normalised
    assert (plan.total_chips, plan.total_hosts, plan.total_devices, plan.devices_per_host) == (128, 32, 256, 8)
    assert job.spec.mesh.shape == {"data": 2, "fsdp": 64, "context": 1, "expert": 1, "tensor": 2}
    # v7x: 2307 TFLOP/s bf16 per chip, two JAX devices per chip.
    assert plan.peak_flops_per_device == pytest.approx(2307e12 / 2)


def test_fp8_peak_and_moe_mesh():
    job = parse_job(
        tiny_job(
            model={"preset": "tiny-moe"},
            parallelism={"expert": 4, "fsdp": "auto"},
            training={"steps": 1, "globalBatch": 8, "sequenceLength": 128, "precision": "fp8"},
            kernels={"attention": "xla", "moeMatmul": "ragged_dot"},
        )
    )
    assert job.spec.mesh.shape == {"data": 1, "fsdp": 2, "context": 1, "expert": 4, "tensor": 1}
    assert Plan(job).peak_flops_per_device == pytest.approx(4614e12 / 2)


def test_auto_may_fill_any_axis():
    job = parse_job(
        tiny_job(
            parallelism={"fsdp": 2, "context": "auto"}, training={"steps": 1, "globalBatch": 8, "sequenceLength": 256}
        )
    )
    assert job.spec.mesh.context == 4


def test_trainer_config_carries_the_resolved_plan():
    job = parse_job(tiny_job(model={"preset": "tiny", "layers": 3}))
    cfg = Plan(job).trainer_config()
    assert cfg.model.layers == 3 and cfg.model.model_dim == 64  # explicit field overrides the preset
    assert cfg.hosts_per_slice == 1 and cfg.devices_per_host == 8 and cfg.mesh.fsdp == 8


def test_summary_names_the_plan():
    text = "\n".join(summary(Plan(parse_job(tiny_job()))))
    for part in (
        "4 chips",
        "1 hosts",
        "8 JAX devices",
        "fsdp=8",
        "--xla_tpu_scoped_vmem_limit_kib=61440",
        "all_gather",
        "tiny-slice-0-0",
    ):
        assert part in text


def test_summary_names_the_checkpoint_a_model_starts_from():
    def line(**model):
        job = tiny_job(model={"preset": "tiny", **model})
        return next(x for x in summary(Plan(parse_job(job))) if x.startswith("model:"))

    assert line().endswith("vocab 256, dense")
    init = {"format": "huggingface", "path": "gs://bucket/Meta-Llama-3.1-8B"}
    assert line(init=init).endswith("vocab 256, dense, starts from huggingface gs://bucket/Meta-Llama-3.1-8B")


def test_summary_names_the_capacity_and_the_queue():
    def line(**spec):
        return next(x for x in summary(Plan(parse_job(tiny_job(**spec)))) if x.startswith("capacity:"))

    assert line() == "capacity:   onDemand; no queue (the JobSet starts at once)"
    assert (
        line(
            tpu={
                "topology": "2x2x1",
                "capacity": "reservation",
                "reservationName": "r",
                "reservationProject": "shared-tpus",
            },
            queueName="q",
            priorityClassName="batch",
        )
        == "capacity:   reservation r of project shared-tpus; Kueue LocalQueue q, priority batch"
    )
    assert (
        line(tpu={"topology": "2x2x1", "capacity": "flexStart", "maxRunDuration": "24h"}, queueName="dws")
        == "capacity:   flexStart for at most 24h; Kueue LocalQueue dws"
    )


def test_every_generation_is_reachable_by_its_gke_spelling():
    for spelling, name in [("tpu7x", "v7x"), ("tpu-v6e-slice", "v6e"), ("tpu-v5p-slice", "v5p")]:
        assert catalogue.generation(spelling).name == name
    with pytest.raises(ValueError, match="not a supported TPU generation"):
        catalogue.generation("v4")
    with pytest.raises(InvalidJob):
        parse_job(tiny_job(tpu={"generation": "v4", "topology": "2x2x1"}))

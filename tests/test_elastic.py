"""Elastic slices, the pure parts: spec.tpu.elastic validation, the microbatch rule, and a job rendered at
each slice count it may run on (docs/elastic.md)."""

import pytest

from tests.conftest import tiny_job
from tpu_operator.api.contract import microbatches_at
from tpu_operator.api.derived import Plan
from tpu_operator.api.models import TPUTrainingJob
from tpu_operator.api.validation import InvalidJob, parse_job
from tpu_operator.rendering.manifests import render


def _job(slices=2, elastic=None, batch=16, micro=1, **tpu):
    return tiny_job(
        tpu={
            "generation": "v7x",
            "topology": "2x2x1",
            "slices": slices,
            **({"elastic": elastic} if elastic is not None else {}),
            **tpu,
        },
        training={"steps": 10, "globalBatch": batch, "sequenceLength": 128, "microbatches": micro},
    )


def _problems(doc):
    try:
        parse_job(doc)
    except InvalidJob as exc:
        return [tuple(line.split(": ", 1)) for line in exc.problems]
    return []


@pytest.mark.parametrize(
    "elastic, path, reason",
    [
        ({"minSlices": 3}, "spec.tpu.elastic.minSlices", "3 is more than slices (2)"),
        ({"minSlices": 0}, "spec.tpu.elastic.minSlices", "greater than or equal to 1"),
        ({}, "spec.tpu.elastic.minSlices", "Field required"),
        ({"minSlices": 1, "growback": True}, "spec.tpu.elastic.growback", "unknown field"),
    ],
)
def test_bad_elastic_settings_name_the_field(elastic, path, reason):
    problems = _problems(_job(elastic=elastic))
    assert any(p == path and reason in r for p, r in problems), problems


def test_a_slice_count_that_cannot_split_the_batch_is_refused_naming_min_slices():
    # 3 slices of 8 devices: 24 rows split 3 ways, but not over 2 x 8 = 16 shards.
    problems = _problems(_job(slices=3, elastic={"minSlices": 1}, batch=24))
    assert problems == [
        (
            "spec.tpu.elastic.minSlices",
            "on 2 slice(s) the global batch 24 does not split over 2 x fsdp x expert = 16 shards; "
            "raise minSlices above 2 or make globalBatch a multiple of it",
        )
    ], problems
    assert _problems(_job(slices=3, elastic={"minSlices": 3}, batch=24)) == []


@pytest.mark.parametrize(
    "batch, micro, slices, running, shards, expected",
    [
        (16, 1, 2, 2, 8, 1),  # all slices: as written
        (16, 1, 2, 1, 8, 2),  # half the slices: twice the microbatches, the same rows per device at a time
        (48, 1, 3, 2, 8, 3),  # 1 x 3/2 rounds up to 2, which does not split 48 over 16 shards: 3
        (64, 2, 4, 1, 8, 8),
        (24, 1, 3, 2, 8, None),  # 24 rows over 16 shards: no count does
    ],
)
def test_microbatches_keep_the_global_batch_and_no_more_rows_per_device(
    batch, micro, slices, running, shards, expected
):
    got = microbatches_at(batch, micro, slices, running, shards)
    assert got == expected
    if got is not None:
        assert batch % (running * shards * got) == 0
        assert batch // (running * shards * got) <= batch // (slices * shards * micro)


def test_a_job_renders_at_each_slice_count_with_the_same_config_map():
    job = TPUTrainingJob.model_validate(_job(slices=2, elastic={"minSlices": 1, "growBack": True}, batch=32, micro=2))
    whole_cm, whole = render(job)
    cm, shrunk = render(job, running=1)
    assert cm == whole_cm  # one ConfigMap for every count: the trainer scales it ($TPUJOB_SLICES)

    def env(js):
        rj = js["spec"]["replicatedJobs"][0]
        c = rj["template"]["spec"]["template"]["spec"]["containers"][0]
        return rj["replicas"], {e["name"]: e.get("value") for e in c["env"]}

    replicas, e = env(whole)
    assert replicas == 2 and e["TPUJOB_SLICES"] == "2" and e["TPUJOB_NUM_PROCESSES"] == "2"
    assert e["MEGASCALE_NUM_SLICES"] == "2"
    replicas, e = env(shrunk)
    assert replicas == 1 and e["TPUJOB_SLICES"] == "1" and e["TPUJOB_NUM_PROCESSES"] == "1"
    assert "MEGASCALE_NUM_SLICES" not in e and "MEGASCALE_COORDINATOR_ADDRESS" not in e  # one slice: no DCN

    full, one = Plan(job).running_config(), Plan(job, 1).running_config()
    assert (full.mesh.data, full.training.microbatches) == (2, 2)
    assert (one.slices, one.mesh.data, one.training.microbatches) == (1, 1, 4)
    assert one.training.global_batch == full.training.global_batch
    assert one.mesh.model_copy(update={"data": 2}) == full.mesh  # only the data degree changes
    with pytest.raises(ValueError, match="slices: 3 is not a slice count"):
        Plan(job, 3)


def test_a_job_without_elastic_renders_as_before():
    job = TPUTrainingJob.model_validate(_job(slices=2))
    assert list(job.spec.tpu.slice_counts) == [2]
    rj = render(job)[1]["spec"]["replicatedJobs"][0]
    names = {e["name"] for e in rj["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "TPUJOB_SLICES" not in names
    with pytest.raises(ValueError):
        Plan(job, 1)

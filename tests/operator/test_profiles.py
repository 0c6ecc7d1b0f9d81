"""Profiles on demand, the operator's part: the annotation `training.tpu-operator.dev/profile` goes to the
trainer's `POST /profile` once, and the job's status.profile follows the trainer's answer to the trace's path
(controller/profiles.py). The API is the in-memory one of tests/fakes.py; the trainer's end is real HTTP:
a process standing in for the trainer, running the trainer's own server and Profiler (standin_trainer.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import operator_job
from tests.fakes import NOW, FakeKube, jobset
from tpu_operator.api import names
from tpu_operator.api.status import TPUTrainingJobStatus
from tpu_operator.controller import reconcile
from tpu_operator.controller.kube import JOBS, JOBSETS, PODS
from tpu_operator.controller.metrics_reader import MetricsReader
from tpu_operator.controller.reconcile import OperatorConfig
from tpu_operator.local.pods import free_port

STANDIN = Path(__file__).with_name("standin_trainer.py")


def _job(kube: FakeKube, annotation: str | None, port: int = 9431) -> dict:
    doc = operator_job(training={"steps": 10, "globalBatch": 16, "sequenceLength": 128}, runtime={"metricsPort": port})
    if annotation is not None:
        doc["metadata"]["annotations"] = {names.PROFILE_ANNOTATION: annotation}
    return kube.add_job(doc)


def _running(kube: FakeKube, ip: str = "127.0.0.1") -> None:
    """The JobSet runs and its pod 0 (process 0) is at `ip`."""
    kube.objects[JOBSETS.path("default", "tiny")]["status"] = jobset(active=1, ready=1)["status"]
    labels = {
        "jobset.sigs.k8s.io/jobset-name": "tiny",
        "jobset.sigs.k8s.io/job-index": "0",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    kube.objects[PODS.path("default", "tiny-slice-0-0-x")] = {
        "metadata": {"name": "tiny-slice-0-0-x", "creationTimestamp": "2026-01-01T00:00:00Z", "labels": labels},
        "status": {"phase": "Running", "podIP": ip},
    }


def _reconcile(kube: FakeKube, reader: MetricsReader, read: bool = True) -> list:
    """One reconcile of the job as the manager runs it after a metrics read (`read`: the trainer's /status
    read first, as the manager's ticker does); the Events it posted."""
    notices = []
    means = reconcile.Means(
        kube, OperatorConfig(metrics_access="direct"), lambda o, n: notices.append(n), reader, clock=lambda: NOW
    )

    async def one():
        sample = await reader.read("default", "tiny", _port(kube)) if read else None
        return await reconcile.reconcile(means, kube.job(), reconcile.Seen(kube.jobset(), sample))

    asyncio.run(one())
    return notices


def _port(kube: FakeKube) -> int:
    return kube.job()["spec"]["runtime"]["metricsPort"]


def _profile(kube: FakeKube):
    return TPUTrainingJobStatus.model_validate(kube.objects[JOBS.path("default", "tiny")]["status"]).profile


@pytest.fixture
def standin(tmp_path):
    """A stand-in trainer process (the trainer's HTTP server and Profiler, no model); its port and GO file."""
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, str(STANDIN), str(tmp_path / "tensorboard"), str(go), "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read()
        yield int(line), go, tmp_path / "tensorboard"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _status_of_trainer(port: int) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        return json.loads(response.read())


def test_annotation_is_sent_once_and_status_profile_ends_with_the_trace_path(standin):
    port, go, logdir = standin
    kube = FakeKube()
    _job(kube, "steps:3-4", port)
    _reconcile(kube, MetricsReader(kube, "direct"), read=False)  # creates the JobSet: Pending, nothing sent
    assert _profile(kube) is None and _status_of_trainer(port).get("profile_posts") is None
    _running(kube)
    _reconcile(kube, MetricsReader(kube, "direct"), read=False)  # Running now
    notices = _reconcile(kube, MetricsReader(kube, "direct"))  # sent
    profile = _profile(kube)
    assert (profile.request, profile.steps, profile.state, profile.path) == ("steps:3-4", "3-4", "pending", None)
    assert notices == [] and _status_of_trainer(port)["profile_posts"] == 1
    # Idempotent: the same annotation again, and again from an operator restarted (a new reader, the status as
    # written): nothing is sent, nothing written.
    rv = kube.job()["metadata"]["resourceVersion"]
    _reconcile(kube, MetricsReader(kube, "direct"))
    _reconcile(kube, MetricsReader(kube, "direct"))
    assert _status_of_trainer(port)["profile_posts"] == 1 and kube.job()["metadata"]["resourceVersion"] == rv
    # The trainer reaches the steps; the next read brings the path.
    go.write_text("go")
    deadline = time.monotonic() + 120
    while _status_of_trainer(port)["profile"]["state"] != "done":
        assert time.monotonic() < deadline, _status_of_trainer(port)
        time.sleep(0.1)
    notices = _reconcile(kube, MetricsReader(kube, "direct"))
    profile = _profile(kube)
    traces = list((logdir / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert profile.state == "done" and traces and profile.path == str(traces[0])
    assert [(n.type, n.reason) for n in notices] == [("Normal", "Profiled")] and profile.path in notices[0].message
    assert _status_of_trainer(port)["profile_posts"] == 1
    # A new request for steps the trainer has run: refused by the trainer, with its reason, once.
    kube.objects[JOBS.path("default", "tiny")]["metadata"]["annotations"][names.PROFILE_ANNOTATION] = "steps:1-2"
    notices = _reconcile(kube, MetricsReader(kube, "direct"))
    profile = _profile(kube)
    assert profile.request == "steps:1-2" and profile.state == "failed" and "have already run" in profile.message
    assert [(n.type, n.reason) for n in notices] == [("Warning", "ProfileRefused")]
    assert _reconcile(kube, MetricsReader(kube, "direct")) == [] and _status_of_trainer(port)["profile_posts"] == 2


@pytest.mark.parametrize(
    "value, reason",
    [
        ("100-105", "does not start with 'steps:'"),
        ("steps:5-2", "the first step (5) is after the last (2)"),
        ("steps:9-11", "the job has 10 steps"),
    ],
)
def test_a_bad_annotation_is_refused_naming_it_without_a_request(value, reason):
    kube = FakeKube()
    _job(kube, value, port=free_port())  # nothing listens there: a request would fail, not be refused
    notices = _reconcile(kube, MetricsReader(kube, "direct"), read=False)  # refused at once, in any phase
    profile = _profile(kube)
    assert profile.state == "failed" and profile.message.startswith(f"annotation {names.PROFILE_ANNOTATION}: ")
    assert reason in profile.message
    assert [(n.type, n.reason) for n in notices if n.reason.startswith("Profile")] == [("Warning", "ProfileRefused")]
    _running(kube)
    assert _reconcile(kube, MetricsReader(kube, "direct"), read=False) == []  # said once, never sent


def test_an_unreachable_trainer_records_nothing_and_is_asked_again():
    kube = FakeKube()
    _job(kube, "steps:3-4", port=free_port())  # nothing listens there
    _reconcile(kube, MetricsReader(kube, "direct", timeout_s=2), read=False)
    _running(kube)
    _reconcile(kube, MetricsReader(kube, "direct", timeout_s=2), read=False)
    assert _profile(kube) is None  # not sent: the next reconcile tries again

"""Profiles on demand: a trace of the steps asked for lands where TensorBoard's profile plugin looks, and
/status says where (workload/performance/profiling.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import trainer_config

from tpu_workload.loop import train
from tpu_workload.performance import profiling
from tpu_workload.process import metrics

MESH = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)


def _train_step_runs(trace_dir: Path) -> int:
    """How many times the jitted train step ran inside the trace (the Chrome trace the profiler writes beside
    the .xplane.pb: one `Execute (jit_train_step)` event per step on the host)."""
    with gzip.open(next(trace_dir.glob("*.trace.json.gz"))) as f:
        events = json.load(f)["traceEvents"]
    return sum(e.get("name") == "CommonPjRtLoadedExecutable::Execute (jit_train_step)" for e in events)


def test_config_profile_traces_those_steps_into_the_tensorboard_dir(tmp_path, capsys):
    cfg = trainer_config("tiny", mesh=MESH, steps=5, checkpoint=str(tmp_path / "ckpt")).model_copy(
        update={"profile_steps": "2-3"}
    )
    status = metrics.Status(cfg.training.steps, 1)
    logdir = train.tensorboard_dir(cfg, None)
    profiler = profiling.for_config(cfg, logdir, status)
    assert status.snapshot()["profile"]["state"] == "pending"
    try:
        train.run(cfg, peak_flops_per_device=5e10, status=status, extra_hooks=profiler.hooks)
    finally:
        profiler.close(status.snapshot()["step"])
    traces = sorted((tmp_path / "ckpt" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert _train_step_runs(traces[0].parent) == 2  # steps 2 and 3, nothing of 1, 4 or 5
    report = status.snapshot()["profile"]
    assert report == {
        "requested": "2-3",
        "steps": "2-3",
        "state": "done",
        "directory": logdir,
        "path": str(traces[0]),
        "message": "",
    }


@pytest.fixture
def profiler():
    return profiling.Profiler(total_steps=100, logdir="/tmp/unused")


class _Run:  # only what Profiler.hooks reads of a hooks.Run
    def __init__(self, start):
        self.start = start


@pytest.mark.parametrize(
    "steps,reason",
    [
        ("5-2", "the first step (5) is after the last (2)"),
        ("0-3", "steps count from 1"),
        ("90-101", "the job has 100 steps"),
        ("a-b", "is not a step range"),
        (7, "is not a step range"),
        ("1-51", "a trace may hold at most 50 steps"),
        ("1-" + "9" * 5000, "is not a step range"),
        ("x" * 4000, "is not a step range"),
    ],
)
def test_bad_ranges_are_refused_with_the_reason(profiler, steps, reason):
    code, answer = profiler.answer(json.dumps({"steps": steps}).encode())
    assert code == 400 and reason in answer["error"] and answer["state"] == "failed"
    assert len(answer["error"]) < 200  # the request is anyone's: little of it is echoed
    assert profiler.report() is None  # a refused request changes nothing


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"{}"])
def test_malformed_bodies_are_refused(profiler, body):
    code, answer = profiler.answer(body)
    assert code == 400 and "steps" in answer["error"]


def test_a_range_already_reached_is_moved_on_or_refused(profiler):
    profiler.hooks(_Run(start=0))
    profiler.on_state(1, {})
    profiler.on_state(10, {})  # the loop dispatched step 10: step 11's trace would have started already
    code, answer = profiler.answer(b'{"steps": "5-20"}')
    assert code == 200 and answer["steps"] == "12-20" and answer["state"] == "pending"
    assert answer["message"] == "steps 5-11 had already run"
    assert profiler.answer(b'{"steps": "5-20"}') == (code, answer)  # the same request: the same answer
    code, answer = profiler.answer(b'{"steps": "3-11"}')
    assert code == 400 and "already run" in answer["error"] and "earliest step it can trace is 12" in answer["error"]
    code, answer = profiler.answer(b'{"steps": "30-31"}')  # replaces the pending one
    assert code == 200 and profiler.report().requested == "30-31"


def test_a_range_before_the_resumed_step_is_refitted(profiler):
    assert profiler.request("5-20")[0] == 200
    profiler.hooks(_Run(start=8))  # the run resumed from a checkpoint at step 8
    assert profiler.report().steps == "9-20" and "resumed after step 8" in profiler.report().message
    profiler.close(8)  # its trace started (step 9 is next): stop it, or the next trace in this process fails
    other = profiling.Profiler(total_steps=100, logdir="/tmp/unused")
    other.request("2-3")
    other.hooks(_Run(start=8))
    assert other.report().state == "failed" and "already run" in other.report().message


def test_a_trace_of_slow_steps_stops_at_its_time_cap(tmp_path):
    # The clock is the profiler's own (injected): what is tested is the cap, not the time anything takes.
    now = [0.0]
    profiler = profiling.Profiler(total_steps=100, logdir=str(tmp_path), clock=lambda: now[0])
    assert profiler.request("1-40")[0] == 200
    profiler.hooks(_Run(start=0))  # step 1 is next: the trace starts now
    assert profiler.report().state == "capturing"
    profiler.on_state(1, {})
    now[0] += profiling.MAX_TRACE_SECONDS + 1
    profiler.on_state(2, {})
    report = profiler.report()
    assert report.state == "done" and report.steps == "1-2" and report.path
    assert f"at most {profiling.MAX_TRACE_SECONDS} s" in report.message
    profiler.on_state(3, {})
    assert profiler.report() == report  # nothing more is traced


def test_no_directory_no_trace():
    code, report = profiling.Profiler(total_steps=10, logdir=None).request("2-3")
    assert code == 400 and "spec.checkpoint.directory" in report.message


TOKEN = "the-jobs-control-token"  # what the operator derives (controller/control.py); the pod holds its SHA-256


def _post(url: str, body: bytes, token: str = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "X-Tpujob-Control-Token": token}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.e2e  # a trainer process
def test_post_profile_to_a_running_trainer(trainers, tmp_path):
    cfg = trainer_config("tiny", mesh=MESH, steps=30, checkpoint=str(tmp_path / "ckpt"))
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    proc = trainers.start(cfg, TPUJOB_METRICS_PORT=0, TPUJOB_LINGER_SECONDS=30, TPUJOB_CONTROL_TOKEN_SHA256=digest)[0]
    port = None
    for _ in range(600):  # the server is up before the first step compiles; its port is in its log
        text = Path(proc.stderr_path).read_text()
        found = re.search(r"metrics: serving /status and /metrics on port (\d+)", text)
        if found:
            port = int(found.group(1))
            break
        assert proc.poll() is None, trainers.stderr(proc)
        time.sleep(0.1)
    assert port, trainers.stderr(proc)
    base = f"http://127.0.0.1:{port}"
    assert _post(f"{base}/profile", b'{"steps": "20-21"}', token="guess")[0] == 401
    code, answer = _post(f"{base}/profile", b'{"steps": "25-40"}')
    assert code == 400 and "the job has 30 steps" in answer["error"]
    code, answer = _post(f"{base}/profile", b'{"steps": "20-21"}')
    assert code == 200 and answer["steps"] == "20-21" and answer["state"] == "pending", answer
    assert _get(f"{base}/status")["profile"]["requested"] == "20-21"
    while (line := trainers.read_line(proc, timeout=180)) is not None and not line.get("summary"):
        pass
    report = _get(f"{base}/status")["profile"]  # the trainer lingers, serving its last status
    assert report["state"] == "done", report
    assert Path(report["path"]).is_file() and report["path"].endswith(".xplane.pb")
    assert Path(report["path"]).parent.parent == tmp_path / "ckpt" / "tensorboard" / "plugins" / "profile"
    assert _train_step_runs(Path(report["path"]).parent) == 2
    assert _post(f"{base}/profile", b'{"steps": "20-21"}') == (200, report)  # asked again: the same answer

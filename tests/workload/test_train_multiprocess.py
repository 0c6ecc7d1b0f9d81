"""Two processes x 4 CPU devices train tiny dense and tiny MoE models; the loss falls.
The metrics endpoint serves what stdout says."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from conftest import trainer_config

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out


def _falls(lines):
    steps = [r for r in lines if not r.get("summary")]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    for r in steps:
        assert set(r) >= {"step", "loss", "step_time_s", "global_tokens_per_s", "mfu", "last_checkpoint_step"}
    summary = lines[-1]
    assert summary["summary"] is True and summary["step"] == len(steps)
    first, last = steps[0]["loss"], min(r["loss"] for r in steps[-3:])
    assert last < first - 0.5, [r["loss"] for r in steps]
    return steps, summary


def test_dense_fsdp_context_tensor_two_processes(trainers):
    cfg = trainer_config("tiny", mesh=dict(data=1, fsdp=2, context=2, expert=1, tensor=2), steps=8)
    _falls(trainers.run(cfg, processes=2, devices=4))


@pytest.mark.long  # the MoE twin of the dense two-process run (about 1 minute)
def test_moe_fsdp_context_expert_two_processes(trainers):
    cfg = trainer_config("tiny-moe", mesh=dict(data=1, fsdp=2, context=2, expert=2, tensor=1), steps=8)
    _falls(trainers.run(cfg, processes=2, devices=4))


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_metrics_endpoint_serves_what_stdout_says(trainers):
    cfg = trainer_config("tiny", mesh=dict(data=1, fsdp=2, context=2, expert=1, tensor=2), steps=8)
    # Port 0: the trainer binds a free port itself and logs it (no race with other listeners).
    procs = trainers.start(cfg, processes=1, devices=8, TPUJOB_METRICS_PORT=0, TPUJOB_LINGER_SECONDS=20)
    lines = []
    while True:
        line = trainers.read_line(procs[0], timeout=180)
        assert line is not None, trainers.stderr(procs[0])
        lines.append(line)
        if line.get("summary"):
            break
    steps, summary = _falls(lines)
    # The port from the metrics server's own log line, not any "on port N" another library may log.
    with open(procs[0].stderr_path) as f:  # the whole log: `trainers.stderr` is only its tail
        logged = re.search(r"metrics: serving /status and /metrics on port (\d+)", f.read())
    assert logged, trainers.stderr(procs[0])
    port = int(logged.group(1))
    # The metrics endpoint serves what stdout says (process 0 lingers after completion).
    assert procs[0].poll() is None, f"the trainer did not linger (exit {procs[0].returncode})"
    status = json.loads(_get(f"http://127.0.0.1:{port}/status"))
    assert status["state"] == "completed" and status["total_steps"] == 8 and status["process_count"] == 1
    for key in ("step", "loss", "step_time_s", "global_tokens_per_s", "mfu", "last_checkpoint_step"):
        assert status[key] == summary[key], key
    text = _get(f"http://127.0.0.1:{port}/metrics").decode()
    values = dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["tpujob_step"]) == 8
    assert float(values["tpujob_loss"]) == summary["loss"]
    assert float(values["tpujob_mfu"]) == summary["mfu"]
    assert "tpujob_last_checkpoint_step" not in values  # no checkpoints: no sample

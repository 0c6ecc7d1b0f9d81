"""`tpujob run --local` of an elastic two-slice job with the real trainer, each slice its own process: one
slice's process is killed, the run goes on on one slice from the last checkpoint (the same global batch in
twice the microbatches), grows back to two slices after its next checkpoint, and every step's loss is that
of an uninterrupted run within bf16 rounding (docs/elastic.md)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.conftest import local_trainer_pid, tiny_job

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out
STEPS = 14


def _doc(elastic: bool):
    return tiny_job(
        tpu={
            "generation": "v7x",
            "topology": "2x2x1",
            "slices": 2,
            **({"elastic": {"minSlices": 1, "growBack": True}} if elastic else {}),
        },
        training={
            "steps": STEPS,
            "globalBatch": 16,
            "sequenceLength": 128,
            "learningRate": {"peak": 1e-2, "warmupSteps": 1, "schedule": "constant"},
        },
        checkpoint={"directory": "/checkpoints/elastic", "interval": 4, "keep": 2},
        failurePolicy={"maxRestarts": 2, "backoffSeconds": 0.5},
    )


def _start(tmp_path, name, doc):
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / name
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "run",
            "--local",
            "-f",
            str(tmp_path / f"{name}.yaml"),
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, run_dir


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long  # the elastic shrink and grow-back end to end (about 2 minutes)
def test_a_lost_slice_shrinks_the_run_which_grows_back_on_the_same_loss_curve(tmp_path):
    base, base_dir = _start(tmp_path, "whole", _doc(elastic=False))
    out = base.communicate(timeout=600)[0]
    assert base.returncode == 0, out
    expected = {r["step"]: r["loss"] for r in _records(base_dir)}
    assert sorted(expected) == list(range(1, STEPS + 1))

    proc, run_dir = _start(tmp_path, "elastic", _doc(elastic=True))
    lines, killed = [], False
    try:
        for line in proc.stdout:  # a line per step: "step 6/14  loss ...  ckpt 4"
            lines.append(line)
            words = line.split()
            step = int(words[1].split("/")[0]) if words[:1] == ["step"] and "/" in words[1] else None
            if not killed and step is not None and step >= 5 and words[-1] not in ("-", "0"):
                os.kill(local_trainer_pid(run_dir, "TPUJOB_SLICE_ID", 1), signal.SIGKILL)  # slice 1's host lost
                killed = True
        assert proc.wait(timeout=600) == 0, "".join(lines)
    finally:
        proc.kill()
    text = "".join(lines)
    assert "tiny-slice-1-0 exited with code 137" in text, text
    assert "resized (SliceLost): slice 1 was lost: training goes on on 1 of 2 slices" in text, text
    assert "resized (GrewBack): back on all 2 slices (from 1) after a checkpoint" in text, text

    records = _records(run_dir)
    attempts: dict[float, list[dict]] = {}
    for r in records:
        attempts.setdefault(r["progress"]["started_at"], []).append(r)
    two, one, again = attempts.values()
    # One slice resumed from the last checkpoint of two; two resumed exactly where one was stopped (SIGTERM
    # saves the step in flight), after one had written a checkpoint of its own.
    assert one[0]["progress"]["start_step"] % 4 == 0 and one[0]["progress"]["start_step"] >= 4
    assert any(r["last_checkpoint_step"] > one[0]["progress"]["start_step"] for r in one)
    assert (
        again[0]["progress"]["start_step"] == one[-1]["step"] + 1
        or again[0]["progress"]["start_step"] == one[-1]["step"]
    ), (one[-1], again[0])
    assert again[-1]["step"] == STEPS
    # The same global batch on one slice: the loss stays on the uninterrupted curve, step by step.
    got = [(r["step"], r["loss"]) for r in records]
    np.testing.assert_allclose([loss for _, loss in got], [expected[s] for s, _ in got], rtol=2e-3)
    worst = max(abs(loss - expected[s]) / expected[s] for s, loss in got)
    status = yaml.safe_load((run_dir / "status.yaml").read_text())["status"]
    assert status["phase"] == "Succeeded" and status["step"] == STEPS
    # Back on both slices; `replaces` is the operator's record of the smaller JobSet the grow-back replaced.
    slices = status["slices"]
    assert {k: v for k, v in slices.items() if k != "replaces"} == {"desired": 2, "running": 2, "shown": "2/2"}
    assert slices["replaces"], slices
    assert status["restarts"]["failure"] == 1 and status["restarts"]["total"] == 1  # the grow-back is no restart
    # The gap before the run on one slice is shrinking, the grow-back's gap growing; neither is restarting.
    assert status["badput"]["shrinking"] > 0 and status["badput"]["growing"] > 0, status["badput"]
    assert status["badput"]["restarting"] == 0, status["badput"]
    history = json.loads((run_dir / "slices.json").read_text())["history"]
    assert [n for _, n in history] == [2, 1, 2]
    print(
        f"worst relative loss difference {worst:.2e} over {len(got)} reported steps; "
        f"one slice ran steps {one[0]['step']}-{one[-1]['step']}; badput {status['badput']}"
    )

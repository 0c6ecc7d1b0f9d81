"""The trainer's exit-code contract, black-box on real trainer processes: each exit class and the
termination record that says why, and SIGTERM to one host: the step in flight is checkpointed on
every host, they exit 143, and the resumed run reproduces the uninterrupted losses exactly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import trainer_config

from tpu_operator.api.lifecycle import TerminationRecord
from tpu_operator.local.pods import free_port

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out

MESH4 = dict(data=1, fsdp=2, context=1, expert=1, tensor=2)


def _record(proc) -> TerminationRecord:
    with open(proc.termination_path) as f:
        return TerminationRecord.parse(f.read())


def _losses(lines):
    return {r["step"]: r["loss"] for r in lines if not r.get("summary")}


def test_a_bad_config_is_a_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"name": "x", "training": {"steps": 0}}))
    term = tmp_path / "termination"
    result = subprocess.run(
        [sys.executable, "-m", "tpu_workload", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"TPUJOB_TERMINATION_LOG": str(term), "PATH": ""},
    )
    assert result.returncode == 3, result.stderr[-2000:]
    record = TerminationRecord.parse(term.read_text())
    assert record.code == 3 and record.error.startswith("ValidationError: ") and "TrainerConfig" in record.error


def test_a_coordinator_that_never_answers_is_retryable(trainers):
    cfg = trainer_config("tiny", mesh=MESH4, steps=2)
    # Process 1 of 2, pointed at a coordinator nobody runs: start-up times out.
    (proc,) = trainers.start(
        cfg,
        processes=1,
        devices=4,
        TPUJOB_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        TPUJOB_NUM_PROCESSES=2,
        TPUJOB_PROCESS_ID=1,
        TPUJOB_INIT_TIMEOUT_SECONDS=3,
    )
    assert proc.wait(timeout=180) == 42, trainers.stderr(proc)
    record = _record(proc)
    assert record.code == 42 and record.error == (
        "Retryable: joining the other processes (jax.distributed start-up) did not complete within 3 s"
    ), record


def test_an_injected_user_error_exits_3_with_its_line(trainers, tmp_path):
    cfg = trainer_config("tiny", mesh=MESH4, steps=6, checkpoint=str(tmp_path / "ckpt"))
    (proc,) = trainers.start(cfg, devices=4, TPUJOB_TEST_FAIL_AT_STEP="2:3")
    assert proc.wait(timeout=240) == 3, trainers.stderr(proc)
    record = _record(proc)
    assert record.error == "UserError: injected fault (TPUJOB_TEST_FAIL_AT_STEP) at step 2"
    assert record.progress.step == 2 and record.progress.start_step == 0 and record.progress.first_step_at
    # What /status served last goes with it: the operator's final status shows the last step's loss.
    assert record.last["step"] == 2 and record.last["loss"] > 0 and record.last["step_time_s"] > 0
    assert "training failed (exit 3): UserError: injected fault" in trainers.stderr(proc)


@pytest.mark.long  # a SIGTERM, a checkpoint and a resume (about 1.5 minutes)
def test_sigterm_to_one_host_checkpoints_the_step_in_flight_and_resume_is_exact(trainers, tmp_path):
    whole = trainer_config("tiny", mesh=MESH4, steps=10, checkpoint=str(tmp_path / "a"), interval=100)
    expected = _losses(trainers.run(whole, processes=2, devices=2))

    cfg = trainer_config("tiny", mesh=MESH4, steps=10, checkpoint=str(tmp_path / "b"), interval=100)
    procs = trainers.start(cfg, processes=2, devices=2)
    while (line := trainers.read_line(procs[0])) is not None and line["step"] < 3:
        assert line["loss"] == expected[line["step"]]
    procs[1].send_signal(signal.SIGTERM)  # one host only, as node maintenance would
    assert [p.wait(timeout=120) for p in procs] == [143, 143], trainers.stderr(procs[0])
    records = [_record(p) for p in procs]
    stopped = records[0].progress.last_checkpoint_step
    assert {r.progress.last_checkpoint_step for r in records} == {stopped} and 3 < stopped < 10, records
    assert records[1].error == f"stopped by SIGTERM at step {stopped} after a checkpoint at step {stopped}"
    assert sorted(int(p.name) for p in (tmp_path / "b").iterdir() if p.name.isdigit()) == [stopped]

    got = _losses(trainers.run(cfg, processes=2, devices=2))
    assert min(got) == stopped + 1 and got == {s: expected[s] for s in got}  # exact, from that step on

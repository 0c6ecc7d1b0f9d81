"""`tpujob run --local` with the real trainer, one host killed mid-run and later one sent SIGTERM:
the slice restarts after the kill, resuming from its last checkpoint, and after the SIGTERM,
resuming at exactly the step that was in flight (a preemption, not charged against maxRestarts 1);
the run's goodput accounts for the time: the steps redone are `lost` (within a step of
steps-since-the-checkpoint x step time) and the buckets add up to the wall time within 5 %."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.conftest import EXAMPLES, local_trainer_pid

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out
NOTICED_S = 0.1  # how late the operator may notice a dead process: the kubelet's report, JobSet's status, a reconcile
ROUNDED_S = 0.05  # the operator writes badput to 0.1 s (controller/accounting.py)


@pytest.mark.long  # two restarts of a local run (about 1.5 minutes)
def test_killed_host_then_sigterm_restart_resume_and_goodput_accounts_for_the_time(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = 18
    doc["spec"]["checkpoint"].update(interval=4, keep=2)
    doc["spec"]["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 0.5}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "run",
            "--local",
            "-f",
            str(tmp_path / "job.yaml"),
            "--run-dir",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, stage = [], "kill"
    try:
        for line in proc.stdout:  # a line per step: "step 6/18  loss ...  ckpt 4"
            out.append(line)
            words = line.split()
            step = int(words[1].split("/")[0]) if words[:1] == ["step"] and "/" in words[1] else None
            if stage == "kill" and step is not None and step >= 6 and words[-1] not in ("-", "0"):
                os.kill(local_trainer_pid(run_dir, "TPUJOB_HOST_ID", 1), signal.SIGKILL)  # a node lost
                stage = "restarted"
            elif stage == "restarted" and line.startswith("restarted 2 process(es)"):
                stage = "sigterm"
            elif stage == "sigterm" and step is not None and step >= 11:
                os.kill(local_trainer_pid(run_dir, "TPUJOB_HOST_ID", 0), signal.SIGTERM)  # maintenance on one host
                break
        out += proc.stdout.readlines()
        assert proc.wait(timeout=400) == 0, "".join(out)
    finally:
        proc.kill()
    text = "".join(out)
    assert "quickstart-slice-0-1 exited with code 137" in text and "restart 1 (failure) in 0.5 s" in text, text
    assert "exited with code 143 (stopped by SIGTERM)" in text and "restart 2 (preemption)" in text, text
    status = yaml.safe_load((run_dir / "status.yaml").read_text())["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 18
    assert status["restarts"] == {"failure": 1, "preemption": 1, "hang": 0, "hardware": 0, "total": 2}

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    attempts: dict[float, list[dict]] = {}
    for r in records:
        attempts.setdefault(r["progress"]["started_at"], []).append(r["progress"])
    killed, stopped, last = attempts.values()
    # SIGTERM: the step in flight was saved, and the next attempt starts there. The save reads that step's
    # metrics first (no state after a non-finite step is saved: divergence.py), so it is the last one reported.
    assert last[0]["start_step"] == stopped[-1]["step"], (stopped[-1], last[0])
    step_s = killed[-1]["step_seconds"] / killed[-1]["steps_timed"]
    redone = killed[-1]["step"] - stopped[0]["start_step"]
    assert redone >= 1 and stopped[0]["start_step"] % 4 == 0, (killed[-1], stopped[0])
    badput, goodput = status["badput"], status["goodput"]
    # Lost: the steps redone after the kill, and the part of a step in flight when the host died (noticed
    # within NOTICED_S); the SIGTERM lost nothing.
    lost = badput["lost"]
    assert redone * step_s <= lost + ROUNDED_S <= (redone + 1) * step_s + NOTICED_S + 2 * ROUNDED_S, (
        badput,
        redone,
        step_s,
    )
    wall = sum(badput.values()) / (1 - goodput)
    assert badput["other"] <= 0.05 * wall, (status, wall)  # the named buckets and goodput explain 95 %
    assert badput["restarting"] >= 1.0 and badput["startup"] > 0 and 0 < goodput < 1
    assert f"goodput {100 * goodput:.1f}% of the wall time" in text
    print(f"goodput {goodput:.3f} of {wall:.1f} s; badput {badput}; {redone} steps redone at {step_s:.3f} s")

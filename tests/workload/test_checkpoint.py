"""Checkpoint -> kill -> resume reproduces the uninterrupted losses; half-written saves are ignored."""

from __future__ import annotations

import shutil

import pytest
from conftest import trainer_config

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out

MESH4 = dict(data=1, fsdp=2, context=1, expert=1, tensor=2)


def _losses(lines):
    return {r["step"]: r["loss"] for r in lines if not r.get("summary")}


@pytest.mark.long  # a SIGKILL and an exact resume (about 1 minute)
def test_kill_mid_run_then_resume_reproduces_losses(trainers, tmp_path):
    whole = trainer_config("tiny", mesh=MESH4, steps=10, checkpoint=str(tmp_path / "a"), interval=3)
    expected = _losses(trainers.run(whole, devices=4))

    ckpt = tmp_path / "b"
    cfg = trainer_config("tiny", mesh=MESH4, steps=10, checkpoint=str(ckpt), interval=3)
    proc = trainers.start(cfg, devices=4)[0]
    while True:  # kill as soon as a checkpoint is complete
        line = trainers.read_line(proc, timeout=120)
        assert line is not None and not line.get("summary"), "finished before it could be killed"
        assert line["loss"] == expected[line["step"]]
        if line["last_checkpoint_step"]:
            break
    proc.kill()
    assert proc.wait(timeout=30) != 0
    # A save killed half-way: orbax's temporary directory, never renamed. Resume must skip it.
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    half = ckpt / f"{complete[-1] + 3}.orbax-checkpoint-tmp-1234567"
    shutil.copytree(ckpt / str(complete[-1]), half)
    for f in list(half.rglob("*"))[::2]:
        if f.is_file():
            f.write_bytes(b"garbage")

    resumed = trainers.run(cfg, devices=4)
    got = _losses(resumed)
    assert min(got) == complete[-1] + 1
    assert got == {s: expected[s] for s in got}  # exact: same data by step, same program
    assert resumed[-1]["last_checkpoint_step"] == 10

    # Started again on a checkpoint at the last step: nothing to train, and the summary says so.
    (again,) = trainers.run(cfg, devices=4)
    assert again["summary"] and again["already_complete"] and again["step"] == 10, again
    assert again["last_checkpoint_step"] == 10 and "already complete" in again["message"], again
    assert "loss" not in again and "step_time_s" not in again, again

"""Divergence (docs/divergence.md): a non-finite loss ends the run with exit code 43 and its record, no
state from it or after it is ever saved (not by the interval, not by the SIGTERM save), keep's rotation
leaves the last finite checkpoint, and a rewind resumes from it with the next skipBatches batches
skipped, exactly. The in-step check changes nothing when the step is finite."""

from __future__ import annotations

import json
import math
import signal

import jax
import numpy as np
import pytest
from conftest import trainer_config

from tpu_operator.api.contract import DivergenceSpec
from tpu_operator.api.lifecycle import Divergence, TerminationRecord
from tpu_workload.data import batches as data_lib
from tpu_workload.loop import checkpoint, divergence, faults, preemption, train
from tpu_workload.loop.hooks import Hook
from tpu_workload.model import sharding
from tpu_workload.process import exits, metrics

FSDP8 = dict(data=1, fsdp=8, context=1, expert=1, tensor=1)
MESH4 = dict(data=1, fsdp=2, context=1, expert=1, tensor=2)


def _config(directory, steps, *, interval=2, keep=2, on="Rewind", skip=3, mesh=FSDP8):
    cfg = trainer_config("tiny", mesh=mesh, steps=steps, checkpoint=str(directory), interval=interval)
    return cfg.model_copy(
        update={
            "checkpoint": cfg.checkpoint.model_copy(update={"keep": keep}),
            "divergence": DivergenceSpec(on_divergence=on, skip_batches=skip),
        }
    )


def _saved_steps(directory) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


class _Positions:
    """Run.batches, recording the data position of every batch the loop asks for."""

    def __init__(self, batches, seen: list[int]):
        self.inner, self.seen = batches, seen

    def __call__(self, position: int):
        self.seen.append(position)
        return self.inner(position)

    def close(self) -> None:
        self.inner.close()


def _recording(seen: list[int], env: dict | None = None, before: list | None = None):
    def extra(run):
        run.batches = _Positions(run.batches, seen)
        return [*(before or []), *faults.hooks(run, 0, env=env or {})]

    return extra


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_check_changes_nothing_when_finite_and_keeps_the_state_when_not():
    """Bit-exact on the CPU: the checked, jitted step gives the loss and state of the bare update, jitted
    alike; a NaN step (faults' poisoned step) leaves the state exactly as it was."""
    cfg = trainer_config("tiny", mesh=FSDP8, steps=3)
    t = train.build(cfg, sharding.make_mesh(cfg.mesh.shape))
    bare = jax.jit(
        t.update,
        in_shardings=(t.state_shardings, t.batch_sharding),
        out_shardings=(t.state_shardings, t.state_shardings["step"]),
    )
    batches = data_lib.Batches(data_lib.make_source(cfg.training, cfg.model.vocab), t.batch_sharding, 1)
    checked_state, bare_state = t.init(), t.init()
    for step in range(3):
        checked_state, checked = t.step(checked_state, batches(step))
        bare_state, unchecked = bare(bare_state, batches(step))
        assert bool(checked["finite"])
        for key, value in unchecked.items():
            assert np.array_equal(np.asarray(checked[key]), np.asarray(value)), (step, key)
        jax.tree.map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), checked_state, bare_state
        )

    before = jax.device_get(checked_state)
    after, poisoned = t.poisoned_step()(checked_state, batches(3))
    assert not bool(poisoned["finite"]) and math.isnan(float(poisoned["loss"]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), after, before)


def test_nan_at_a_step_saves_nothing_after_it_and_a_rewind_skips_the_next_batches(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    # Saves at 2, 4, 6 with keep 2 (4 and 6 stay), then NaN at step 7 (the last step, 8, would save).
    seen: list[int] = []
    status = metrics.Status(8, 1)
    with pytest.raises(exits.Diverged) as failed:
        train.run(
            _config(ckpt, 8),
            peak_flops_per_device=5e10,
            status=status,
            extra_hooks=_recording(seen, {faults.NAN: "7"}),
        )
    assert failed.value.divergence == Divergence(step=7, metric="loss", value="nan", last_checkpoint_step=6)
    # The termination record the operator reads (__main__ ends every run through exits.fail).
    monkeypatch.setenv("TPUJOB_TERMINATION_LOG", str(tmp_path / "termination"))
    assert exits.fail(failed.value, None, status.snapshot()) == 43
    record = TerminationRecord.parse((tmp_path / "termination").read_text())
    assert record.code == 43 and record.diverged == failed.value.divergence
    assert record.error == (
        "Diverged: loss is nan at step 7: the update was not applied, and no state after it was saved "
        "(latest checkpoint: step 6)"
    )
    assert record.last["loss"] == "nan" and record.last["step"] == 7
    assert seen[:7] == list(range(7))  # steps 1..7 read positions 0..6 (step 8 may be dispatched, never saved)
    assert _saved_steps(ckpt) == [4, 6]  # keep's rotation took step 2, never the last finite one
    # /status and the JSON line show the NaN itself, in the wire format.
    assert metrics.wired(status.snapshot())["loss"] == "nan" and status.snapshot()["step"] == 7
    lines = _lines(capsys)
    assert lines[-1]["step"] == 7 and lines[-1]["loss"] == "nan" and lines[-2]["loss"] > 0
    marker = divergence.read_marker(str(ckpt))
    assert marker == {"step": 7, "metric": "loss", "value": "nan", "restoreStep": 6, "skippedBatches": 3}

    # The newest checkpoint is whole and finite.
    cfg = _config(ckpt, 10)
    restored, _ = checkpoint.Checkpointer(str(ckpt), 2).restore(
        train.build(cfg, sharding.make_mesh(cfg.mesh.shape)).abstract_state
    )
    assert int(restored["step"]) == 6
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree.leaves(restored["params"]))

    # The restarted job is preempted after step 7, before its next checkpoint (the fault hook runs before
    # the checkpoint hook of step 8): it trained step 7 on position 9, and left the checkpoints as they were.
    seen.clear()
    with pytest.raises(exits.Retryable):
        train.run(cfg, peak_flops_per_device=5e10, extra_hooks=_recording(seen, {faults.FAIL: "7:42"}))
    assert seen[0] == 9 and _saved_steps(ckpt) == [4, 6]

    # Restarted again (the same config; the switches fired once): from step 6, positions 6..8 skipped again.
    seen.clear()
    summary = train.run(cfg, peak_flops_per_device=5e10, extra_hooks=_recording(seen, {faults.NAN: "7"}))
    assert seen == [9, 10, 11, 12]  # steps 7..10
    assert math.isfinite(summary.loss) and all(math.isfinite(r["loss"]) for r in _lines(capsys)[:-1])
    assert _saved_steps(ckpt) == [8, 10]

    # A later restart restores step 10, whose checkpoint carries the skip: positions 13, 14 for steps 11, 12.
    seen.clear()
    train.run(_config(ckpt, 12), peak_flops_per_device=5e10, extra_hooks=_recording(seen))
    assert seen == [13, 14]


def test_the_sigterm_save_never_saves_a_non_finite_step(tmp_path, capsys):
    """SIGTERM during step 4: the step in flight, 5, is NaN. The save of the step in flight reads its
    flag first, and the run exits 43 with nothing saved."""
    ckpt = tmp_path / "ckpt"
    handler = signal.getsignal(signal.SIGTERM)

    def sigterm_at_4(step, _):
        if step == 4:
            signal.raise_signal(signal.SIGTERM)

    try:
        with pytest.raises(exits.Diverged) as failed:
            train.run(
                _config(ckpt, 8, interval=100, on="Fail", skip=0),
                peak_flops_per_device=5e10,
                extra_hooks=lambda run: [
                    Hook(1, on_state=sigterm_at_4),
                    preemption.StopOnSigterm(run).hook(),
                    *faults.hooks(run, 0, env={faults.NAN: "5"}),
                ],
            )
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert failed.value.divergence == Divergence(step=5, metric="loss", value="nan", last_checkpoint_step=None)
    assert _saved_steps(ckpt) == []
    assert divergence.read_marker(str(ckpt))["restoreStep"] == 0
    capsys.readouterr()


def test_markers_accumulate_and_apply_only_to_the_checkpoint_they_name(tmp_path):
    d = str(tmp_path)
    cfg = _config(tmp_path, 10, skip=100)
    first = divergence.write_marker(d, Divergence(step=9, metric="loss", value="inf", last_checkpoint_step=8), 0, 100)
    assert first["skippedBatches"] == 100 and divergence.skipped_at_start(cfg, 8, saved=0) == 100
    # Diverged again before a new checkpoint: the run that skipped 100 writes 200 for the same checkpoint.
    divergence.write_marker(d, Divergence(step=12, metric="grad_norm", value="nan", last_checkpoint_step=8), 100, 100)
    assert divergence.skipped_at_start(cfg, 8, saved=0) == 200
    assert divergence.skipped_at_start(cfg, 10, saved=100) == 100  # a later checkpoint's own skip
    fail = cfg.model_copy(update={"divergence": DivergenceSpec(on_divergence="Fail", skip_batches=100)})
    assert divergence.skipped_at_start(fail, 8, saved=0) == 0  # Fail: written, never applied


def test_wire_format_of_non_finite_values():
    assert [exits.wire(v) for v in (1.5, float("nan"), float("inf"), float("-inf"), 3, None)] == [
        1.5,
        "nan",
        "inf",
        "-inf",
        3,
        None,
    ]
    record = TerminationRecord.parse(
        TerminationRecord(code=43, last=exits._numbers({"loss": float("nan"), "step": 7, "state": "x"})).message()
    )
    assert record.last == {"loss": "nan", "step": 7}


@pytest.mark.e2e
@pytest.mark.long  # a trainer process (about 30 s); the in-process test above covers the record
def test_a_nan_exits_43_with_where_it_diverged(trainers, tmp_path):
    cfg = _config(tmp_path / "ckpt", 6, on="Fail", skip=0, mesh=MESH4)
    (proc,) = trainers.start(cfg, devices=4, TPUJOB_TEST_NAN_AT_STEP=3)
    assert proc.wait(timeout=240) == 43, trainers.stderr(proc)
    with open(proc.termination_path) as f:
        record = TerminationRecord.parse(f.read())
    assert record.code == 43
    assert record.diverged == Divergence(step=3, metric="loss", value="nan", last_checkpoint_step=2)
    assert record.error.startswith("Diverged: loss is nan at step 3")
    assert record.last["loss"] == "nan" and record.last["step"] == 3
    assert _saved_steps(tmp_path / "ckpt") == [2]
    lines = []
    while (line := trainers.read_line(proc, timeout=30)) is not None:
        lines.append(line)
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[-1]["loss"] == "nan"


@pytest.mark.long  # two processes, about a minute
def test_every_process_stops_at_the_same_step(trainers, tmp_path):
    cfg = _config(tmp_path / "ckpt", 6, on="Fail", skip=0, mesh=MESH4)
    procs = trainers.start(cfg, processes=2, devices=2, TPUJOB_TEST_NAN_AT_STEP=3)
    assert [p.wait(timeout=240) for p in procs] == [43, 43], trainers.stderr(procs[1])
    records = []
    for p in procs:
        with open(p.termination_path) as f:
            records.append(TerminationRecord.parse(f.read()))
    expected = Divergence(step=3, metric="loss", value="nan", last_checkpoint_step=2)
    assert [r.diverged for r in records] == [expected, expected]
    assert _saved_steps(tmp_path / "ckpt") == [2]


def test_the_config_map_carries_the_jobs_divergence_policy():
    from tests.conftest import tiny_job
    from tpu_operator.api.derived import Plan
    from tpu_operator.api.validation import parse_job

    job = parse_job(
        tiny_job(checkpoint={"directory": "/ckpt"}, failurePolicy={"onDivergence": "Rewind", "skipBatches": 200})
    )
    assert Plan(job).trainer_config().divergence == DivergenceSpec(on_divergence="Rewind", skip_batches=200)
    assert Plan(parse_job(tiny_job())).trainer_config().divergence == DivergenceSpec()  # Fail, none skipped


def test_the_local_report_plots_a_diverged_run(tmp_path):
    """`tpujob report` reads the JSON lines a diverged run printed: its last loss is the string "nan"."""
    from tpu_operator.local.report import write_report

    lines = [{"step": 1, "loss": 5.0, "step_time_s": 0.1, "mfu": 0.1}, {"step": 2, "loss": "nan", "step_time_s": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert write_report(tmp_path).stat().st_size > 1000


@pytest.mark.e2e
@pytest.mark.long  # two trainer processes one after the other (about a minute)
def test_a_rewound_trainer_resumes_from_the_last_checkpoint_past_the_skipped_batches(trainers, tmp_path):
    """What the operator's Rewind does, by hand: the same config and environment started again."""
    cfg = _config(tmp_path / "ckpt", 6, on="Rewind", skip=3, mesh=MESH4)
    (proc,) = trainers.start(cfg, devices=4, TPUJOB_TEST_NAN_AT_STEP=3)
    assert proc.wait(timeout=240) == 43, trainers.stderr(proc)
    lines = trainers.run(cfg, devices=4, TPUJOB_TEST_NAN_AT_STEP=3)
    steps = {r["step"]: r["loss"] for r in lines if not r.get("summary")}
    assert sorted(steps) == [3, 4, 5, 6] and all(isinstance(v, float) and math.isfinite(v) for v in steps.values())
    with open(trainers.procs[-1].stderr_path) as f:
        assert "resuming from step 2 with 3 batches skipped in all (3 more)" in f.read()
    assert _saved_steps(tmp_path / "ckpt") == [4, 6]

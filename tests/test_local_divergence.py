"""`tpujob run --local` with the real trainer and a NaN at step 5 (TPUJOB_TEST_NAN_AT_STEP): the trainer
exits 43 and the operator's controller classifies it as `diverged` (docs/failures.md, docs/divergence.md).
Under `onDivergence: Fail` the job fails there with nothing saved after step 4; under `Rewind` it restarts
from the step-4 checkpoint past the skipped batches, charged to `restartBudgets.diverged`, and succeeds."""

import subprocess
import sys

import pytest
import yaml

from tests.conftest import tiny_job

pytestmark = pytest.mark.e2e  # process-level: `pytest -m "not e2e"` leaves it out
STEPS, NAN_AT = 8, 5


def _run(tmp_path, **policy):
    doc = tiny_job(
        training={"steps": STEPS, "globalBatch": 8, "sequenceLength": 128},
        checkpoint={"directory": "/checkpoints/diverge", "interval": 2, "keep": 2},
        failurePolicy={"backoffSeconds": 0.5, **policy},
        runtime={"env": [{"name": "TPUJOB_TEST_NAN_AT_STEP", "value": str(NAN_AT)}]},
    )
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "run", "--local", "-f", str(tmp_path / "job.yaml")]
        + ["--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    status = yaml.safe_load((run_dir / "status.yaml").read_text())["status"]
    return result, status, run_dir


def _checkpoints(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.long  # a local run (about 30 s); tests/operator/test_restarts.py and tests/workload/test_divergence.py
def test_a_nan_fails_the_job_as_diverged_with_nothing_saved_after_it(tmp_path):  # hold each half in the default run
    result, status, run_dir = _run(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert status["phase"] == "Failed" and status["restarts"]["total"] == 0
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "Diverged"
    assert status["divergence"] == {"step": NAN_AT, "metric": "loss", "value": "nan", "lastCheckpointStep": 4}
    assert _checkpoints(run_dir) == [2, 4]  # nothing at or after the non-finite step


@pytest.mark.long  # two attempts of a local run (about a minute)
def test_rewind_restarts_from_the_last_checkpoint_charged_as_diverged_and_succeeds(tmp_path):
    result, status, run_dir = _run(tmp_path, onDivergence="Rewind", skipBatches=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert status["phase"] == "Succeeded" and status["step"] == STEPS
    assert status["restarts"]["diverged"] == 1 and status["restarts"]["total"] == 1
    assert status["divergence"]["step"] == NAN_AT and status["divergence"]["lastCheckpointStep"] == 4
    assert "nonFinite" not in status and status["loss"] > 0  # the rewound run's readings are finite again
    assert _checkpoints(run_dir)[-1] == STEPS

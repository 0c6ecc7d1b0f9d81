"""`tpujob run --local` with a stand-in trainer: environment, mounts, restarts, failure policy, Ctrl-C.

The stand-in is a few lines of Python given as the job's command override, so these tests check the
runner itself in seconds; tests/test_quickstart.py runs the real trainer.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_job
from tpu_operator.api.validation import parse_job
from tpu_operator.local.run import TooLargeForLocal, check_fits, scale_down

# Process 0 prints metric lines and, as it ends, its termination record (the operator's final read of a
# completed job, as the real trainer leaves it); every process records its environment; host 1 fails on the
# first attempt with the exit code in $FAIL_CODE (when set), after printing an error line and no termination
# record (so its log's tail stands in), and any process can be told to hang.
TRAINER = r"""
import json, os, pathlib, sys, time
cfg = json.load(open(os.environ["TPUJOB_CONFIG"]))
ckpt = pathlib.Path(cfg["checkpoint"]["directory"]); ckpt.mkdir(parents=True, exist_ok=True)
me = f"{os.environ['TPUJOB_SLICE_ID']}-{os.environ['TPUJOB_HOST_ID']}"
(ckpt / f"env-{me}.json").write_text(json.dumps({**dict(os.environ), "ARGV": sys.argv}))
if os.environ.get("HANG"):
    (ckpt / f"pid-{me}").write_text(str(os.getpid())); time.sleep(600)
marker = ckpt / "failed-once"
if me == "0-1" and os.environ.get("FAIL_CODE") and not marker.exists():
    marker.write_text("x"); print(f"StandInError: failing with {os.environ['FAIL_CODE']}", flush=True)
    sys.exit(int(os.environ["FAIL_CODE"]))
if me == "0-0":
    start = 3 if marker.exists() else 0
    for step in range(start + 1, cfg["training"]["steps"] + 1):
        print(json.dumps({"step": step, "loss": 5.0 / step, "step_time_s": 0.01, "global_tokens_per_s": 1000.0,
                          "mfu": 0.001, "last_checkpoint_step": step - step % 2}), flush=True)
    print(json.dumps({"summary": True, "step": cfg["training"]["steps"]}), flush=True)
    steps = cfg["training"]["steps"]
    record = {"code": 0, "progress": {"startedAt": time.time(), "step": steps, "lastCheckpointStep": steps}}
    pathlib.Path(os.environ["TPUJOB_TERMINATION_LOG"]).write_text(json.dumps(record))
"""


def _job(tmp_path, **env):
    doc = tiny_job(
        tpu={"generation": "v7x", "topology": "2x2x2"},
        training={"steps": 6, "globalBatch": 16, "sequenceLength": 128},
        checkpoint={"directory": "/checkpoints/x", "persistentVolumeClaim": "ckpt"},
        command=["python", "-c", TRAINER],
        args=["--config", "/etc/tpujob/config.json"],
        failurePolicy={"maxRestarts": 1, "restartOnExitCodes": [42, 143], "backoffSeconds": 0.5},
        runtime={
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "xlaFlags": ["--xla_tpu_enable_latency_hiding_scheduler=true"],
        },
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(tmp_path, job_path, *extra, **kw):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "run",
            "--local",
            "-f",
            str(job_path),
            "--run-dir",
            str(tmp_path / "run"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        **kw,
    )


@pytest.mark.e2e
def test_each_pod_gets_the_manifest_environment_on_loopback(tmp_path):
    result = _run(tmp_path, _job(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    ckpt = tmp_path / "run" / "checkpoints"
    envs = {p.name: json.loads(p.read_text()) for p in ckpt.glob("env-*.json")}
    assert sorted(envs) == ["env-0-0.json", "env-0-1.json"]
    for env in envs.values():
        assert env["TPUJOB_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
        assert env["TPUJOB_NUM_PROCESSES"] == "2" and env["TPUJOB_HOSTS_PER_SLICE"] == "2"
        assert env["TPUJOB_CPU_DEVICES"] == "8" and env["JAX_PLATFORMS"] == "cpu"
        assert "XLA_FLAGS" not in env  # TPU compiler flags would abort the CPU backend
        assert "sparse_core_collective_offload_all_gather=true" in env["LIBTPU_INIT_ARGS"]
        # The ConfigMap mount and the config path point into the run directory.
        config = Path(env["TPUJOB_CONFIG"])
        assert config.is_relative_to(tmp_path / "run") and env["ARGV"][-1] == str(config)
        assert json.loads(config.read_text())["checkpoint"]["directory"] == str(ckpt.resolve())
    assert envs["env-0-1.json"]["TPUJOB_HOST_ID"] == "1" and envs["env-0-0.json"]["TPUJOB_HOST_ID"] == "0"
    assert envs["env-0-0.json"]["TPUJOB_COORDINATOR_ADDRESS"] == envs["env-0-1.json"]["TPUJOB_COORDINATOR_ADDRESS"]
    status = yaml.safe_load((tmp_path / "run" / "status.yaml").read_text())["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 6 and status["restarts"]["total"] == 0
    assert "step 6/6" in result.stdout and "phase: Succeeded" in result.stdout
    assert (tmp_path / "run" / "logs" / "tiny-slice-0-1.log").exists()
    assert (tmp_path / "run" / "report.png").stat().st_size > 1000


def _status(tmp_path):
    return yaml.safe_load((tmp_path / "run" / "status.yaml").read_text())["status"]


@pytest.mark.e2e
@pytest.mark.parametrize("code, cause", [(42, "failure"), (143, "preemption")])
def test_a_retryable_exit_restarts_the_whole_slice_after_its_backoff(tmp_path, code, cause):
    result = _run(tmp_path, _job(tmp_path, FAIL_CODE=str(code)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tiny-slice-0-1 exited with code {code}" in result.stdout and "restarted 2 process(es)" in result.stdout
    assert f"restart 1 ({cause}) in 0.5 s" in result.stdout
    status = _status(tmp_path)
    assert status["phase"] == "Succeeded" and status["step"] == 6
    assert status["restarts"] == {
        "failure": 0,
        "preemption": 0,
        "hang": 0,
        "hardware": 0,
        cause: 1,
        "total": 1,
    }


@pytest.mark.e2e
@pytest.mark.parametrize(
    "code, why", [(9, "not in restartOnExitCodes [42, 143]"), (3, "a user error is never retried")]
)
def test_other_exits_fail_at_once_quoting_the_last_error_line(tmp_path, code, why):
    result = _run(tmp_path, _job(tmp_path, FAIL_CODE=str(code)))
    assert result.returncode == 1
    status = _status(tmp_path)
    assert status["phase"] == "Failed" and status["restarts"]["total"] == 0
    # The operator names the pod (JobSet's name for it: its hostname and a suffix), as on a cluster.
    assert (
        re.search(rf"tiny-slice-0-1-\w{{5}} exited with code {code}\b", status["message"]) and why in status["message"]
    )
    assert f"tiny-slice-0-1 exited with code {code}" in result.stdout
    assert f"StandInError: failing with {code}" in status["message"]  # the log's last line, as FallbackToLogsOnError


@pytest.mark.e2e
def test_interrupt_stops_every_process(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpu_operator.cli",
            "run",
            "--local",
            "-f",
            str(_job(tmp_path, HANG="1")),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    pid_files = [tmp_path / "run" / "checkpoints" / f"pid-0-{i}" for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert time.monotonic() < deadline, "the stand-in trainers never started"
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pid_files]
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the local run did not stop within 30 s of Ctrl-C; it said:\n{proc.communicate()[0]}")
        assert code == 130, proc.stdout.read()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        proc.kill()
        proc.wait()


def test_large_jobs_are_refused_with_how_far_local_goes():
    job = parse_job(yaml.safe_load(open(Path(__file__).parents[1] / "examples" / "llama3-8b-fsdp.yaml")))
    with pytest.raises(TooLargeForLocal) as exc:
        check_fits(job)
    assert "16 hosts" in str(exc.value) and "up to 8" in str(exc.value) and "--scale-down" in str(exc.value)


def test_scale_down_keeps_the_kind_of_job():
    doc = yaml.safe_load(open(Path(__file__).parents[1] / "examples" / "moe.yaml"))
    small, changes = scale_down(doc)
    job = parse_job(small)
    check_fits(job)
    assert job.spec.model.preset == "tiny-moe" and job.spec.mesh.expert == 2 and job.spec.tpu.topology == "2x2x2"
    assert any("model -> preset tiny-moe" in c for c in changes)


def test_scale_down_of_a_fine_tuning_job_says_it_trains_a_random_model_on_synthetic_data():
    """The Hugging Face checkpoint and chat files are not this machine's: tests/test_finetune.py runs the
    example itself, scaled down by hand."""
    doc = yaml.safe_load(open(Path(__file__).parents[1] / "examples" / "sft-llama3-8b.yaml"))
    small, changes = scale_down(doc)
    job = parse_job(small)
    check_fits(job)
    assert job.spec.model.init is None and job.spec.training.objective == "pretrain"
    assert job.spec.training.eval is not None and job.spec.training.eval.data is None
    path = doc["spec"]["model"]["init"]["path"]
    assert f"model -> preset tiny (random: not model.init's {path})" in changes
    assert any("(objective sft -> pretrain: no chat files here)" in c for c in changes)


def test_scale_down_keeps_gradient_accumulation():
    doc = yaml.safe_load(open(Path(__file__).parents[1] / "examples" / "long-context.yaml"))
    doc["spec"]["training"].update(globalBatch=128, microbatches=8)
    small, changes = scale_down(doc)
    job = parse_job(small)  # valid: every microbatch splits over the batch axes
    check_fits(job)
    assert job.spec.training.microbatches == 4 and job.spec.training.global_batch == 4 * 16
    assert any("in 4 microbatches" in c for c in changes)


def test_a_scaled_down_run_is_short_unless_asked():
    """examples/packed-documents.yaml trains 5,000 steps; scaled down, 20 (about 1.5 hours of the tiny model
    here otherwise), saying so; a shorter job keeps its own count."""
    doc = yaml.safe_load(open(Path(__file__).parents[1] / "examples" / "packed-documents.yaml"))
    small, changes = scale_down(doc)
    assert parse_job(small).spec.training.steps == 20 and "steps 5000 -> 20 (--steps N for more)" in changes
    doc["spec"]["training"]["steps"] = 7
    small, changes = scale_down(doc)
    assert parse_job(small).spec.training.steps == 7 and not any(c.startswith("steps") for c in changes)


@pytest.mark.parametrize(
    "steps, reason",
    [("5-2", "the first step (5) is after the last (2)"), ("3-7", "the job has 6 steps"), ("x", "not a step range")],
)
def test_a_bad_profile_range_is_refused_before_anything_runs(tmp_path, steps, reason):
    result = _run(tmp_path, _job(tmp_path), "--profile", steps)
    assert result.returncode == 2 and "error: --profile: " in result.stderr and reason in result.stderr
    assert not (tmp_path / "run").exists()

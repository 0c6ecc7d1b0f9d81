"""Plan a job on this machine: `python -m tpu_workload.performance.plan` in a child process (libtpu reads the
job's flags once per process), with the job's TrainerConfig, flags and HBM, as the pre-flight pod
runs it. Used by `tpujob plan` and `tpujob run --local`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from ..api.contract import PlanResult
from ..api.derived import Plan
from ..api.models import TPUTrainingJob
from ..rendering.preflight import plan_args, plan_env

NO_WORKLOAD = (
    "the JAX workload is not installed here: pip install 'tpu-operator[workload,plan]' "
    "(bash scripts/setup.sh does) to compile the train step"
)


def available() -> bool:
    """The trainer and libtpu are installed: a plan can run here."""
    return all(importlib.util.find_spec(m) is not None for m in ("jax", "libtpu"))


def run_plan(job: TPUTrainingJob, timeout_s: float = 1800, running: int | None = None) -> PlanResult:
    """The job's plan, as the pre-flight would find it; never raises for a plan that went wrong. `running`: an
    elastic job's plan on that many of its slices (its microbatches raised, api/derived.py `running_config`)."""
    headroom = job.spec.plan.hbm_headroom
    if importlib.util.find_spec("jax") is None:
        return PlanResult(verdict="NoLibtpu", message=NO_WORKLOAD, headroom=headroom)
    with tempfile.TemporaryDirectory(prefix="tpujob-plan-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(Plan(job, running).running_config().model_dump_json(by_alias=True))
        env = {**os.environ, **plan_env(job)}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "tpu_workload.performance.plan", *plan_args(job, str(config))],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return PlanResult(
                verdict="CompileError", headroom=headroom, message=f"the plan did not finish in {timeout_s:.0f} s"
            )
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    try:
        return Plan(job, running).bounded(PlanResult.model_validate_json(last))
    except ValidationError:
        tail = " | ".join(line for line in proc.stderr.strip().splitlines()[-5:])
        return PlanResult(
            verdict="CompileError",
            headroom=headroom,
            message=f"the plan exited {proc.returncode} without a result: {tail[-800:]}",
        )

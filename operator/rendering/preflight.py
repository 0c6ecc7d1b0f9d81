"""The plan of a job as a command: what `tpujob plan` runs on this machine, and the operator's
pre-flight batch Job that runs it on a CPU node before the JobSet is created.

Both run `python -m tpu_workload.performance.plan` (workload/performance/plan.py) on the job's own `TrainerConfig`, with the
job's LIBTPU_INIT_ARGS and XLA_FLAGS in its environment (libtpu reads them once per process, so a
plan is a process of its own), the HBM of one device from the catalogue and the job's headroom.
"""

from __future__ import annotations

from typing import Any

import yaml

from ..api import names
from ..api.derived import Plan
from ..api.lifecycle import TERMINATION_LOG
from ..api.models import CONFIG_FILE, CONFIG_MOUNT_DIR, TPUTrainingJob
from . import libtpu
from .manifests import _environment, _Loader, owner_reference, trainer_config_json

PLAN_MODULE = ["python", "-m", "tpu_workload.performance.plan"]
LABEL_ROLE = "training.tpu-operator.dev/role"
LABEL_GENERATION = "training.tpu-operator.dev/generation"
ROLE = "preflight"
DEADLINE_S = 900  # activeDeadlineSeconds: a 70B step on two slices compiles in 2-10 minutes on 2 cores
# Peak RSS of a compile is 1.8 GB (8B) to 2.9 GB (70B on two slices).
POD_RESOURCES = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "12Gi"}}


def plan_args(job: TPUTrainingJob, config_path: str) -> list[str]:
    """The plan's arguments for `job`, whose TrainerConfig is at `config_path`."""
    plan = Plan(job)
    return [
        "--config",
        config_path,
        "--hbm-capacity-gib",
        f"{plan.hbm_gib_per_device:g}",
        "--host-capacity-gib",
        f"{plan.host_gib_per_device:.1f}",
        "--headroom",
        f"{job.spec.plan.hbm_headroom:g}",
    ]


def slice_counts_args(job: TPUTrainingJob) -> list[str]:
    """An elastic job's pre-flight compiles every count it may run on (spec.tpu.slices down to minSlices), so
    every shape it may take is known to fit before any TPU is spent; `tpujob plan` does the same, one child
    process per count (local/compiler.py)."""
    counts = sorted(job.spec.tpu.slice_counts, reverse=True)
    return ["--slice-counts", ",".join(map(str, counts))] if len(counts) > 1 else []


def plan_env(job: TPUTrainingJob) -> dict[str, str]:
    """The flags the pods get, which the compile must see: LIBTPU_INIT_ARGS and XLA_FLAGS."""
    spec = job.spec
    env = {"LIBTPU_INIT_ARGS": " ".join(libtpu.libtpu_init_args(Plan(job).gen, spec.runtime))}
    if spec.runtime.xla_flags:
        env["XLA_FLAGS"] = " ".join(spec.runtime.xla_flags)
    return env


def preflight_name(job: str, generation: int) -> str:
    """One pre-flight Job per spec generation: an operator restarted mid-way adopts it, an edit gets a new one."""
    return f"{job}-plan-{generation}"


def preflight_labels(job: str, generation: int) -> dict[str, str]:
    return {**names.labels(job), LABEL_ROLE: ROLE, LABEL_GENERATION: str(generation)}


def render_preflight(
    job: TPUTrainingJob, generation: int, default_image: str | None = None, deadline_s: int = DEADLINE_S
) -> dict[str, Any]:
    """The batch/v1 Job that plans `job` (its ConfigMap must exist: the pod mounts it)."""
    spec, name = job.spec, job.metadata.name
    image = default_image if default_image and "image" not in spec.model_fields_set else spec.image
    command = [
        *PLAN_MODULE,
        *plan_args(job, f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE}"),
        *slice_counts_args(job),
        "--termination-log",
        TERMINATION_LOG,
    ]
    env = [{"name": k, "value": v} for k, v in plan_env(job).items() if v]
    # Values only: a compile needs no secret, and the pre-flight never holds one (valueFrom, envFrom left out).
    env += [{"name": e.name, "value": e.value} for e in spec.runtime.env if e.value_from is None]
    ctx = {
        "job": job,
        "name": preflight_name(name, generation),
        "labels": preflight_labels(name, generation),
        "owner": owner_reference(job),
        "deadline_s": deadline_s,
        "image": image,
        "command": command,
        "env": env,
        "resources": POD_RESOURCES,
        "termination_log": TERMINATION_LOG,
        "config_dir": CONFIG_MOUNT_DIR,
        "config_map": names.config_map_name(name, trainer_config_json(Plan(job))),
    }  # the config it plans
    return yaml.load(_environment().get_template("preflight.yaml.j2").render(ctx), Loader=_Loader)

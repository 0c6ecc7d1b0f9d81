"""`tpujob run --local`: a job run by the operator's own controller on this machine.

The job is validated and rendered exactly as for a cluster, then created in an in-memory API where the
operator's Manager, a JobSet stand-in and a process kubelet run it (controlplane.py); the run's status.yaml
is the job's `.status` as the controller wrote it. Two things change, and both are said on the terminal:
the checkpoint directory moves into the run directory (a PVC or gs:// path is not this machine's), and
every TPU host becomes a process whose chips are virtual CPU devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..api import goodput, names
from ..api.derived import Plan
from ..api.models import TPUTrainingJob
from ..api.names import PROFILE_ANNOTATION
from ..api.profiling import ANNOTATION_PREFIX
from ..api.status import TPUTrainingJobStatus
from ..controller.kube import JOBS, JOBSETS, PODS
from ..controller.reconcile import OperatorConfig
from ..rendering.manifests import render
from ..rendering.summary import summary
from .controlplane import ControlPlane
from .memory_api import MemoryApi
from .narrator import Narrator

NAMESPACE = "default"

# What one 2-core, 24 GiB laptop-class machine can hold: processes and bytes of f32 weights + Adam.
MAX_LOCAL_HOSTS = 8
BYTES_PER_PARAM = 16  # f32 master weights, two Adam moments, gradients
MAX_LOCAL_PARAM_BYTES = 4 << 30


class TooLargeForLocal(ValueError):
    pass


def check_fits(job: TPUTrainingJob) -> None:
    plan = Plan(job)
    params = plan.parameters
    problems = []
    if plan.total_hosts > MAX_LOCAL_HOSTS:
        problems.append(
            f"{plan.total_hosts} hosts ({job.spec.tpu.topology} x {plan.slices} slice(s)) need "
            f"{plan.total_hosts} processes; a local run goes up to {MAX_LOCAL_HOSTS} "
            f"(v7x 2x4x4 = 8 hosts)"
        )
    if params * BYTES_PER_PARAM > MAX_LOCAL_PARAM_BYTES:
        problems.append(
            f"the model has {params / 1e9:.2f}B parameters, {params * BYTES_PER_PARAM / 2**30:.0f} GiB "
            f"of weights and optimizer state; a local run holds up to "
            f"{MAX_LOCAL_PARAM_BYTES / 2**30:.0f} GiB (about "
            f"{MAX_LOCAL_PARAM_BYTES / BYTES_PER_PARAM / 1e6:.0f}M parameters)"
        )
    if problems:
        raise TooLargeForLocal(
            "this job is too large to run on one machine: "
            + "; ".join(problems)
            + ". Pass --scale-down to run a tiny model of the same kind on a 2-host slice."
        )


# A scaled-down run is a try of the job's shape, not its training: at most this many steps unless --steps says.
SCALED_DOWN_STEPS = 20


def scale_down(doc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The same job shrunk to a tiny model on a 2-host slice of the same generation, for at most
    `SCALED_DOWN_STEPS` steps; what changed."""
    doc = json.loads(json.dumps(doc))
    spec = doc["spec"]
    job = TPUTrainingJob.model_validate(doc)
    moe = job.spec.model_dims.is_moe
    context = 2 if job.spec.mesh.context > 1 else 1
    expert = 2 if moe and job.spec.mesh.expert > 1 else 1
    slices = min(job.spec.tpu.slices, 2)
    small = {"v7x": "2x2x2", "v5p": "2x2x2", "v6e": "2x4"}[job.spec.tpu.generation]
    changes = {
        "tpu": {**spec["tpu"], "topology": small, "slices": slices},
        "model": {"preset": "tiny-moe" if moe else "tiny"},
        "parallelism": {"fsdp": "auto", "context": context, "expert": expert, "tensor": 1},
        # The reference kernels: Splash takes 128-token blocks, the Mosaic grouped matmul 128-wide dimensions.
        "kernels": {**spec.get("kernels", {}), "attention": "xla", "moeMatmul": "ragged_dot"},
    }
    spec.update(changes)
    devices = Plan(TPUTrainingJob.model_validate(doc)).total_devices
    micro = min(job.spec.training.microbatches, 4)  # accumulation kept, its batch one row per device each
    steps = min(job.spec.training.steps, SCALED_DOWN_STEPS)
    spec["training"].update(
        {
            "sequenceLength": 256 if context > 1 else 128,
            "globalBatch": devices * micro,
            "microbatches": micro,
            "steps": steps,
        }
    )
    # Synthetic data (this machine has not the job's files); packed documents stay packed, and an
    # evaluation reads synthetic held-out data.
    packed = job.spec.training.data.packing
    spec["training"]["data"] = {"packing": True} if packed else {}
    sft = job.spec.training.objective == "sft"
    spec["training"].pop("objective", None)  # sft reads chat files: on synthetic data it pretrains
    if job.spec.training.eval is not None:
        spec["training"]["eval"] = {k: v for k, v in spec["training"]["eval"].items() if k != "data"}
    said = [
        f"topology {job.spec.tpu.topology} x {job.spec.tpu.slices} -> {small} x {slices}",
        f"model -> preset {'tiny-moe' if moe else 'tiny'}"
        + (f" (random: not model.init's {job.spec.model.init.path})" if job.spec.model.init else ""),
        f"parallelism -> context {context}, expert {expert}",
        f"batch -> {devices * micro} x {spec['training']['sequenceLength']} tokens"
        + (f" in {micro} microbatches" if micro > 1 else "")
        + (", synthetic packed documents" if packed else ", synthetic data")
        + (" (objective sft -> pretrain: no chat files here)" if sft else "")
        + ", attention xla"
        + (", moe matmul ragged_dot" if moe else ""),
    ]
    if steps < job.spec.training.steps:
        said.append(f"steps {job.spec.training.steps} -> {steps} (--steps N for more)")
    return doc, said


def localize(job: TPUTrainingJob, run_dir: Path) -> TPUTrainingJob:
    """The job with its checkpoint directory inside the run directory."""
    doc = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    if job.spec.checkpoint.directory:
        doc["spec"]["checkpoint"]["directory"] = str((run_dir / "checkpoints").resolve())
        doc["spec"]["checkpoint"].pop("persistentVolumeClaim", None)
    return TPUTrainingJob.model_validate(doc)


def with_profile(doc: dict[str, Any], steps: str) -> dict[str, Any]:
    """The job with --profile's request on it: the annotation a user puts on a job on a cluster, which the
    operator passes on to the running trainer (api/profiling.py)."""
    meta = doc["metadata"]
    return {
        **doc,
        "metadata": {
            **meta,
            "annotations": {**(meta.get("annotations") or {}), PROFILE_ANNOTATION: f"{ANNOTATION_PREFIX}{steps}"},
        },
    }


# The operator's settings for a local run. Its trainer is read four times a second (a cluster's default is every
# 10 s): the terminal follows every step, and the last read before process 0 exits sees its final step and
# evaluation (its termination record, read after it exits, carries its progress but no loss). No image is
# pulled here (the pods run this environment's python), so a job that names none gets this one, never Invalid.
LOCAL_IMAGE = "tpu-operator/workload:local"
LOCAL_CONFIG = OperatorConfig(
    default_image=LOCAL_IMAGE, metrics_access="proxy", metrics_interval_s=0.25, resync_interval_s=5.0
)
ENDED = ("Succeeded", "Failed", "Invalid")  # Invalid: the operator refused the spec; nothing will run
FAILED_GRACE_S = 2.0  # a failed run's processes left: a JAX process cannot save without its peers
SETTLE_S = 0.5  # after the job's last phase: the reconcile that wrote it may queue one more (a final read)


@dataclass
class LocalRun:
    """How a local run ended: its phase (or Interrupted), the job's status as the operator wrote it, the step
    lines process 0 printed, and when each JobSet started, on how many slices."""

    phase: str
    status: dict[str, Any]
    metrics: list[dict[str, Any]]
    slices: list[tuple[float, int]]


def run_local(job: TPUTrainingJob, run_dir: Path, out: TextIO = sys.stdout, profile: str | None = None) -> LocalRun:
    """Run the job under the operator's own controller on this machine (controlplane.py); `profile` (FIRST-LAST,
    checked by the caller) traces those steps with the JAX profiler."""
    check_fits(job)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = localize(job, run_dir)
    plan = Plan(job)
    config_map, jobset = render(job)
    (run_dir / "manifests.yaml").write_text(yaml.safe_dump_all([config_map, jobset], sort_keys=False))
    out.write("\n".join(summary(plan)) + "\n")
    out.write(
        f"local run: {plan.total_hosts} process(es) x {plan.devices_per_host} CPU devices; logs, checkpoints "
        f"and metrics in {run_dir}\n"
    )
    doc = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    # The plan was checked before the run (cli.py print_plan), for the real slice; a pre-flight batch Job here
    # would compile the CPU stand-in's step, which says nothing.
    doc["spec"]["plan"] = {**doc["spec"].get("plan", {}), "preflight": "skip"}
    if profile:
        doc = with_profile(doc, profile)
    ran = asyncio.run(_operate(doc, run_dir, out, plan.termination_grace_period_seconds))
    (run_dir / "slices.json").write_text(json.dumps({"desired": plan.slices, "history": ran.slices}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ran.metrics)
    status_doc = {"status": ran.status}
    (run_dir / "status.yaml").write_text(yaml.safe_dump(status_doc, sort_keys=False))
    out.write(_summary(ran, run_dir) + yaml.safe_dump(status_doc, sort_keys=False))
    out.flush()
    return ran


async def _operate(doc: dict[str, Any], run_dir: Path, out: TextIO, grace_s: float) -> LocalRun:
    """Create the job in an in-memory API and run the operator, JobSet and the kubelet on it until the job
    finishes or SIGINT/SIGTERM; then every process is stopped."""
    loop = asyncio.get_running_loop()
    api = MemoryApi()
    control = ControlPlane(api, LOCAL_CONFIG, run_dir)
    name = doc["metadata"]["name"]
    narrator = Narrator(name, doc["spec"]["training"]["steps"], out)
    slices: list[tuple[float, int]] = []

    def jobset_seen(kind: str, jobset: dict[str, Any]) -> None:
        if kind == "ADDED" and jobset["metadata"]["name"] == names.jobset_name(name):
            slices.append((time.time(), sum(r.get("replicas", 1) for r in jobset["spec"]["replicatedJobs"])))
        narrator.jobset_seen(kind, jobset)

    api.watch(JOBS, narrator.job_seen)
    api.watch(JOBSETS, jobset_seen)
    api.watch(PODS, narrator.pod_seen)
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    phase = "Interrupted"
    try:
        control.start()
        await api.create(JOBS, NAMESPACE, doc)
        while not interrupted.is_set():
            status = TPUTrainingJobStatus.model_validate((await api.get(JOBS, NAMESPACE, name)).get("status") or {})
            if status.phase in ENDED:
                await asyncio.sleep(SETTLE_S)
                phase = str(status.phase)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupted.wait(), 0.1)
        await control.stop()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # Off the loop: the kubelet's threads report to the API through it while their processes stop.
        await asyncio.to_thread(control.shutdown, grace_s if phase == "Interrupted" else FAILED_GRACE_S)
    final = (await api.get(JOBS, NAMESPACE, name)).get("status") or {}
    if phase == "Interrupted":
        out.write("\ninterrupted by the user; every process was stopped\n")
    return LocalRun(phase, final, _step_lines(run_dir / "logs" / f"{names.hostname(name, 0, 0)}.log"), slices)


def _step_lines(log: Path) -> list[dict[str, Any]]:
    """Process 0's JSON step lines, every attempt's in order (the trainer prints one per step it reports)."""
    records = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and not record.get("summary"):
            records.append(record)
    return records


def _summary(ran: LocalRun, run_dir: Path) -> str:
    status = TPUTrainingJobStatus.model_validate(ran.status)
    restarts = status.restarts
    lines = [f"{ran.phase}: {status.message or ''}"]
    if status.step is not None:
        lines.append(
            f"step {status.step}, {status.step_time_seconds or 0:.3f} s/step, {status.tokens_per_second or 0:,.0f} "
            f"tokens/s, MFU {100 * (status.mfu or 0):.2f}% (of the documented CPU peak; see docs/local-run.md), "
            f"restarts {restarts.total if restarts else 0} (failure {restarts.failure if restarts else 0}, "
            f"preemption {restarts.preemption if restarts else 0})"
        )
    if status.goodput is not None and status.badput is not None:
        lines.append(
            f"goodput {100 * status.goodput:.1f}% of the wall time; badput "
            + ", ".join(f"{b} {getattr(status.badput, b):.1f} s" for b in goodput.BUCKETS)
        )
    if status.profile is not None:
        p = status.profile
        lines.append(
            f"profile of steps {p.steps}: {p.path}\n  open it: tensorboard --logdir {Path(p.path).parents[3]} "
            f"(the Profile tab), or xprof --logdir {Path(p.path).parents[3]}"
            if p.state == "done" and p.path
            else f"profile ({p.request}) {p.state}: {p.message}"
        )
    lines.append(f"logs: {run_dir / 'logs'}   picture: tpujob report {run_dir}")
    return "\n".join(lines) + "\n"

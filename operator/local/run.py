"""`tpujob run --local`: a job's rendered JobSet run as processes on this machine.

The job is validated and rendered exactly as for a cluster. Two things change, and both are said
on the terminal: the checkpoint directory moves into the run directory (a PVC or gs:// path is
not this machine's), and every TPU host becomes a process whose chips are virtual CPU devices.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..api import goodput, names
from ..api.derived import Plan
from ..api.failures import verdict
from ..api.models import TPUTrainingJob
from ..api.profiling import ANNOTATION_PREFIX
from ..api.status import TPUTrainingJobStatus
from ..rendering.manifests import render
from ..rendering.summary import summary
from .accounting import LocalLedger
from .pods import free_port, local_pods
from .supervisor import Outcome, supervise

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
    if job.spec.training.eval is not None:
        spec["training"]["eval"] = {k: v for k, v in spec["training"]["eval"].items() if k != "data"}
    said = [
        f"topology {job.spec.tpu.topology} x {job.spec.tpu.slices} -> {small} x {slices}",
        f"model -> preset {'tiny-moe' if moe else 'tiny'}",
        f"parallelism -> context {context}, expert {expert}",
        f"batch -> {devices * micro} x {spec['training']['sequenceLength']} tokens"
        + (f" in {micro} microbatches" if micro > 1 else "")
        + (", synthetic packed documents" if packed else ", synthetic data")
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


@dataclass
class ProgressPrinter:
    """A compact live line on a terminal; one line per report otherwise."""

    total: int
    out: TextIO

    def __call__(self, kind: str, **d: Any) -> None:
        tty = self.out.isatty()
        if kind == "metrics":
            r = d["record"]
            evaluated = f"  eval {r['eval_loss']:.4f}" if r.get("eval_loss") is not None else ""
            line = (
                f"step {r['step']}/{self.total}  loss {r['loss']:.4f}{evaluated}  step {r['step_time_s']:.3f}s  "
                f"{r['global_tokens_per_s']:,.0f} tok/s  MFU {100 * r['mfu']:.2f}%  "
                f"ckpt {r.get('last_checkpoint_step') if r.get('last_checkpoint_step') is not None else '-'}"
            )
            self.out.write(f"\r\033[K{line}" if tty else line + "\n")
        elif kind == "started":
            self.out.write(
                f"{'started' if d['attempt'] == 0 else 'restarted'} {len(d['pods'])} process(es): "
                f"{', '.join(p.hostname for p in d['pods'])}\n"
            )
        elif kind == "pod_failed":
            self.out.write(f"{chr(10) if tty else ''}{d['pod'].hostname} exited with code {d['code']}\n")
        elif kind == "restarting":
            self.out.write(f"{d['message']}; training resumes from the latest checkpoint\n")
        elif kind == "resized":
            self.out.write(f"{chr(10) if tty else ''}resized ({d['resize'].reason}): {d['message']}\n")
        elif kind == "succeeded" and tty:
            self.out.write("\n")
        self.out.flush()


def with_profile(config_map: dict[str, Any], steps: str) -> dict[str, Any]:
    """The ConfigMap with `profileSteps` in the trainer's config: what --profile asks of the trainer (on a
    cluster the annotation asks the running trainer instead, the same request)."""
    key = next(iter(config_map["data"]))  # the one config file
    config = json.loads(config_map["data"][key])
    return {**config_map, "data": {key: json.dumps({**config, "profileSteps": steps}, indent=2)}}


def profile_status(report: dict[str, Any] | None, steps: str) -> dict[str, Any] | None:
    """status.profile as the operator writes it, from the trainer's last word on the profile."""
    if report is None:
        return {
            "request": f"{ANNOTATION_PREFIX}{steps}",
            "state": "failed",
            "message": "the trainer said nothing about the profile (it did not reach its steps)",
        }
    return {
        "request": f"{ANNOTATION_PREFIX}{steps}",
        "steps": report.get("steps"),
        "state": report["state"],
        "path": report.get("path"),
        "message": report.get("message") or None,
    }


def run_status(
    outcome: Outcome,
    start: dt.datetime,
    end: dt.datetime,
    job: TPUTrainingJob,
    ledger: LocalLedger,
    profile: dict[str, Any] | None = None,
    running: int | None = None,
) -> TPUTrainingJobStatus:
    """The status the operator would have written for this run."""
    last = outcome.last_metrics or {}
    phase = "Failed" if outcome.phase == "Interrupted" else outcome.phase
    stamp = end.strftime("%Y-%m-%dT%H:%M:%SZ")
    fraction, _, badput = ledger.report()
    return TPUTrainingJobStatus.model_validate(
        {
            "phase": phase,
            "conditions": [
                {
                    "type": phase,
                    "status": "True",
                    "reason": outcome.phase,
                    "message": outcome.message,
                    "lastTransitionTime": stamp,
                }
            ],
            "observedGeneration": 1,
            "jobSetName": names.jobset_name(job.metadata.name),
            "slices": {"desired": job.spec.tpu.slices, "running": running or job.spec.tpu.slices},
            "restarts": outcome.restarts,
            "step": last.get("step"),
            "stepTimeSeconds": last.get("step_time_s"),
            "loss": last.get("loss"),
            "evalLoss": next(
                (r["eval_loss"] for r in reversed(outcome.metrics) if r.get("eval_loss") is not None), None
            ),
            "tokensPerSecond": last.get("global_tokens_per_s"),
            "mfu": last.get("mfu"),
            # The summary line comes after the final (asynchronous) save has finished.
            "lastCheckpointStep": (outcome.summary or last).get("last_checkpoint_step"),
            "metricsTime": stamp if last else None,
            "startTime": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "completionTime": stamp,
            "message": outcome.message,
            "goodput": round(fraction, 4),
            "badput": goodput.rounded(badput, 2),
            "profile": profile,
        }
    )


def run_local(
    job: TPUTrainingJob, run_dir: Path, out: TextIO = sys.stdout, profile: str | None = None
) -> tuple[Outcome, TPUTrainingJobStatus]:
    """Run the job; `profile` (FIRST-LAST, checked by the caller) traces those steps with the JAX profiler."""
    check_fits(job)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = localize(job, run_dir)
    plan = Plan(job)
    config_map, jobset = render(job)
    if profile:
        config_map = with_profile(config_map, profile)
    (run_dir / "manifests.yaml").write_text(yaml.safe_dump_all([config_map, jobset], sort_keys=False))
    out.write("\n".join(summary(plan)) + "\n")
    out.write(
        f"local run: {plan.total_hosts} process(es) x {plan.devices_per_host} CPU devices; logs, checkpoints "
        f"and metrics in {run_dir}\n"
    )

    def make_pods(attempt: int, slices: int | None):
        # Fresh ports per attempt: a killed coordinator's port may linger in TIME_WAIT. An elastic job's
        # attempt runs on the slices the supervisor says, rendered as the operator would (render(running=)).
        shaped = jobset if slices in (None, plan.slices) else render(job, running=slices)[1]
        return local_pods(
            shaped,
            {config_map["metadata"]["name"]: config_map["data"]},
            run_dir,
            cpu_devices=plan.devices_per_host,
            coordinator_port=free_port(),
            metrics_port=free_port(),
            base_env=os.environ,
        )

    start = dt.datetime.now(dt.UTC)
    policy, ledger, progress = (
        job.spec.failure_policy,
        LocalLedger(start.timestamp()),
        ProgressPrinter(job.spec.training.steps, out),
    )

    reports: list[dict[str, Any]] = []  # the trainer's word on the profile, latest last
    slice_history: list[tuple[float, int]] = []  # (when an attempt started, its slices): report.png

    def on_event(kind: str, **d) -> None:
        ledger(kind, **d)
        progress(kind, **d)
        if kind == "profile":
            reports.append(d["report"])
        if kind == "started":
            slice_history.append((d["at"], d.get("slices") or plan.slices))

    outcome = supervise(
        make_pods,
        run_dir / "logs",
        decide=lambda counts, failure: verdict(policy, counts, failure),
        grace_s=plan.termination_grace_period_seconds,
        on_event=on_event,
        tpu=job.spec.tpu if job.spec.tpu.elastic is not None else None,
    )
    status = run_status(
        outcome,
        start,
        dt.datetime.now(dt.UTC),
        job,
        ledger,
        profile_status(reports[-1] if reports else None, profile) if profile else None,
        slice_history[-1][1] if slice_history else None,
    )
    (run_dir / "slices.json").write_text(json.dumps({"desired": plan.slices, "history": slice_history}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in outcome.metrics)
    status_doc = {"status": status.model_dump(by_alias=True, exclude_none=True, mode="json")}
    (run_dir / "status.yaml").write_text(yaml.safe_dump(status_doc, sort_keys=False))
    out.write(_summary(outcome, status, run_dir) + yaml.safe_dump(status_doc, sort_keys=False))
    out.flush()
    return outcome, status


def _summary(outcome: Outcome, status: TPUTrainingJobStatus, run_dir: Path) -> str:
    lines = [f"{outcome.phase}: {outcome.message}"]
    if status.step is not None:
        lines.append(
            f"step {status.step}, {status.step_time_seconds:.3f} s/step, {status.tokens_per_second:,.0f} "
            f"tokens/s, MFU {100 * status.mfu:.2f}% (of the documented CPU peak; see docs/local-run.md), "
            f"restarts {outcome.restarts.total} (failure {outcome.restarts.failure}, preemption "
            f"{outcome.restarts.preemption})"
        )
    if status.goodput is not None:
        lines.append(
            f"goodput {100 * status.goodput:.1f}% of the wall time; badput "
            + ", ".join(f"{b} {getattr(status.badput, b):.1f} s" for b in goodput.BUCKETS)
        )
    if status.profile is not None:
        p = status.profile
        lines.append(
            f"profile of steps {p.steps}: {p.path}\n  open it: tensorboard --logdir {Path(p.path).parents[3]} "
            f"(the Profile tab), or xprof --logdir {Path(p.path).parents[3]}"
            if p.state == "done"
            else f"profile ({p.request}) {p.state}: {p.message}"
        )
    lines.append(f"logs: {run_dir / 'logs'}   picture: tpujob report {run_dir}")
    return "\n".join(lines) + "\n"

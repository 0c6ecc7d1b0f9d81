"""What a plan says about a job, in words: the lines `tpujob plan` prints, and the problems the
operator puts in a job's status when its pre-flight says the job must change. Pure."""

from __future__ import annotations

from ..api.contract import PlanResult
from ..api.models import TPUTrainingJob
from ..api.plan import Plan
from .libtpu import field_of


def problems(result: PlanResult, job: TPUTrainingJob) -> list[str]:
    """'field: reason' lines for a plan whose verdict is that the job must change: a refused flag
    names the field it came from (spec.runtime.libtpuInitArgs[i], ...)."""
    if result.verdict == "RejectedFlags":
        return [f"{field_of(job.spec.runtime, r.flag)}: libtpu {result.libtpu_version or ''} refuses {r.flag}: "
                f"{r.message}".replace("  ", " ") for r in result.rejected_flags]
    if not result.change:
        return [f"spec: {result.message}"]
    return [f"spec.{result.change[0]}: {result.message}; change " + ", ".join(f"spec.{c}" for c in result.change)]


def lines(result: PlanResult, job: TPUTrainingJob) -> list[str]:
    """The per-device breakdown (or why there is none), as `tpujob plan` prints it."""
    plan = Plan(job)
    where = (f"{plan.gen.name} {job.spec.tpu.topology} x {plan.slices} slice(s), "
             f"{result.devices or plan.total_devices} {result.device_kind or 'TPU'} devices")
    out = [f"job:         {job.metadata.namespace}/{job.metadata.name} on {where}"]
    if result.compile_seconds is not None:
        out.append(f"compiler:    libtpu {result.libtpu_version}, {result.compile_seconds:.1f} s")
    if result.hbm_per_device_gib is not None:
        out += [f"per device:  {result.state_gib:.2f} GiB parameters + optimizer state (+ batch), "
                f"{result.temporaries_gib:.2f} GiB activations/temporaries = {result.hbm_per_device_gib:.2f} GiB"]
    capacity = result.hbm_capacity_gib or plan.hbm_gib_per_device
    usable = capacity * (1 - result.headroom)
    if result.hbm_per_device_gib is not None:
        spare = usable - result.hbm_per_device_gib
        out.append(f"HBM:         {capacity:g} GiB per device, {usable:.1f} GiB with {result.headroom:.0%} headroom: "
                   + (f"fits, {spare:.1f} GiB to spare" if spare >= 0 else f"{-spare:.1f} GiB short"))
    if result.host_per_device_gib:
        host = result.host_capacity_gib or plan.host_gib_per_device
        out.append(f"host:        {result.host_per_device_gib:.2f} GiB of offloaded activations per device, of "
                   f"{host:.1f} GiB host memory per device")
    verdict = {"Fits": "fits", "DoesNotFit": "DOES NOT FIT", "VmemOverflow": "DOES NOT COMPILE (VMEM)",
               "RejectedFlags": "REFUSED FLAGS"}.get(result.verdict, "NOT CHECKED")
    out.append(f"verdict:     {verdict}")
    if result.verdict != "Fits":
        out += [f"  {p}" for p in (problems(result, job) if result.fits is False else [result.message])]
    if result.largest:
        out.append("largest allocations (XLA):")
        out += [f"  {a}" for a in result.largest]
    return out

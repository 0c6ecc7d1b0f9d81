"""What a plan says about a job, in words: the lines `tpujob plan` prints, and the problems the
operator puts in a job's status when its pre-flight says the job must change. Pure."""

from __future__ import annotations

from ..api.contract import RESOURCES, PlanResult, StepResources
from ..api.derived import Plan
from ..api.models import TPUTrainingJob
from .libtpu import field_of


def plan_problems(result: PlanResult, job: TPUTrainingJob) -> list[str]:
    """'field: reason' lines for a plan whose verdict is that the job must change: a refused flag
    names the field it came from (spec.runtime.libtpuInitArgs[i], ...)."""
    if result.verdict == "RejectedFlags":
        return [
            f"{field_of(job.spec.runtime, r.flag)}: libtpu {result.libtpu_version or ''} refuses {r.flag}: "
            f"{r.message}".replace("  ", " ")
            for r in result.rejected_flags
        ]
    if not result.change:
        return [f"spec: {result.message}"]
    return [f"spec.{result.change[0]}: {result.message}; change " + ", ".join(f"spec.{c}" for c in result.change)]


def lines(result: PlanResult, job: TPUTrainingJob) -> list[str]:
    """The per-device breakdown (or why there is none), as `tpujob plan` prints it."""
    plan = Plan(job)
    where = (
        f"{plan.gen.name} {job.spec.tpu.topology} x {plan.slices} slice(s), "
        f"{result.devices or plan.total_devices} {result.device_kind or 'TPU'} devices"
    )
    out = [f"job:         {job.metadata.namespace}/{job.metadata.name} on {where}"]
    if result.compile_seconds is not None:
        out.append(f"compiler:    libtpu {result.libtpu_version}, {result.compile_seconds:.1f} s")
    if result.hbm_per_device_gib is not None:
        out += [
            f"per device:  {result.state_gib:.2f} GiB parameters + optimizer state (+ batch), "
            f"{result.temporaries_gib:.2f} GiB activations/temporaries = {result.hbm_per_device_gib:.2f} GiB"
        ]
    capacity = result.hbm_capacity_gib or plan.hbm_gib_per_device
    usable = capacity * (1 - result.headroom)
    if result.hbm_per_device_gib is not None:
        spare = usable - result.hbm_per_device_gib
        out.append(
            f"HBM:         {capacity:g} GiB per device, {usable:.1f} GiB with {result.headroom:.0%} headroom: "
            + (f"fits, {spare:.1f} GiB to spare" if spare >= 0 else f"{-spare:.1f} GiB short")
        )
    if result.host_per_device_gib:
        host = result.host_capacity_gib or plan.host_gib_per_device
        out.append(
            f"host:        {result.host_per_device_gib:.2f} GiB of offloaded activations per device, of "
            f"{host:.1f} GiB host memory per device"
        )
    if result.resources is not None:
        out += resource_lines(result.resources)
    verdict = {
        "Fits": "fits",
        "DoesNotFit": "DOES NOT FIT",
        "VmemOverflow": "DOES NOT COMPILE (VMEM)",
        "RejectedFlags": "REFUSED FLAGS",
    }.get(result.verdict, "NOT CHECKED")
    out.append(f"verdict:     {verdict}")
    if result.verdict != "Fits":
        out += [f"  {p}" for p in (plan_problems(result, job) if result.fits is False else [result.message])]
    if result.largest:
        out.append("largest allocations (XLA):")
        out += [f"  {a}" for a in result.largest]
    return out


def _kinds(gib: dict[str, float]) -> str:
    total = sum(gib.values())
    parts = ", ".join(f"{k} {v:,.3g}" for k, v in sorted(gib.items(), key=lambda kv: -kv[1]) if v)
    return f"{total:,.4g} GiB" + (f" ({parts})" if parts else "")


def _seconds(s: float) -> str:
    return f"{s:.4g} s" if s >= 1 or s == 0 else f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} µs"


def resource_lines(r: StepResources) -> list[str]:
    """What one step costs a device and the least time that allows, as `tpujob plan` prints it."""
    out = [
        f"matmuls:     {r.matmul_tflop:,.5g} TFLOP per device per step"
        + (f" ({r.fp8_tflop:,.5g} in fp8)" if r.fp8_tflop else "")
        + (f"; the model's {r.model_tflop:,.5g} (MFU counts these)" if r.model_tflop is not None else "")
        + (f"; {r.kernel_calls} kernel calls" if r.kernel_calls else ""),
        f"collectives: ICI {_kinds(r.ici_gib)}"
        + (f"; DCN {_kinds(r.dcn_gib)}" if r.dcn_gib else "")
        + " per device per step",
    ]
    if r.hbm_traffic_gib is not None:
        out.append(f"HBM traffic: {r.hbm_traffic_gib:,.5g} GiB per device per step (estimated from the module)")
    if r.step_time_bound_s is not None:
        each = ", ".join(f"{k} {_seconds(r.bound_seconds[k])}" for k in RESOURCES if k in r.bound_seconds)
        out.append(f"step time:   at least {_seconds(r.step_time_bound_s)}, bound by {r.binding} ({each})")
    if r.mfu_ceiling is not None:
        out.append(f"MFU ceiling: {r.mfu_ceiling:.1%} (the model's FLOPs over that bound at peak)")
    if r.unknown_loops:
        out.append(f"  ({r.unknown_loops} loop(s) of unknown trip count counted once: the figures are low)")
    return out

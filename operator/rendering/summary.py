"""What `tpujob validate` (and a local run) prints of a job: the derived plan and what its pods get."""

from __future__ import annotations

from ..api import names
from ..api.derived import Plan
from ..api.models import TPUTrainingJobSpec
from ..api.spec import TPUCapacity
from . import libtpu


def _capacity(tpu: TPUCapacity) -> str:
    if tpu.capacity == "reservation":
        owner = f" of project {tpu.reservation_project}" if tpu.reservation_project else ""
        return f"reservation {tpu.reservation_name}{owner}"
    if tpu.capacity == "flexStart" and tpu.max_run_duration:
        return f"flexStart for at most {tpu.max_run_duration}"
    return tpu.capacity


def _queue(spec: TPUTrainingJobSpec) -> str:
    if not spec.queue_name:
        return "no queue (the JobSet starts at once)"
    priority = spec.workload_priority_class_name or spec.priority_class_name
    return f"Kueue LocalQueue {spec.queue_name}" + (f", priority {priority}" if priority else "")


def summary(plan: Plan) -> list[str]:
    """A few readable lines."""
    job, spec, sl, gen = plan.job, plan.job.spec, plan.slice, plan.gen
    dims = spec.model_dims
    kind = f"MoE {dims.experts} experts top-{dims.experts_per_token}" if dims.is_moe else "dense"
    ckpt = spec.checkpoint
    ckpt_line = (
        (f"{ckpt.directory} every {ckpt.interval} steps, keep {ckpt.keep}, resume {'on' if ckpt.resume else 'off'}")
        if ckpt.directory
        else "off"
    )
    offload = libtpu.offloaded(gen, spec.runtime)
    flags = libtpu.libtpu_init_args(gen, spec.runtime)
    peak = gen.peak_flops(spec.training.precision)
    return [
        f"job:        {job.metadata.namespace}/{job.metadata.name}",
        f"tpu:        {gen.name} {spec.tpu.topology} x {plan.slices} slice(s): {plan.total_chips} chips, "
        f"{plan.total_hosts} hosts ({sl.chips_per_host} chips/host, {sl.machine_type}), "
        f"{plan.total_devices} JAX devices",
        f"peak:       {peak * plan.total_chips / 1e15:.1f} PFLOP/s {spec.training.precision} "
        f"({peak / 1e12:.0f} TFLOP/s per chip)",
        f"model:      {dims.layers} layers, d={dims.model_dim}, {dims.heads}/{dims.kv_heads} heads x "
        f"{dims.head_dim}, mlp {dims.mlp_dim}, vocab {dims.vocab}, {kind}"
        + (f", starts from {spec.model.init.format} {spec.model.init.path}" if spec.model.init else ""),
        f"mesh:       {spec.mesh}",
        f"training:   {spec.training.steps} steps, batch {spec.training.global_batch} x "
        f"{spec.training.sequence_length} tokens" + _batch_extras(spec.training) + f", {spec.training.precision}, "
        f"remat {spec.training.remat.policy}, attention {spec.kernels.attention}"
        + (f", moe {spec.kernels.moe_matmul}" if dims.is_moe else ""),
        f"offload:    SparseCore {', '.join(offload) if offload else 'off'}",
        f"flags:      LIBTPU_INIT_ARGS={' '.join(flags) or '(none)'}",
        f"checkpoint: {ckpt_line}",
        f"restarts:   up to {spec.failure_policy.max_restarts} after failures and hangs (exit codes "
        f"{', '.join(map(str, spec.failure_policy.restart_on_exit_codes)) or 'all but 3'}), backoff "
        f"{spec.failure_policy.backoff_seconds:g}-{spec.failure_policy.max_backoff_seconds:g} s; SIGTERM grace "
        f"{plan.termination_grace_period_seconds} s",
        f"capacity:   {_capacity(spec.tpu)}; {_queue(spec)}",
        f"pods:       {names.hostname(job.metadata.name, 0, 0)} .. "
        f"{names.longest_hostname(job.metadata.name, plan.slices, sl.hosts)}",
    ]


def _batch_extras(t) -> str:
    """Accumulation, packing and evaluation, where the job uses them."""
    extras = [
        f" in {t.microbatches} microbatches" if t.microbatches > 1 else "",
        ", packed documents" if t.data.packing else "",
        f", {t.data.format} text tokenized on the fly" if t.data.tokenizer else "",
        ", sft (the loss on the assistant's tokens)" if t.objective == "sft" else "",
        f", eval every {t.eval.interval} steps ({t.eval.batches} batches)" if t.eval is not None else "",
    ]
    return "".join(extras)

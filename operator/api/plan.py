"""The derived plan of a validated job: what it runs on, how it is sharded, what the pods get."""

from __future__ import annotations

from dataclasses import dataclass

from . import catalogue, flags, naming
from .models import TPUTrainingJob, TrainerConfig


@dataclass(frozen=True)
class Plan:
    job: TPUTrainingJob

    @property
    def gen(self) -> catalogue.Generation:
        return catalogue.generation(self.job.spec.tpu.generation)

    @property
    def slice(self) -> catalogue.Slice:
        return self.job.spec.tpu.slice

    @property
    def slices(self) -> int:
        return self.job.spec.tpu.slices

    @property
    def total_chips(self) -> int:
        return self.slice.chips * self.slices

    @property
    def total_hosts(self) -> int:
        return self.slice.hosts * self.slices

    @property
    def total_devices(self) -> int:
        return self.slice.devices * self.slices

    @property
    def devices_per_host(self) -> int:
        return self.slice.chips_per_host * self.gen.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        return self.gen.peak_flops(self.job.spec.training.precision) / self.gen.devices_per_chip

    @property
    def libtpu_init_args(self) -> list[str]:
        return flags.libtpu_init_args(self.gen, self.job.spec.runtime)

    def trainer_config(self) -> TrainerConfig:
        spec = self.job.spec
        return TrainerConfig(
            name=self.job.metadata.name, namespace=self.job.metadata.namespace, generation=self.gen.name,
            topology=spec.tpu.topology, slices=self.slices, hosts_per_slice=self.slice.hosts,
            devices_per_host=self.devices_per_host, peak_flops_per_device=self.peak_flops_per_device,
            model=spec.model_dims, training=spec.training, mesh=spec.mesh, kernels=spec.kernels,
            checkpoint=spec.checkpoint, metrics_port=spec.runtime.metrics_port)

    def summary(self) -> list[str]:
        """A few readable lines for `tpujob validate`."""
        spec, sl, gen = self.job.spec, self.slice, self.gen
        dims = spec.model_dims
        kind = f"MoE {dims.experts} experts top-{dims.experts_per_token}" if dims.is_moe else "dense"
        ckpt = spec.checkpoint
        ckpt_line = (f"{ckpt.directory} every {ckpt.interval} steps, keep {ckpt.keep}, "
                     f"resume {'on' if ckpt.resume else 'off'}") if ckpt.directory else "off"
        offload = flags.offloaded(gen, spec.runtime)
        return [
            f"job:        {self.job.metadata.namespace}/{self.job.metadata.name}",
            f"tpu:        {gen.name} {spec.tpu.topology} x {self.slices} slice(s): {self.total_chips} chips, "
            f"{self.total_hosts} hosts ({sl.chips_per_host} chips/host, {sl.machine_type}), "
            f"{self.total_devices} JAX devices",
            f"peak:       {gen.peak_flops(spec.training.precision) * self.total_chips / 1e15:.1f} PFLOP/s "
            f"{spec.training.precision} ({gen.peak_flops(spec.training.precision) / 1e12:.0f} TFLOP/s per chip)",
            f"model:      {dims.layers} layers, d={dims.model_dim}, {dims.heads}/{dims.kv_heads} heads x "
            f"{dims.head_dim}, mlp {dims.mlp_dim}, vocab {dims.vocab}, {kind}",
            f"mesh:       {spec.mesh}",
            f"training:   {spec.training.steps} steps, batch {spec.training.global_batch} x "
            f"{spec.training.sequence_length} tokens, {spec.training.precision}, remat {spec.training.remat.policy}, "
            f"attention {spec.kernels.attention}" + (f", moe {spec.kernels.moe_matmul}" if dims.is_moe else ""),
            f"offload:    SparseCore {', '.join(offload) if offload else 'off'}",
            f"flags:      LIBTPU_INIT_ARGS={' '.join(self.libtpu_init_args) or '(none)'}",
            f"checkpoint: {ckpt_line}",
            f"restarts:   up to {spec.failure_policy.max_restarts}",
            f"pods:       {naming.hostname(self.job.metadata.name, 0, 0)} .. "
            f"{naming.longest_hostname(self.job.metadata.name, self.slices, sl.hosts)}",
        ]

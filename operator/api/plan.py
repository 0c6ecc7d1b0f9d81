"""The derived plan of a validated job: what it runs on, how it is sharded, what the pods get."""

from __future__ import annotations

from dataclasses import dataclass

from . import catalogue
from .contract import TrainerConfig
from .models import TPUTrainingJob


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
    def hbm_gib_per_device(self) -> float:
        return self.gen.hbm_gib / self.gen.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        return self.gen.peak_flops(self.job.spec.training.precision) / self.gen.devices_per_chip

    def trainer_config(self) -> TrainerConfig:
        spec = self.job.spec
        return TrainerConfig(
            name=self.job.metadata.name, namespace=self.job.metadata.namespace, generation=self.gen.name,
            topology=spec.tpu.topology, slices=self.slices, hosts_per_slice=self.slice.hosts,
            devices_per_host=self.devices_per_host, peak_flops_per_device=self.peak_flops_per_device,
            model=spec.model_dims, training=spec.training, mesh=spec.mesh, kernels=spec.kernels,
            checkpoint=spec.checkpoint, metrics_port=spec.runtime.metrics_port)

"""The derived plan of a validated job: what it runs on, how it is sharded, what the pods get."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import catalogue, roofline
from .contract import DivergenceSpec, PlanResult, TrainerConfig
from .models import TPUTrainingJob

# What a SIGTERM must fit in before the kubelet kills the pod: the step in flight, then a blocking save
# of this host's share of the checkpoint (f32 weights and two Adam moments) at a conservative write rate.
CHECKPOINT_BYTES_PER_PARAM = 12
GRACE_WRITE_BYTES_PER_S = 200e6
GRACE_MARGIN_S = 60
MAX_GRACE_S = 86400  # spec.terminationGracePeriodSeconds' own maximum


@dataclass(frozen=True)
class Plan:
    """`running`: the slices an elastic job runs on now (docs/elastic.md); unset, all of spec.tpu.slices."""

    job: TPUTrainingJob
    running: int | None = None

    def __post_init__(self) -> None:
        if self.running is not None and self.running not in self.job.spec.tpu.slice_counts:
            raise ValueError(
                f"slices: {self.running} is not a slice count this job may run on "
                f"({list(self.job.spec.tpu.slice_counts)})"
            )

    @property
    def gen(self) -> catalogue.Generation:
        return catalogue.generation(self.job.spec.tpu.generation)

    @property
    def slice(self) -> catalogue.Slice:
        return self.job.spec.tpu.slice

    @property
    def slices(self) -> int:
        """The slices that run (fewer than spec.tpu.slices after an elastic shrink)."""
        return self.running if self.running is not None else self.job.spec.tpu.slices

    @property
    def resized(self) -> bool:
        return self.slices != self.job.spec.tpu.slices

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
    def host_gib_per_device(self) -> float:
        """The host VM's memory shared by its devices (activations offloaded to `pinned_host` land there)."""
        return self.gen.host_ram_gb * 1e9 / 2**30 / (self.gen.chips_per_host * self.gen.devices_per_chip)

    @property
    def peak_flops_per_device(self) -> float:
        return self.gen.peak_flops(self.job.spec.training.precision) / self.gen.devices_per_chip

    @property
    def parameters(self) -> int:
        m = self.job.spec.model_dims
        attention = m.model_dim * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
        mlp = 3 * m.model_dim * m.mlp_dim * max(1, m.experts) + (m.model_dim * m.experts)
        return m.layers * (attention + mlp + 2 * m.model_dim) + 2 * m.vocab * m.model_dim + m.model_dim

    @property
    def termination_grace_period_seconds(self) -> int:
        """The spec's, else a margin for the step in flight plus this host's share of a checkpoint written
        at GRACE_WRITE_BYTES_PER_S, rounded up to 30 s (llama3-8b on 4x4x4: 120 s)."""
        if self.job.spec.termination_grace_period_seconds is not None:
            return self.job.spec.termination_grace_period_seconds
        per_host = self.parameters * CHECKPOINT_BYTES_PER_PARAM / self.total_hosts
        # At most what the spec may set (a day): a model at the bounds of spec.model on one host would
        # otherwise be given years, and a stuck pod would hold its TPUs for as long.
        return min(30 * math.ceil((GRACE_MARGIN_S + per_host / GRACE_WRITE_BYTES_PER_S) / 30), MAX_GRACE_S)

    def bounded(self, result: PlanResult) -> PlanResult:
        """A plan's result with its step's time bounds on this job's generation (roofline.py)."""
        if result.resources is None:
            return result
        return result.model_copy(
            update={"resources": roofline.bound(result.resources, self.gen, self.job.spec.training.precision)}
        )

    def running_config(self) -> TrainerConfig:
        """What the trainer runs: the ConfigMap's config at the slices that run (TrainerConfig.at_slices)."""
        return self.trainer_config().at_slices(self.slices)

    def trainer_config(self) -> TrainerConfig:
        """The ConfigMap's config: always the whole job (every slice), whatever runs now."""
        spec = self.job.spec
        return TrainerConfig(
            name=self.job.metadata.name,
            namespace=self.job.metadata.namespace,
            generation=self.gen.name,
            topology=spec.tpu.topology,
            slices=spec.tpu.slices,
            hosts_per_slice=self.slice.hosts,
            devices_per_host=self.devices_per_host,
            peak_flops_per_device=self.peak_flops_per_device,
            peak_bf16_flops_per_device=(
                self.gen.peak_flops("bf16") / self.gen.devices_per_chip if spec.training.precision != "bf16" else None
            ),
            model=spec.model_dims,
            init=spec.model.init,
            training=spec.training,
            mesh=spec.mesh,
            kernels=spec.kernels,
            checkpoint=spec.checkpoint,
            divergence=DivergenceSpec(
                on_divergence=spec.failure_policy.on_divergence, skip_batches=spec.failure_policy.skip_batches
            ),
            metrics_port=spec.runtime.metrics_port,
        )

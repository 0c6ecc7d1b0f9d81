"""What the loop and its hooks share, in a module of its own so that the hooks (evaluation, preemption,
faults, profiling) and the loop (train.py) import it and not each other: the built step (`Trainer`),
the run set up around it (`Run`), the `Hook` protocol the loop calls, and what it hands the hooks
(`StepRecord`) and its caller (`Summary`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import NamedSharding

from tpu_operator.api.contract import TrainerConfig

from ..data import batches as data_lib
from ..model import sharding
from .checkpoint import Checkpointer
from .progress import Clock


@dataclasses.dataclass
class Trainer:
    """Everything built once per run: shardings, the jitted init and step."""

    cfg: TrainerConfig
    sharder: sharding.Sharder
    param_shardings: dict
    state_shardings: dict
    abstract_state: dict
    batch_sharding: NamedSharding
    init: callable
    step: callable  # (state, batch) -> (state, metrics): `update` applied only where finite (divergence.py)
    eval_step: callable  # (params, batch) -> (summed cross entropy, tokens counted): evaluation.py
    update: callable | None = None  # the step's pure update, unjitted and unchecked (a test compares the two)
    poisoned_step: Callable[[], callable] | None = None  # jits `step` with a NaN loss and gradients (faults.py)
    start_from: callable | None = None  # params -> a fresh state around them (spec.model.init): fresh optimizer


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one reported step says (a JSON line on stdout, /status, TensorBoard; docs/metrics.md)."""

    step: int
    loss: float  # what the optimizer minimised: ce + the weighted aux and z-losses
    step_time_s: float
    global_tokens_per_s: float  # all devices'
    tflops_per_device: float  # model FLOPs (6N + attention, flops.py) per second per device, in 10^12
    mfu: float  # against the peak of the job's precision
    last_checkpoint_step: int | None
    ce: float | None = None  # the cross entropy alone
    aux: float | None = None  # the MoE load-balancing loss, unweighted (0 for dense models)
    z_loss: float | None = None  # mean logsumexp^2, unweighted (0 unless training.zLossWeight > 0)
    grad_norm: float | None = None  # the global gradient norm before clipping
    learning_rate: float | None = None  # the rate this step's update used
    mfu_bf16: float | None = None  # against the bf16 peak, where the job's precision has another (fp8)
    eval_loss: float | None = None  # cross entropy on the held-out data, on steps that evaluate
    eval_perplexity: float | None = None
    data_wait_s: float = 0.0  # the loop's wait for batches since the previous record
    progress: dict | None = None  # the trainer's clock (lifecycle.Progress) after this step

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Summary:
    """How a run ended: the last step's loss and the median step time over the timed steps (the
    first step of a run, which compiles, is not timed). A run that found its last step already
    checkpointed trains nothing: `already_complete`, and no loss or timing."""

    step: int
    last_checkpoint_step: int | None
    loss: float | None = None
    step_time_s: float | None = None
    global_tokens_per_s: float | None = None
    mfu: float | None = None
    steps_timed: int = 0
    already_complete: bool = False

    def as_dict(self) -> dict:
        if self.already_complete:
            return {
                "summary": True,
                "step": self.step,
                "already_complete": True,
                "last_checkpoint_step": self.last_checkpoint_step,
                "message": f"already complete: the checkpoint at step {self.last_checkpoint_step} is the "
                f"last step; nothing was trained",
            }
        return {"summary": True, **{k: v for k, v in dataclasses.asdict(self).items() if k != "already_complete"}}


@dataclasses.dataclass(frozen=True)
class Hook:
    """Work done on every `every`-th step and on the last: `on_state` with the new state right after
    the step is dispatched (checkpoints must see it before the next step donates it), `values` adds
    to the step's record once its metrics are read (e.g. what `on_state` computed), `on_record` with
    the record."""

    every: int
    on_state: Callable[[int, dict], object] | None = None
    on_record: Callable[[StepRecord], object] | None = None
    values: Callable[[int], dict] | None = None

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total


@dataclasses.dataclass
class Run:
    """One run, set up: the built step, the state it starts from, the data, the checkpoints, and
    what a step's metrics are measured against."""

    cfg: TrainerConfig
    trainer: Trainer
    state: dict
    start: int
    batches: data_lib.Batches
    ckpt: Checkpointer | None
    flops_per_step: float
    peak_flops: float  # of all devices in the mesh
    devices: int
    peak_bf16_flops: float | None = None  # of all devices, where the job's precision has another peak
    clock: Clock = dataclasses.field(default_factory=Clock)
    data_wait_s: float = 0.0  # since the last record
    skipped: int = 0  # batches skipped by rewinds before this run: step s reads data position s + skipped
    # Test faults (faults.py): the step function of a step (0-based, as the loop counts) instead of trainer.step.
    step_overrides: dict[int, Callable] = dataclasses.field(default_factory=dict)
    # Set by the loop: reads (and reports) every step's metrics up to the given one, raising
    # exits.Diverged at a non-finite one. `save` calls it first, so that no state after it is saved.
    read_through: Callable[[int], None] = lambda step: None

    def save(self, step: int, state: dict) -> None:
        """Checkpoint the state after step `step`, once every step up to it is known finite (its
        metrics read: no extra wait, the save needs the step's arrays anyway); blocking time counted
        as checkpoint time."""
        self.read_through(step)
        self.clock.timed(self.ckpt.save)(step, state)

    def waited_for_data(self, seconds: float) -> None:
        self.data_wait_s += seconds
        self.clock.data_waited(seconds)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.training.global_batch * self.cfg.training.sequence_length

    def record(self, step: int, values: dict, step_time_s: float, extra: dict | None = None) -> StepRecord:
        """`values`: the step's metrics (train_step), read back as floats; `extra`: what hooks add."""
        last_checkpoint = self.ckpt.last_complete_step() if self.ckpt else None
        self.clock.step_done(step, step_time_s, last_checkpoint)
        flops_per_s = self.flops_per_step / step_time_s
        waited, self.data_wait_s = self.data_wait_s, 0.0
        return StepRecord(
            step=step,
            step_time_s=step_time_s,
            data_wait_s=waited,
            global_tokens_per_s=self.tokens_per_step / step_time_s,
            tflops_per_device=flops_per_s / self.devices / 1e12,
            mfu=flops_per_s / self.peak_flops,
            mfu_bf16=flops_per_s / self.peak_bf16_flops if self.peak_bf16_flops else None,
            last_checkpoint_step=last_checkpoint,
            progress=self.clock.snapshot().model_dump(),
            **{k: values[k] for k in ("loss", "ce", "aux", "z_loss", "grad_norm", "learning_rate")},
            **(extra or {}),
        )

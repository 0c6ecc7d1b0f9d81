"""Evaluation on held-out data (`training.eval`): the cross entropy and perplexity of the parameters
after every `interval`-th step and the last.

The held-out set is fixed: the same `batches` batches of `globalBatch` sequences every time, each
run one microbatch at a time (no more memory than a training microbatch), so evaluations compare
along the run, whatever slice count an elastic job runs on. With `eval.data` they are that source's first batches; with
synthetic training data and no `eval.data`, synthetic batches of steps training never reaches
(HELD_OUT_STEP onwards), so no held-out sequence is one the model trained on.

Evaluation reads only the parameters and changes nothing: the step's state is not donated to it
and no random state advances. It runs right after the step it follows, before the next step is
dispatched, and the loop waits for it: that time is the clock's evaluation time (goodput's `eval`
bucket), not step time. Its result joins that step's record.
"""

from __future__ import annotations

import math

import jax

from tpu_operator.api.contract import TrainerConfig

from ..data import batches as data_lib
from .hooks import Hook

# Synthetic held-out batches are those of steps from here on: far past any run's last step.
HELD_OUT_STEP = 1 << 40


class Evaluator:
    def __init__(self, cfg: TrainerConfig, trainer):
        t, spec = cfg.training, cfg.training.eval
        self.cfg, self.trainer = cfg, trainer
        self.first = 0 if spec.data is not None else HELD_OUT_STEP
        held_out = t.model_copy(update={"data": spec.data or t.data})
        self.batches = data_lib.Batches(
            data_lib.make_source(held_out, cfg.model.vocab), trainer.batch_sharding, cfg.mesh.context
        )
        self.done: dict[int, dict] = {}

    def evaluate(self, step: int, state: dict) -> None:
        """Evaluate `state` (after `step`) and wait for the result."""
        sums = [
            self.trainer.eval_step(state["params"], self.batches(self.first + i))
            for i in range(self.cfg.training.eval.batches)
        ]
        total, count = (sum(float(v) for v in vs) for vs in zip(*jax.device_get(sums)))
        loss = total / max(count, 1.0)
        self.done[step] = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}

    def values(self, step: int) -> dict:
        """The evaluation after `step`, or nothing if there was none."""
        return self.done.pop(step, {})

    def hook(self, clock) -> Hook:
        return Hook(self.cfg.training.eval.interval, on_state=clock.timed(self.evaluate, "eval"), values=self.values)

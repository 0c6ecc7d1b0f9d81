"""The trainer's Prometheus series: what process 0's `/metrics` serves, one gauge per `/status` key.

A value that is not finite (a diverged step's loss, docs/divergence.md) is the gauge's NaN or +-Inf, and
in `/status` the string "nan", "inf" or "-inf" (JSON has no token for it).

Shared by the trainer, which serves them (`tpu_workload.process.metrics`; it imports this module beside
`contract` and `lifecycle`: stdlib only), and by the operator's reference docs (`docs.py`,
`metrics-trainer` in docs/metrics.md), which list them without importing the trainer.
"""

from __future__ import annotations

from typing import NamedTuple


class TrainerSeries(NamedTuple):
    """One gauge: its series name, the `/status` key whose latest value it carries, and its help text."""

    name: str
    key: str
    help: str


PROMETHEUS = (
    TrainerSeries("tpujob_step", "step", "Completed training steps."),
    TrainerSeries(
        "tpujob_loss",
        "loss",
        "Training loss of the latest step (with the weighted aux and z-losses); NaN or +-Inf at a diverged step "
        '(/status: "nan", "inf", "-inf").',
    ),
    TrainerSeries("tpujob_cross_entropy", "ce", "Cross entropy of the latest step, without the aux and z-losses."),
    TrainerSeries(
        "tpujob_grad_norm", "grad_norm", "Global gradient norm before clipping; NaN or +Inf at a diverged step."
    ),
    TrainerSeries("tpujob_learning_rate", "learning_rate", "Learning rate of the latest reported step."),
    TrainerSeries("tpujob_step_time_seconds", "step_time_s", "Latest step time in seconds."),
    TrainerSeries("tpujob_tokens_per_second", "global_tokens_per_s", "Throughput of all devices, tokens per second."),
    TrainerSeries("tpujob_tflops_per_device", "tflops_per_device", "Model TFLOP/s per device."),
    TrainerSeries("tpujob_mfu", "mfu", "Model FLOPs utilisation at the job's precision, 0..1."),
    TrainerSeries("tpujob_mfu_bf16", "mfu_bf16", "Model FLOPs utilisation against the bf16 peak (fp8 jobs), 0..1."),
    TrainerSeries("tpujob_data_wait_seconds", "data_wait_s", "Time waited for batches since the previous report."),
    TrainerSeries("tpujob_eval_loss", "eval_loss", "Cross entropy on the held-out data at the latest evaluation."),
    TrainerSeries("tpujob_eval_perplexity", "eval_perplexity", "exp(eval loss)."),
    TrainerSeries("tpujob_last_checkpoint_step", "last_checkpoint_step", "Step of the latest complete checkpoint."),
)

"""Divergence: a step whose loss or gradient norm is not finite ends the run with exit code 43, and a
rewind (spec.failurePolicy.onDivergence Rewind) skips the data that led to it.

The check costs no extra host sync. The jitted step (train.build) tests `isfinite` of its loss and
gradient norm on the device and applies its update only where both are finite (a select of the old
state: the state in memory stays finite), returning the flag with its metrics. The loop reads the flag
where it reads the metrics anyway, one step behind dispatch; a checkpoint (the interval's, the last
step's, the SIGTERM save) first reads every step up to the one it saves (`Run.save`), which costs
nothing more, since a save waits for that step's arrays in any case. So no checkpoint ever holds state
from a step at or after a non-finite one, and `checkpoint.keep`'s rotation, which deletes only the
oldest, can never delete the last finite checkpoint: every checkpoint is finite.

On a non-finite step every process (the flag is a reduction of replicated values: each sees the same)
waits for the saves in flight, raises `exits.Diverged` (code 43, the termination record's `diverged`),
and process 0 writes the marker `divergence.json` beside the checkpoints:

  {"step": 7, "metric": "loss", "value": "nan", "restoreStep": 6, "skippedBatches": 300}

`restoreStep` is the checkpoint the restarted job restores (0: none, the start), `skippedBatches` the
batches to have skipped by then: those skipped when it diverged plus failurePolicy.skipBatches. The data
position of step s is s + skipped (batches.py reads position p as it read step p before: a batch is a pure
function of its position), and every checkpoint records the skip in effect (checkpoint.py). At start-up
with onDivergence Rewind, a run that restores `restoreStep` takes the marker's skip, any other the skip its
checkpoint recorded: so a preemption before the next checkpoint restores the same skip, a later
checkpoint carries it on, and a second divergence before a new checkpoint skips further (the marker
accumulates). Under Fail the marker is written too (the record of what happened) but not applied.
"""

from __future__ import annotations

import json
import logging
import math

from etils import epath

from tpu_operator.api.contract import TrainerConfig
from tpu_operator.api.lifecycle import Divergence

from ..process.exits import Diverged, wire

log = logging.getLogger(__name__)
MARKER = "divergence.json"
CHECKED = ("loss", "grad_norm")  # in this order: Divergence.metric names the first that is not finite


def diverged_at(step: int, values: dict, last_checkpoint_step: int | None) -> Diverged | None:
    """The failure of step `step` whose metrics read back as `values`, or None where it was finite."""
    if values.get("finite", True):
        return None
    metric = next((k for k in CHECKED if not math.isfinite(values[k])), "loss")
    return Diverged(
        Divergence(
            step=step, metric=metric, value=str(wire(float(values[metric]))), last_checkpoint_step=last_checkpoint_step
        )
    )


def write_marker(directory: str, divergence: Divergence, skipped: int, skip_batches: int) -> dict:
    """Process 0's record of a divergence for the rewind (the module docstring), written atomically: a
    reader sees the previous marker or this one, never a part."""
    marker = {
        "step": divergence.step,
        "metric": divergence.metric,
        "value": divergence.value,
        "restoreStep": divergence.last_checkpoint_step or 0,
        "skippedBatches": skipped + skip_batches,
    }
    path = epath.Path(directory) / MARKER
    tmp = path.parent / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(marker) + "\n")
    tmp.replace(path)  # a POSIX rename; on gs:// the object appears whole
    return marker


def read_marker(directory: str) -> dict | None:
    path = epath.Path(directory) / MARKER
    return json.loads(path.read_text()) if path.exists() else None


def skipped_at_start(cfg: TrainerConfig, start: int, saved: int) -> int:
    """The batches skipped before step `start` of this run: the marker's where a rewind restores the
    checkpoint it names, else `saved`, what the restored checkpoint recorded (0 without one)."""
    if cfg.divergence.on_divergence != "Rewind" or not cfg.checkpoint.directory:
        return saved
    marker = read_marker(cfg.checkpoint.directory)
    if marker is None or int(marker["restoreStep"]) != start:
        return saved
    skipped = int(marker["skippedBatches"])
    log.warning(
        "rewind: step %d diverged (%s %s); resuming from step %d with %d batches skipped in all (%d more)",
        marker["step"],
        marker["metric"],
        marker["value"],
        start,
        skipped,
        skipped - saved,
    )
    return skipped

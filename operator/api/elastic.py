"""Elastic slices: how many slices a job runs on next. Pure; the operator and the local runner share it
(docs/elastic.md).

A multi-slice JAX job is one program over every slice: a slice that is lost stops all of them. Without
`spec.tpu.elastic`, the job restarts on all of its slices (api/failures.py), so it waits until the lost
one is back. With it, the rule (`after_failure`), first match wins:

1. A failure the restart policy does not restart: the job fails, whatever runs.
2. The failure's root cause (api/failures.py `root_cause`) is in one slice's pods, and the slices left
   are at least `minSlices`: restart on the slices left, not waiting for the lost one. The coordinator
   and MEGASCALE_* environment are derived anew for the smaller JobSet (rendering/manifests.py), and the
   trainer restores the latest checkpoint onto the smaller mesh with the global batch kept
   (contract.TrainerConfig.at_slices).
3. Otherwise: restart on every slice (the lost one included), as without elastic.

Growing back (`grow_back_due`): a job on fewer than `spec.tpu.slices` with `growBack: true` goes back to
all of them once it has written a checkpoint since it shrank, and the larger job can be placed (the
caller knows: always, on one machine; the scheduler or Kueue on a cluster). The smaller job is stopped
the way a preemption stops it (SIGTERM: the step in flight is saved), so a grow-back loses no step.
"""

from __future__ import annotations

import dataclasses

from .spec import TPUSpec


@dataclasses.dataclass(frozen=True)
class Resize:
    """The slice count of the next attempt, and why it differs from the last one's (None: it does not)."""

    slices: int
    reason: str | None = None  # SliceLost, GrewBack
    message: str = ""


def after_failure(tpu: TPUSpec, running: int, lost_slice: int | None) -> Resize:
    """The next attempt's slices after a restarted failure whose root cause was in `lost_slice` (None:
    not in one slice's pods, e.g. a hang, or a preemption of every pod)."""
    if tpu.elastic is None or lost_slice is None:
        return _whole(tpu, running, "")
    left = running - 1
    if left < tpu.elastic.min_slices:
        return _whole(
            tpu, running, f"; {left} slice(s) would be left, fewer than elastic.minSlices {tpu.elastic.min_slices}"
        )
    return Resize(
        left,
        "SliceLost",
        f"slice {lost_slice} was lost: training goes on on {left} of "
        f"{tpu.slices} slices from the latest checkpoint, with the same global batch",
    )


def _whole(tpu: TPUSpec, running: int, why: str) -> Resize:
    if running == tpu.slices:
        return Resize(running)
    return Resize(tpu.slices, "Restarted", f"restarting on all {tpu.slices} slices{why}")


def grow_back_due(tpu: TPUSpec, running: int, resumed_from: int | None, last_checkpoint: int | None) -> bool:
    """Whether a job on `running` slices should go back to all of them now: growBack is set, and it has
    written a checkpoint since it resumed from `resumed_from` (the step it restored, None: from scratch)."""
    if tpu.elastic is None or not tpu.elastic.grow_back or running >= tpu.slices or last_checkpoint is None:
        return False
    return resumed_from is None or last_checkpoint > resumed_from


def grow_back(tpu: TPUSpec, running: int) -> Resize:
    return Resize(tpu.slices, "GrewBack", f"back on all {tpu.slices} slices (from {running}) after a checkpoint")

"""Orbax checkpoints: asynchronous saves (the loop's checkpoint hook picks the steps), keep K, resume.

Orbax writes each step into a temporary directory and renames it when every process has
finished, so a process killed mid-save leaves only a temporary directory that `latest_step`
ignores: resume picks the latest complete checkpoint. Restore places arrays straight onto the
current mesh (the target carries shardings), so the mesh may differ from the one that saved.

Each checkpoint holds two items: `state` (the arrays) and `data` (a small JSON: the fingerprint of
the data order, fingerprint.py, which resume checks, and, once a rewind skipped batches, how many:
the data position of step s is s + skippedBatches, divergence.py).
"""

from __future__ import annotations

import logging

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)
SKIPPED = "skippedBatches"  # in the `data` item; absent means 0 (every checkpoint before any rewind)


class Checkpointer:
    def __init__(self, directory: str, keep: int, fingerprint: dict | None = None):
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True),
        )
        self._complete = self.manager.latest_step()
        self.fingerprint = fingerprint or {}  # what every save records
        self.skipped = 0  # batches skipped by rewinds so far: restored, then recorded by every save

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state) -> tuple[dict, dict]:
        """(the latest complete checkpoint's state on `abstract_state`'s shardings (ShapeDtypeStructs),
        the fingerprint it recorded); the batches it had skipped go to `self.skipped`."""
        step = self.manager.latest_step()
        log.info("restoring checkpoint step %d from %s", step, self.manager.directory)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        )
        data = dict(restored["data"])
        self.skipped = int(data.pop(SKIPPED, 0))
        return restored["state"], data

    def save(self, step: int, state) -> None:
        """Start an asynchronous save of `state` at `step` (the caller decides which steps, and checks
        that the state is finite first: Run.save)."""
        data = self.fingerprint | ({SKIPPED: self.skipped} if self.skipped else {})
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)),
            force=True,
        )

    def last_complete_step(self) -> int | None:
        """Step of the newest checkpoint whose save has finished (never one still being written)."""
        if not self.manager.is_saving_in_progress():
            self._complete = self.manager.latest_step()
        else:  # finalized step directories only; the save in flight is still a temporary one
            done = [int(p.name) for p in epath.Path(self.manager.directory).iterdir() if p.name.isdigit()]
            self._complete = max(done) if done else self._complete
        return self._complete

    def finish(self) -> int | None:
        self.manager.wait_until_finished()
        self._complete = self.manager.latest_step()
        return self._complete

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs with shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

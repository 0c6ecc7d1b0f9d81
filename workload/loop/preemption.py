"""SIGTERM loses no step: the step in flight finishes, is checkpointed, and the process exits 143.

The signal handler only sets a flag. After each step is dispatched, every process contributes its
flag to a tiny global OR (one int32 per device, reduced by `jnp.max`), dispatched like the step and
read with the step's metrics, so the loop never waits for it. A SIGTERM that reaches one host only
(node maintenance) thus stops all of them at the same step: when the OR of step n's flags reads
true, the next state hook, which holds step n+1 (the step in flight), saves it with a blocking
checkpoint on every process and raises `Stopped`, unless a step up to it was not finite (Run.save
raises exits.Diverged instead, and nothing is saved). The hook runs before the interval checkpoint
hook, so that step is saved once. It must fit in the pod's terminationGracePeriodSeconds.
"""

from __future__ import annotations

import logging
import signal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..process.exits import Stopped
from .hooks import Hook, Run, StepRecord

log = logging.getLogger(__name__)


class StopOnSigterm:
    def __init__(self, run: Run):
        self.run = run
        self.requested = False
        self.stopping = False
        self._flags: dict[int, jax.Array] = {}
        mesh = Mesh(np.array(jax.devices()), ("process_flags",))
        self._sharding = NamedSharding(mesh, P("process_flags"))
        self._any = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if not self.requested:
            log.warning("SIGTERM: finishing the step in flight, then a checkpoint and exit 143")
        self.requested = True

    def hook(self) -> Hook:
        return Hook(1, on_state=self.on_state, on_record=self.on_record)

    def on_state(self, step: int, state: dict) -> None:
        if self.stopping:
            saved = self.run.ckpt is not None
            if saved:
                log.warning("saving the step in flight (%d) before exiting", step)
                self.run.save(step, state)  # reads step's flag first: a non-finite step is never saved
                self.run.clock.finish_checkpoints(self.run.ckpt)
            raise Stopped(step, saved)
        local = np.full((jax.local_device_count(),), int(self.requested), np.int32)
        self._flags[step] = self._any(jax.make_array_from_process_local_data(self._sharding, local))

    def on_record(self, record: StepRecord) -> None:
        flag = self._flags.pop(record.step, None)
        if flag is not None and int(jax.device_get(flag)):
            self.stopping = True

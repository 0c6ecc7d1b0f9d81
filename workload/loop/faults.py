"""Fault injection, for tests only: switches read from the environment here and nowhere else, inert
unless set, never set by the renderer (a user sets them through spec.runtime.env in a test job).

  TPUJOB_TEST_FAIL_AT_STEP=STEP:CODE[@PROCESS]  once step STEP is reported (STEP < steps), fail
      with exit class CODE: 3 raises UserError, 42 Retryable, any other code exits with it
      (exits.InjectedExit)
  TPUJOB_TEST_HANG_AT_STEP=STEP[@PROCESS]       once step STEP is reported, stop making progress for
      good (the process keeps serving /status and, like a collective that never returns, ignores
      SIGTERM)

  TPUJOB_TEST_NAN_AT_STEP=STEP                  step STEP (1-based, as reported) computes a NaN loss and
      NaN gradients, as a real divergence would: the trainer exits 43 (divergence.py). Every process
      fires (the step is one program over all of them).

FAIL and HANG act in the state hook of step STEP + 1, which the loop calls right after reporting step
STEP; NAN replaces the step function of step STEP (Run.step_overrides).

Without @PROCESS every process fires. Each switch fires once per job: it leaves a marker in
`<checkpoint directory>/.tpujob-test-faults/`, so the restarted job trains on (without a checkpoint
directory it fires on every attempt). So a rewind (onDivergence Rewind) trains through step STEP on
other data: PaLM's spikes were data-dependent, so the switch models a blow-up that the skipped batches
caused, which does not recur.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from etils import epath

from ..process.exits import InjectedExit, Retryable, UserError
from .hooks import Hook, Run

log = logging.getLogger(__name__)
FAIL = "TPUJOB_TEST_FAIL_AT_STEP"
HANG = "TPUJOB_TEST_HANG_AT_STEP"
NAN = "TPUJOB_TEST_NAN_AT_STEP"


def _parse(value: str) -> tuple[list[str], int | None]:
    spec, _, process = value.partition("@")
    return spec.split(":"), int(process) if process else None


def _marker(run: Run, name: str, process: int) -> epath.Path | None:
    """Where this job records that `name` fired on `process` (beside the checkpoints), None without them."""
    if not run.cfg.checkpoint.directory:
        return None
    return epath.Path(run.cfg.checkpoint.directory) / ".tpujob-test-faults" / f"{name}-p{process}"


def _fired(run: Run, name: str, process: int) -> bool:
    marker = _marker(run, name, process)
    return marker is not None and marker.exists()


def _mark(run: Run, name: str, process: int) -> None:
    marker = _marker(run, name, process)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("fired\n")


def _once(run: Run, name: str, process: int) -> bool:
    """True the first time this job fires `name` on `process` (a marker beside the checkpoints)."""
    if _fired(run, name, process):
        return False
    _mark(run, name, process)
    return True


def hooks(run: Run, process: int, env: Mapping[str, str] | None = None) -> list[Hook]:
    env = os.environ if env is None else env
    found = []
    if env.get(FAIL):
        (step, code), only = _parse(env[FAIL])
        if only in (None, process):
            found.append(Hook(1, on_state=lambda s, _: _fail(run, s - 1, int(step), int(code), process)))
    if env.get(HANG):
        (step,), only = _parse(env[HANG])
        if only in (None, process):
            found.append(Hook(1, on_state=lambda s, _: _hang(run, s - 1, int(step), process)))
    if env.get(NAN):
        _poison(run, int(env[NAN]), process)
    return found


def _poison(run: Run, step: int, process: int) -> None:
    """Step `step`'s function, where this run trains it and the job has not fired it yet: the poisoned
    step (compiled when first called), marked as fired as it is dispatched. Every process decides alike:
    each reads its own marker, and all of them wrote theirs at the same step."""
    name = f"nan-{step}"
    if not run.start < step <= run.cfg.training.steps or _fired(run, name, process):
        return
    poisoned = run.trainer.poisoned_step()

    def fire(state, batch):
        _mark(run, name, process)
        log.warning("injected divergence (%s): step %d's loss and gradients are NaN", NAN, step)
        return poisoned(state, batch)

    run.step_overrides[step - 1] = fire


def _fail(run: Run, reported: int, step: int, code: int, process: int) -> None:
    if reported != step or not _once(run, f"fail-{step}-{code}", process):
        return
    message = f"injected fault ({FAIL}) at step {step}"
    if code == 3:
        raise UserError(message)
    if code == 42:
        raise Retryable(message)
    raise InjectedExit(code, message)


def _hang(run: Run, reported: int, step: int, process: int) -> None:
    if reported != step or not _once(run, f"hang-{step}", process):
        return
    log.warning("injected hang (%s) after step %d: no further progress", HANG, step)
    while True:
        time.sleep(3600)

"""Shared helpers for the workload tests: tiny TrainerConfigs and trainer subprocesses.

In-process tests use 8 virtual CPU devices; set before any test touches JAX devices.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import absl.flags  # noqa: E402

absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags on first use; pytest's own are not its

from tests.workload.blocks import SMALLEST_BLOCKS  # noqa: E402
from tpu_operator.api.contract import TrainerConfig  # noqa: E402
from tpu_operator.api.presets import PRESETS  # noqa: E402
from tpu_operator.local.pods import free_port  # noqa: E402


def trainer_config(
    preset="tiny",
    *,
    mesh=None,
    steps=6,
    batch=8,
    seq=128,
    attention="xla",
    moe="ragged_dot",
    lr=1e-2,
    checkpoint=None,
    interval=100,
    precision="bf16",
    remat="full",
    **training,
) -> TrainerConfig:
    mesh = mesh or dict(data=1, fsdp=1, context=1, expert=1, tensor=1)
    return TrainerConfig(
        name="t",
        generation="v7x",
        topology="2x2x1",
        slices=1,
        hosts_per_slice=1,
        devices_per_host=8,
        peak_flops_per_device=2.3e15,
        model=dict(PRESETS[preset]),
        training=dict(
            steps=steps,
            global_batch=batch,
            sequence_length=seq,
            precision=precision,
            learning_rate=dict(peak=lr, warmup_steps=1, schedule="constant"),
            remat=dict(policy=remat),
            **training,
        ),
        mesh=mesh,
        kernels=dict(
            attention=attention,
            moe_matmul=moe,
            splash=SMALLEST_BLOCKS.model_dump(),
        ),
        checkpoint=dict(directory=checkpoint, interval=interval, keep=3),
        metrics_port=0,
    )  # 0: any free port


class Trainers:
    """Trainer subprocesses (`python -m tpu_workload`), killed in `close`."""

    def __init__(self, tmp_path):
        self.tmp_path, self.procs, self.n = tmp_path, [], 0

    def start(self, cfg: TrainerConfig, processes=1, devices=8, **env) -> list[subprocess.Popen]:
        self.n += 1
        path = self.tmp_path / f"config{self.n}.json"
        path.write_text(cfg.model_dump_json(by_alias=True))
        coordinator = f"127.0.0.1:{free_port()}"
        procs = []
        for i in range(processes):
            e = dict(
                os.environ,
                TPUJOB_PLATFORM="cpu",
                TPUJOB_CPU_DEVICES=str(devices),
                JAX_PLATFORMS="cpu",
                **{k: str(v) for k, v in env.items()},
            )
            e.pop("XLA_FLAGS", None)
            if processes > 1:
                e.update(
                    TPUJOB_COORDINATOR_ADDRESS=coordinator,
                    TPUJOB_NUM_PROCESSES=str(processes),
                    TPUJOB_PROCESS_ID=str(i),
                )
            err = open(self.tmp_path / f"stderr{self.n}.{i}.txt", "w")
            e.setdefault("TPUJOB_TERMINATION_LOG", str(self.tmp_path / f"termination{self.n}.{i}"))
            p = subprocess.Popen(
                [sys.executable, "-m", "tpu_workload", "--config", str(path)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            p.stderr_path, p.termination_path = err.name, e["TPUJOB_TERMINATION_LOG"]
            p.lines = _pump(p.stdout)
            procs.append(p)
        self.procs += procs
        return procs

    def run(self, cfg, processes=1, devices=8, timeout=240, **env) -> list[dict]:
        """Run to completion; the JSON lines of process 0."""
        procs = self.start(cfg, processes, devices, **env)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"trainer timed out; stderr:\n{self.stderr(p)}") from None
            assert p.returncode == 0, f"trainer exited {p.returncode}; stderr:\n{self.stderr(p)}"
        lines = []
        while (line := self.read_line(procs[0], timeout=30)) is not None:
            lines.append(line)
        return lines

    @staticmethod
    def stderr(p) -> str:
        with open(p.stderr_path) as f:
            return f.read()[-6000:]

    @staticmethod
    def read_line(p, timeout=120) -> dict | None:
        """Next JSON line from p's stdout within `timeout` seconds; None at EOF."""
        try:
            line = p.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no output from trainer in time") from None
        return json.loads(line) if line is not None else None

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def trainers(tmp_path):
    t = Trainers(tmp_path)
    try:
        yield t
    finally:
        t.close()


def _pump(stdout) -> queue.Queue:
    """Lines of `stdout` as they arrive, then None at EOF, read by a thread. (select() on the pipe
    with readline() misses lines already in the file object's buffer: a reader that fell behind
    would then see the last line only at EOF, i.e. after a lingering trainer had exited.)"""
    lines: queue.Queue = queue.Queue()

    def pump():
        with stdout:
            for line in stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def loss_and_grads(base, sh, seq: int):
    """`value_and_grad(**changes)`: the loss and gradients of `base` with `changes` made to its ModelConfig, on
    one fixed batch of 8 x `seq` tokens and `base`'s initial parameters, under mesh `sh`; two ways of
    computing the same model (chunks, slices, tiles) then compare (`compute="f32"`: the same model in f32,
    the reference)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tpu_workload.model import decoder as model_lib
    from tpu_workload.model import sharding

    params = nnx.split(model_lib.Decoder(base, nnx.Rngs(0)))[1].to_pure_dict()
    tokens_BT = jnp.asarray(np.random.default_rng(1).integers(0, base.dims.vocab, (8, seq), dtype=np.int32))
    targets_BT = jnp.roll(tokens_BT, -1, axis=1)
    pos_BT = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (8, seq))

    def value_and_grad(**changes):
        graphdef = nnx.split(model_lib.Decoder(dataclasses.replace(base, **changes), nnx.Rngs(0)))[0]

        @jax.jit
        def f(p):
            with sharding.use(sh):
                return jax.value_and_grad(
                    lambda q: model_lib.loss_fn(nnx.merge(graphdef, q), tokens_BT, targets_BT, pos_BT)[0]
                )(p)

        return f(params)

    return value_and_grad

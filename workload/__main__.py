"""`python -m tpu_workload --config FILE`: train the TrainerConfig in FILE (JSON).

Stdout of process 0 carries JSON lines only (one per logged step, then a summary with
"summary": true); human logs go to stderr. The exit code follows the contract in
`tpu_operator.api.lifecycle` (0 finished, 3 user error, 42 retryable, 143 stopped by SIGTERM after a
checkpoint, 1 unexpected), decided in `process/exits.py`, which also writes the termination record.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpu-workload", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainerConfig JSON file")
    args = parser.parse_args(argv)
    _reserve_stdout_for_json()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .loop.progress import Clock
    from .process import exits

    clock = Clock(started_at=time.time())
    shown: dict = {}  # what /status served last, for the termination record
    try:
        _train(args.config, clock, shown)
    except Exception as exc:  # every failure leaves through the one mapping to exit codes
        _exit_now(exits.fail(exc, clock.snapshot(), shown))
    return exits.finish(clock.snapshot(), shown)


def _exit_now(code: int) -> None:
    """Leave without the interpreter's exit handlers: jax.distributed's waits for every other process to
    shut down too (up to 5 minutes), which the peers of a failed process never do."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _train(config: str, clock, shown: dict) -> None:
    from tpu_operator.api.contract import TrainerConfig

    from .performance import compile_cache
    from .process import exits, metrics, runtime, serving

    with open(config) as f:
        cfg = TrainerConfig.model_validate_json(f.read())
    try:
        env = runtime.read_env()
        runtime.join_plan(env)
        if env.slices is not None and env.slices != cfg.slices:
            # An elastic job on fewer slices: the same global batch in more microbatches (docs/elastic.md).
            whole, cfg = cfg.slices, cfg.at_slices(env.slices)
            logging.getLogger("tpu_workload").info(
                "running on %d of %d slices: mesh %s, %d microbatches",
                env.slices,
                whole,
                cfg.mesh,
                cfg.training.microbatches,
            )
    except ValueError as exc:
        raise exits.UserError(f"environment contract: {exc}") from exc
    try:
        with exits.deadline(
            env.init_timeout_s, "joining the other processes (jax.distributed start-up)", clock.snapshot
        ):
            runtime.start(env)
    except Exception as exc:
        raise exits.Retryable(f"joining the other processes failed: {exits.error_line(exc)}") from exc

    import absl.flags
    import jax
    from jax.experimental import multihost_utils

    absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags on first use
    from .loop import faults, preemption, train
    from .performance import profiling

    if jax.process_count() > 1:  # a peer that joined and died at once would block the first step for good
        with exits.deadline(env.init_timeout_s, "the first collective across all processes", clock.snapshot):
            multihost_utils.sync_global_devices("tpujob:started")
    compile_cache.enable(cfg)
    port = env.metrics_port if env.metrics_port is not None else cfg.metrics_port
    status = metrics.Status(cfg.training.steps, jax.process_count(), progress=lambda: clock.snapshot().model_dump())
    main = jax.process_index() == 0
    # Only process 0 serves HTTP, so only process 0 traces a profile asked for (profiling.py).
    profiler = (
        profiling.for_config(cfg, train.tensorboard_dir(cfg, env.run_dir), status, metrics.emit) if main else None
    )
    # Process 0 serves /status and /metrics from start-up (compile included) until it exits.
    server = (
        metrics.serve(status, port, profile=profiler.answer, control_digest=serving.control_digest()) if main else None
    )
    try:
        train.run(
            cfg,
            peak_flops_per_device=runtime.peak_flops_per_device(env, cfg.peak_flops_per_device),
            run_dir=env.run_dir,
            status=status,
            clock=clock,
            extra_hooks=lambda run: [
                preemption.StopOnSigterm(run).hook(),
                *faults.hooks(run, jax.process_index()),
                *(profiler.hooks(run) if profiler else []),
            ],
        )
    except Exception:
        status.update(state="failed")
        raise
    finally:
        shown.update(status.snapshot())
        if profiler is not None:
            profiler.close(status.snapshot().get("step"))
    if server is not None:
        if env.linger_s > 0:
            logging.getLogger("tpu_workload").info("serving final metrics for %.0f s", env.linger_s)
            time.sleep(env.linger_s)
        server.shutdown()


def _reserve_stdout_for_json() -> None:
    """Native libraries (gloo, XLA) print to fd 1: point fd 1 at stderr, keep the real stdout for JSON."""
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(json_fd, "w", buffering=1)


if __name__ == "__main__":
    sys.exit(main())

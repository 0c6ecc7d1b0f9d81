"""`python -m tpu_workload --config FILE`: train the TrainerConfig in FILE (JSON).

Stdout of process 0 carries JSON lines only (one per logged step, then a summary with
"summary": true); human logs go to stderr. Exit 0 on completion, 1 on failure.
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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tpu_workload")

    from tpu_operator.api.contract import TrainerConfig

    from . import metrics, runtime

    with open(args.config) as f:
        cfg = TrainerConfig.model_validate_json(f.read())
    env = runtime.read_env()
    runtime.start(env)

    import absl.flags
    import jax

    absl.flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags on first use
    from . import train

    port = env.metrics_port if env.metrics_port is not None else cfg.metrics_port
    status = metrics.Status(cfg.training.steps, jax.process_count())
    # Process 0 serves /status and /metrics from start-up (compile included) until it exits.
    server = metrics.serve(status, port) if jax.process_index() == 0 else None
    try:
        train.run(cfg, peak_flops_per_device=runtime.peak_flops_per_device(env, cfg.peak_flops_per_device),
                  run_dir=env.run_dir, status=status)
    except Exception:
        status.update(state="failed")
        log.exception("training failed")
        return 1
    if server is not None:
        if env.linger_s > 0:
            log.info("serving final metrics for %.0f s", env.linger_s)
            time.sleep(env.linger_s)
        server.shutdown()
    return 0


def _reserve_stdout_for_json() -> None:
    """Native libraries (gloo, XLA) print to fd 1: point fd 1 at stderr, keep the real stdout for JSON."""
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(json_fd, "w", buffering=1)


if __name__ == "__main__":
    sys.exit(main())

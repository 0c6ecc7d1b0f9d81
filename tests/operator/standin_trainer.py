"""A stand-in for a trainer process, for the operator's profile tests: the trainer's own HTTP server
(`tpu_workload.process.metrics.serve`) and `Profiler` with a real JAX profiler, but no model: its "loop" is the
profiler's hook called for steps 1..STEPS once the file GO exists, with nothing to wait for.

    python tests/operator/standin_trainer.py LOGDIR GO STEPS

Prints its port on the first line of stdout. `/status` also counts the `POST /profile` requests it got
(`profile_posts`), so a test can see that a request was not sent twice.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"  # the profiler of another platform's plugin is not this test's

from tpu_workload.performance import profiling  # noqa: E402
from tpu_workload.process import metrics  # noqa: E402


class _Run:  # what Profiler.hooks reads of a hooks.Run
    start = 0


def main(logdir: str, go: str, steps: int) -> None:
    status = metrics.Status(steps, 1)
    profiler = profiling.Profiler(steps, logdir, status)
    posts = 0

    def answer(body: bytes):
        nonlocal posts
        posts += 1
        status.update(profile_posts=posts)
        return profiler.answer(body)

    server = metrics.serve(status, 0, profile=answer)
    print(server.server_address[1], flush=True)
    while not os.path.exists(go):
        time.sleep(0.05)
    profiler.hooks(_Run())
    for step in range(1, steps + 1):
        profiler.on_state(step, {})
        status.update(step=step)
    profiler.close(steps)
    time.sleep(600)  # serve the final status until the test ends


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

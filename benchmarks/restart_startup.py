"""Start-up of a restarted job with and without the persistent compilation cache, on the local runner.

    python benchmarks/restart_startup.py [--steps 12] [--fail-at 6]

Runs the quickstart job (2 hosts as processes) twice with `tpujob run --local`; a test fault makes
host 1 exit 42 after step --fail-at, so the slice restarts once and resumes from its checkpoint.
The first run has the compilation cache (`<checkpoint dir>/compilation-cache`, the default), the
second runs with TPUJOB_COMPILATION_CACHE=0. For each attempt it prints the trainer's own start-up
(process start -> first step done: jax.distributed, restore, compilation, the first step), and the
run's goodput and badput.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run(workdir: Path, steps: int, fail_at: int, cache: bool) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["checkpoint"].update(interval=2)
    doc["spec"]["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 0}
    doc["spec"]["runtime"] = {"env": [{"name": "TPUJOB_TEST_FAIL_AT_STEP", "value": f"{fail_at}:42@1"}]}
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "TPUJOB_COMPILATION_CACHE": "1" if cache else "0"}
    subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", "run", "--local", "-f", str(job), "--run-dir", str(workdir / "run")],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    records = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    attempts: dict[float, dict] = {}  # process start -> the attempt's first report
    for r in records:
        attempts.setdefault(r["progress"]["started_at"], r["progress"])
    firsts = list(attempts.values())
    status = yaml.safe_load((workdir / "run" / "status.yaml").read_text())["status"]
    return {
        "startup_s": [round(p["first_step_at"] - p["started_at"], 1) for p in firsts],
        "goodput": status["goodput"],
        "badput": status["badput"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fail-at", type=int, default=6)
    p.add_argument("--repeat", type=int, default=1, help="runs of each kind, interleaved")
    args = p.parse_args()
    for _ in range(args.repeat):
        for cache in (True, False):
            with tempfile.TemporaryDirectory() as d:
                result = run(Path(d), args.steps, args.fail_at, cache)
            assert len(result["startup_s"]) == 2, result
            first, restart = result["startup_s"]
            print(
                f"compilation cache {'on ' if cache else 'off'}: start-up first attempt {first:.1f} s, "
                f"restart {restart:.1f} s; goodput {result['goodput']:.3f}; badput {result['badput']}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Per-device HBM (and host memory of offloaded activations), what one step costs each device (matmul
FLOPs, collective bytes by kind over ICI and DCN, HBM traffic), the step-time bound those set, and the
compile time of every example's train step, compiled by libtpu for its slice.

    python benchmarks/plan.py [--loss-chunks N] [--largest N] [--dump DIR] [--json] [examples/*.yaml ...]

Each example is planned as `tpujob plan` plans it (a `python -m tpu_workload.performance.plan` child per job, the
job's flags, the catalogue's HBM and peaks; docs/plan.md says how the costs are read). `--loss-chunks 1`
forces the unchunked cross entropy (the step as it was before chunking: `model.loss_fn`'s
whole-vocabulary path), to measure what chunking saves. `--dump DIR` keeps each step's XLA dump in
DIR/<example>/slices-<n> (`python -m tpu_workload.performance.hlo_costs` on it lists where the FLOPs and bytes go).
Compile times are wall-clock on this machine: on 2 shared cores they vary up to 3x with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpu_operator.api.contract import PlanResult  # noqa: E402
from tpu_operator.api.derived import Plan  # noqa: E402
from tpu_operator.api.validation import parse_job, read_documents, read_text  # noqa: E402
from tpu_operator.rendering.plan_report import resource_lines  # noqa: E402
from tpu_operator.rendering.preflight import plan_args, plan_env  # noqa: E402

# The plan with the loss chunk count forced (a benchmark-only override).
FORCED = (
    "import sys, tpu_workload.loop.train as t; n = int(sys.argv.pop(1)); tiling = t.loss_tiling; "
    "t.loss_tiling = lambda cfg: (n, tiling(cfg)[1] if n > 1 else 1); "
    "from tpu_workload.performance.plan import main; sys.exit(main(sys.argv[1:]))"
)


def plan_one(path: Path, loss_chunks: int | None, dump: Path | None = None) -> tuple[PlanResult, float, object]:
    job = parse_job(read_documents(read_text(str(path)))[0])
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(Plan(job).trainer_config().model_dump_json(by_alias=True))
        head = (
            [sys.executable, "-m", "tpu_workload.performance.plan"]
            if loss_chunks is None
            else [sys.executable, "-c", FORCED, str(loss_chunks)]
        )
        start = time.perf_counter()
        keep = ["--keep-dump", str(dump / path.stem)] if dump else []
        proc = subprocess.run(
            [*head, *plan_args(job, str(config)), *keep],
            env={**os.environ, **plan_env(job)},
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise SystemExit(f"{path}: the plan printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return Plan(job).bounded(PlanResult.model_validate_json(lines[-1])), wall, job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="*", type=Path, help="job YAMLs (default: examples/*.yaml)")
    parser.add_argument("--loss-chunks", type=int, help="force this many cross-entropy chunks (1: unchunked)")
    parser.add_argument("--json", action="store_true", help="one JSON line per example")
    parser.add_argument("--largest", type=int, default=0, help="also print the N largest HBM allocations")
    parser.add_argument("--dump", type=Path, help="keep each step's XLA dump under DIR/<example>")
    args = parser.parse_args(argv)
    paths = args.examples or sorted((ROOT / "examples").glob("*.yaml"))
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; loss chunks "
        f"{args.loss_chunks or 'as the trainer picks'}",
        flush=True,
    )
    if not args.json:
        print(
            f"{'example':24} {'slice':14} {'devices':>7} {'state':>7} {'temps':>7} {'total':>7} {'HBM':>5} "
            f"{'host':>6} {'of':>5} {'fits':>5} {'compile':>8} {'wall':>6}",
            flush=True,
        )
    for path in paths:
        r, wall, job = plan_one(path, args.loss_chunks, args.dump)
        if args.json:
            print(
                json.dumps({"example": path.name, "wall_s": round(wall, 1), **r.model_dump(by_alias=True)}), flush=True
            )
            continue
        tpu = job.spec.tpu
        gib = lambda v: f"{v:7.2f}" if v is not None else "      -"  # noqa: E731
        print(
            f"{path.name:24} {tpu.generation + ' ' + tpu.topology + ' x' + str(tpu.slices):14} {r.devices or 0:7} "
            f"{gib(r.state_gib)} {gib(r.temporaries_gib)} {gib(r.hbm_per_device_gib)} "
            f"{r.hbm_capacity_gib or 0:5.0f} {r.host_per_device_gib or 0:6.2f} {r.host_capacity_gib or 0:5.0f} "
            f"{str(r.fits):>5} {r.compile_seconds or 0:7.1f}s {wall:5.0f}s"
            + ("" if r.verdict == "Fits" else f"  {r.verdict}: {r.message[:200]}"),
            flush=True,
        )
        if r.resources is not None:
            print("\n".join(f"    {line}" for line in resource_lines(r.resources)), flush=True)
        for allocation in r.largest[: args.largest]:
            print(f"    {allocation}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to validate and render a job: the v7x 4x4x4 example and a full 9,216-chip v7x pod.

    python benchmarks/render.py [--repeat N]

Prints the median and p95 over N runs of parse+validate+render, in milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import yaml

from tpu_operator.api.validation import parse_job
from tpu_operator.rendering.manifests import render

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama3-8b-fsdp.yaml"


def _time(doc: dict, repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        render(parse_job(doc))
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.95 * (len(samples) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    base = yaml.safe_load(EXAMPLE.read_text())
    pod = copy.deepcopy(base)
    pod["metadata"]["name"] = "full-pod"
    pod["spec"]["tpu"]["topology"] = "16x24x24"  # 144 cubes of 4x4x4 = 9,216 chips, 2,304 hosts
    pod["spec"]["training"]["globalBatch"] = 18432  # a multiple of the 18,432 devices
    render(parse_job(base))  # warm the template cache, as a running operator would be
    for label, doc in (("v7x 4x4x4 (64 chips, 16 hosts)", base), ("v7x 16x24x24 (9,216 chips, 2,304 hosts)", pod)):
        median, p95 = _time(doc, args.repeat)
        print(f"validate+render {label}: median {median:.2f} ms, p95 {p95:.2f} ms over {args.repeat} runs")


if __name__ == "__main__":
    main()

"""Training throughput of a preset: tokens/s, step time and MFU (median after compile).

    python benchmarks/train.py [--case dense|moe|context] [--preset P] [--steps N] [--devices N]

On CPU it uses N virtual devices (default 8) and the XLA kernels unless told otherwise; MFU
there is against runtime.CPU_PEAK_FLOPS_PER_DEVICE (nominal). On TPU: all devices, Splash/gmm.
Cases: `dense` (FSDP over every device), `moe` (tiny-moe, expert parallelism 2 x FSDP: the experts'
rows exchanged between devices), `context` (context parallelism 2 x FSDP at 256 tokens). The script
passes only config fields older trainers have too, so one run can time two checkouts, each with its
own venv: `python benchmarks/train.py --case moe` and `OLD/.venv/bin/python benchmarks/train.py
--case moe`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

# The cases: a preset, its sequence, and the mesh degrees that are not FSDP (FSDP takes the rest).
CASES = {
    "dense": dict(preset="tiny", seq=128, mesh={}),
    "moe": dict(preset="tiny-moe", seq=128, mesh={"expert": 2}),
    "context": dict(preset="tiny", seq=256, mesh={"context": 2}),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), default="dense")
    p.add_argument("--preset", default=None, help="model preset (default: the case's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (ignored on TPU)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default max(8, devices))")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the case's)")
    p.add_argument("--attention", choices=["splash", "xla"], default=None)
    p.add_argument("--moe-matmul", choices=["gmm", "ragged_dot"], default=None)
    p.add_argument("--remat", choices=["full", "minimal", "none"], default="full")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    args = p.parse_args()

    import jax

    from tpu_workload.process import runtime

    on_tpu = runtime.on_tpu_host(runtime.read_env()) and os.environ.get("JAX_PLATFORMS") != "cpu"
    if not on_tpu:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    import absl.flags

    absl.flags.FLAGS.mark_as_parsed()
    from tpu_operator.api.contract import TrainerConfig
    from tpu_operator.api.presets import PRESETS
    from tpu_workload.loop import train

    n = jax.device_count()
    batch = args.batch or max(8, n)
    case = CASES[args.case]
    preset, seq = args.preset or case["preset"], args.seq or case["seq"]
    mesh = {a: case["mesh"].get(a, 1) for a in ("data", "context", "expert", "tensor")}
    mesh["fsdp"] = n // (mesh["context"] * mesh["expert"] * mesh["tensor"])
    cfg = TrainerConfig(
        name="bench",
        generation="v7x",
        topology="2x2x1",
        slices=1,
        hosts_per_slice=1,
        devices_per_host=n,
        peak_flops_per_device=2.307e15 / 2,
        model=dict(PRESETS[preset]),
        training=dict(
            steps=args.steps,
            global_batch=batch,
            sequence_length=seq,
            precision=args.precision,
            remat=dict(policy=args.remat),
            learning_rate=dict(peak=1e-3, schedule="constant"),
        ),
        mesh=mesh,
        kernels=dict(
            attention=args.attention or ("splash" if on_tpu else "xla"),
            moe_matmul=args.moe_matmul or ("gmm" if on_tpu else "ragged_dot"),
        ),
        checkpoint={},
        metrics_port=0,
    )
    peak = cfg.peak_flops_per_device if on_tpu else runtime.CPU_PEAK_FLOPS_PER_DEVICE
    stdout, sys.stdout = sys.stdout, io.StringIO()  # the per-step JSON lines
    try:
        summary = train.run(cfg, peak_flops_per_device=peak)
    finally:
        sys.stdout = stdout
    # Older trainers named it tokens_per_s.
    tokens_per_s = getattr(summary, "global_tokens_per_s", None) or summary.tokens_per_s
    result = {
        "case": args.case,
        "preset": preset,
        "mesh": mesh,
        "devices": n,
        "platform": jax.default_backend(),
        "global_batch": batch,
        "sequence_length": seq,
        "steps_timed": summary.steps_timed,
        "step_time_s": summary.step_time_s,
        "global_tokens_per_s": tokens_per_s,
        "mfu": summary.mfu,
        "peak_flops_per_device": peak,
        "final_loss": summary.loss,
    }
    print(
        f"{args.case} ({preset}): {result['global_tokens_per_s']:.0f} tokens/s, step {1e3 * result['step_time_s']:.1f} ms, "
        f"MFU {100 * result['mfu']:.2f}% of {peak:.3g} FLOP/s x {n} ({result['platform']})",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

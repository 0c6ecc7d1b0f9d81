"""`tpujob report RUN_DIR`: loss, step time and MFU over steps as one PNG."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no metrics yet")
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    panels = [("loss", "loss", 1.0), ("step time (s)", "step_time_s", 1.0), ("MFU (%)", "mfu", 100.0)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), constrained_layout=True)
    for ax, (title, key, scale) in zip(axes, panels):
        ax.plot(steps, [r[key] * scale for r in records], marker=".", linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    # A restart shows as a step that does not exceed the one before it.
    for prev, cur in zip(records, records[1:]):
        if cur["step"] <= prev["step"]:
            for ax in axes:
                ax.axvline(cur["step"], color="tab:red", alpha=0.4, linestyle="--")
    fig.suptitle(f"{run_dir.name}: {len(records)} reports, last step {steps[-1]}")
    out = out or run_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""`tpujob report RUN_DIR`: training and eval loss, step time, time waiting for data and MFU over
steps, and where the wall time went (goodput and each badput bucket, from the run's status.yaml), as
one PNG. An elastic run's steps trained on fewer slices than the job asks for are shaded on every panel
(from the run's slices.json: when each attempt started, on how many slices)."""

from __future__ import annotations

import json
from pathlib import Path


def _number(value: object) -> float:
    """A JSON line's value as a float: a diverged step's loss is the string "nan", "inf" or "-inf" (JSON
    has no token for them; docs/divergence.md), plotted as matplotlib plots a NaN (a gap); missing is 0."""
    if isinstance(value, str):
        return float(value) if value in ("nan", "inf", "-inf") else 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no metrics yet")
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    panels = [
        ("loss", "loss", 1.0),
        ("step time (s)", "step_time_s", 1.0),
        ("waiting for data (ms per step)", "data_wait_s", 1e3),
        ("MFU (%)", "mfu", 100.0),
    ]
    status = _status(run_dir)
    columns = len(panels) + (1 if status.get("badput") else 0)
    fig, axes = plt.subplots(1, columns, figsize=(4.3 * columns, 3.6), constrained_layout=True)
    if status.get("badput"):
        _wall_time(axes[-1], status)
    for ax, (title, key, scale) in zip(axes, panels):
        ax.plot(
            steps,
            [_number(r.get(key)) * scale for r in records],
            marker=".",
            linewidth=1.2,
            label="train" if key == "loss" else None,
        )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:  # the held-out loss on the loss panel (training.eval)
        axes[0].plot(
            [r["step"] for r in evaluated],
            [_number(r["eval_loss"]) for r in evaluated],
            marker="o",
            linewidth=1.2,
            color="tab:orange",
            label="eval",
        )
        axes[0].legend()
    for first, last, n, desired in _fewer_slices(run_dir, records):
        for i, ax in enumerate(axes[: len(panels)]):
            ax.axvspan(
                first - 0.5,
                last + 0.5,
                color="tab:orange",
                alpha=0.15,
                label=f"on {n} of {desired} slices" if i == 1 else None,
            )
        axes[1].legend()
    # A restart shows as a step that does not exceed the one before it.
    for prev, cur in zip(records, records[1:]):
        if cur["step"] <= prev["step"]:
            for ax in axes[: len(panels)]:
                ax.axvline(cur["step"], color="tab:red", alpha=0.4, linestyle="--")
    fig.suptitle(f"{run_dir.name}: {len(records)} reports, last step {steps[-1]}")
    out = out or run_dir / "report.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _fewer_slices(run_dir: Path, records: list[dict]) -> list[tuple[int, int, int, int]]:
    """(first step, last step, slices, desired) of each attempt that ran on fewer slices than desired. An
    attempt's records are those whose trainer started at or after it and before the next attempt."""
    path = run_dir / "slices.json"
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    history, desired = doc.get("history") or [], doc.get("desired")
    spans = []
    for i, (started, n) in enumerate(history):
        if desired is None or n >= desired:
            continue
        until = history[i + 1][0] if i + 1 < len(history) else float("inf")
        steps = [r["step"] for r in records if started <= ((r.get("progress") or {}).get("started_at") or -1) < until]
        if steps:
            spans.append((min(steps), max(steps), n, desired))
    return spans


def _status(run_dir: Path) -> dict:
    path = run_dir / "status.yaml"
    if not path.exists():
        return {}
    import yaml

    return (yaml.safe_load(path.read_text()) or {}).get("status") or {}


def _wall_time(ax, status: dict) -> None:
    """Goodput and the badput buckets as seconds of wall time, one bar each."""
    from ..api.goodput import BUCKETS

    badput = status["badput"]
    wall = sum(badput.get(b, 0.0) for b in BUCKETS) / max(1e-9, 1 - status.get("goodput", 0.0))
    names = ["goodput", *BUCKETS]
    seconds = [status.get("goodput", 0.0) * wall, *(badput.get(b, 0.0) for b in BUCKETS)]
    ax.barh(names[::-1], seconds[::-1], color=["tab:gray"] * len(BUCKETS) + ["tab:green"])
    ax.set_title(f"wall time (s): goodput {100 * status.get('goodput', 0.0):.1f}%")
    ax.grid(alpha=0.3, axis="x")

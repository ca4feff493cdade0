"""What a sweep reports: each run's numbers from its metrics.jsonl, the table (markdown, CSV, JSON)
and the plot (see the package docstring for the columns)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...telemetry.jsonl import read_jsonl

COLUMNS = ("n", "label", "mesh", "status", "exit_code", "tokens_per_s", "step_time_s", "peak_mem_bytes",
           "val_accuracy", "val_loss", "steps", "wall_s", "run_dir")


@dataclass
class Row:
    n: int
    label: str
    mesh: str
    status: str = "ok"
    exit_code: int | None = 0
    tokens_per_s: float = math.nan
    step_time_s: float = math.nan
    peak_mem_bytes: float = math.nan
    val_accuracy: float = math.nan
    val_loss: float = math.nan
    steps: int = 0
    wall_s: float = math.nan
    run_dir: str = ""
    error: str = field(default="", repr=False)


def summarize_metrics(path: Path) -> dict[str, Any]:
    """The table's numbers from one run's metrics.jsonl (see the module docstring)."""
    records = read_jsonl(path)
    train = [r for r in records if r.get("type") == "train" and not r.get("skipped")]
    evals = [r for r in records if r.get("type") == "eval" and r.get("split") == "validation"]
    summary = [r for r in records if r.get("type") == "summary"]
    timed = [r for r in train if r.get("step_time_s")]
    total_time = sum(r["step_time_s"] for r in timed)
    peaks = [r["peak_mem_bytes"] for r in train + summary if r.get("peak_mem_bytes") is not None]
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / total_time if total_time else math.nan,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed) if timed else math.nan,
        "peak_mem_bytes": max(peaks) if peaks else math.nan,
        "val_accuracy": evals[-1]["accuracy"] if evals and evals[-1]["accuracy"] is not None else math.nan,
        "val_loss": evals[-1]["loss"] if evals else math.nan,
        "steps": max((r["step"] for r in train), default=0),
        "finished": bool(summary),
    }


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| n | run | mesh | tokens/s | median step (s) | peak memory (MiB) | val accuracy | val loss | steps "
            "| status |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        mem = r.peak_mem_bytes / 2**20 if not math.isnan(r.peak_mem_bytes) else math.nan
        lines.append(f"| {r.n} | {r.label} | {r.mesh} | {_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.step_time_s, '.4f')} | "
                     f"{_fmt(mem, '.0f')} | {_fmt(r.val_accuracy, '.4f')} | {_fmt(r.val_loss, '.4f')} | {r.steps} | "
                     f"{r.status}{': ' + r.error.replace('|', '/') if r.error else ''} |")
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def write_outputs(rows: Sequence[Row], root: Path) -> None:
    """sweep.json (every field), sweep.csv (the table's columns, full precision), sweep.md, sweep.png."""
    records = [{k: _json_safe(v) for k, v in asdict(r).items()} for r in rows]
    (root / "sweep.json").write_text(json.dumps({"columns": list(COLUMNS), "runs": records}, indent=1) + "\n")
    with open(root / "sweep.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    (root / "sweep.md").write_text(markdown_table(rows))
    plot(rows, root / "sweep.png")


def plot(rows: Sequence[Row], path: Path) -> None:
    """Four bar charts, one bar per run (failed runs: an empty slot marked 'failed')."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    panels = [("tokens_per_s", "throughput (tokens/s)", 1.0), ("step_time_s", "median step time (s)", 1.0),
              ("peak_mem_bytes", "peak memory (MiB)", 2.0**-20), ("val_accuracy", "final validation accuracy", 1.0)]
    labels = [r.label for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(max(8.0, 1.3 * len(rows) + 4), 7), constrained_layout=True)
    for ax, (key, title, scale) in zip(axes.flat, panels):
        values = [getattr(r, key) * scale for r in rows]
        xs = range(len(rows))
        ax.bar(xs, [0.0 if math.isnan(v) else v for v in values],
               color=["tab:blue" if r.status == "ok" else "tab:red" for r in rows])
        for x, v, r in zip(xs, values, rows):
            if r.status != "ok":
                ax.text(x, 0, "failed", ha="center", va="bottom", color="tab:red", rotation=90)
            elif not math.isnan(v):
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_xticks(list(xs), labels, rotation=30 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center")
    fig.suptitle(f"distzo sweep: {len(rows)} runs")
    fig.savefig(path, dpi=100)
    plt.close(fig)

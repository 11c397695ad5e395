"""The loss curve PNG (matplotlib, Agg backend: works without a display).

Training loss, the held-out loss when the run measured it (`eval.every`) and the learning rate,
with a legend that names each line."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the display-free backend)

from bridge.atomic_files import replacing


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of metrics.jsonl; a partial last line (a run killed mid-write) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_loss(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    metrics = read_metrics(metrics_path)
    rows = [r for r in metrics if "loss" in r]
    held_out = [r for r in metrics if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    lines = ax.plot(
        [r["step"] for r in rows], [r["loss"] for r in rows], color="tab:blue", label="training loss"
    )
    if held_out:
        lines += ax.plot(
            [r["step"] for r in held_out],
            [r["eval_loss"] for r in held_out],
            color="tab:green",
            marker="o",
            markersize=3,
            label="held-out loss",
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    values = [r["loss"] for r in rows] + [r["eval_loss"] for r in held_out]
    if values and min(values) > 0:
        ax.set_yscale("log")
    ax2 = ax.twinx()
    lines += ax2.plot(
        [r["step"] for r in rows],
        [r["lr"] for r in rows],
        color="tab:orange",
        alpha=0.6,
        label="learning rate",
    )
    ax2.set_ylabel("learning rate")
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right")
    ax.set_title(title or "training loss")
    fig.tight_layout()
    with replacing(png_path) as tmp:  # a kill mid-write leaves the previous plot, not half of one
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return Path(png_path)

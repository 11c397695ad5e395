"""The loss curve PNG (matplotlib, Agg backend: works without a display)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color="tab:blue", label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if rows and min(r["loss"] for r in rows) > 0:
        ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in rows], [r["lr"] for r in rows], color="tab:orange", alpha=0.6, label="lr")
    ax2.set_ylabel("learning rate")
    ax.set_title(title or "training loss")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)

"""DDP on the CPU with the gloo backend: `bridge train --nproc 2` (which launches torchrun) gives the
same per-step losses as one rank with the same global batch.

Why they can match: every rank takes its slice of the same seeded global batch (sampler.py), the
loss is a per-sample mean averaged over samples (so the mean of two ranks' means is the global
mean) and DDP averages gradients. Stated tolerance: 1e-4 absolute on each logged loss (float
reduction order differs between 1 and 2 processes; observed differences are ~1e-7).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4

RECIPE = {
    "name": "ddp",
    "seed": 0,
    "stage": "finetune",
    "model": {
        "tiny": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 16,
            "intermediate_size": 64,
        }
    },
    "encoder": {
        "modality": "graph",
        "tower": {"name": "gin", "dim": 32, "num_layers": 2, "readout_tokens": 2},
        "projector": {"name": "mlp", "num_layers": 2},
    },
    "data": {"source": "graphs", "prompt": "<graph>", "num_train": 64, "num_eval": 8},
    "train": {
        "max_steps": 4,
        "lr": 1e-2,
        "log_every": 1,
        "progress": False,
        "device": "cpu",
        "trainable": {"tower": True},
    },
    "eval": {"enabled": False},
}


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    return [r["loss"] for r in rows]


def test_two_gloo_ranks_match_one_rank_with_the_same_global_batch(tmp_path):
    recipe = tmp_path / "ddp.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    base = [sys.executable, "-m", "bridge", "train", str(recipe)]
    one = subprocess.run(
        [*base, "--output-dir", str(tmp_path / "one"), "train.batch_size=8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [*base, "--output-dir", str(tmp_path / "two"), "--nproc", "2", "train.batch_size=4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert "torch.distributed.run" in two.stdout  # the shortcut really launched torchrun
    meta = json.loads((tmp_path / "two" / "checkpoints" / "step_4" / "meta.json").read_text())
    assert meta["world_size"] == 2
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert l1[-1] < l1[0]  # it trains
    for a, b in zip(l1, l2):
        assert abs(a - b) <= TOLERANCE, (l1, l2)

"""A run that tells you what happened: its summary, its reruns, resumes with other settings,
Ctrl-C, the held-out loss, and every miss in eval.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bridge.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "train.max_steps=4",
    "train.checkpoint_every=2",
    "train.batch_size=4",
    "train.log_every=1",
    "data.num_train=32",
    "data.num_eval=12",
    "eval.num_items=12",
    "eval.max_tokens=4",
    "eval.num_samples=2",
    "eval.every=2",
    "eval.loss_items=6",
]


def _strict_json(text: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_run_summary_rerun_resume_and_changed_settings(tmp_path, capsys):
    out = tmp_path / "run"
    # shapes trains the whole LLM: each checkpoint writes an HF model dir (transformers' own bar)
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK]) == 0
    captured = capsys.readouterr()
    summary = _strict_json(captured.out)
    assert summary["eval_json"] == str(out / "eval.json") and summary["loss_png"] == str(out / "loss.png")
    assert summary["checkpoint"] == str(out / "checkpoints" / "step_4") and summary["elapsed_s"] > 0
    assert "Writing model shards" not in captured.err and "Loading weights" not in captured.err
    assert f"last checkpoint: {out / 'checkpoints' / 'step_4'}" in captured.err.strip().splitlines()[-1]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    report = json.loads((out / "eval.json").read_text())
    hits = round(report["exact_match"] * report["n"])
    assert len(report["misses"]) == report["num_misses"] == report["n"] - hits  # every miss, not a sample
    assert all({"target", "output"} <= set(m) for m in report["misses"]) and len(report["samples"]) == 2

    # the same command again: complete, valid JSON, no NaN loss
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK]) == 0
    captured = capsys.readouterr()
    again = _strict_json(captured.out)
    assert again["already_complete"] is True and again["final_loss"] == rows[-2]["loss"]
    assert "run already complete: step 4" in captured.err

    # more steps: resumes, says so first, and lists what changed
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK, "train.max_steps=5"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0] == f"resumed from step 4 ({out / 'checkpoints' / 'step_4'})"
    assert lines[1] == "settings changed since that checkpoint:"
    assert lines[2].strip() == "train.max_steps: 4 -> 5"

    # a different encoder or data: refused before anything is written, unless --force
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK, "encoder.projector.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert "refusing to resume" in err and "encoder.projector.num_layers: 2 -> 3" in err
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK, "data.num_train=40"]) == 2
    assert "data.num_train: 32 -> 40" in capsys.readouterr().err
    assert main(["demo", "shapes", "--output-dir", str(out), *QUICK, "data.num_train=40", "--force"]) == 0
    assert "data.num_train: 32 -> 40" in capsys.readouterr().err


def test_ctrl_c_says_where_to_resume_and_exits_130(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "bridge", "demo", "graphs", "--output-dir", str(out)]
    cmd += ["train.max_steps=100000", "train.checkpoint_every=3", "train.batch_size=4", "train.log_every=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step_3" / "meta.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.poll() else ""
            )
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("bridge: interrupted at step ") and "rerun the same command to resume" in last
    assert "the last checkpoint is step " in last


@pytest.mark.parametrize("key", ["prompt", "text"])
def test_bridge_api_prompt_key_text_alias_and_hidden_size(tmp_path, key):
    from bridge.api import Bridge

    bridge = Bridge.from_recipe(ROOT / "recipes" / "demo" / "graphs.yaml", output_dir=tmp_path, device="cpu")
    assert bridge.hidden_size == 64
    graph = {"num_nodes": 4, "edges": [[0, 1], [1, 2], [2, 3]]}
    requests = bridge.build_requests([{key: "<graph>", "graph": graph}])
    assert requests[0]["prompt_embeds"].shape[1] == bridge.hidden_size
    with pytest.raises(ValueError, match="one 'prompt' string"):
        bridge.build_requests([{"prompt": "<graph>", "text": "<graph>", "graph": graph}])

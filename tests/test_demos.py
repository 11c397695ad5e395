"""The built-in demos: each recipe runs end to end through `bridge train` (a few steps here; the
full runs, which must reach exact_match >= 0.9 on 200 held-out items, take under a minute each on
an idle 2-core CPU; they are part of the default suite, and BRIDGE_FULL_DEMOS=0 skips them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.data.sources import build_datasets
from bridge.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DEMOS = ("shapes", "tones", "graphs")


@pytest.mark.parametrize("name", DEMOS)
def test_demo_synthetic_sets_are_deterministic_and_held_out(name):
    recipe = load_recipe(ROOT / "recipes" / "demo" / f"{name}.yaml")
    train, held_out = build_datasets(recipe.data, recipe.seed)
    again, _ = build_datasets(recipe.data, recipe.seed)
    assert len(held_out) >= 200
    a, b = train[3], again[3]
    assert a.target == b.target and a.prompt == b.prompt
    targets = {train[i].target for i in range(200)}
    assert len(targets) > 5  # a real captioning task, not one answer
    words = set(train.vocab_words())
    assert all(set(t.split()) <= words for t in targets)


@pytest.mark.parametrize("name", DEMOS)
def test_demo_runs_end_to_end_briefly(name, tmp_path, capsys):
    out = tmp_path / name
    code = main(
        [
            "demo",
            name,
            "--output-dir",
            str(out),
            "train.max_steps=2",
            "train.progress=false",
            "train.checkpoint_every=1",
            "eval.num_items=4",
            "data.num_train=64",
            "train.batch_size=4",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.rindex("{\n") :])
    assert summary["steps"] == 2 and summary["eval_n"] == 4
    report = json.loads((out / "eval.json").read_text())
    assert report["n"] == 4 and {"exact_match", "samples"} <= set(report)
    assert (out / "loss.png").is_file() and (out / "checkpoints" / "step_2" / "meta.json").is_file()
    assert (out / "checkpoints" / "step_2" / "llm" / "config.json").is_file()  # LLM trained in demos


FULL_DEMOS_OFF = os.environ.get("BRIDGE_FULL_DEMOS") == "0"


@pytest.fixture(scope="module")
def full_demo_runs(tmp_path_factory):
    """The three full demo trainings, started together: each trains on one thread (the recipes set
    train.cpu_threads: 1), so on a 2-core CI machine running them side by side saves about a minute
    of the suite's wall time against running them one after another."""
    root = tmp_path_factory.mktemp("full_demos")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name in DEMOS:
        out = root / name
        procs[name] = (out, subprocess.Popen(
            [sys.executable, "-m", "bridge", "train", str(ROOT / "recipes" / "demo" / f"{name}.yaml"),
             "--output-dir", str(out), "train.progress=false"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    yield procs
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.skipif(FULL_DEMOS_OFF, reason="full demo runs skipped (BRIDGE_FULL_DEMOS=0)")
@pytest.mark.parametrize("name", DEMOS)
def test_full_demo_reaches_target(name, full_demo_runs):
    out, proc = full_demo_runs[name]
    printed, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, printed[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["n"] >= 200
    assert report["exact_match"] >= 0.9, report["samples"]


def test_bridge_api_generates_like_the_evaluation(tmp_path, capsys):
    """Bridge.from_checkpoint(...).generate with a PIL image gives what eval.json recorded, and the
    request it hands the runner is one (n, hidden) tensor with the is_token_ids mask and token ids."""
    import torch

    from bridge.api import Bridge

    out = tmp_path / "shapes"
    assert (
        main(
            [
                "demo",
                "shapes",
                "--output-dir",
                str(out),
                "train.max_steps=2",
                "train.progress=false",
                "eval.num_items=3",
                "data.num_train=16",
                "train.batch_size=4",
            ]
        )
        == 0
    )
    capsys.readouterr()
    report = json.loads((out / "eval.json").read_text())
    bridge = Bridge.from_checkpoint(out, device="cpu")
    recipe = load_recipe(ROOT / "recipes" / "demo" / "shapes.yaml")
    _, held_out = build_datasets(recipe.data, recipe.seed)
    prompts = [{"text": held_out[i].prompt, "image": held_out[i].media["image"][0]} for i in range(3)]
    request = bridge.build_requests(prompts[:1])[0]
    embeds, mask, ids = request["prompt_embeds"], request["prompt_is_token_ids"], request["prompt_token_ids"]
    rows = bridge.encoders["image"].num_rows(prompts[0]["image"])
    assert embeds.shape == (len(ids), 64) and mask.dtype == torch.bool and int((~mask).sum()) == rows
    outs = bridge.generate(prompts, max_tokens=recipe.eval.max_tokens)
    assert [o.outputs[0].text for o in outs] == [s["output"] for s in report["samples"]]


def test_bridge_from_recipe_generates_with_an_untrained_encoder(tmp_path):
    from bridge.api import Bridge

    bridge = Bridge.from_recipe(ROOT / "recipes" / "demo" / "graphs.yaml", output_dir=tmp_path, device="cpu")
    graph = {"num_nodes": 5, "edges": [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0]]}
    outs = bridge.generate([{"text": "<graph>", "graph": graph}, "plain text, no media"], max_tokens=4)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    with pytest.raises(ValueError, match="placeholders"):
        bridge.build_requests([{"text": "<graph> <graph>", "graph": graph}])


def test_cli_reports_recipe_errors_and_prints_defaults(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "recipes" / "demo" / "graphs.yaml").read_text() + "\ntrian: {}\n")
    assert main(["train", str(bad), "--output-dir", str(tmp_path / "o")]) == 2
    assert "unknown key 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    assert main(["train", str(ROOT / "recipes" / "demo" / "graphs.yaml"), "train.lr=-1"]) == 2
    assert "train.lr: must be > 0" in capsys.readouterr().err
    assert main(["defaults"]) == 0
    assert "train.cache_tower_outputs = False" in capsys.readouterr().out

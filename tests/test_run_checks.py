"""What `bridge train` refuses before it writes anything: data it cannot read (every media path of
the train and eval JSONL, all problems at once, `file:line`), output folders it cannot use, symlink
loops, and targets longer than the model's context (or cuts them, with `data.truncate: true`).
Also: recipe files read numbers as YAML 1.2 does (`3e-3` is a float)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from bridge.cli import main
from bridge.recipe import load_recipe, load_yaml

ROOT = Path(__file__).resolve().parents[1]
#: a tiny one-step run: a 1-layer LLM with a 64-token context reading graphs from JSONL
QUICK = ["train.max_steps=1", "train.batch_size=2", "train.progress=false", "eval.enabled=false"]


def _graph_recipe(folder: Path, train_rows: list, eval_rows: list | None = None, **data) -> Path:
    (folder / "g.json").write_text(json.dumps({"num_nodes": 3, "edges": [[0, 1], [1, 2]]}))
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    raw = {
        "name": "checks",
        "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                           "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64}},
        "encoder": {"modality": "graph", "tower": {"name": "gin", "dim": 32, "num_layers": 1,
                                                   "readout_tokens": 2},
                    "projector": {"name": "linear"}},
        "data": {"source": "jsonl", "train": "train.jsonl", "prompt": "<graph>", **data},
    }
    if eval_rows is not None:
        (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
        raw["data"]["eval"] = "eval.jsonl"
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_recipe_file_numbers_are_yaml_1_2_floats(tmp_path):
    path = _graph_recipe(tmp_path, [{"graph": "g.json", "text": "a"}])
    text = path.read_text() + "train: {lr: 3e-3, llm_lr: 5E-5, weight_decay: 1e-4, betas: [0.9, 9.99e-1]}\n"
    path.write_text(text)
    r = load_recipe(path)
    assert (r.train.lr, r.train.llm_lr, r.train.weight_decay) == (3e-3, 5e-5, 1e-4)
    assert r.train.betas == [0.9, 0.999]
    assert load_yaml("{a: 1.5e3, b: +2E-1, c: 1_000, d: '3e-3', e: 1e, f: x1e3, g: 0x1e3}") == {
        "a": 1500.0, "b": 0.2, "c": 1000, "d": "3e-3", "e": "1e", "f": "x1e3", "g": 483}


def test_missing_media_exits_2_naming_file_line_and_writes_nothing(tmp_path, capsys):
    """Every bad row of train and eval in one message, before the output folder exists."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "a_folder.png").mkdir()
    rows = [{"image": "ok.png", "text": "a red circle"}] * 3
    rows[1] = {"image": "missing.png", "text": "a red circle"}
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad_eval = [{"image": "a_folder.png", "text": "x"}, {"image": "ok.png"}, "not json"]
    (tmp_path / "eval.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in bad_eval))
    out = tmp_path / "out"
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    argv = ["demo", "shapes", "--output-dir", str(out), "data.source=jsonl", f"data.train={train}",
            f"data.eval={held_out}", "data.options={}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert not out.exists() and "Traceback" not in err
    assert err.startswith("bridge: 4 problems found before training (nothing was written):"), err
    for line in (f"{train}:2: image file {tmp_path / 'missing.png'}: file not found",
                 f"{held_out}:1: image file {tmp_path / 'a_folder.png'}: is a folder, not a file",
                 f"{held_out}:2: missing string field 'text'",
                 f"{held_out}:3: not valid JSON"):
        assert line in err, (line, err)


def test_problems_are_a_bounded_list_with_a_count(tmp_path):
    from bridge.data.jsonl_check import KEEP_PROBLEMS, scan_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"image": f"m{i}.png", "text": "x"}) + "\n" for i in range(500)))
    scan = scan_jsonl(path, prompt="<image>")
    assert scan.rows == 500 and scan.num_problems == 500 and len(scan.problems) == KEEP_PROBLEMS
    assert scan.problems[0] == f"{path}:1: image file {tmp_path / 'm0.png'}: file not found"


@pytest.mark.parametrize("case", ["file", "parent_file", "symlink_loop"])
def test_unusable_output_folder_is_one_line_exit_2(tmp_path, capsys, case):
    recipe = _graph_recipe(tmp_path, [{"graph": "g.json", "text": "a"}])
    if case == "file":
        out = tmp_path / "taken"
        out.write_text("x")
        expected = f"output folder {out}: is a file, not a folder"
    elif case == "parent_file":
        (tmp_path / "taken").write_text("x")
        out = tmp_path / "taken" / "run"
        expected = f"output folder {out}: cannot be created, {tmp_path / 'taken'} is a file"
    else:
        out = tmp_path / "loop"
        os.symlink(out, out)
        expected = f"output folder {out}: symlink loop at {out}"
    assert main(["train", str(recipe), "--output-dir", str(out), *QUICK]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_read_only_output_folder_is_one_line_exit_2(tmp_path):
    """A folder the run cannot write to. Root ignores permission bits, so as root the folder is a
    read-only bind mount in a private mount namespace (what a read-only filesystem gives)."""
    recipe = _graph_recipe(tmp_path, [{"graph": "g.json", "text": "a"}])
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = [sys.executable, "-m", "bridge", "train", str(recipe), "--output-dir", str(ro / "run"), *QUICK]
    if os.geteuid() != 0:
        ro.chmod(0o555)
        expected = "Permission denied"
    elif shutil.which("unshare") and subprocess.run(["unshare", "-m", "true"]).returncode == 0:
        cmd = ["unshare", "-m", "sh", "-c", f'mount --bind -o ro "{ro}" "{ro}" && exec "$@"', "sh", *cmd]
        expected = "Read-only file system"
    else:
        pytest.skip("running as root without mount namespaces: no folder is read-only here")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"output folder {ro / 'run'}: cannot write there (its parent {ro}): {expected}" in done.stderr
    assert "Traceback" not in done.stderr and not (ro / "run").exists()


def test_data_train_symlink_loop_is_named(tmp_path, capsys):
    recipe = _graph_recipe(tmp_path, [{"graph": "g.json", "text": "a"}])
    loop = tmp_path / "loop.jsonl"
    os.symlink(loop, loop)
    out = tmp_path / "out"
    assert main(["train", str(recipe), "--output-dir", str(out), f"data.train={loop}", *QUICK]) == 2
    err = capsys.readouterr().err
    assert f"data.train: symlink loop (too many levels of symbolic links): {loop}" in err, err
    assert "Traceback" not in err and not out.exists()


def test_target_longer_than_the_context_is_refused_or_cut(tmp_path, capsys):
    """A 100-word target against a 64-token context: refused by default (file:line, exit 2, nothing
    written); with data.truncate: true the run trains and says how many targets it cut."""
    long_row = {"graph": "g.json", "text": " ".join(["ring"] * 100)}
    recipe = _graph_recipe(tmp_path, [{"graph": "g.json", "text": "a ring"}, long_row, long_row])
    out = tmp_path / "out"
    assert main(["train", str(recipe), "--output-dir", str(out), *QUICK]) == 2
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'train.jsonl'}:2: the target is 101 tokens (with EOS), longer than the model's "
            f"context (64); shorten it, or set data.truncate: true") in err, err
    assert f"{tmp_path / 'train.jsonl'}:3: the target is 101 tokens" in err and not out.exists()

    assert main(["train", str(recipe), "--output-dir", str(out), "data.truncate=true", *QUICK]) == 0
    err = capsys.readouterr().err
    assert ("bridge: data.truncate: 2 target(s) longer than the model's context (64 tokens) are cut to fit "
            f"(the first: {tmp_path / 'train.jsonl'}:2, 101 tokens)") in err, err
    from bridge.data.tokenize import tokenize_target
    from bridge.training.trainer import Trainer

    trainer = Trainer(load_recipe(recipe, ["data.truncate=true", *QUICK]), out)
    example = trainer.train_set[1]  # what the loader hands the collate
    n_target = len(tokenize_target(trainer.tokenizer, example.target))
    assert 50 < n_target < 64 and example.target.startswith("ring ring")


def test_fit_to_context_cuts_the_target_at_a_token_boundary():
    from bridge.data.example import Example
    from bridge.data.tokenize import tokenize_prompt, tokenize_target
    from bridge.tiny_models import build_tokenizer
    from bridge.training.fit_context import FitToContext

    tok = build_tokenizer(["ring", "red"])
    rows = {"graph": lambda item: 5}
    data = [Example("<graph> describe:", "a red ring " * 40, {"graph": [{}]}),
            Example("<graph>", "a red ring", {"graph": [{}]})]
    fitted = FitToContext(data, tok, rows, context=32)
    short = fitted[0]
    n_prompt = len(tokenize_prompt(tok, short.prompt, short.media, rows).ids)
    cut, full = tokenize_target(tok, short.target), tokenize_target(tok, data[0].target)
    assert n_prompt + len(cut) <= 32 and n_prompt + len(cut) >= 30  # filled, not over
    assert cut[:-1] == full[: len(cut) - 1] and cut[-1] == tok.eos_token_id  # a prefix, EOS kept
    assert fitted[1] is data[1]  # what fits is untouched
    with pytest.raises(ValueError, match="the prompt alone is"):
        FitToContext(data, tok, {"graph": lambda item: 40}, context=32)[0]


def test_the_check_and_the_data_set_number_lines_alike(tmp_path):
    """JSONL lines end at "\\n" only: a U+2028 inside a JSON string is not a line break for either."""
    from bridge.data.jsonl import JsonlDataset
    from bridge.data.jsonl_check import scan_jsonl

    (tmp_path / "g.json").write_text(json.dumps({"num_nodes": 3, "edges": [[0, 1], [1, 2]]}))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"graph": "g.json", "text": "a\u2028b"}, ensure_ascii=False) + "\n{oops\n",
                    encoding="utf-8")
    assert scan_jsonl(path, prompt="<graph>").problems == [
        f"{path}:2: not valid JSON: Expecting property name enclosed in double quotes at column 2"]
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        JsonlDataset(path, prompt="<graph>")

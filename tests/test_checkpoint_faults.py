"""Checkpoints against faults and tampering: planted code-running pickles never run, a damaged
newest checkpoint is skipped for the previous good one (a warning names what is wrong), a partial
metrics line and killed saves' temp folders are cleaned up on resume."""

from __future__ import annotations

import builtins
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import recipe

from bridge.training import checkpoint as ckpt_io
from bridge.training.trainer import Trainer

STEPS = ("stage=finetune", "train.lora.rank=2", "train.max_steps=2", "train.checkpoint_every=1")
READ_ON_RESUME = (
    "meta.json", "encoder/graph/model.safetensors", "llm_trainable.safetensors", "trainer_state.pt"
)


class _WritesMarker:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.path!r}, 'w').write('ran')",))


def _evil_bytes(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"optimizer": _WritesMarker(marker)}, buffer)
    raw = buffer.getvalue()
    torch.load(io.BytesIO(raw), weights_only=False)  # prove it is live: an unsafe load runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    return raw


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 2-step LoRA run with checkpoints step_1 and step_2 (copied per test)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    Trainer(recipe(*STEPS), out).run()
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file())


def test_checkpoints_carry_a_manifest_that_verifies(run):
    for step in ("step_1", "step_2"):
        ckpt = run / "checkpoints" / step
        manifest = json.loads((ckpt / "manifest.json").read_text())
        listed = set(manifest["files"])
        assert listed == {p.relative_to(ckpt).as_posix() for p in _files(ckpt)} - {"manifest.json"}
        assert set(READ_ON_RESUME) <= listed and ckpt_io.verify_checkpoint(ckpt) == []
    resumed = Trainer(recipe(*STEPS), run)
    assert resumed.resumed_from.name == "step_2" and resumed.step == 2


def test_planted_pickles_in_every_file_never_run(run, tmp_path):
    marker = tmp_path / "marker"
    evil = _evil_bytes(marker)
    newest = run / "checkpoints" / "step_2"
    for path in _files(newest):
        path.write_bytes(evil)
    # the manifest (planted too) no longer verifies: step_2 is skipped, step_1 resumes
    with pytest.warns(ckpt_io.CheckpointWarning, match="skipping damaged checkpoint .*step_2"):
        resumed = Trainer(recipe(*STEPS), run)
    assert resumed.resumed_from.name == "step_1" and not marker.exists()

    # an attacker who also rewrites the manifests: every reader refuses, nothing runs
    for step in ("step_1", "step_2"):
        ckpt = run / "checkpoints" / step
        for path in _files(ckpt):
            path.write_bytes(evil)
        ckpt_io.write_manifest(ckpt)
    with pytest.raises(ValueError, match="meta.json"):
        Trainer(recipe(*STEPS), run)
    assert not marker.exists()


@pytest.mark.parametrize("name", READ_ON_RESUME)
def test_each_file_read_on_resume_refuses_a_planted_pickle(run, tmp_path, name):
    marker = tmp_path / "marker"
    ckpt = run / "checkpoints" / "step_2"
    (ckpt / name).write_bytes(_evil_bytes(marker))
    ckpt_io.write_manifest(ckpt)  # the manifest agrees: only the reader stands in the way
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as info:
        Trainer(recipe(*STEPS), run)
    assert not marker.exists() and len(str(info.value)) < 600


def test_truncated_file_in_newest_checkpoint_falls_back_and_the_run_heals(run):
    weights = run / "checkpoints" / "step_2" / "encoder" / "graph" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])
    expected = rf"model.safetensors: {size // 2} bytes, the manifest says {size}"
    with pytest.warns(ckpt_io.CheckpointWarning, match=expected):
        resumed = Trainer(recipe(*STEPS), run)
    assert resumed.resumed_from.name == "step_1" and resumed.step == 1
    resumed.run()  # re-saves step_2 whole
    assert ckpt_io.verify_checkpoint(run / "checkpoints" / "step_2") == []


def test_every_checkpoint_damaged_is_a_clear_error_not_a_restart(run):
    for step in ("step_1", "step_2"):
        (run / "checkpoints" / step / "trainer_state.pt").write_bytes(b"")
    with pytest.warns(ckpt_io.CheckpointWarning), pytest.raises(ValueError, match="no intact checkpoint"):
        Trainer(recipe(*STEPS), run)


def test_checkpoint_without_manifest_resumes_unverified_with_a_warning(run):
    (run / "checkpoints" / "step_2" / "manifest.json").unlink()
    with pytest.warns(ckpt_io.CheckpointWarning, match="no manifest.json"):
        assert Trainer(recipe(*STEPS), run).resumed_from.name == "step_2"


def test_partial_last_metrics_line_is_dropped_on_resume(run):
    metrics = run / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join(rows) + '\n{"step": 3, "lo')  # killed mid-write
    (run / "checkpoints" / "step_2").rename(run / "checkpoints" / "gone")
    Trainer(recipe(*STEPS), run).run()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2]


def test_stale_temp_folders_are_removed_at_start(run):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    root = run / "checkpoints"
    stale = [root / f".tmp-step_3-{dead_pid}", root / f".old-step_2-{dead_pid}"]
    live = root / ".tmp-step_3-1"  # pid 1 is always running: a save in progress elsewhere
    for folder in (*stale, live):
        (folder / "encoder").mkdir(parents=True)
    Trainer(recipe(*STEPS), run)
    assert not any(p.exists() for p in stale) and live.exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"", "not a valid safetensors"), (b"\x08\x00\x00\x00\x00\x00\x00\x00{}", "not a valid safetensors"),
     (b"garbage" * 10, "not a valid safetensors")],
)
def test_damaged_tensor_files_name_the_file(tmp_path, content, match):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path}: {match}"):
        ckpt_io.load_tensors(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [('{"step": 3', "not valid JSON"), ("[1, 2]", "expected a JSON object, got list"),
     ('{"step": "x"}', "'step' must be an integer")],
)
def test_damaged_meta_names_the_file(tmp_path, text, match):
    (tmp_path / "meta.json").write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        ckpt_io.read_meta(tmp_path)
    assert str(tmp_path / "meta.json") in str(info.value)


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [("model.safetensors", b"", "not a valid safetensors"),
     ("model.safetensors", None, "not a valid safetensors"),  # truncated to half
     ("config.json", b"[1]", "expected a JSON object, got list"),
     ("config.json", b'{"tower": ', "not valid JSON")],
)
def test_damaged_encoder_checkpoint_files_name_the_file(run, name, content, match):
    from encoders.api import load_encoder

    folder = run / "checkpoints" / "step_2" / "encoder" / "graph"
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if content is None else content)
    with pytest.raises(ValueError, match=match) as info:
        load_encoder(folder)
    assert str(path) in str(info.value)


def test_every_load_path_verifies_the_manifest_unless_told_not_to(run, capsys):
    """16 flipped bytes in the encoder's weights: Bridge.from_checkpoint (a run or a checkpoint),
    the server's loader and `bridge eval` refuse, naming the file; verify=False loads it."""
    from bridge.api import Bridge
    from bridge.cli import main
    from bridge.serve.engine_build import resolve_model

    step = run / "checkpoints" / "step_2"
    weights = step / "encoder" / "graph" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-16:] = bytes(b ^ 0xFF for b in raw[-16:])
    weights.write_bytes(bytes(raw))
    named = f"{weights}: checksum differs from the manifest"
    for target in (run, step):
        with pytest.raises(ValueError, match="does not match its manifest") as info:
            Bridge.from_checkpoint(target, device="cpu")
        assert named in str(info.value)
    with pytest.raises(ValueError, match="does not match its manifest"):
        resolve_model(run)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err

    loaded = Bridge.from_checkpoint(run, device="cpu", verify=False)
    assert "graph" in loaded.encoders
    assert set(resolve_model(run, verify=False).encoders) == {"graph"}


def test_half_written_base_model_is_rebuilt_and_the_run_resumes(run, capsys):
    """A kill just after base_model/config.json appeared (an older Bridge wrote it in place) left it
    0 bytes: the rerun rebuilds the folder (same seed and words: the same weights, so the
    checkpoints still fit) instead of failing on it, and resumes."""
    from bridge.training.components import model_dir_problem

    base = run / "base_model"
    weights = (base / "model.safetensors").read_bytes()
    (base / "config.json").write_text("")
    (base / "model.safetensors").unlink()
    (run / ".base_model.tmp-999999999").mkdir()  # a killed writer's temp folder
    summary = Trainer(recipe(*STEPS, "train.max_steps=3"), run).run()
    assert summary["steps"] == 3 and summary["resumed_from"].endswith("step_2")
    assert model_dir_problem(base) is None and (base / "model.safetensors").read_bytes() == weights
    assert not (run / ".base_model.tmp-999999999").exists()
    said = capsys.readouterr().err
    assert f"rebuilding {base}: it is incomplete ({base / 'config.json'}: not valid JSON" in said


def test_files_a_run_writes_are_replaced_whole_or_not_at_all(tmp_path):
    from bridge.atomic_files import replacing_dir, write_text_atomic

    target = tmp_path / "base_model"
    with replacing_dir(target) as tmp:
        (tmp / "config.json").write_text("{}")
    with pytest.raises(RuntimeError), replacing_dir(target) as tmp:
        (tmp / "config.json").write_text("{")  # killed half way: the old folder stays
        raise RuntimeError("killed")
    assert (target / "config.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == [
        "base_model"]
    write_text_atomic(tmp_path / "eval.json", "{}")
    assert (tmp_path / "eval.json").read_text() == "{}" and len(list(tmp_path.iterdir())) == 2

"""JSONL data against bad rows and damaged media: every failure is a ValueError naming file:line
(and the media file), at load time where a cheap check can see it, else at first read; a corrupt
eval item is found before training starts."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from bridge.data.jsonl import JsonlDataset
from bridge.data.sources import build_datasets
from encoders.audio_inputs import save_wav


@pytest.fixture
def media(tmp_path):
    """Good media files plus damaged ones, in tmp_path."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "ok.png")
    raw = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "garbage.png").write_bytes(b"not an image at all")
    save_wav(tmp_path / "ok.wav", torch.zeros(800), 16000)
    wav = bytearray((tmp_path / "ok.wav").read_bytes())
    wav[24:28] = struct.pack("<I", 0)  # the fmt chunk's sample rate
    (tmp_path / "rate0.wav").write_bytes(bytes(wav))
    (tmp_path / "ok.json").write_text(json.dumps({"num_nodes": 3, "edges": [[0, 1], [1, 2]]}))
    (tmp_path / "syntax.json").write_text('{"num_nodes": 3, "edges": [[0, 1]')
    (tmp_path / "badgraph.json").write_text(json.dumps({"num_nodes": 2, "edges": [[0, 7]]}))
    return tmp_path


def _jsonl(path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("row", "prompt", "match"),
    [
        ({"image": 5, "text": "x"}, "<image>", r"'image' must be a file path .* got 5"),
        ({"image": ["ok.png", None], "text": "x"}, "<image> <image>", "'image' must be a file path"),
        ({"img": "ok.png", "text": "x"}, "<image>", r"unknown media key 'img'; media keys are image, audio"),
        ({"audio": "rate0.wav", "text": "x"}, "<audio>", r"audio file .*rate0.wav: the WAV .* sample rate 0"),
        ({"graph": "syntax.json", "text": "x"}, "<graph>", r"graph file .*syntax.json: not valid JSON"),
        ({"graph": "badgraph.json", "text": "x"}, "<graph>", r"graph .*badgraph.json: .*outside \[0, 2\)"),
        ({"image": "garbage.png", "text": "x"}, "<image>", r"image file .*garbage.png: not a readable image"),
        ({"image": "missing.png", "text": "x"}, "<image>", r"image file .*missing.png: file not found"),
        ({"text": "x"}, "<image>", "placeholders"),
        ({"text": "x", "prompt": 3}, "<image>", "'prompt' must be a string"),
    ],
)
def test_bad_rows_fail_at_load_naming_file_and_line(media, row, prompt, match):
    path = _jsonl(media / "d.jsonl", {"text": "fine", "prompt": "plain text"}, row)
    with pytest.raises(ValueError, match=match) as info:
        JsonlDataset(path, prompt=prompt)
    assert "d.jsonl:2:" in str(info.value) and len(str(info.value)) < 600


def test_truncated_png_fails_at_first_read_naming_file_line_and_image(media):
    rows = {"image": "ok.png", "text": "a"}, {"image": "truncated.png", "text": "b"}
    path = _jsonl(media / "d.jsonl", *rows)
    data = JsonlDataset(path, prompt="<image>")  # the header is intact: loads
    assert data[0].media["image"][0].size == (16, 16)
    with pytest.raises(ValueError, match=r"d.jsonl:2: image file .*truncated.png: cannot decode the image"):
        data[1]


def test_corrupt_item_only_in_the_eval_set_is_found_before_training(media):
    train = _jsonl(media / "train.jsonl", {"image": "ok.png", "text": "a"})
    rows = {"image": "ok.png", "text": "a"}, "", {"image": "truncated.png", "text": "b"}
    held = _jsonl(media / "eval.jsonl", *rows)
    spec = {"source": "jsonl", "train": train, "eval": held, "prompt": "<image>", "target_field": "text"}
    with pytest.raises(ValueError, match=r"eval.jsonl:3: image file .*truncated.png"):
        build_datasets(spec, seed=0)
    (media / "eval.jsonl").write_text(json.dumps({"image": "ok.png", "text": "b"}) + "\n")
    train_set, eval_set = build_datasets(spec, seed=0)
    assert len(train_set) == 1 and len(eval_set) == 1


def test_good_rows_of_every_modality_load(media):
    path = _jsonl(
        media / "d.jsonl",
        {"image": "ok.png", "text": "a", "shot": "ok.png"},  # a template field may hold a path
        {"audio": "ok.wav", "prompt": "<audio> hear", "text": "b", "shot": ""},
        {"graph": ["ok.json"], "prompt": "<graph>", "text": "c", "note": "metadata is fine", "shot": ""},
    )
    data = JsonlDataset(path, prompt="<image> {shot}")
    assert data[0].prompt == "<image> ok.png" and data[0].media["image"][0].size == (16, 16)
    assert data[1].media["audio"] == [str(media / "ok.wav")]
    assert data[2].media["graph"][0]["num_nodes"] == 3
    data.check_all_items()

"""runner.worker.model_files.check_model_files: a damaged model directory is one ValueError naming the
file and what is wrong, checked from metadata before anything loads it."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from safetensors.torch import load_file

from bridge import tiny_models
from runner.worker.model_files import check_model_files


@pytest.fixture(scope="module")
def model_dir(tiny_model_root):
    return tiny_models.build_tiny_model(tiny_model_root / "model_files", "qwen3", num_layers=1)


@pytest.fixture
def copy(model_dir, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(model_dir, out)
    return out


def test_intact_tiny_model_passes(model_dir):
    check_model_files(str(model_dir))
    assert load_file(str(model_dir / "model.safetensors"))  # and it really is loadable


def _truncate(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


def _header(path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


@pytest.mark.parametrize(
    ("damage", "file", "match"),
    [
        (lambda p: p.write_bytes(b""), "model.safetensors", "0 bytes, too short"),
        (lambda p: _truncate(p, p.stat().st_size - 10), "model.safetensors", "holds .* \\(truncated"),
        (lambda p: _truncate(p, 200), "model.safetensors", "does not fit|holds"),
        (lambda p: p.write_bytes(b"\xff" * 64), "model.safetensors", "does not fit"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"[1,2"), "model.safetensors", "not valid JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "model.safetensors", "not a JSON object"),
        (lambda p: p.write_text("[1, 2]"), "config.json", "expected a JSON object, got list"),
        (lambda p: p.write_text('{"model_type": "qw'), "config.json", "not valid JSON"),
        (lambda p: _truncate(p, p.stat().st_size // 2), "tokenizer.json", "not valid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe{}"), "tokenizer_config.json", "not UTF-8"),
        (lambda p: p.unlink(), "config.json", "missing"),
    ],
)
def test_damaged_files_are_named(copy, damage, file, match):
    damage(copy / file)
    with pytest.raises(ValueError, match=match) as info:
        check_model_files(str(copy))
    assert str(copy / file) in str(info.value) and len(str(info.value)) < 400


def test_header_lies_about_a_tensor_are_caught(copy):
    path = copy / "model.safetensors"
    n, header = _header(path)
    name = next(k for k in header if k != "__metadata__")
    body = path.read_bytes()[8 + n :]
    for lie, match in [({"dtype": "Q9"}, "unknown dtype"), ({"shape": [10**6]}, "needs"),
                       ({"data_offsets": [5, 1]}, "malformed data_offsets")]:
        bad = {**header, name: {**header[name], **lie}}
        text = json.dumps(bad).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + body)
        with pytest.raises(ValueError, match=match):
            check_model_files(str(copy))


def test_a_missing_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        check_model_files(str(tmp_path / "nope"))


def test_llm_construction_checks_the_files_first(tmp_path):
    """`LLM(...)` runs the check before transformers reads anything: the error names the file."""
    from bridge.tiny_models import build_tiny_model
    from runner import LLM

    model_dir = build_tiny_model(tmp_path / "m", "llama", seed=0, hidden_size=32, num_layers=1,
                                 num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32)
    weights = next(model_dir.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(ValueError, match=weights.name):
        LLM(model_dir, device="cpu", num_kv_blocks=8)

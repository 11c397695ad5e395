"""Encoder core: registries, projectors, the runner protocol, hashing, save/load and its errors."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from encoders.api import (
    PROJECTORS,
    TOWERS,
    Encoder,
    build_encoder,
    build_preprocessor,
    build_projector,
    build_tower,
    content_hash,
    load_encoder,
    stack_frames,
    tiny_encoder_config,
)

HIDDEN = 48


def _image(color, size=(40, 36)):
    return Image.new("RGB", size, color)


def _items(modality):
    if modality == "image":
        return [_image((255, 0, 0)), _image((0, 90, 200), (20, 50))]
    if modality == "audio":
        g = torch.Generator().manual_seed(0)
        return [torch.randn(16000, generator=g) * 0.1, (torch.randn(6000, generator=g) * 0.1, 8000)]
    return [{"num_nodes": 3, "edges": [[0, 1], [1, 2]]}, {"num_nodes": 6, "edges": [[0, 1], [2, 3], [4, 5]]}]


@pytest.fixture(scope="module")
def encoders_by_modality():
    torch.manual_seed(0)
    return {m: build_encoder(tiny_encoder_config(m, HIDDEN)).eval() for m in ("image", "audio", "graph")}


# ----------------------------------------------------------------------------- registry
def test_registries_list_builtin_parts():
    build_tower({"name": "gin"})  # triggers registration of all built-ins
    assert {
        "open_clip",
        "hf_vision",
        "conv",
        "conformer",
        "wav2vec2",
        "whisper_hf",
        "gcn",
        "gin",
        "gat",
    } <= set(TOWERS)
    assert {"identity", "linear", "mlp", "stack_swiglu", "perceiver"} <= set(PROJECTORS)


def test_preprocessor_registry():
    mel = build_preprocessor({"name": "log_mel", "n_mels": 20, "hop_length": 100})
    assert mel(torch.randn(1000)).shape == (11, 20)
    with pytest.raises(ValueError, match="valid preprocessor names: log_mel"):
        build_preprocessor({"name": "fbank"})


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match=r"unknown tower name 'resnet9000'.*valid tower names: .*conformer"):
        build_tower({"name": "resnet9000"})
    with pytest.raises(ValueError, match=r"unknown projector name 'qformer'.*valid projector names: .*mlp"):
        build_projector({"name": "qformer"}, 8, 8)
    with pytest.raises(ValueError, match="no 'name' key"):
        build_tower({"dim": 3})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['numlayers'\]"):
        build_tower({"name": "gin", "numlayers": 3})
    with pytest.raises(ValueError, match="unknown config key"):
        build_encoder({**tiny_encoder_config("graph", HIDDEN), "frozen": True})
    with pytest.raises(ValueError, match="missing required key 'llm_hidden_size'"):
        build_encoder({"tower": {"name": "gin"}, "projector": {"name": "linear"}})
    with pytest.raises(ValueError, match="does not match tower"):
        build_encoder({**tiny_encoder_config("graph", HIDDEN), "modality": "image"})


# ----------------------------------------------------------------------------- projectors
@pytest.mark.parametrize(
    "cfg,rows_in,rows_out",
    [
        ({"name": "linear"}, 10, 10),
        ({"name": "mlp", "num_layers": 3, "hidden_dim": 20}, 10, 10),
        ({"name": "stack_swiglu", "stack": 4}, 10, 3),
        ({"name": "perceiver", "num_queries": 5, "num_layers": 1, "num_heads": 4}, 10, 5),
    ],
)
def test_projector_shapes_and_rows(cfg, rows_in, rows_out):
    proj = build_projector(cfg, 12, 16)
    assert proj.output_rows(rows_in) == rows_out
    x = torch.randn(2, rows_in, 12)
    y, lengths = proj(x, torch.tensor([rows_in, 7]))
    assert y.shape == (2, rows_out, 16)
    if lengths is not None:
        assert lengths.tolist() == [rows_out, proj.output_rows(7)]


def test_stack_frames_keeps_every_real_frame():
    x = torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 5, 2)
    y, lengths = stack_frames(x, torch.tensor([5, 3]), 2)
    assert y.shape == (2, 3, 4) and lengths.tolist() == [3, 2]
    assert torch.equal(y[0, 2], torch.tensor([8.0, 9.0, 0.0, 0.0]))  # last real frame + zero pad
    assert torch.equal(y[1, 1], torch.cat([x[1, 2], torch.zeros(2)]))  # padding frames zeroed


def test_perceiver_ignores_padding():
    proj = build_projector(
        {"name": "perceiver", "num_queries": 3, "num_layers": 2, "num_heads": 2}, 8, 8
    ).eval()
    x = torch.randn(1, 4, 8)
    padded = torch.cat([x, torch.randn(1, 3, 8) * 100], dim=1)
    a, _ = proj(x, torch.tensor([4]))
    b, _ = proj(padded, torch.tensor([4]))
    assert torch.allclose(a, b, atol=1e-5)


# ----------------------------------------------------------------------------- runner protocol
@pytest.mark.parametrize("modality", ["image", "audio", "graph"])
def test_encode_rows_match_num_rows(encoders_by_modality, modality):
    enc = encoders_by_modality[modality]
    items = _items(modality)
    outs = enc.encode(items)
    assert len(outs) == len(items)
    for item, out in zip(items, outs):
        assert out.shape == (enc.num_rows(item), HIDDEN)
        assert out.device == enc.device and not out.requires_grad and torch.isfinite(out).all()
    assert enc.modality == modality and enc.is_realtime is False
    assert enc.encode([]) == []


def test_encoder_meets_runner_protocol(encoders_by_modality):
    protocol = pytest.importorskip("runner.multimodal.encoder_protocol")
    for enc in encoders_by_modality.values():
        assert isinstance(enc, protocol.EncoderProtocol)
    checked = protocol.check_encoders(dict(encoders_by_modality))
    assert set(checked) == {"image", "audio", "graph"}


@pytest.mark.parametrize("modality", ["image", "audio", "graph"])
def test_batched_encode_matches_single(encoders_by_modality, modality):
    enc = encoders_by_modality[modality]
    items = _items(modality)
    batched = enc.encode(items)
    for item, out in zip(items, batched):
        assert torch.allclose(enc.encode([item])[0], out, atol=1e-4)


def test_content_hash_stable_and_content_sensitive(encoders_by_modality, tmp_path):
    img = encoders_by_modality["image"]
    red, red2, blue = _image((255, 0, 0)), _image((255, 0, 0)), _image((0, 0, 255))
    assert img.content_hash(red) == img.content_hash(red2) != img.content_hash(blue)
    red.save(tmp_path / "red.png")
    assert img.content_hash(tmp_path / "red.png") == img.content_hash(red)  # decoded pixels, not container
    almost = red.copy()
    almost.putpixel((3, 3), (254, 0, 0))
    assert img.content_hash(almost) != img.content_hash(red)
    aud = encoders_by_modality["audio"]
    wave = torch.randn(800)
    assert aud.content_hash(wave) == aud.content_hash(wave.clone())
    assert aud.content_hash((wave, 16000)) != aud.content_hash((wave, 8000))  # rate is content
    nudged = wave.clone()
    nudged[5] += 1e-3
    assert aud.content_hash(nudged) != aud.content_hash(wave)
    gr = encoders_by_modality["graph"]
    g = {"num_nodes": 3, "edges": [[0, 1], [1, 2]]}
    assert gr.content_hash(g) == gr.content_hash(json.loads(json.dumps(g)))
    assert gr.content_hash(g) != gr.content_hash({"num_nodes": 3, "edges": [[0, 1], [0, 2]]})
    assert gr.content_hash(g) != gr.content_hash({**g, "directed": True})
    assert len(content_hash("graph", g)) == 64


# ----------------------------------------------------------------------------- training path
def test_forward_is_differentiable_and_freeze_flags_work():
    torch.manual_seed(0)
    enc = build_encoder(tiny_encoder_config("graph", HIDDEN, freeze_tower=True))
    assert all(not p.requires_grad for p in enc.tower.parameters())
    assert enc.trainable_parameters() and all(p.requires_grad for p in enc.projector.parameters())
    enc.train()
    assert enc.training and not enc.tower.training  # frozen tower stays in eval mode
    batch = enc.collate([enc.preprocess(g) for g in _items("graph")])
    outs = enc(batch)
    sum(o.square().sum() for o in outs).backward()
    assert all(p.grad is not None for p in enc.projector.parameters())
    enc.set_trainable(tower=True)
    assert all(p.requires_grad for p in enc.tower.parameters()) and enc.config["freeze_tower"] is False


@pytest.mark.parametrize("modality", ["image", "audio", "graph"])
def test_tower_rows_then_project_rows_equals_forward(encoders_by_modality, modality):
    enc = encoders_by_modality[modality]
    batch = enc.collate([enc.preprocess(x) for x in _items(modality)])
    with torch.no_grad():
        direct = enc(batch)
        cached = enc.tower_rows(batch)
        assert [r.shape[-1] for r in cached] == [enc.tower.out_dim] * len(cached)
        staged = enc.project_rows(cached)
    for a, b in zip(direct, staged):
        assert torch.allclose(a, b, atol=1e-5)


# ----------------------------------------------------------------------------- streaming
def test_streaming_audio_fixed_rows_per_chunk():
    torch.manual_seed(0)
    enc = build_encoder(tiny_encoder_config("audio", HIDDEN, streaming={"chunk_samples": 1600})).eval()
    assert enc.is_realtime and enc.rows_per_chunk > 0
    wave = torch.randn(4000) * 0.1  # 2.5 chunks -> 3 chunks, the last zero padded
    assert enc.num_rows(wave) == 3 * enc.rows_per_chunk
    full = enc.encode([wave])[0]
    assert full.shape == (3 * enc.rows_per_chunk, HIDDEN)
    padded = torch.nn.functional.pad(wave, (0, 800))
    chunks = [enc.encode_stream(padded[i * 1600 : (i + 1) * 1600]) for i in range(3)]
    assert all(c.shape == (enc.rows_per_chunk, HIDDEN) for c in chunks)
    assert torch.allclose(torch.cat(chunks), full, atol=1e-5)
    with pytest.raises(ValueError, match="more than chunk_samples=1600"):
        enc.encode_stream(torch.randn(1601))
    with pytest.raises(ValueError, match="streaming"):
        build_encoder(tiny_encoder_config("graph", HIDDEN, streaming={"chunk_samples": 10}))


# ----------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("modality", ["image", "audio", "graph"])
def test_save_load_round_trip(encoders_by_modality, modality, tmp_path):
    enc = encoders_by_modality[modality]
    enc.save(tmp_path / "enc")
    assert (tmp_path / "enc" / "config.json").is_file() and (tmp_path / "enc" / "model.safetensors").is_file()
    loaded = Encoder.load(tmp_path / "enc").eval()
    assert loaded.config == enc.config
    for key, value in enc.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    items = _items(modality)
    for a, b in zip(enc.encode(items), loaded.encode(items)):
        assert torch.equal(a, b)


def test_load_reports_missing_unexpected_and_shape_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    enc = build_encoder(tiny_encoder_config("graph", HIDDEN))
    enc.save(tmp_path / "enc")
    weights = tmp_path / "enc" / "model.safetensors"
    state = load_file(str(weights))
    missing_key = "projector.net.0.bias"
    state.pop(missing_key)
    state["projector.extra.weight"] = torch.zeros(2)
    state["tower.readout.queries"] = torch.zeros(7, 64)
    save_file(state, str(weights))
    with pytest.raises(ValueError) as err:
        load_encoder(tmp_path / "enc")
    message = str(err.value)
    assert f"missing from checkpoint (1): {missing_key}" in message
    assert "unexpected in checkpoint (1): projector.extra.weight" in message
    assert (
        "shape mismatch for tower.readout.queries: checkpoint has (7, 64), model expects (4, 64)" in message
    )


def test_load_reports_bad_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_encoder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_encoder(tmp_path / "empty")
    enc = build_encoder(tiny_encoder_config("graph", HIDDEN))
    enc.save(tmp_path / "enc")
    (tmp_path / "enc" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_encoder(tmp_path / "enc")


def test_tiny_config_rejects_unknown_modality():
    with pytest.raises(ValueError, match="valid: \\['audio', 'graph', 'image'\\]"):
        tiny_encoder_config("video", 8)

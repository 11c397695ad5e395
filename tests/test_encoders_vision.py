"""Image towers: open_clip (tiny config, arch names, local weights), HF CLIP/SigLIP dirs, conv."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from encoders.api import build_encoder, build_tower, load_encoder, load_image

HIDDEN = 40


def _pictures():
    a = Image.new("RGB", (48, 40), (250, 10, 10))
    b = Image.fromarray((np.random.default_rng(0).random((30, 30, 3)) * 255).astype(np.uint8))
    return [a, b]


def test_load_image_accepts_common_forms(tmp_path):
    pil = Image.new("RGB", (6, 4), (1, 2, 3))
    pil.save(tmp_path / "x.png")
    for item in (
        pil,
        tmp_path / "x.png",
        str(tmp_path / "x.png"),
        (tmp_path / "x.png").read_bytes(),
        np.asarray(pil),
        torch.from_numpy(np.array(pil)).permute(2, 0, 1),
    ):
        out = load_image(item)
        assert out.mode == "RGB" and out.size == (6, 4) and out.getpixel((0, 0)) == (1, 2, 3)
    with pytest.raises(ValueError, match="does not exist"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="unsupported image item"):
        load_image(3.5)


def test_open_clip_tiny_patch_tokens():
    torch.manual_seed(0)
    tower = build_tower({"name": "open_clip", "arch": "bridge-tiny-vit"}).eval()
    assert tower.num_tokens == (32 // 8) ** 2 and tower.out_dim == 64
    pixels = tower.collate([tower.preprocess(p) for p in _pictures()])
    assert pixels["pixel_values"].shape == (2, 3, 32, 32)
    tokens, lengths = tower(pixels)
    assert tokens.shape == (2, 16, 64) and lengths is None
    # the final tokens are open_clip's own ln_post'ed patch tokens (output_tokens path)
    tower.visual.output_tokens = True
    _, reference = tower.visual(pixels["pixel_values"])
    assert torch.allclose(tokens, reference, atol=1e-5)


def test_open_clip_layer_and_cls_options():
    torch.manual_seed(0)
    tower = build_tower({"name": "open_clip", "arch": "bridge-tiny-vit", "layer": -2, "keep_cls": True})
    assert len(tower.visual.transformer.resblocks) == 1  # blocks after the chosen one are dropped
    tokens, _ = tower(tower.collate([tower.preprocess(_pictures()[0])]))
    assert tokens.shape == (1, 17, 64) and tower.output_rows(None) == 17
    with pytest.raises(ValueError, match="layer 5 is out of range"):
        build_tower({"name": "open_clip", "arch": "bridge-tiny-vit", "layer": 5})


def test_open_clip_arch_names_resolve():
    # ViT-B-32's visual tower (88M parameters) builds from open_clip's config in well under a second
    tower = build_tower({"name": "open_clip", "arch": "ViT-B-32"})
    assert tower.num_tokens == 49 and tower.out_dim == 768
    assert tower.transform.transforms[0].size == 224
    tower = build_tower({"name": "open_clip", "arch": "ViT-B-16", "vision_cfg": {"layers": 1}})
    assert tower.num_tokens == 196 and len(tower.visual.transformer.resblocks) == 1
    with pytest.raises(ValueError, match="unknown arch 'ViT-Q-99'"):
        build_tower({"name": "open_clip", "arch": "ViT-Q-99"})
    with pytest.raises(ValueError, match="pretrained file .* does not exist"):
        build_tower({"name": "open_clip", "arch": "bridge-tiny-vit", "pretrained": "/nonexistent/clip.bin"})


def test_open_clip_preprocessing_is_open_clips_own():
    import open_clip

    _, _, preprocess_val = open_clip.create_model_and_transforms("ViT-B-32")  # random init, no download
    tower = build_tower({"name": "open_clip", "arch": "ViT-B-32"})
    picture = Image.fromarray((np.random.default_rng(1).random((300, 260, 3)) * 255).astype(np.uint8))
    assert torch.equal(tower.preprocess(picture), preprocess_val(picture))


def test_open_clip_pretrained_local_file(tmp_path):
    import open_clip
    from safetensors.torch import save_file

    torch.manual_seed(1)
    source = build_tower({"name": "open_clip", "arch": "bridge-tiny-vit"})
    # a full-CLIP style checkpoint: visual.* keys next to other towers' keys
    full = {
        f"visual.{k}": v
        for k, v in open_clip.model._build_vision_tower(64, source._cfg["model_cfg"]["vision_cfg"])
        .state_dict()
        .items()
    }
    full["text.token_embedding.weight"] = torch.zeros(3, 4)
    torch.save(full, tmp_path / "clip.pt")
    tower = build_tower(
        {"name": "open_clip", "arch": "bridge-tiny-vit", "pretrained": str(tmp_path / "clip.pt")}
    )
    assert torch.equal(tower.visual.conv1.weight, full["visual.conv1.weight"])
    bad = dict(full)
    bad["visual.conv1.weight"] = torch.zeros(1)
    save_file({k: v.contiguous() for k, v in bad.items()}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"shape mismatch for conv1.weight: checkpoint has \(1,\)"):
        build_tower(
            {"name": "open_clip", "arch": "bridge-tiny-vit", "pretrained": str(tmp_path / "bad.safetensors")}
        )


def test_open_clip_encoder_save_load_without_pretrained_file(tmp_path):
    torch.manual_seed(0)
    enc = build_encoder(
        {
            "tower": {"name": "open_clip", "arch": "bridge-tiny-vit"},
            "projector": {"name": "mlp"},
            "llm_hidden_size": HIDDEN,
            "freeze_tower": True,
        }
    )
    enc.save(tmp_path / "enc")
    loaded = load_encoder(tmp_path / "enc")
    assert loaded.config["tower"]["pretrained"] is None and loaded.config["freeze_tower"] is True
    for a, b in zip(enc.encode(_pictures()), loaded.encode(_pictures())):
        assert a.shape == (16, HIDDEN) and torch.equal(a, b)


def test_conv_tower():
    tower = build_tower({"name": "conv", "image_size": 32, "channels": [8, 16, 16]})
    tokens, _ = tower(tower.collate([tower.preprocess(p) for p in _pictures()]))
    assert tokens.shape == (2, 16, 16) and tower.output_rows(None) == 16
    with pytest.raises(ValueError, match="divisible"):
        build_tower({"name": "conv", "image_size": 30, "channels": [8, 8]})


@pytest.fixture(scope="module")
def hf_vision_dirs(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("hf_vision")
    small = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    torch.manual_seed(0)
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**small)).save_pretrained(root / "clip")
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**small)).save_pretrained(root / "siglip")
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=64,
        max_position_embeddings=16,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    full = transformers.CLIPConfig(text_config=text, vision_config=small, projection_dim=16)
    transformers.CLIPModel(full).save_pretrained(root / "clip_full")
    return root


@pytest.mark.parametrize("kind,cls_token", [("clip", True), ("siglip", False), ("clip_full", True)])
def test_hf_vision_tower_from_local_dir(hf_vision_dirs, kind, cls_token, tmp_path):
    import transformers

    tower = build_tower({"name": "hf_vision", "path": str(hf_vision_dirs / kind)}).eval()
    assert tower.num_tokens == 16 and tower.out_dim == 32
    pixels = tower.collate([tower.preprocess(p) for p in _pictures()])["pixel_values"]
    tokens, _ = tower({"pixel_values": pixels})
    assert tokens.shape == (2, 16, 32)
    # the weights are the directory's (not a random init): compare with transformers' own model
    model_cls = transformers.SiglipVisionModel if kind == "siglip" else transformers.CLIPVisionModel
    reference = model_cls.from_pretrained(str(hf_vision_dirs / kind)).eval()
    with torch.no_grad():
        expected = reference(pixel_values=pixels).last_hidden_state
    assert torch.allclose(tokens, expected[:, 1:] if cls_token else expected, atol=1e-5)
    enc = build_encoder(
        {
            "tower": {"name": "hf_vision", "path": str(hf_vision_dirs / kind), "layer": -2, "keep_cls": True},
            "projector": {"name": "linear"},
            "llm_hidden_size": HIDDEN,
        }
    )
    out = enc.encode(_pictures())
    assert [o.shape[0] for o in out] == [enc.num_rows(p) for p in _pictures()] == [16 + cls_token] * 2
    enc.save(tmp_path / "enc")  # saved config carries the HF config: no need for the source dir
    loaded = load_encoder(tmp_path / "enc")
    assert loaded.config["tower"]["path"] is None
    assert torch.equal(loaded.encode(_pictures())[0], out[0])


def test_hf_vision_rejects_other_model_types(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        build_tower({"name": "hf_vision", "path": str(tmp_path / "bert")})
    with pytest.raises(ValueError, match="no config.json"):
        build_tower({"name": "hf_vision", "path": str(tmp_path)})

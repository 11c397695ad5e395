"""Encoders on a CUDA device: outputs land on the device, match the CPU, and run in bf16."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from encoders.api import build_encoder, tiny_encoder_config

pytestmark = pytest.mark.gpu

HIDDEN = 64


def _items(modality):
    if modality == "image":
        return [Image.new("RGB", (40, 36), (200, 30, 30)), Image.new("RGB", (64, 64), (10, 200, 90))]
    if modality == "audio":
        g = torch.Generator().manual_seed(0)
        return [torch.randn(16000, generator=g) * 0.1, (torch.randn(6000, generator=g) * 0.1, 8000)]
    return [{"num_nodes": 3, "edges": [[0, 1], [1, 2]]}, {"num_nodes": 6, "edges": [[0, 1], [2, 3], [4, 5]]}]


@pytest.mark.parametrize("modality", ["image", "audio", "graph"])
def test_encode_on_cuda_matches_cpu(modality):
    torch.manual_seed(0)
    enc = build_encoder(tiny_encoder_config(modality, HIDDEN)).eval()
    items = _items(modality)
    cpu = enc.encode(items)
    enc.to("cuda")
    gpu = enc.encode(items)
    for a, b, item in zip(cpu, gpu, items):
        assert b.device.type == "cuda" and b.shape == (enc.num_rows(item), HIDDEN)
        assert torch.allclose(a, b.cpu(), atol=2e-3, rtol=1e-3)
    enc.to(torch.bfloat16)
    half = enc.encode(items)
    assert all(h.dtype == torch.bfloat16 and torch.isfinite(h).all() for h in half)


def test_vit_b_32_patch_tokens_on_cuda():
    enc = build_encoder(
        {
            "tower": {"name": "open_clip", "arch": "ViT-B-32"},
            "projector": {"name": "mlp"},
            "llm_hidden_size": 1024,
        }
    )
    enc.to("cuda", torch.bfloat16).eval()
    images = [Image.new("RGB", (300, 240), (i * 30 % 255, 90, 160)) for i in range(16)]
    outs = enc.encode(images)
    assert len(outs) == 16 and all(o.shape == (49, 1024) and o.device.type == "cuda" for o in outs)


def test_streaming_audio_on_cuda():
    torch.manual_seed(0)
    enc = (
        build_encoder(tiny_encoder_config("audio", HIDDEN, streaming={"chunk_samples": 1600}))
        .to("cuda")
        .eval()
    )
    chunk = enc.encode_stream(torch.randn(1600) * 0.1)
    assert chunk.device.type == "cuda" and chunk.shape == (enc.rows_per_chunk, HIDDEN)

"""Media sized from headers and declared sizes, and summed against `MediaLimits`, before anything is
decoded: forged WAV rates, resampler filters, 8 images at the old per-image cap, `num_nodes` 10**12;
the same bounds in `bridge train`'s JSONL check and in `Bridge.generate`; `multi_modal_uuids` (the
engine keys an item by the caller's hash and reads nothing of it)."""

from __future__ import annotations

import io
import json
import struct
import wave

import numpy as np
import pytest
import torch
from helpers import png_header

from encoders.audio_inputs import (
    MAX_RESAMPLE_KERNEL_VALUES,
    audio_size,
    load_audio,
    load_wav,
    resample_kernel_values,
    save_wav,
    wav_header,
)
from encoders.graph_format import graph_size
from encoders.media_budget import MediaBudget, MediaLimits
from encoders.vision_inputs import image_size

FORGED_RATES = [100_000_007, 2_147_483_647]


def wav_bytes(rate: int, frames: int = 8000, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV whose header says `rate` (the wave module writes any rate)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(b"\x00\x00" * frames * channels)
    return buf.getvalue()


@pytest.mark.parametrize("rate", FORGED_RATES)
def test_a_forged_wav_rate_is_refused_from_the_header(rate, tmp_path):
    with pytest.raises(ValueError, match=rf"sample rate {rate} Hz is outside"):
        wav_header(wav_bytes(rate))
    path = tmp_path / "forged.wav"
    path.write_bytes(wav_bytes(rate))
    with pytest.raises(ValueError, match=rf"forged.wav: .*sample rate {rate} Hz"):
        load_wav(path)
    # a waveform handed over with such a rate is refused before torchaudio builds its filter
    with pytest.raises(ValueError, match="sample rate"):
        load_audio((torch.zeros(100), rate), 16000)


def test_a_rate_sharing_no_factor_with_the_towers_is_refused_before_its_filter_is_built():
    assert resample_kernel_values(16000, 16000) == 0
    assert resample_kernel_values(44100, 16000) < MAX_RESAMPLE_KERNEL_VALUES  # common rates resample
    assert resample_kernel_values(11025, 16000) < MAX_RESAMPLE_KERNEL_VALUES
    assert resample_kernel_values(16001, 16000) > MAX_RESAMPLE_KERNEL_VALUES
    with pytest.raises(ValueError, match="16001 Hz cannot be resampled to the encoder's 16000 Hz"):
        load_audio((torch.zeros(100), 16001), 16000)
    # the filter the check counts is the one torchaudio builds
    from torchaudio.functional.functional import _get_sinc_resample_kernel

    kernel, _ = _get_sinc_resample_kernel(22050, 16000, 50)
    assert kernel.numel() == resample_kernel_values(22050, 16000)


@pytest.mark.parametrize("rates", [(48000, 16000), (44100, 16000), (8000, 16000), (96000, 16000)])
def test_resampling_in_chunks_equals_torchaudio(rates, monkeypatch):
    import torchaudio.functional as AF

    from encoders import audio_inputs

    monkeypatch.setattr(audio_inputs, "RESAMPLE_CHUNK_BLOCKS", 1000)  # many chunks, a partial last one
    wave_ = torch.randn(123_457, generator=torch.Generator().manual_seed(0))
    got, want = audio_inputs.resample(wave_, *rates), AF.resample(wave_, *rates)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_a_header_claiming_more_frames_than_the_file_holds_is_capped(tmp_path):
    raw = bytearray(wav_bytes(16000, frames=100))
    raw[40:44] = struct.pack("<I", 0xFFFFFFFF)  # the data chunk's size: a streamed or forged WAV
    header = wav_header(bytes(raw))
    assert header.frames <= len(raw) // 2 and header.rate == 16000
    path = save_wav(tmp_path / "a.wav", torch.linspace(-1, 1, 300).reshape(3, 100), 8000)
    assert audio_size(str(path)) == (100, 3, 8000)
    wave_, rate = load_wav(path)
    assert wave_.shape == (3, 100) and rate == 8000


def test_sizes_come_from_headers_and_declared_counts():
    assert image_size(png_header(8192, 8192)) == (8192, 8192)  # no pixel data at all: only the header
    assert image_size(np.zeros((4, 6, 3), dtype=np.uint8)) == (6, 4)
    assert image_size(torch.zeros(3, 5, 7)) == (7, 5)
    assert graph_size({"num_nodes": 10**12, "edges": []}) == (10**12, 0)
    with pytest.raises(ValueError, match="num_nodes must be an integer >= 1"):
        graph_size({"num_nodes": "many", "edges": []})
    assert audio_size((torch.zeros(2, 50), 8000)) == (50, 2, 8000)


def test_eight_images_at_the_old_per_image_cap_exceed_the_request_budget():
    budget = MediaBudget(scope="request", knob=lambda name: f"--{name}")
    with pytest.raises(ValueError, match=r"part 0: this request's image pixels .* over the limit of "
                                         rf"{MediaLimits().max_image_pixels} \(--max_image_pixels\)"):
        for k in range(8):
            budget.add("image", png_header(8192, 8192), f"part {k}")
    assert budget.pixels == 0  # refused at the first: a single 8192 x 8192 image is over it already


def test_samples_nodes_edges_and_items_are_summed_and_named():
    limits = MediaLimits(max_items=3, max_audio_samples=20000, max_audio_file_samples=50000,
                         max_graph_nodes=100, max_graph_edges=10)
    budget = MediaBudget(limits, scope="prompt")
    # 5334 samples at 16 kHz, 32000 as stored
    budget.add("audio", (torch.zeros(2, 16000), 48000), "a", target_rate=16000)
    with pytest.raises(ValueError, match=r"b: this prompt's audio samples as stored .*MediaLimits\."
                                         r"max_audio_file_samples"):
        budget.add("audio", (torch.zeros(1, 20000), 16000), "b", target_rate=16000)
    with pytest.raises(ValueError, match="at the encoder's rate"):
        budget.add("audio", torch.zeros(16000), "c", target_rate=16000)
    with pytest.raises(ValueError, match=r"over the limit of 100 \(MediaLimits.max_graph_nodes\)"):
        budget.add("graph", {"num_nodes": 10**12, "edges": []}, "g")
    with pytest.raises(ValueError, match="graph edges"):
        budget.add("graph", {"num_nodes": 5, "edges": [[0, 1]] * 11}, "g")
    budget.add("graph", {"num_nodes": 5, "edges": []}, "g")  # refused items took nothing: 2 of 3 now
    budget.add("graph", {"num_nodes": 5, "edges": []}, "g")
    assert (budget.items, budget.nodes, budget.samples, budget.file_samples) == (3, 10, 5334, 32000)
    with pytest.raises(ValueError, match=r"g: this prompt's media items add up to 4, over the limit of 3"):
        budget.add("graph", {"num_nodes": 5, "edges": []}, "g")
    with pytest.raises(ValueError, match="max_items must be a positive integer"):
        MediaLimits(max_items=0)


def test_jsonl_rows_are_refused_at_load_for_forged_rates_and_over_budget_media(tmp_path):
    from bridge.data.jsonl import JsonlDataset

    (tmp_path / "forged.wav").write_bytes(wav_bytes(100_000_007))
    (tmp_path / "big.png").write_bytes(png_header(8192, 8192))
    (tmp_path / "huge.json").write_text(json.dumps({"num_nodes": 10**12, "edges": []}))
    cases = [({"audio": "forged.wav", "text": "x"}, "<audio>",
              r"data.jsonl:1: audio file .*forged.wav: the WAV header's sample rate 100000007 Hz is outside"),
             ({"image": "big.png", "text": "x"}, "<image>",
              r"data.jsonl:1: image file .*big.png: this row's image pixels .* over the limit"),
             ({"graph": "huge.json", "text": "x"}, "<graph>",
              r"data.jsonl:1: graph file .*huge.json: this row's graph nodes add up to 1000000000000")]
    for row, prompt, message in cases:
        (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=message):
            JsonlDataset(tmp_path / "data.jsonl", prompt=prompt)


def test_bridge_generate_refuses_over_budget_media_before_encoding(tmp_path):
    from bridge.api import Bridge

    bridge = Bridge.from_recipe("recipes/demo/graphs.yaml", ["data.num_train=4", "data.num_eval=1"],
                                output_dir=tmp_path / "run", device="cpu")
    with pytest.raises(ValueError, match=r"prompt 1: graph item 0: this prompt's graph nodes add up to "
                                         r"1000000000000, over the limit of \d+ \(Bridge.media_limits"):
        bridge.generate([{"prompt": "<graph>", "graph": {"num_nodes": 3, "edges": [[0, 1]]}},
                         {"prompt": "<graph>", "graph": {"num_nodes": 10**12, "edges": []}}], max_tokens=2)
    assert bridge._engine is None  # refused before the engine was even built


def test_multi_modal_uuids_key_items_without_reading_them():
    from runner.multimodal.placeholders import expand_mm_prompt

    class Encoder:
        modality, is_realtime = "image", False

        def num_rows(self, item):
            return 2

        def content_hash(self, item):
            raise AssertionError("a keyed item is not hashed")

        def encode(self, items):
            return [torch.zeros(2, 4) for _ in items]

    expanded = expand_mm_prompt([1, 9, 2, 9], {"image": ["a", "b"]}, {"image": 9}, {"image": Encoder()}, 4,
                                uuids={"image": ["k1", "k2"]})
    assert [f.identifier for f in expanded.features] == ["image:k1", "image:k2"]
    with pytest.raises(ValueError, match="multi_modal_uuids has 1 entries for 'image'"):
        expand_mm_prompt([9, 9], {"image": ["a", "b"]}, {"image": 9}, {"image": Encoder()}, 4,
                         uuids={"image": ["k1"]})
    with pytest.raises(ValueError, match="non-empty string"):
        expand_mm_prompt([9], {"image": ["a"]}, {"image": 9}, {"image": Encoder()}, 4, uuids={"image": [""]})

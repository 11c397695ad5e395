"""Audio: WAV I/O and resampling, log-mel conformer, wav2vec2 family, HF Whisper encoder dir."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from encoders.api import build_encoder, build_tower, load_audio, load_encoder, load_wav, save_wav

HIDDEN = 32
TINY_W2V = {
    "extractor_mode": "layer_norm",
    "extractor_conv_layer_config": [[16, 10, 5], [16, 3, 2], [16, 3, 2], [16, 2, 2]],
    "extractor_conv_bias": False,
    "encoder_embed_dim": 32,
    "encoder_projection_dropout": 0.0,
    "encoder_pos_conv_kernel": 8,
    "encoder_pos_conv_groups": 4,
    "encoder_num_layers": 2,
    "encoder_num_heads": 4,
    "encoder_attention_dropout": 0.0,
    "encoder_ff_interm_features": 64,
    "encoder_ff_interm_dropout": 0.0,
    "encoder_dropout": 0.0,
    "encoder_layer_norm_first": True,
    "encoder_layer_drop": 0.0,
}
TINY_CONFORMER = {
    "name": "conformer",
    "n_mels": 32,
    "dim": 32,
    "num_heads": 4,
    "ffn_dim": 64,
    "num_layers": 1,
    "kernel_size": 7,
}


def _tone(seconds: float, rate: int = 16000, freq: float = 440.0) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return 0.5 * torch.sin(2 * math.pi * freq * t)


def test_wav_round_trip_and_resampling(tmp_path):
    wave = _tone(0.25, 8000)
    stereo = torch.stack([wave, -wave * 0.5])
    save_wav(tmp_path / "a.wav", stereo, 8000)
    data, rate = load_wav(tmp_path / "a.wav")
    assert rate == 8000 and data.shape == (2, 2000)
    assert torch.allclose(data, stereo, atol=1e-4)
    mono = load_audio(tmp_path / "a.wav", 16000)  # channels averaged, resampled to 16 kHz
    assert mono.shape == (4000,)
    assert torch.allclose(load_audio((stereo.numpy(), 8000), 16000), mono, atol=1e-4)
    assert torch.allclose(
        load_audio({"array": stereo.numpy(), "sampling_rate": 8000}, 16000), mono, atol=1e-4
    )
    with pytest.raises(ValueError, match="not a readable PCM WAV"):
        (tmp_path / "junk.wav").write_bytes(b"nope")
        load_wav(tmp_path / "junk.wav")
    with pytest.raises(ValueError, match="floating point"):
        load_audio(torch.zeros(10, dtype=torch.int16))
    with pytest.raises(ValueError, match="needs 'waveform'"):
        load_audio({"samples": np.zeros(3)})


@pytest.mark.parametrize("stack,subsample", [(1, 1), (2, 2), (1, 4)])
def test_conformer_rows_and_shapes(stack, subsample):
    tower = build_tower({**TINY_CONFORMER, "stack": stack, "subsample": subsample}).eval()
    lengths_in = [16000, 5000, 100]
    items = [_tone(n / 16000) for n in lengths_in]
    feats, lengths = tower(tower.collate([tower.preprocess(x) for x in items]))
    expected = [tower.output_rows(x) for x in items]
    for n, rows in zip(lengths_in, expected):
        assert rows == math.ceil(math.ceil((max(n, 400) // 160 + 1) / stack) / subsample)
    assert lengths.tolist() == expected and feats.shape == (3, max(expected), 32)


def test_conformer_batch_invariant_and_resampled_rows(tmp_path):
    tower = build_tower(TINY_CONFORMER).eval()
    short, long = _tone(0.3, freq=300), _tone(1.0, freq=900)
    with torch.no_grad():
        both, lengths = tower(tower.collate([tower.preprocess(short), tower.preprocess(long)]))
        alone, _ = tower(tower.collate([tower.preprocess(short)]))
    assert torch.allclose(both[0, : lengths[0]], alone[0], atol=1e-5)  # padding never leaks into real rows
    save_wav(tmp_path / "t.wav", _tone(0.5, 22050), 22050)
    assert tower.output_rows(tmp_path / "t.wav") == tower.preprocess(tmp_path / "t.wav").shape[0]


def test_wav2vec2_tiny_and_presets(tmp_path):
    tower = build_tower({"name": "wav2vec2", "model_cfg": TINY_W2V}).eval()
    items = [_tone(0.5), _tone(0.2)]
    feats, lengths = tower(tower.collate([tower.preprocess(x) for x in items]))
    assert lengths.tolist() == [tower.output_rows(x) for x in items] and feats.shape[-1] == 32
    base = build_tower({"name": "wav2vec2", "preset": "wav2vec2_base"})  # architecture only, random init
    assert base.out_dim == 768 and base.rows_for_samples(16000) == 49  # 20 ms frames
    torch.save(tower.model.state_dict(), tmp_path / "w.pt")
    loaded = build_tower({"name": "wav2vec2", "model_cfg": TINY_W2V, "checkpoint": str(tmp_path / "w.pt")})
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.model.state_dict().values(), tower.model.state_dict().values())
    )
    with pytest.raises(ValueError, match="unknown preset 'wav2vec3'"):
        build_tower({"name": "wav2vec2", "preset": "wav2vec3"})
    with pytest.raises(ValueError, match="shorter than one output frame"):
        tower.output_rows(torch.zeros(5))


def test_audio_encoder_save_load_wav2vec2(tmp_path):
    torch.manual_seed(0)
    enc = build_encoder(
        {
            "tower": {"name": "wav2vec2", "model_cfg": TINY_W2V},
            "projector": {"name": "stack_swiglu", "stack": 2},
            "llm_hidden_size": HIDDEN,
        }
    )
    items = [_tone(0.4), (_tone(0.3, 8000).numpy(), 8000)]
    outs = enc.encode(items)
    assert [o.shape for o in outs] == [(enc.num_rows(x), HIDDEN) for x in items]
    enc.save(tmp_path / "enc")
    assert all(torch.equal(a, b) for a, b in zip(load_encoder(tmp_path / "enc").encode(items), outs))


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=40,
        max_source_positions=50,
        max_target_positions=16,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    path = tmp_path_factory.mktemp("whisper") / "tiny-whisper"
    transformers.WhisperForConditionalGeneration(cfg).save_pretrained(path)
    return path


def test_whisper_encoder_dir(whisper_dir, tmp_path):
    import transformers

    tower = build_tower({"name": "whisper_hf", "path": str(whisper_dir)}).eval()
    assert tower.max_samples == 100 * 160 and tower.out_dim == 32
    items = [_tone(0.5), _tone(1.0)]  # 1.0 s is the whole (tiny) window
    batch = tower.collate([tower.preprocess(x) for x in items])
    assert batch["input_features"].shape == (2, 40, 100)
    feats, lengths = tower(batch)
    assert lengths.tolist() == [25, 50] == [tower.output_rows(x) for x in items]
    reference = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_dir).model.encoder.eval()
    with torch.no_grad():
        expected = reference(input_features=batch["input_features"]).last_hidden_state
    assert torch.allclose(feats[1], expected[1], atol=1e-5)  # the directory's weights, not a random init
    with pytest.raises(ValueError, match="exceed the encoder window"):
        tower.output_rows(_tone(1.5))
    enc = build_encoder(
        {
            "tower": {"name": "whisper_hf", "path": str(whisper_dir)},
            "projector": {"name": "mlp"},
            "llm_hidden_size": HIDDEN,
        }
    )
    outs = enc.encode(items)
    enc.save(tmp_path / "enc")
    loaded = load_encoder(tmp_path / "enc")
    assert loaded.config["tower"]["path"] is None
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(loaded.encode(items), outs))


def test_whisper_streaming_chunks(whisper_dir):
    enc = build_encoder(
        {
            "tower": {"name": "whisper_hf", "path": str(whisper_dir)},
            "projector": {"name": "stack_swiglu", "stack": 5},
            "llm_hidden_size": HIDDEN,
            "streaming": {"chunk_samples": 8000},
        }
    )
    assert enc.is_realtime and enc.rows_per_chunk == 5  # 0.5 s -> 25 whisper rows -> 5 stacked rows
    wave = _tone(1.7)  # 4 chunks: can exceed the encoder window because each chunk is encoded alone
    assert enc.num_rows(wave) == 20 and enc.encode([wave])[0].shape == (20, HIDDEN)
    assert enc.encode_stream(_tone(0.25)).shape == (5, HIDDEN)


def test_whisper_log_mel_matches_transformers_feature_extractor(whisper_dir):
    import transformers

    tower = build_tower({"name": "whisper_hf", "path": str(whisper_dir)})
    wave = _tone(0.6, freq=523.0) + 0.01 * torch.randn(9600, generator=torch.Generator().manual_seed(0))
    extractor = transformers.WhisperFeatureExtractor(feature_size=40, chunk_length=1)  # window: 100 frames
    reference = extractor(wave.numpy(), sampling_rate=16000, return_tensors="np").input_features[0]
    assert torch.allclose(tower.preprocess(wave)["features"], torch.from_numpy(reference), atol=1e-4)

"""Audio towers: a log-mel front end + torchaudio Conformer, the torchaudio wav2vec2 family, and a
local Hugging Face Whisper encoder directory.

Every audio tower works at one sample rate (16 kHz by default; items at other rates are resampled)
and knows how many rows ``n`` samples become, so a prompt's placeholders can be expanded before
anything runs, and so that streaming (fixed-size chunks, each encoded on its own) has a fixed row
count per chunk.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encoders.audio_inputs import load_audio
from encoders.audio_inputs import num_samples as _num_samples
from encoders.checkpoint import load_state_dict_checked
from encoders.parts import Tower, check_keys, lengths_mask
from encoders.projectors import stack_frames
from encoders.registry import register_preprocessor, register_tower


@register_preprocessor("log_mel")
class LogMel:
    """Waveform ``(samples,)`` -> log-mel features ``(frames, n_mels)``; frames = samples // hop + 1.

    Deliberately not an ``nn.Module``: its filterbank is derived from the config, so it stays out
    of checkpoints, and it runs on the CPU inside data-loader workers.
    Config keys (``from_config``): sample_rate 16000, n_mels 80, n_fft 400, hop_length 160.
    """

    @classmethod
    def from_config(cls, cfg: dict) -> LogMel:
        check_keys(cfg, {"sample_rate", "n_mels", "n_fft", "hop_length"}, "preprocessor 'log_mel'")
        return cls(**cfg)

    def __init__(self, sample_rate: int = 16000, n_mels: int = 80, n_fft: int = 400, hop_length: int = 160):
        import torchaudio

        self.n_fft, self.hop_length = n_fft, hop_length
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels, power=2.0
        )

    def padded_samples(self, samples: int) -> int:
        return max(samples, self.n_fft)  # reflect padding needs at least n_fft samples

    def frames(self, samples: int) -> int:
        return self.padded_samples(samples) // self.hop_length + 1

    def __call__(self, wave: torch.Tensor) -> torch.Tensor:
        if wave.shape[-1] < self.n_fft:
            wave = F.pad(wave, (0, self.n_fft - wave.shape[-1]))
        with torch.no_grad():
            return torch.log(self.mel(wave) + 1e-6).T.contiguous()


class _AudioTower(Tower):
    modality = "audio"
    sample_rate: int = 16000

    def rows_for_samples(self, samples: int) -> int:
        raise NotImplementedError

    def num_samples(self, item: Any) -> int:
        """Samples the item has at this tower's rate (cheap)."""
        return _num_samples(item, self.sample_rate)

    def output_rows(self, item: Any) -> int:
        return self.rows_for_samples(self.num_samples(item))

    # streaming: fixed-size chunks, each encoded on its own
    def chunk_rows(self, chunk_samples: int) -> int:
        return self.rows_for_samples(chunk_samples)

    def num_chunks(self, item: Any, chunk_samples: int) -> int:
        return max(1, math.ceil(self.num_samples(item) / chunk_samples))

    def split_chunks(self, item: Any, chunk_samples: int) -> list[torch.Tensor]:
        """Waveform at the tower's rate cut into ``chunk_samples`` pieces, the last zero padded."""
        wave = load_audio(item, self.sample_rate)
        n = self.num_chunks(wave, chunk_samples)
        wave = F.pad(wave, (0, n * chunk_samples - wave.shape[0]))
        return list(wave.view(n, chunk_samples).unbind(0))


def _pad_stack(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


@register_tower("conformer")
class ConformerTower(_AudioTower):
    """Log-mel -> optional frame stacking -> linear -> stride-2 conv subsampling -> torchaudio Conformer.

    Config keys (defaults): sample_rate 16000, n_mels 80, n_fft 400, hop_length 160 (10 ms frames),
    stack 1 (front-end frame stacking: k frames concatenated, rows / k), subsample 1|2|4|8 (stride-2
    convolutions), dim 144, num_heads 4, ffn_dim 576, num_layers 4, kernel_size 31 (depthwise conv),
    dropout 0.0. Rows for n samples: ceil(ceil((n // hop + 1) / stack) / subsample).

    Padding is zeroed before every convolution, so (in eval mode) an item's rows do not depend on
    what else is in its batch.
    """

    KEYS = {
        "sample_rate",
        "n_mels",
        "n_fft",
        "hop_length",
        "stack",
        "subsample",
        "dim",
        "num_heads",
        "ffn_dim",
        "num_layers",
        "kernel_size",
        "dropout",
    }

    def __init__(
        self,
        sample_rate: int = 16000,
        n_mels: int = 80,
        n_fft: int = 400,
        hop_length: int = 160,
        stack: int = 1,
        subsample: int = 1,
        dim: int = 144,
        num_heads: int = 4,
        ffn_dim: int = 576,
        num_layers: int = 4,
        kernel_size: int = 31,
        dropout: float = 0.0,
    ):
        super().__init__()
        from torchaudio.models import Conformer

        if subsample not in (1, 2, 4, 8):
            raise ValueError(f"conformer tower: subsample must be 1, 2, 4 or 8, got {subsample}")
        if stack < 1:
            raise ValueError(f"conformer tower: stack must be >= 1, got {stack}")
        self._cfg = {k: v for k, v in locals().items() if k in self.KEYS}
        self.sample_rate, self.stack = int(sample_rate), int(stack)
        self.frontend = LogMel(sample_rate, n_mels, n_fft, hop_length)
        self.inp = nn.Linear(n_mels * stack, dim)
        self.subsample = nn.ModuleList(
            [nn.Conv1d(dim, dim, 3, stride=2, padding=1) for _ in range(int(math.log2(subsample)))]
        )
        self.conformer = Conformer(
            input_dim=dim,
            num_heads=num_heads,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            depthwise_conv_kernel_size=kernel_size,
            dropout=dropout,
        )
        self.out_dim = int(dim)
        self._mask: torch.Tensor | None = None
        for layer in self.conformer.conformer_layers:
            layer.conv_module.sequential[2].register_forward_pre_hook(self._mask_padding)

    def _mask_padding(self, module: nn.Module, args: tuple) -> tuple | None:
        """Zero padded frames right before each depthwise convolution (input is (B, C, T))."""
        if self._mask is None:
            return None
        return (args[0] * self._mask,)

    @classmethod
    def from_config(cls, cfg: dict) -> ConformerTower:
        check_keys(cfg, cls.KEYS, "tower 'conformer'")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {"name": "conformer", **copy.deepcopy(self._cfg)}

    def rows_for_samples(self, samples: int) -> int:
        rows = math.ceil(self.frontend.frames(samples) / self.stack)
        for _ in self.subsample:
            rows = (rows + 1) // 2
        return rows

    def preprocess(self, item: Any) -> torch.Tensor:
        return self.frontend(load_audio(item, self.sample_rate))

    def collate(self, processed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        features, lengths = _pad_stack(processed)
        return {"features": features, "lengths": lengths}

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = stack_frames(batch["features"], batch["lengths"], self.stack)
        b = x.shape[0]
        x = self.inp(x)
        for conv in self.subsample:
            x = x * lengths_mask(lengths, b, x.shape[1], x.device).unsqueeze(-1).to(x.dtype)
            x = F.gelu(conv(x.transpose(1, 2))).transpose(1, 2)
            lengths = (lengths + 1) // 2
        self._mask = lengths_mask(lengths, b, x.shape[1], x.device).unsqueeze(1).to(x.dtype)
        try:
            x, lengths = self.conformer(x, lengths.to(x.device))
        finally:
            self._mask = None
        return x, lengths


_W2V_PRESETS = (
    "wav2vec2_base",
    "wav2vec2_large",
    "wav2vec2_large_lv60k",
    "hubert_base",
    "hubert_large",
    "wavlm_base",
    "wavlm_large",
)


@register_tower("wav2vec2")
class Wav2Vec2Tower(_AudioTower):
    """The torchaudio wav2vec2 family on raw 16 kHz waveforms (random init or a local state dict).

    Config keys:
      preset:     one of wav2vec2_base, wav2vec2_large, wav2vec2_large_lv60k, hubert_base, hubert_large,
                  wavlm_base, wavlm_large (torchaudio's architecture factories; dropout off)
      model_cfg:  instead of preset, keyword arguments of ``torchaudio.models.wav2vec2_model`` (or of
                  ``wavlm_model`` with ``"arch": "wavlm"`` inside)
      checkpoint: local state-dict file (.pt/.bin/.safetensors) in torchaudio's key layout
      normalize:  zero-mean / unit-variance each waveform first (wav2vec2 large-lv60k, WavLM) (False)
    Rows for n samples: the conv feature extractor's output length (320x downsampling for the presets).
    """

    KEYS = {"preset", "model_cfg", "checkpoint", "normalize"}

    def __init__(
        self,
        preset: str | None = None,
        model_cfg: dict | None = None,
        checkpoint: str | None = None,
        normalize: bool = False,
    ):
        super().__init__()
        import torchaudio.models as tam

        if (preset is None) == (model_cfg is None):
            raise ValueError(
                f"wav2vec2 tower needs exactly one of 'preset' ({', '.join(_W2V_PRESETS)}) or 'model_cfg'"
            )
        if preset is not None:
            if preset not in _W2V_PRESETS:
                raise ValueError(
                    f"wav2vec2 tower: unknown preset {preset!r}; valid: {', '.join(_W2V_PRESETS)}"
                )
            no_drop = {
                "encoder_projection_dropout": 0.0,
                "encoder_attention_dropout": 0.0,
                "encoder_ff_interm_dropout": 0.0,
                "encoder_dropout": 0.0,
                "encoder_layer_drop": 0.0,
            }
            model = getattr(tam, preset)(**no_drop)
        else:
            kwargs = copy.deepcopy(model_cfg)
            arch = kwargs.pop("arch", "wav2vec2")
            if arch not in ("wav2vec2", "wavlm"):
                raise ValueError(
                    f"wav2vec2 tower: model_cfg arch must be 'wav2vec2' or 'wavlm', got {arch!r}"
                )
            if kwargs.get("extractor_conv_layer_config") is not None:
                kwargs["extractor_conv_layer_config"] = [
                    tuple(c) for c in kwargs["extractor_conv_layer_config"]
                ]
            kwargs.setdefault("aux_num_out", None)
            builder = tam.wav2vec2_model if arch == "wav2vec2" else tam.wavlm_model
            try:
                model = builder(**kwargs)
            except TypeError as e:
                raise ValueError(f"wav2vec2 tower: bad model_cfg for {builder.__name__}: {e}") from e
        if checkpoint:
            path = Path(checkpoint)
            if not path.is_file():
                raise ValueError(f"wav2vec2 tower: checkpoint file {path} does not exist")
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(str(path))
            else:
                state = torch.load(str(path), map_location="cpu", weights_only=True)
            load_state_dict_checked(model, state, source=str(path))
        self.model = model
        self._cfg = {"preset": preset, "model_cfg": copy.deepcopy(model_cfg), "normalize": bool(normalize)}
        self.normalize = bool(normalize)
        self._convs = [
            (layer.conv.kernel_size[0], layer.conv.stride[0]) for layer in model.feature_extractor.conv_layers
        ]
        self.out_dim = int(model.encoder.feature_projection.projection.out_features)

    @classmethod
    def from_config(cls, cfg: dict) -> Wav2Vec2Tower:
        check_keys(cfg, cls.KEYS, "tower 'wav2vec2'")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {"name": "wav2vec2", **copy.deepcopy(self._cfg), "checkpoint": None}

    def rows_for_samples(self, samples: int) -> int:
        rows = samples
        for kernel, stride in self._convs:
            rows = (rows - kernel) // stride + 1
        if rows < 1:
            raise ValueError(f"wav2vec2 tower: {samples} samples is shorter than one output frame")
        return rows

    def preprocess(self, item: Any) -> torch.Tensor:
        wave = load_audio(item, self.sample_rate)
        self.rows_for_samples(wave.shape[0])
        if self.normalize:
            wave = (wave - wave.mean()) / (wave.std() + 1e-7)
        return wave

    def collate(self, processed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        waveform, lengths = _pad_stack(processed)
        return {"waveform": waveform, "lengths": lengths}

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = self.model(batch["waveform"], batch["lengths"])
        return x, lengths


@register_tower("whisper_hf")
class WhisperEncoderTower(_AudioTower):
    """The encoder of a local Hugging Face Whisper directory (WhisperModel or
    WhisperForConditionalGeneration); the decoder is dropped.

    Whisper reads a fixed window of ``2 * max_source_positions`` mel frames (30 s for real checkpoints):
    shorter audio is zero padded (as Whisper itself does) and the output is trimmed to the rows that
    cover real audio: ceil(ceil(n / 160) / 2) for n samples. Longer audio is an error (stream it).
    Config keys: path (local dir), hf_config (written by save, rebuilds without the dir).
    """

    KEYS = {"path", "hf_config"}

    def __init__(self, path: str | None = None, hf_config: dict | None = None):
        super().__init__()
        import torchaudio
        import transformers
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        if path is not None:
            directory = Path(path)
            if not (directory / "config.json").is_file():
                raise ValueError(f"whisper_hf tower: {directory} is not a model directory (no config.json)")
            model_type = json.loads((directory / "config.json").read_text()).get("model_type")
            if model_type != "whisper":
                raise ValueError(
                    f"whisper_hf tower: {directory} holds model_type {model_type!r}, not 'whisper'"
                )
            encoder = transformers.WhisperModel.from_pretrained(str(directory), local_files_only=True).encoder
        elif hf_config is not None:
            encoder = WhisperEncoder(transformers.WhisperConfig.from_dict(copy.deepcopy(hf_config)))
        else:
            raise ValueError("whisper_hf tower needs 'path' (a local Whisper model directory)")
        self.encoder = encoder
        cfg = encoder.config
        self.hop_length, self.n_fft = 160, 400
        self.window_frames = int(cfg.max_source_positions) * 2
        self.max_rows = int(cfg.max_source_positions)
        self.max_samples = self.window_frames * self.hop_length
        self.out_dim = int(cfg.d_model)
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=self.sample_rate,
            n_fft=self.n_fft,
            hop_length=self.hop_length,
            n_mels=int(cfg.num_mel_bins),
            power=2.0,
            norm="slaney",
            mel_scale="slaney",
        )
        # keep the filterbank out of the state dict: it is derived from the config
        self._mel = [self.mel]
        del self.mel

    @classmethod
    def from_config(cls, cfg: dict) -> WhisperEncoderTower:
        check_keys(cfg, cls.KEYS, "tower 'whisper_hf'")
        return cls(**cfg)

    def export_config(self) -> dict:
        return {"name": "whisper_hf", "path": None, "hf_config": self.encoder.config.to_dict()}

    def rows_for_samples(self, samples: int) -> int:
        if samples > self.max_samples:
            raise ValueError(
                f"whisper_hf tower: {samples} samples exceed the encoder window of "
                f"{self.max_samples} samples; split the audio or use streaming"
            )
        return max(1, math.ceil(math.ceil(samples / self.hop_length) / 2))

    def preprocess(self, item: Any) -> torch.Tensor:
        """Whisper's log-mel: slaney filterbank, log10, clamp to (max - 8), (x + 4) / 4."""
        wave = load_audio(item, self.sample_rate)
        rows = self.rows_for_samples(wave.shape[0])
        wave = F.pad(wave, (0, self.max_samples - wave.shape[0]))
        with torch.no_grad():
            spec = self._mel[0](wave)[:, :-1]
            log_spec = torch.clamp(spec, min=1e-10).log10()
            log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return {"features": (log_spec + 4.0) / 4.0, "rows": rows}

    def collate(self, processed: list[dict]) -> dict[str, torch.Tensor]:
        return {
            "input_features": torch.stack([p["features"] for p in processed]),
            "lengths": torch.tensor([p["rows"] for p in processed], dtype=torch.long),
        }

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.encoder(input_features=batch["input_features"]).last_hidden_state
        lengths = batch["lengths"].to(out.device)
        return out[:, : int(lengths.max())], lengths

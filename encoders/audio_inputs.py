"""Raw audio items -> mono float waveforms at a target sample rate, WAV I/O, content-hash bytes.

Accepted items:
  * a path (str / Path) to a PCM WAV file with 8/16/32-bit integer samples (the standard library's
    `wave` module reads no floating-point WAV);
  * ``(waveform, sample_rate)`` or ``{"waveform"|"array": ..., "sample_rate"|"sampling_rate": int}``;
  * a bare 1-D (samples,) or 2-D (channels, samples) tensor / numpy array, taken to be at the
    tower's sample rate already.
Channels are averaged to mono. WAV reading uses the standard library (no codec dependency).
"""

from __future__ import annotations

import math
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch


def load_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """Read a PCM WAV file -> ``(channels, samples)`` float32 in [-1, 1], and its sample rate."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"audio file {path} does not exist")
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate, frames = (
                f.getnchannels(),
                f.getsampwidth(),
                f.getframerate(),
                f.getnframes(),
            )
            raw = f.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise ValueError(f"{path} is not a readable PCM WAV file: {e}") from e
    if width == 1:
        data = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        data = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 4:
        data = np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    else:
        raise ValueError(f"{path}: unsupported WAV sample width {width * 8} bits (use 8, 16 or 32)")
    return torch.from_numpy(data.reshape(-1, channels).T.copy()), rate


def save_wav(path: str | Path, waveform: torch.Tensor | np.ndarray, sample_rate: int) -> Path:
    """Write a (samples,) or (channels, samples) float waveform in [-1, 1] as 16-bit PCM WAV."""
    data = torch.as_tensor(waveform, dtype=torch.float32)
    if data.dim() == 1:
        data = data[None]
    if data.dim() != 2:
        raise ValueError(f"waveform must be (samples,) or (channels, samples), got {tuple(data.shape)}")
    pcm = (data.clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous().numpy()
    path = Path(path)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(data.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.astype("<i2").tobytes())
    return path


def _wav_header(path: Path) -> tuple[int, int]:
    """(frames, sample_rate) from a WAV header, without decoding the samples."""
    if not path.is_file():
        raise ValueError(f"audio file {path} does not exist")
    try:
        with wave.open(str(path), "rb") as f:
            return f.getnframes(), f.getframerate()
    except (wave.Error, EOFError) as e:
        raise ValueError(f"{path} is not a readable PCM WAV file: {e}") from e


def _unpack(item: Any) -> tuple[Any, int | None]:
    if isinstance(item, dict):
        data = item.get("waveform", item.get("array"))
        rate = item.get("sample_rate", item.get("sampling_rate"))
        if data is None or rate is None:
            raise ValueError(
                "audio dict needs 'waveform' (or 'array') and 'sample_rate' (or 'sampling_rate'), "
                f"got keys {sorted(item)}"
            )
        return data, int(rate)
    if isinstance(item, tuple) and len(item) == 2:
        return item[0], int(item[1])
    return item, None


def raw_waveform(item: Any) -> tuple[torch.Tensor, int | None]:
    """Any accepted audio item -> mono float32 ``(samples,)`` at its own rate (None = the tower's rate)."""
    if isinstance(item, (str, Path)):
        data, rate = load_wav(item)
    else:
        data, rate = _unpack(item)
        if isinstance(data, (str, Path)):
            raise ValueError("give an audio path on its own, not inside a tuple/dict")
        if not isinstance(data, (torch.Tensor, np.ndarray)):
            raise ValueError(
                f"unsupported audio item of type {type(data).__name__}; expected a WAV path, a "
                "tensor/array, (waveform, sample_rate) or a dict with waveform and sample_rate"
            )
        data = torch.as_tensor(np.asarray(data) if isinstance(data, np.ndarray) else data)
    if data.dim() == 2:
        data = data.float().mean(dim=0)
    if data.dim() != 1:
        raise ValueError(f"waveform must be (samples,) or (channels, samples), got {tuple(data.shape)}")
    if not data.is_floating_point():
        raise ValueError(f"waveform must be floating point in [-1, 1], got dtype {data.dtype}")
    if rate is not None and rate <= 0:
        raise ValueError(f"sample rate must be positive, got {rate}")
    return data.float().cpu(), rate


def resampled_length(samples: int, orig_rate: int | None, target_rate: int) -> int:
    """Length torchaudio's resample produces: ceil(samples * target / orig)."""
    if orig_rate is None or orig_rate == target_rate:
        return samples
    g = math.gcd(orig_rate, target_rate)
    return -(-samples * (target_rate // g) // (orig_rate // g))


def num_samples(item: Any, target_rate: int) -> int:
    """Samples the item has at ``target_rate``, cheaply (WAV files: header only)."""
    if isinstance(item, (str, Path)):
        frames, rate = _wav_header(Path(item))
        return resampled_length(frames, rate, target_rate)
    data, rate = _unpack(item)
    shape = tuple(np.shape(data)) if isinstance(data, np.ndarray) else tuple(torch.as_tensor(data).shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"waveform must be (samples,) or (channels, samples), got {shape}")
    return resampled_length(shape[-1], rate, target_rate)


def load_audio(item: Any, sample_rate: int = 16000) -> torch.Tensor:
    """Any accepted audio item -> mono float32 ``(samples,)`` at ``sample_rate`` (resampled if needed)."""
    data, rate = raw_waveform(item)
    if rate is not None and rate != sample_rate:
        import torchaudio.functional as AF

        data = AF.resample(data, rate, sample_rate)
    return data


def audio_hash_parts(item: Any) -> list[bytes]:
    data, rate = raw_waveform(item)
    return [str(rate).encode(), data.contiguous().numpy().tobytes()]

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

import io
import math
import struct
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAX_SAMPLE_RATE = 768_000
"""The highest sample rate accepted anywhere: no recording format goes above it, so a header that
claims more is damaged or hostile."""

MAX_RESAMPLE_KERNEL_VALUES = 2**20
"""The largest filter `torchaudio.functional.resample` may build. Its size grows with the two rates
divided by their greatest common divisor: a rate with no common factor with the tower's (16001 Hz, or a
forged 2,147,483,647 Hz) asks for gigabytes, and its convolution costs that many operations per sample."""


@dataclass(frozen=True)
class WavHeader:
    """What a PCM WAV's header says. `frames` is the declared count, capped by what the file's size can
    hold (a streamed WAV declares 0xFFFFFFFF bytes of data; a forged one any number)."""

    frames: int
    channels: int
    width: int  # bytes per sample
    rate: int

    @property
    def samples(self) -> int:
        """Samples as stored: frames times channels."""
        return self.frames * self.channels


def wav_header(source: str | Path | bytes) -> WavHeader:
    """The header of a PCM WAV file or its bytes, read without decoding a sample. Raises ValueError for
    anything the encoders cannot read (not a WAV, a width other than 8/16/32 bits, no channels, a rate
    outside [1, MAX_SAMPLE_RATE])."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        size, opened = len(source), io.BytesIO(source)
    else:
        size, opened = Path(source).stat().st_size, str(source)
    try:
        with wave.open(opened, "rb") as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            frames = f.getnframes()
    except (wave.Error, EOFError, OSError, ValueError, struct.error) as e:
        raise ValueError(f"not a readable PCM WAV file ({e})") from None
    if width not in (1, 2, 4):
        raise ValueError(f"the WAV header says {width * 8}-bit samples; the audio towers read 8, 16 or 32")
    if channels < 1:
        raise ValueError(f"the WAV header says {channels} channels")
    check_sample_rate(rate, "the WAV header's sample rate")
    return WavHeader(min(frames, size // (width * channels)), channels, width, rate)


def check_sample_rate(rate: Any, what: str = "sample rate") -> int:
    """`rate` as an int in [1, MAX_SAMPLE_RATE], or a ValueError naming `what`."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {str(rate)[:40]}")
    if not 1 <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"{what} {rate} Hz is outside 1 to {MAX_SAMPLE_RATE} Hz (no recording format goes "
                         "beyond that)")
    return int(rate)


def resample_kernel_values(orig_rate: int, target_rate: int) -> int:
    """Values of the filter `torchaudio.functional.resample(x, orig_rate, target_rate)` builds (its
    default arguments): target' x (orig' + 2 width) with both rates divided by their gcd and width =
    ceil(6 orig' / (0.99 min(orig', target'))). 0 when nothing is resampled."""
    if orig_rate == target_rate:
        return 0
    g = math.gcd(orig_rate, target_rate)
    orig, new = orig_rate // g, target_rate // g
    width = math.ceil(6 * orig / (min(orig, new) * 0.99))
    return new * (orig + 2 * width)


def check_resample(rate: Any, target_rate: int, what: str = "sample rate") -> int:
    """`rate` (see `check_sample_rate`) when resampling it to `target_rate` stays within
    MAX_RESAMPLE_KERNEL_VALUES; else a ValueError that says which rates would do."""
    rate = check_sample_rate(rate, what)
    values = resample_kernel_values(rate, target_rate)
    if values > MAX_RESAMPLE_KERNEL_VALUES:
        raise ValueError(
            f"{what} {rate} Hz cannot be resampled to the encoder's {target_rate} Hz within bounds (its "
            f"filter would hold {values} values, over {MAX_RESAMPLE_KERNEL_VALUES}: the two rates share "
            f"too small a factor); convert the audio to a common rate such as 16000, 44100 or 48000 Hz")
    return rate


def decode_pcm(raw: bytes, channels: int, width: int) -> torch.Tensor:
    """PCM bytes (little-endian, interleaved) -> ``(channels, frames)`` float32 in [-1, 1]. A trailing
    partial frame is dropped. One copy: the samples are converted straight into channel-major order."""
    usable = len(raw) - len(raw) % (width * channels)
    ints = np.frombuffer(raw, dtype={1: np.uint8, 2: "<i2", 4: "<i4"}[width], count=usable // width)
    data = np.array(ints.reshape(-1, channels).T, dtype=np.float32, order="C")
    if width == 1:
        data -= 128.0
    data *= 1.0 / {1: 128.0, 2: 32768.0, 4: 2147483648.0}[width]
    return torch.from_numpy(data)


def wav_file_header(path: str | Path) -> WavHeader:
    """`wav_header` of a file, its errors naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"audio file {path} does not exist")
    try:
        return wav_header(path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """Read a PCM WAV file -> ``(channels, samples)`` float32 in [-1, 1], and its sample rate."""
    header = wav_file_header(path)
    with wave.open(str(path), "rb") as f:
        raw = f.readframes(header.frames)  # never the declared count: a forged header claims any number
    return decode_pcm(raw, header.channels, header.width), header.rate


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
    if rate is not None:
        check_sample_rate(rate)
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
        header = wav_file_header(item)
        return resampled_length(header.frames, header.rate, target_rate)
    data, rate = _unpack(item)
    shape = tuple(np.shape(data)) if isinstance(data, np.ndarray) else tuple(torch.as_tensor(data).shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"waveform must be (samples,) or (channels, samples), got {shape}")
    return resampled_length(shape[-1], rate, target_rate)


def audio_size(item: Any) -> tuple[int, int, int | None]:
    """(frames, channels, sample rate) of any accepted audio item without reading a sample (a WAV
    file: its header); the rate is None for a bare waveform (taken to be at the tower's rate)."""
    if isinstance(item, (str, Path)):
        header = wav_file_header(item)
        return header.frames, header.channels, header.rate
    data, rate = _unpack(item)
    if isinstance(data, (str, Path)):
        raise ValueError("give an audio path on its own, not inside a tuple/dict")
    shape = tuple(np.shape(data)) if isinstance(data, np.ndarray) else tuple(torch.as_tensor(data).shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"waveform must be (samples,) or (channels, samples), got {shape}")
    if rate is not None:
        check_sample_rate(rate)
    return (shape[0], 1, rate) if len(shape) == 1 else (shape[1], shape[0], rate)


def load_audio(item: Any, sample_rate: int = 16000) -> torch.Tensor:
    """Any accepted audio item -> mono float32 ``(samples,)`` at ``sample_rate`` (resampled if needed)."""
    data, rate = raw_waveform(item)
    if rate is not None and rate != sample_rate:
        data = resample(data, check_resample(rate, sample_rate), sample_rate)
    return data


RESAMPLE_CHUNK_BLOCKS = 2**16
"""Filter positions convolved at once: the convolution unfolds its input into a copy as many times larger
as the filter is longer than its stride, so it runs over chunks of the output."""


def resample(wave: torch.Tensor, orig_rate: int, target_rate: int) -> torch.Tensor:
    """`torchaudio.functional.resample(wave, orig_rate, target_rate)` of a 1-D waveform, computed over
    chunks of the output, so its working memory is a bounded multiple of the input rather than the
    unfolded whole. The same filter and convolution: the values equal torchaudio's up to the rounding of
    the convolution's blocking (training, the Bridge API and the server all resample here)."""
    if orig_rate == target_rate:
        return wave
    from torchaudio.functional.functional import _get_sinc_resample_kernel

    g = math.gcd(orig_rate, target_rate)
    orig, new = orig_rate // g, target_rate // g
    kernel, width = _get_sinc_resample_kernel(orig_rate, target_rate, g, device=wave.device, dtype=wave.dtype)
    length = wave.shape[-1]
    padded = torch.nn.functional.pad(wave.reshape(1, length), (width, width + orig))
    positions = (padded.shape[-1] - kernel.shape[-1]) // orig + 1
    out = torch.empty(positions * new, dtype=wave.dtype, device=wave.device)
    for start in range(0, positions, RESAMPLE_CHUNK_BLOCKS):
        stop = min(start + RESAMPLE_CHUNK_BLOCKS, positions)
        piece = padded[:, start * orig : (stop - 1) * orig + kernel.shape[-1]]
        rows = torch.nn.functional.conv1d(piece[:, None], kernel, stride=orig)  # (1, new, stop - start)
        out[start * new : stop * new] = rows[0].T.reshape(-1)
    target = int(torch.ceil(torch.as_tensor(new * length / orig)))  # torchaudio's own rounding
    return out[:target]


def audio_hash_parts(item: Any) -> list[bytes]:
    data, rate = raw_waveform(item)
    return [str(rate).encode(), data.contiguous().numpy().tobytes()]

"""Media files of data rows: a cheap header check at load time, and the full read.

`check_media_header` reads only what is cheap (an image's header, a WAV's header, a graph's
small JSON, fully validated) so that a whole data set can be checked before training starts;
`load_media` decodes the item. Both raise ValueError saying what is wrong with the file; the
data set adds where the file is named (file:line).
"""

from __future__ import annotations

import json
import wave
from pathlib import Path
from typing import Any

from encoders.graph_format import graph_from_dict

#: file suffixes that mark a row value as a media path (for "unknown media key" errors)
MEDIA_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".wav", ".flac", ".mp3", ".ogg",
     ".json"}
)
_WAV_WIDTHS = (1, 2, 4)  # sample widths the audio towers read (encoders.audio_inputs.load_wav)


def check_media_header(modality: str, path: Path) -> None:
    """Cheap validity check of one media file (no pixel or sample decoding)."""
    if not path.is_file():
        raise ValueError("file not found")
    if modality == "image":
        _check_image_header(path)
    elif modality == "audio":
        _check_wav_header(path)
    elif modality == "graph":
        _read_graph(path)
    else:
        raise ValueError(f"unknown media modality {modality!r}")


def load_media(modality: str, path: Path) -> Any:
    """The decoded item: an RGB PIL image, a WAV path (checked; the audio tower reads and
    resamples it), or a graph dict in the encoders' JSON graph format (validated)."""
    if not path.is_file():
        raise ValueError("file not found")
    if modality == "image":
        from PIL import Image

        try:
            with Image.open(path) as img:
                return img.convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"cannot decode the image ({_why(err)}); truncated or damaged?") from None
    if modality == "audio":
        _check_wav_header(path)
        return str(path)
    if modality == "graph":
        return _read_graph(path)
    raise ValueError(f"unknown media modality {modality!r}")


def decode_fully(modality: str, path: Path) -> None:
    """Decode the item as its encoder will (for the pre-training pass over eval items): images
    and graphs through `load_media`, audio through the encoders' WAV reader."""
    load_media(modality, path)
    if modality == "audio":
        from encoders.audio_inputs import load_wav

        try:
            waveform, _ = load_wav(path)
        except ValueError as err:
            raise ValueError(_why(err)) from None
        if waveform.numel() == 0:
            raise ValueError("the WAV holds no samples")


def _why(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _check_image_header(path: Path) -> None:
    from PIL import Image

    try:
        with Image.open(path) as img:
            width, height = img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"not a readable image ({_why(err)})") from None
    if width < 1 or height < 1:
        raise ValueError(f"image has size {width}x{height}")


def _check_wav_header(path: Path) -> None:
    try:
        with wave.open(str(path), "rb") as f:
            channels, width = f.getnchannels(), f.getsampwidth()
            rate, frames = f.getframerate(), f.getnframes()
    except (wave.Error, EOFError, OSError, ValueError) as err:
        raise ValueError(f"not a readable PCM WAV file ({_why(err)})") from None
    if rate <= 0:
        raise ValueError(f"the WAV header says sample rate {rate}")
    if channels < 1:
        raise ValueError(f"the WAV header says {channels} channels")
    if width not in _WAV_WIDTHS:
        raise ValueError(f"the WAV header says {width * 8}-bit samples; the audio towers read 8, 16 or 32")
    if frames < 1:
        raise ValueError("the WAV header says it holds no samples")


def _read_graph(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at line {err.lineno})") from None
    try:
        graph_from_dict(data, source="graph")
    except ValueError as err:
        raise ValueError(_why(err)) from None
    return data

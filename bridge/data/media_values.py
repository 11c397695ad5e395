"""Media stored inside a data set (bytes in a Hugging Face column, a member of a tar shard) -> the item
its encoder reads, sized against the row's `MediaBudget` before anything is decoded.

The forms a stored value takes: the `datasets` Image / Audio feature's `{"bytes", "path"}` (bytes
win; a path alone is a file, relative to the media root), raw bytes, a path string, a decoded audio
`{"array", "sampling_rate"}`, and for graphs a dict in the encoders' JSON graph format or its JSON
text. Every failure is a ValueError saying what is wrong; the data set adds where the row is.
"""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path
from typing import Any

from bridge.data.media import check_media_header, load_media
from encoders.media_budget import MediaBudget


def _bytes_or_path(value: Any) -> tuple[bytes | None, str | None]:
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None and not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"'bytes' holds a {type(data).__name__}, not bytes")
        if path is not None and not isinstance(path, str):
            raise ValueError(f"'path' holds a {type(path).__name__}, not a string")
        return (bytes(data) if data else None), (path or None)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if isinstance(value, str):
        return None, value
    raise ValueError(f"a {type(value).__name__} is not a media value (expected bytes, a path, or "
                     "{'bytes', 'path'})")


def media_item(modality: str, value: Any, media_root: Path, budget: MediaBudget) -> Any:
    """The encoder's item for a stored `value` of `modality` (see the module docstring)."""
    if value is None:
        raise ValueError(f"the {modality} is empty (null)")
    if modality == "graph":
        return _graph(value, budget)
    if modality == "audio" and isinstance(value, dict) and "array" in value:
        budget.add("audio", (value["array"], value.get("sampling_rate")), "")
        import numpy as np

        return np.asarray(value["array"], dtype=np.float32), int(value["sampling_rate"])
    data, path = _bytes_or_path(value)
    if data is None:
        if not path:
            raise ValueError(f"the {modality} has neither bytes nor a path")
        file = Path(path) if Path(path).is_absolute() else media_root / path
        check_media_header(modality, file, budget)
        try:
            return load_media(modality, file)
        except ValueError as exc:
            raise ValueError(f"{modality} file {file}: {exc}") from None
    if modality == "image":
        return decode_image(data, budget)
    if modality == "audio":
        return decode_wav(data, budget)
    raise ValueError(f"unknown media modality {modality!r}")


def decode_image(data: bytes, budget: MediaBudget) -> Any:
    """Encoded image bytes -> an RGB PIL image, its size counted in `budget` from the header first."""
    from PIL import Image

    budget.add("image", data, "")
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"cannot decode the image ({str(err)[:200] or type(err).__name__}); truncated or "
                         "damaged?") from None


def decode_wav(data: bytes, budget: MediaBudget) -> tuple[Any, int]:
    """PCM WAV bytes -> (waveform (channels, frames), sample rate), sized from the header first."""
    from encoders.audio_inputs import decode_pcm, wav_header

    header = wav_header(data)
    if header.frames < 1:
        raise ValueError("the WAV header says it holds no samples")
    budget.add_item("")
    budget.add_audio(header.frames, header.channels, header.rate, None, "")
    with wave.open(io.BytesIO(data), "rb") as f:
        raw = f.readframes(header.frames)
    return decode_pcm(raw, header.channels, header.width), header.rate


def _graph(value: Any, budget: MediaBudget) -> dict:
    from encoders.graph_format import graph_from_dict

    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("the graph is not UTF-8 text") from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"the graph is not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a graph is a JSON object, got {type(value).__name__}")
    graph_from_dict(value, source="graph")
    budget.add_item("")
    budget.add_graph(value["num_nodes"], len(value["edges"]), "")
    return value

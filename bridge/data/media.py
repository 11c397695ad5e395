"""Media files of data rows: a cheap header check at load time, and the full read.

`check_media_header` reads only what is cheap (an image's header, a WAV's header, a graph's
small JSON, fully validated) so that a whole data set can be checked before training starts;
`load_media` decodes the item. Both raise ValueError saying what is wrong with the file; the
data set adds where the file is named (file:line). Given a `MediaBudget` (one per data row), the header
check also adds the item's pixels, samples or nodes to it, so a row whose media would take more memory
than `MediaLimits` allows is refused at load, before a loader worker decodes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from encoders.audio_inputs import wav_header
from encoders.graph_format import graph_from_dict
from encoders.media_budget import MediaBudget

#: file suffixes that mark a row value as a media path (for "unknown media key" errors)
MEDIA_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".wav", ".flac", ".mp3", ".ogg",
     ".json"}
)


def check_row_media(media: dict[str, list[str]], root: Path, limits: Any, where: str) -> None:
    """Every media file of one row passes `check_media_header`, their sizes counted against one row's
    budget of `limits` (a `MediaLimits`); a `BadRow` naming the row (`where`), modality and file if not."""
    from bridge.data.bad_rows import BadRow

    budget = MediaBudget(limits, scope="row")
    for mod, rels in media.items():
        for rel in rels:
            file = root / rel
            try:
                check_media_header(mod, file, budget)
            except ValueError as exc:
                raise BadRow(f"{where}: {mod} file {file}: {exc}") from None


def check_media_header(modality: str, path: Path, budget: MediaBudget | None = None) -> None:
    """Cheap validity check of one media file (no pixel or sample decoding); its size counted in
    `budget` when given."""
    if not path.is_file():
        raise ValueError("file not found")
    if modality == "image":
        width, height = _check_image_header(path)
        if budget is not None:
            budget.add_item("")
            budget.add_image(width, height, "")
    elif modality == "audio":
        frames, channels, rate = _check_wav_header(path)
        if budget is not None:
            budget.add_item("")
            budget.add_audio(frames, channels, rate, None, "")
    elif modality == "graph":
        graph = _read_graph(path)
        if budget is not None:
            budget.add_item("")
            budget.add_graph(graph["num_nodes"], len(graph["edges"]), "")
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


def _check_image_header(path: Path) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as img:
            width, height = img.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"not a readable image ({_why(err)})") from None
    if width < 1 or height < 1:
        raise ValueError(f"image has size {width}x{height}")
    return width, height


def _check_wav_header(path: Path) -> tuple[int, int, int]:
    """(frames, channels, rate) from the header, with the encoders' own checks (width, channels, a rate
    no recording has); a WAV holding no samples is refused."""
    try:
        header = wav_header(path)
    except (ValueError, OSError) as err:
        raise ValueError(_why(err)) from None
    if header.frames < 1:
        raise ValueError("the WAV header says it holds no samples")
    return header.frames, header.channels, header.rate


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

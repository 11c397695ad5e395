"""A chat request's media parts -> engine items, its media budget checked before anything is decoded.

Three passes (`RequestMedia`), so that what a part costs is known before it is spent:

1. count: every media part of every message against `--max-media-items` (nothing is read yet);
2. size: each part's bytes (its base64 decoded, or a local file opened lazily) and its header (an
   image's size, a WAV header's frames, channels and rate, a graph's declared nodes and edges) added to
   the request's `MediaBudget`; the first part that takes a sum over its limit, or a WAV whose rate
   cannot be resampled to its encoder's, is a 400 naming the part and the flag;
3. decode, in one worker thread (never in the event loop, never in the engine's tick): images to
   `(3, H, W)` uint8 tensors, WAVs to mono float32 at their encoder's rate (resampled here, exactly as
   the encoder would), graphs to `Graph`s; and each item's content hash, sent as its
   `multi_modal_uuids` key, so the engine reads nothing of an item but its size before encoding it.
   Tensors cross the pipe to an engine process as raw bytes, where a PIL image went as a pickle.
"""

from __future__ import annotations

import asyncio
import binascii
import io
import wave
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
import torch
from PIL import Image

from bridge.serve.errors import ApiError, bounded
from bridge.serve.media_flags import MEDIA_FLAGS
from encoders.audio_inputs import decode_pcm, load_audio, wav_header
from encoders.graph_format import graph_from_dict, graph_size
from encoders.hashing import content_hash
from encoders.media_budget import MediaBudget, MediaLimits
from encoders.vision_inputs import image_size


def request_budget(limits: MediaLimits) -> MediaBudget:
    return MediaBudget(limits, scope="request", knob=MEDIA_FLAGS.__getitem__)


def b64_bytes(data: str, where: str) -> bytes:
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: not valid base64", param=where) from None


def decode_image(source: bytes | Path, where: str) -> Image.Image:
    """An image file's bytes (or path) -> an RGB PIL image. Its size was budgeted from its header."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ApiError(400, f"{where}: cannot decode the image ({type(err).__name__})", param=where) from None


def image_tensor(source: bytes | Path, where: str) -> torch.Tensor:
    """The image as a `(3, H, W)` uint8 tensor, an item form the encoders take as they take the PIL
    image (the same pixels): it crosses to an engine process as raw bytes."""
    array = np.asarray(decode_image(source, where))  # the PIL image is released here
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def decode_wav(raw: bytes, where: str) -> tuple[torch.Tensor, int]:
    """Bytes of a PCM WAV file -> ((channels, samples) float32 in [-1, 1], sample rate)."""
    try:
        header = wav_header(raw)
    except ValueError as err:
        raise ApiError(400, f"{where}: {bounded(err, 300)}", param=where) from None
    with wave.open(io.BytesIO(raw), "rb") as f:
        data = f.readframes(header.frames)
    wav = decode_pcm(data, header.channels, header.width)
    if wav.shape[1] == 0:
        raise ApiError(400, f"{where}: the WAV holds no samples", param=where)
    return wav, header.rate


@dataclass
class _Pending:
    modality: str
    where: str
    source: Any  # image: bytes or a Path; audio: WAV bytes; graph: its dict


@dataclass
class RequestMedia:
    """One request's media: `count` every part first, then `add_*` each as it is met (sized and
    budgeted), then `await decode()` for the engine's `multi_modal_data` and `multi_modal_uuids`.

    `sample_rates`: the rate each audio encoder reads (samples are budgeted, and resampled, at it)."""

    limits: MediaLimits
    sample_rates: Mapping[str, int]
    budget: MediaBudget = field(init=False)
    pending: list[_Pending] = field(default_factory=list)
    items: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget = request_budget(self.limits)

    def count(self, wheres: list[str]) -> None:
        """Every media part's position, before any is read: over `--max-media-items` is a 400."""
        if len(wheres) > self.limits.max_items:
            where = wheres[self.limits.max_items]
            raise ApiError(400, f"{where}: more than {self.limits.max_items} media items in this request "
                           f"({MEDIA_FLAGS['max_items']})", param=where)

    def _fits(self, add: Any, *args: Any) -> None:
        try:
            add(*args)
        except ValueError as err:
            raise ApiError(400, bounded(err, 400), param=args[-1]) from None

    def add_image(self, source: bytes | Path, where: str) -> None:
        try:
            width, height = image_size(source)
        except ValueError as err:
            raise ApiError(400, f"{where}: {bounded(err, 200)}", param=where) from None
        self._fits(self.budget.add_image, width, height, where)
        self.pending.append(_Pending("image", where, source))

    def add_audio(self, raw: bytes, where: str) -> None:
        try:
            header = wav_header(raw)
        except ValueError as err:
            raise ApiError(400, f"{where}: {bounded(err, 300)}", param=where) from None
        self._fits(self.budget.add_audio, header.frames, header.channels, header.rate,
                   self.sample_rates.get("audio"), where)
        self.pending.append(_Pending("audio", where, raw))

    def add_graph(self, graph: dict, where: str) -> None:
        try:
            nodes, edges = graph_size(graph, source=where)
        except ValueError as err:
            raise ApiError(400, bounded(err, 300), param=where) from None
        self._fits(self.budget.add_graph, nodes, edges, where)
        self.pending.append(_Pending("graph", where, graph))

    def add_ready(self, modality: str, item: Any) -> None:
        """An item decoded already (a prompt-embeds part)."""
        self.items.setdefault(modality, []).append(item)

    async def decode(self) -> tuple[dict[str, list[Any]], dict[str, list[str | None]]]:
        """(multi_modal_data, multi_modal_uuids), decoded in a worker thread."""
        decoded = await asyncio.to_thread(self._decode_all) if self.pending else []
        media = {m: list(items) for m, items in self.items.items()}
        uuids: dict[str, list[str | None]] = {m: [None] * len(items) for m, items in media.items()}
        for (modality, item, digest) in decoded:
            media.setdefault(modality, []).append(item)
            uuids.setdefault(modality, []).append(digest)
        return media, uuids

    def _decode_all(self) -> list[tuple[str, Any, str]]:
        out = []
        for part in self.pending:
            item = self._decode(part)
            out.append((part.modality, item, content_hash(part.modality, item)))
        return out

    def _decode(self, part: _Pending) -> Any:
        if part.modality == "image":
            return image_tensor(part.source, part.where)
        if part.modality == "audio":
            wav, rate = decode_wav(part.source, part.where)
            target = self.sample_rates.get("audio")
            if target is None:
                return wav, rate
            try:
                return load_audio((wav, rate), target), target
            except ValueError as err:
                raise ApiError(400, f"{part.where}: {bounded(err, 300)}", param=part.where) from None
        try:
            return graph_from_dict(part.source, source=part.where)
        except (ValueError, TypeError) as err:
            raise ApiError(400, bounded(err, 300), param=part.where) from None

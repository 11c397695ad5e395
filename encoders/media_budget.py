"""A caller's media counted against memory limits before any of it is decoded.

Decoding is where media cost memory: an image's pixels, a waveform's samples (and the filter that
resamples it), a graph's nodes and edges. Each is known beforehand from what is cheap to read: an image
file's header, a WAV header, a graph's declared `num_nodes` and edge list. `MediaBudget` adds those up
over one unit of work (a server request, one prompt of `Bridge.generate`, one training row) and refuses
the first item that takes a sum over its limit, naming the item and the limit, before anything is
decoded; so memory is bounded before it is spent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from encoders.audio_inputs import audio_size, check_resample, resampled_length
from encoders.graph_format import graph_size
from encoders.vision_inputs import image_size


@dataclass(frozen=True)
class MediaLimits:
    """Sums over one unit of work (see the module docstring). Samples are counted twice: at the
    encoder's rate, mono (what it reads), and as stored, frames times channels (what decoding holds)."""

    max_items: int = 64
    max_image_pixels: int = 2**25  # an 8K frame (7680 x 4320) fits
    max_audio_samples: int = 2**24  # about 17 minutes at 16 kHz
    max_audio_file_samples: int = 2**25  # about 6 minutes of 48 kHz stereo
    max_graph_nodes: int = 2**16
    max_graph_edges: int = 2**20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {str(value)[:40]}")


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _default_knob(name: str) -> str:
    return f"MediaLimits.{name}"


class MediaBudget:
    """Running sums of one unit of work's media against `limits`.

    `scope` names the unit in messages ("request", "prompt", "row"); `knob(name)` says how the caller
    raises the limit `name` (a `bridge serve` flag, a keyword). Every `add_*` raises ValueError
    starting with `where` (unless it is "") when a sum would go over its limit, and leaves the sums
    unchanged then.
    """

    def __init__(self, limits: MediaLimits | None = None, *, scope: str = "prompt",
                 knob: Callable[[str], str] = _default_knob) -> None:
        self.limits = limits or MediaLimits()
        self.scope = scope
        self.knob = knob
        self.items = self.pixels = self.samples = self.file_samples = self.nodes = self.edges = 0

    def _check(self, name: str, total: int, where: str, what: str) -> int:
        limit = getattr(self.limits, name)
        if total > limit:
            raise ValueError(f"{_at(where)}this {self.scope}'s {what} add up to {total}, over the limit of "
                             f"{limit} ({self.knob(name)})")
        return total

    def add_item(self, where: str) -> None:
        """One more media item (counted before anything of it is read)."""
        self.items = self._check("max_items", self.items + 1, where, "media items")

    def add_image(self, width: int, height: int, where: str) -> None:
        self.pixels = self._check("max_image_pixels", self.pixels + width * height, where,
                                  f"image pixels (with this {width}x{height} image)")

    def add_audio(self, frames: int, channels: int, rate: int | None, target_rate: int | None,
                  where: str) -> None:
        """`rate` None: the waveform is at the encoder's rate already; `target_rate` None: the encoder's
        rate is not known, so the samples are counted as stored."""
        if rate is not None and target_rate is not None:
            try:
                check_resample(rate, target_rate)
            except ValueError as err:
                raise ValueError(f"{_at(where)}{err}") from None
        at_rate = resampled_length(frames, rate if target_rate else None, target_rate or 0)
        file_samples = self._check("max_audio_file_samples", self.file_samples + frames * channels, where,
                                   "audio samples as stored (frames x channels)")
        self.samples = self._check("max_audio_samples", self.samples + at_rate, where,
                                   "audio samples at the encoder's rate")
        self.file_samples = file_samples

    def add_graph(self, nodes: int, edges: int, where: str) -> None:
        total_nodes = self._check("max_graph_nodes", self.nodes + nodes, where, "graph nodes")
        self.edges = self._check("max_graph_edges", self.edges + edges, where, "graph edges")
        self.nodes = total_nodes

    def add(self, modality: str, item: Any, where: str, *, target_rate: int | None = None) -> None:
        """Count one item of any form the encoders accept, read from its header or declared size.
        Raises ValueError starting with `where` for an item that cannot be sized, or over a limit."""
        items = self._check("max_items", self.items + 1, where, "media items")
        try:
            if modality == "image":
                size = image_size(item)
            elif modality == "audio":
                size = audio_size(item)
            elif modality == "graph":
                size = graph_size(item)
            else:  # no budget for other modalities (prompt embeds are bounded where they are decoded)
                self.items = items
                return
        except ValueError as err:
            raise ValueError(f"{_at(where)}{err}") from None
        if modality == "image":
            self.add_image(*size, where)
        elif modality == "audio":
            self.add_audio(*size, target_rate, where)
        else:
            self.add_graph(*size, where)
        self.items = items


__all__ = ["MediaBudget", "MediaLimits"]

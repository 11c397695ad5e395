"""The two base classes an encoder is made of: a Tower and a Projector.

Why a shared contract: the Encoder composes any tower with any projector, computes how many rows an
item will produce *before* running anything (the runner expands placeholders first), and saves /
rebuilds itself from JSON. Each part therefore answers three questions besides ``forward``: how
many rows it produces, what its feature width is, and what config rebuilds it without external files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Batch = dict[str, Any]


class Tower(nn.Module):
    """Turns preprocessed items into feature rows: ``(B, T, out_dim)`` plus per-item lengths.

    Subclasses set ``modality`` and ``out_dim`` and implement the methods below. ``preprocess`` and
    ``collate`` run on the CPU (data-loader workers may call them); ``forward`` runs on the tower's
    device. ``lengths`` is ``None`` when every item yields the full ``T`` rows.
    """

    modality: str = ""
    out_dim: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> Tower:
        raise NotImplementedError

    def export_config(self) -> dict:
        """A config that rebuilds this tower's architecture with no external files (weights come
        from the encoder checkpoint), so a saved encoder loads on a machine without the source dir."""
        raise NotImplementedError

    def preprocess(self, item: Any) -> Any:
        raise NotImplementedError

    def collate(self, processed: list[Any]) -> Batch:
        raise NotImplementedError

    def output_rows(self, item: Any) -> int:
        """Rows ``forward`` will produce for this raw item, computed cheaply (no forward pass)."""
        raise NotImplementedError

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


class Projector(nn.Module):
    """Maps tower features ``(B, T, in_dim)`` to LLM rows ``(B, T', out_dim)``.

    ``lengths`` (``(B,)`` long, or None for "all T") travels with the features so that row-count
    changing projectors (frame stacking, resamplers) keep padded batches honest.
    """

    in_dim: int = 0
    out_dim: int = 0

    @classmethod
    def from_config(cls, cfg: dict, in_dim: int, out_dim: int) -> Projector:
        raise NotImplementedError

    def output_rows(self, rows: int) -> int:
        return rows

    def forward(
        self, x: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


def check_keys(cfg: dict, allowed: set[str], where: str) -> None:
    """Reject unknown config keys by name (a typo silently ignored is a week of wrong results)."""
    unknown = sorted(set(cfg) - allowed - {"name"})
    if unknown:
        raise ValueError(f"{where}: unknown config key(s) {unknown}; valid keys: {sorted(allowed)}")


def lengths_mask(lengths: torch.Tensor | None, batch: int, rows: int, device: torch.device) -> torch.Tensor:
    """``(B, T)`` bool, True where a row is real (not padding)."""
    if lengths is None:
        return torch.ones(batch, rows, dtype=torch.bool, device=device)
    return torch.arange(rows, device=device)[None, :] < lengths.to(device)[:, None]


def move_batch(batch: Batch, device: torch.device, dtype: torch.dtype | None = None) -> Batch:
    """Move every tensor of a collated batch to ``device``; floating tensors also to ``dtype``."""
    out: Batch = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if dtype is not None and value.is_floating_point():
                value = value.to(device=device, dtype=dtype)
            else:
                value = value.to(device)
        out[key] = value
    return out

"""A custom image tower: the mean colour of each cell of a grid, lifted to `dim` features."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

import encoders


@encoders.register_tower("colour_grid")
class ColourGridTower(encoders.Tower):
    modality = "image"  # "image", "audio" or "graph": which placeholder the rows stand in for

    def __init__(self, grid: int = 4, dim: int = 32):
        super().__init__()
        self.grid = grid
        self.out_dim = dim  # the width of the rows forward returns (the projector's input)
        self.lift = nn.Sequential(nn.Linear(3, dim), nn.GELU(), nn.Linear(dim, dim))
        self.pos = nn.Parameter(torch.zeros(grid * grid, dim))

    @classmethod
    def from_config(cls, cfg: dict) -> ColourGridTower:
        return cls(**cfg)  # the recipe's tower keys, without "name"

    def export_config(self) -> dict:
        # what rebuilds this tower when a checkpoint is loaded (the weights come from the checkpoint)
        return {"name": "colour_grid", "grid": self.grid, "dim": self.out_dim}

    def preprocess(self, item: Any) -> torch.Tensor:
        # CPU, per item: a PIL image / path / bytes -> (grid * grid, 3) mean colours in [0, 1]
        cells = encoders.load_image(item).resize((self.grid, self.grid), Image.BOX)
        return torch.from_numpy(np.asarray(cells, dtype=np.float32).reshape(-1, 3) / 255.0)

    def collate(self, processed: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"cells": torch.stack(processed)}  # (B, grid * grid, 3)

    def output_rows(self, item: Any) -> int:
        return self.grid * self.grid  # rows per item, known before running anything

    def forward(self, batch: dict) -> tuple[torch.Tensor, None]:
        # (B, rows, out_dim), and per-item lengths (None: every item has all rows)
        return self.lift(batch["cells"]) + self.pos, None

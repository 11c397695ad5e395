"""Synthetic vision set: one coloured shape on a noisy background -> "a <colour> <shape>".

Made in code (no download) and deterministic per (seed, split, index): held-out items come from a
different split stream, so no eval image is a training image. Position, size, background and
pixel noise vary, so the encoder has to see colour and shape, not memorise pixels.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from bridge.data.example import Example
from bridge.data.synthetic_base import SyntheticDataset

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")


class ShapesDataset(SyntheticDataset):
    modality = "image"

    def __init__(
        self,
        num_items: int,
        *,
        seed: int,
        split: str,
        prompt: str = "<image>",
        image_size: int = 32,
        min_size: float = 0.5,
        max_size: float = 0.9,
    ):
        super().__init__(num_items, seed=seed, split=split, prompt=prompt)
        self.image_size = image_size
        if not 0 < min_size <= max_size <= 1:
            raise ValueError(
                f"shape sizes must satisfy 0 < min_size <= max_size <= 1, got {min_size}, {max_size}"
            )
        self.min_size, self.max_size = min_size, max_size

    @staticmethod
    def vocab_words() -> list[str]:
        return ["a", *COLOURS, *SHAPES]

    def __getitem__(self, index: int) -> Example:
        rng = self._item_rng(index)
        colour = list(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        return Example(self.prompt, f"a {colour} {shape}", {"image": [self._draw(rng, colour, shape)]})

    def _draw(self, rng: np.random.Generator, colour: str, shape: str) -> Image.Image:
        s = self.image_size
        background = tuple(int(v) for v in rng.integers(0, 70, size=3))
        img = Image.new("RGB", (s, s), background)
        draw = ImageDraw.Draw(img)
        size = rng.uniform(self.min_size, self.max_size) * s
        x0, y0 = rng.uniform(0, s - size, size=2)
        box = (x0, y0, x0 + size, y0 + size)
        fill = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in COLOURS[colour])
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0 + size / 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)
        pixels = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, size=(s, s, 3))
        return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))

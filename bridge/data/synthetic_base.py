"""What the synthetic demo sets (shapes, tones, graphs) share: size, split and per-item randomness.

Each item is made from its own random stream seeded by (seed, split, index), so an item is the
same whenever and wherever it is asked for (any order, any worker), and the held-out split is a
different stream: no eval item is a training item.
"""

from __future__ import annotations

import numpy as np

SPLIT_IDS: dict[str, int] = {"train": 0, "eval": 1}


class SyntheticDataset:
    """`num_items` items of `modality`, each with the text prompt `prompt`; subclasses make item i
    from `self._item_rng(i)`."""

    modality: str

    def __init__(self, num_items: int, *, seed: int, split: str, prompt: str) -> None:
        self.num_items = num_items
        self.seed = seed
        self.split_id = SPLIT_IDS[split]
        self.prompt = prompt

    def __len__(self) -> int:
        return self.num_items

    def _item_rng(self, index: int) -> np.random.Generator:
        """The random stream of item `index` (IndexError outside the set)."""
        if not 0 <= index < self.num_items:
            raise IndexError(index)
        return np.random.default_rng([self.seed, self.split_id, index])

"""Data order: a seeded, resumable stream of dataset indices shared by every rank.

Epoch e is `randperm(n)` under a generator seeded by (seed, e). The stream is cut into global
micro-batches of `batch_size * world_size` indices; rank r takes its slice of each. Where the
stream stands is a pure function of how many micro-batches were consumed, so resuming at step
s skips straight to the same position (no replay), and a 2-rank run sees exactly the samples a
1-rank run with twice the batch sees.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ResumableSampler:
    def __init__(self, num_items: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
        if num_items < 1:
            raise ValueError("the training set is empty")
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def _epoch_perm(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_items, generator=gen).tolist()
            self._perm_epoch = epoch
        return self._perm

    def _global_index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_items)
        return self._epoch_perm(epoch)[offset]

    def micro_batch(self, micro_step: int) -> list[int]:
        """This rank's dataset indices for global micro-batch number `micro_step` (0-based)."""
        start = micro_step * self.global_batch + self.rank * self.batch_size
        return [self._global_index(start + i) for i in range(self.batch_size)]

    def iterate(self, start_micro_step: int = 0) -> Iterator[list[int]]:
        step = start_micro_step
        while True:
            yield self.micro_batch(step)
            step += 1

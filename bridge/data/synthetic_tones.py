"""Synthetic audio set: beep patterns -> "<count> <pitch> beep(s)", e.g. "two high beeps".

Mono float waveforms made in code, deterministic per (seed, split, index). Pitch (low / mid /
high band, jittered), the number of beeps (1-3), their timing, loudness and background noise vary.
"""

from __future__ import annotations

import numpy as np
import torch

from bridge.data.example import Example
from bridge.data.synthetic_base import SyntheticDataset

PITCHES: dict[str, float] = {"low": 300.0, "mid": 800.0, "high": 2000.0}
COUNTS: tuple[str, ...] = ("one", "two", "three")


class TonesDataset(SyntheticDataset):
    modality = "audio"

    def __init__(
        self,
        num_items: int,
        *,
        seed: int,
        split: str,
        prompt: str = "<audio>",
        sample_rate: int = 16000,
        duration_s: float = 0.5,
    ):
        super().__init__(num_items, seed=seed, split=split, prompt=prompt)
        self.sample_rate = sample_rate
        self.duration_s = duration_s

    @staticmethod
    def vocab_words() -> list[str]:
        return [*COUNTS, *PITCHES, "beep", "beeps"]

    def __getitem__(self, index: int) -> Example:
        rng = self._item_rng(index)
        pitch = list(PITCHES)[rng.integers(len(PITCHES))]
        count = int(rng.integers(1, len(COUNTS) + 1))
        target = f"{COUNTS[count - 1]} {pitch} {'beep' if count == 1 else 'beeps'}"
        return Example(self.prompt, target, {"audio": [self._waveform(rng, PITCHES[pitch], count)]})

    def _waveform(self, rng: np.random.Generator, freq: float, count: int) -> torch.Tensor:
        sr = self.sample_rate
        n = int(sr * self.duration_s)
        wave = rng.normal(0.0, 0.02, size=n)
        slot = n // 3
        beep_len = int(slot * rng.uniform(0.45, 0.7))
        f = freq * rng.uniform(0.9, 1.1)
        amp = rng.uniform(0.3, 0.8)
        t = np.arange(beep_len) / sr
        envelope = np.hanning(beep_len)
        for k in range(count):
            start = k * slot + int(rng.integers(0, slot - beep_len + 1))
            wave[start : start + beep_len] += amp * envelope * np.sin(2 * np.pi * f * t)
        return torch.from_numpy(wave.astype(np.float32))

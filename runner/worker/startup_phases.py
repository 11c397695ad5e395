"""Seconds and Triton builds of each phase of an engine's start-up.

Why: on a fresh machine most of `LLM(...)` is Triton building kernel specialisations, which a warm
on-disk cache hides; a number per phase (load, profile, KV cache, graph captures, warm-up) and its builds
says what a change to the start-up really costs (`benchmarks/generate.py` reports construction).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from runner.worker.kernel_compiles import kernel_compiles


class StartupPhases:
    """`phases[name] = (seconds, Triton builds)`, filled by `with record(name): ...`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, tuple[float, int]] = {}

    @contextlib.contextmanager
    def record(self, name: str) -> Iterator[None]:
        """Time the block, its device work included (a sync at the end on CUDA), and count its builds."""
        cuda = self.device.type == "cuda"
        compiles = kernel_compiles() if cuda else None
        builds = compiles.count if compiles is not None else 0
        started = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            built = compiles.count - builds if compiles is not None else 0
            self.phases[name] = (time.perf_counter() - started, built)

    def summary(self) -> str:
        return ", ".join(f"{name} {s:.2f} s ({n} Triton builds)" for name, (s, n) in self.phases.items())


__all__ = ["StartupPhases"]

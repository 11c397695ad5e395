"""Learning-rate schedule: linear warmup, then cosine / linear decay or constant.

A pure function of the step (a LambdaLR multiplier), so a resumed run gets the same LR at the
same step from the step count alone.
"""

from __future__ import annotations

import math

import torch


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, kind: str, min_lr_ratio: float) -> float:
    """Fraction of the peak LR at optimizer step `step` (0-based: the step about to be taken)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "linear":
        decay = 1.0 - progress
    else:
        raise ValueError(f"unknown LR schedule {kind!r}; choose cosine, linear or constant")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, max_steps: int, kind: str, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup_steps=warmup_steps, max_steps=max_steps, kind=kind, min_lr_ratio=min_lr_ratio
        ),
    )

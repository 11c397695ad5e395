"""A small LoRA in plain torch: `peft` is not a dependency, and the few lines below are all the
finetune stage needs (wrap chosen `nn.Linear`s, train only A and B, merge back for inference).

`W x + (alpha / r) * B A x` with A random (Kaiming) and B zero, so a freshly wrapped model
computes exactly what the base model did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


class LoRALinear(nn.Module):
    """An `nn.Linear` with a trainable low-rank update; the base weight stays frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank = rank
        self.scale = alpha / rank
        for p in self.base.parameters():
            p.requires_grad_(False)
        dev = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        update = (self.dropout(x).to(self.lora_a.dtype) @ self.lora_a.t()) @ self.lora_b.t()
        return out + (update * self.scale).to(out.dtype)

    @torch.no_grad()
    def merged_linear(self) -> nn.Linear:
        """A plain `nn.Linear` whose weight includes the update (for saving an inference model)."""
        merged = nn.Linear(
            self.base.in_features,
            self.base.out_features,
            bias=self.base.bias is not None,
            device=self.base.weight.device,
            dtype=self.base.weight.dtype,
        )
        delta = (self.lora_b @ self.lora_a) * self.scale
        merged.weight.copy_((self.base.weight.float() + delta).to(self.base.weight.dtype))
        if self.base.bias is not None:
            merged.bias.copy_(self.base.bias)
        return merged


def _matches(name: str, targets: Sequence[str] | str) -> bool:
    if targets == "all-linear":
        return "lm_head" not in name
    leaf = name.rsplit(".", 1)[-1]
    return leaf in targets


def apply_lora(
    model: nn.Module, targets: Sequence[str] | str, rank: int, alpha: float, dropout: float = 0.0
) -> list[str]:
    """Replace matching linear layers of `model` in place; returns the wrapped module names.

    Raises ValueError when nothing matches, because a LoRA that adapts nothing would train
    silently to no effect.
    """
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and _matches(name, targets):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, LoRALinear(module, rank, alpha, dropout))
            wrapped.append(name)
    if not wrapped:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"LoRA targets {targets!r} match no linear layer; linear names: {linears}")
    return wrapped


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRALinear back into a plain nn.Linear in place; returns how many were merged."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, module.merged_linear())
            count += 1
    return count

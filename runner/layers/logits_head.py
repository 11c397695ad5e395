"""The LM head plus what a family's `ForCausalLM.forward` does to the logits after it.

The runner computes logits as `lm_head(hidden)` on the rows that sample, never through the model's
own `ForCausalLM.forward`, so a family that post-processes its logits there would lose it: Gemma 2/3
soft-cap them (`final_logit_softcapping`: `c * tanh(logits / c)`), Granite divides them by
`logits_scaling`, Cohere multiplies them by `logit_scale`. Greedy tokens survive all three (each is
monotonic), but logprobs and sampled tokens would not. `wrap_lm_head` returns the head with the same
arithmetic appended, read from the config, so the numbers equal Hugging Face's.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.hf_config import text_config


def final_logits_ops(config: Any) -> tuple[float | None, float | None, float | None]:
    """(divide_by, multiply_by, softcap) the family applies after its LM head, None where it does not."""
    text = text_config(config)
    divide = getattr(text, "logits_scaling", None)
    multiply = getattr(text, "logit_scale", None)
    softcap = getattr(text, "final_logit_softcapping", None)
    return (
        float(divide) if divide not in (None, 1, 1.0) else None,
        float(multiply) if multiply not in (None, 1, 1.0) else None,
        float(softcap) if softcap else None,
    )


class FinalLogitsHead(torch.nn.Module):
    """`head(hidden)` then the family's scaling and soft-capping, in Hugging Face's order."""

    def __init__(self, head: torch.nn.Module, divide: float | None, multiply: float | None,
                 softcap: float | None) -> None:
        super().__init__()
        self.head = head
        self.divide, self.multiply, self.softcap = divide, multiply, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.divide is not None:
            logits = logits / self.divide
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def wrap_lm_head(head: torch.nn.Module, config: Any) -> torch.nn.Module:
    """`head` itself when the family adds nothing after it, else a `FinalLogitsHead` around it."""
    divide, multiply, softcap = final_logits_ops(config)
    if divide is None and multiply is None and softcap is None:
        return head
    return FinalLogitsHead(head, divide, multiply, softcap)

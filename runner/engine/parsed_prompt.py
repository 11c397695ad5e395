"""`ParsedPrompt`: one prompt after validation, before it becomes a `Request`.

Its own module because both the prompt processor (`prompts.py`, which makes them) and the staging of
their embeddings (`embeds_staging.py`, which uploads and checks them) speak it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.multimodal.placeholders import ExpandedPrompt


@dataclass
class ParsedPrompt:
    """A validated prompt: its ids (placeholder id at embedding rows), embeds, mask, media."""

    text: str | None
    token_ids: list[int]
    embeds: torch.Tensor | None = None
    is_token_ids: torch.Tensor | None = None
    mm: ExpandedPrompt | None = None


__all__ = ["ParsedPrompt"]

"""Assemble one prompt's `(n, hidden)` embeddings: token embeddings at text positions, encoder
rows at placeholder positions. Used by training (batched, padded, differentiable) and by
generation (one tensor per prompt, handed to runner.LLM as `prompt_embeds` together with
`prompt_is_token_ids` and `prompt_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bridge.data.tokenize import TokenizedPrompt


def ordered_rows(
    prompts: Sequence[TokenizedPrompt],
    rows_by_modality: dict[str, list[torch.Tensor]],
    first_item: dict[str, list[int]],
) -> list[torch.Tensor]:
    """Encoder rows in sequence order: prompt by prompt, span by span.

    `rows_by_modality[m]` holds the encoder outputs of every modality-m item of the batch, and
    `first_item[m][p]` is where prompt p's items of modality m start in that list.
    """
    out = []
    for p, prompt in enumerate(prompts):
        for span in sorted(prompt.spans, key=lambda s: s.start):
            rows = rows_by_modality[span.modality][first_item[span.modality][p] + span.item_index]
            if rows.shape[0] != span.length:
                raise ValueError(
                    f"the {span.modality} encoder produced {rows.shape[0]} rows for an item "
                    f"but num_rows promised {span.length}"
                )
            out.append(rows)
    return out


def scatter_rows(
    token_embeds: torch.Tensor, is_token: torch.Tensor, rows: list[torch.Tensor]
) -> torch.Tensor:
    """Put `rows` (concatenated in row-major order) at the positions where `is_token` is False.

    `token_embeds` is `(..., L, H)`; out-of-place and differentiable with respect to the rows.
    """
    if not rows:
        return token_embeds
    source = torch.cat(rows, dim=0).to(token_embeds.dtype)
    slots = int((~is_token).sum())
    if slots != source.shape[0]:
        raise ValueError(f"{slots} placeholder positions but {source.shape[0]} encoder rows")
    mask = (~is_token).unsqueeze(-1).expand_as(token_embeds)
    return token_embeds.masked_scatter(mask, source)

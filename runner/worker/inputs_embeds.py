"""Assembly of a step's `inputs_embeds`: token embeddings, media rows, user prompt-embeds rows.

A step's rows come from three sources, told apart by two masks over the step's tokens:

- token-id positions (`is_token_ids_mask` True and not `is_mm_embed`): the embedding lookup;
- media positions (`is_mm_embed` True): encoder rows from `EncoderCache.gather`, scattered in
  step-token order. The engine no longer passes these: it builds the token rows only and lets
  `ItemTable.apply` (runner.multimodal.item_table) write item rows over them on the device; this
  host scatter stays as the reference the device gather is tested against, bit for bit;
- user prompt-embeds positions (neither): rows the prompt-embeds overlay
  (`PromptEmbedsState.apply`) writes. Assembly leaves these rows of the output untouched
  (`torch.where` on the token mask, `masked_scatter` on the media mask; never an
  unconditional overwrite).

Composition with `PromptEmbedsState.apply`, which writes a request's rows unless its
`is_token_ids` is True there: either order is correct, as long as the masks agree (the overlay
treats media and token positions as "token ids", assembly treats user rows as neither):

1. `build(...)` then `apply(out, ...)` (the engine's order): the user rows hold stale buffer
   contents after `build` and the overlay then fills every one of them;
2. `apply(out, ...)` then `build(..., out=out)`: the user rows are already in place and `build`
   keeps them bit-exact.

Placeholder ids (negative, >= vocab, or any id at a non-token position) are replaced by 0
before the lookup, so the embedding never reads out of range and never faults on the device.

Why one persistent buffer: CUDA graphs capture fixed addresses, and warm-up/capture must be
able to produce `inputs_embeds` without running an encoder (`dummy_inputs_embeds`).
Everything here is device-side and free of host syncs (`torch.where`, `masked_scatter`), so it
can run right before a replayed graph.
"""

from __future__ import annotations

import torch
from torch import nn


def _vocab_size_of(embed_tokens: nn.Module) -> int:
    num = getattr(embed_tokens, "num_embeddings", None)
    if num is None:
        weight = getattr(embed_tokens, "weight", None)
        if weight is None:
            raise ValueError(
                f"cannot tell the vocabulary size of {type(embed_tokens).__name__}; pass vocab_size="
            )
        num = weight.shape[0]
    return int(num)


@torch.no_grad()
def assemble_inputs_embeds(
    embed_tokens: nn.Module,
    input_ids: torch.Tensor,
    out: torch.Tensor,
    is_token_ids_mask: torch.Tensor | None = None,
    mm_embeds: torch.Tensor | None = None,
    is_mm_embed: torch.Tensor | None = None,
    *,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Write a step's embeddings into `out` (num_tokens, hidden) in place and return it.

    `input_ids` (num_tokens,) int; `is_token_ids_mask` (num_tokens,) bool, None = every
    position is a token id unless it is a media position; `mm_embeds` (k, hidden) with
    `is_mm_embed` (num_tokens,) bool holding exactly k True. Rows at neither kind of position
    keep `out`'s contents (user prompt embeddings). Inference only: runs without autograd.
    """
    num_tokens = input_ids.shape[0]
    if out.dim() != 2 or out.shape[0] != num_tokens:
        raise ValueError(f"out must be (num_tokens={num_tokens}, hidden), got {tuple(out.shape)}")
    if (mm_embeds is None) != (is_mm_embed is None):
        raise ValueError("mm_embeds and is_mm_embed go together: pass both or neither")
    if mm_embeds is not None and (mm_embeds.dim() != 2 or mm_embeds.shape[1] != out.shape[1]):
        raise ValueError(f"mm_embeds must be (k, hidden={out.shape[1]}), got {tuple(mm_embeds.shape)}")
    vocab = _vocab_size_of(embed_tokens) if vocab_size is None else vocab_size

    token_mask = (input_ids >= 0) & (input_ids < vocab)
    if is_token_ids_mask is not None:
        token_mask &= is_token_ids_mask
    if is_mm_embed is not None:
        token_mask &= ~is_mm_embed
    safe_ids = input_ids.masked_fill(~token_mask, 0)
    embedded = embed_tokens(safe_ids)
    if embedded.dtype != out.dtype:
        embedded = embedded.to(out.dtype)
    torch.where(token_mask.unsqueeze(-1), embedded, out, out=out)
    if mm_embeds is not None:
        out.masked_scatter_(is_mm_embed.unsqueeze(-1), mm_embeds.to(out.dtype))
    return out


class InputsEmbedsBuilder:
    """Owns the persistent `(max_num_tokens, hidden)` inputs_embeds buffer of a model runner."""

    def __init__(
        self,
        max_num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_num_tokens <= 0 or hidden_size <= 0:
            raise ValueError(
                f"max_num_tokens and hidden_size must be positive, got {max_num_tokens}, {hidden_size}"
            )
        self.max_num_tokens = int(max_num_tokens)
        self.hidden_size = int(hidden_size)
        # Zero-filled: warm-up and capture read finite values before any real step.
        self.buffer = torch.zeros(self.max_num_tokens, self.hidden_size, dtype=dtype, device=device)

    def _slice(self, num_tokens: int) -> torch.Tensor:
        if not 0 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"{num_tokens} tokens do not fit the buffer of {self.max_num_tokens}")
        return self.buffer[:num_tokens]

    def dummy_inputs_embeds(self, num_tokens: int) -> torch.Tensor:
        """A view of the first `num_tokens` rows, for warm-up and CUDA-graph capture: the same
        address real steps use, and no encoder runs."""
        return self._slice(num_tokens)

    def build(
        self,
        embed_tokens: nn.Module,
        input_ids: torch.Tensor,
        is_token_ids_mask: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
        is_mm_embed: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """Assemble the step into `out` (default: the buffer's first num_tokens rows); see
        `assemble_inputs_embeds` for the masks."""
        if out is None:
            out = self._slice(input_ids.shape[0])
        return assemble_inputs_embeds(
            embed_tokens,
            input_ids,
            out,
            is_token_ids_mask,
            mm_embeds,
            is_mm_embed,
            vocab_size=vocab_size,
        )

"""M-RoPE positions (Qwen2-VL family): 3-D (temporal, height, width) positions of a prompt's items.

Items with a grid (an encoder's `grid_thw`) get 3-D positions like transformers' `get_rope_index`;
text, and items without a grid (passthrough "prompt_embeds"), are positioned as text. Past the
prompt every position is `index + delta` in all three rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MRopeItem:
    """One embedding item of a prompt, for M-RoPE positions.

    `offset`/`length`: the item's contiguous rows in the prompt. `grid_thw`: (t, h, w) of a media
    item, or None for a passthrough "prompt_embeds" item, which is positioned as text. The grid is in
    LLM tokens (`t * h * w == length`) unless `compute_mrope_positions` is given the vision tower's
    `spatial_merge_size`, in which case it is the raw patch grid (transformers' `image_grid_thw`).
    `time_interval`: temporal spacing (Qwen2.5-VL videos: tokens_per_second * seconds per grid step).
    """

    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None = None
    time_interval: float = 1.0


def compute_mrope_positions(
    num_tokens: int, items: Sequence[MRopeItem], *, spatial_merge_size: int = 1
) -> tuple[torch.Tensor, int]:
    """(3, num_tokens) int64 positions of a prompt and the decode delta, as transformers' Qwen2-VL
    `get_rope_index` computes them.

    Text runs (and gridless items) get `p, p+1, ...` in all three rows. A media item starting at
    position `s` with LLM grid (t, h, w) gets temporal `s + floor(i_t * time_interval)`, height
    `s + i_h`, width `s + i_w` (row-major over t, h, w), and the text after it resumes at
    `s + max(h, w)`. The decode position of sequence index `i >= num_tokens` is `i + delta` in all
    three rows, `delta = max(positions) + 1 - num_tokens`.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    rows: list[torch.Tensor] = []
    pos = 0  # next position to hand out
    cursor = 0  # next prompt index not yet positioned

    def text(count: int) -> None:
        nonlocal pos
        if count > 0:
            rows.append(torch.arange(pos, pos + count, dtype=torch.int64).expand(3, count))
            pos += count

    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < cursor or item.length < 0 or item.offset + item.length > num_tokens:
            raise ValueError(
                f"M-RoPE item at offset {item.offset} with length {item.length} overlaps another item or "
                f"lies outside a prompt of {num_tokens} tokens"
            )
        text(item.offset - cursor)
        cursor = item.offset + item.length
        if item.grid_thw is None:
            text(item.length)
            continue
        t, h, w = (int(v) for v in item.grid_thw)
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(
                f"grid {item.grid_thw} is not divisible by spatial_merge_size {spatial_merge_size}"
            )
        h, w = h // spatial_merge_size, w // spatial_merge_size
        if t * h * w != item.length:
            raise ValueError(
                f"M-RoPE item at offset {item.offset}: grid (t={t}, h={h}, w={w}) in LLM tokens has "
                f"{t * h * w} rows but the item has {item.length}"
            )
        temporal = (torch.arange(t, dtype=torch.float64) * item.time_interval).long() + pos
        height = torch.arange(h, dtype=torch.int64) + pos
        width = torch.arange(w, dtype=torch.int64) + pos
        grid = torch.meshgrid(temporal, height, width, indexing="ij")
        rows.append(torch.stack(grid).reshape(3, -1))
        pos += max(h, w)
    text(num_tokens - cursor)

    if not rows:
        return torch.zeros(3, 0, dtype=torch.int64), 0
    positions = torch.cat(rows, dim=1)
    delta = int(positions.max()) + 1 - num_tokens
    return positions, delta


def mrope_positions_window(
    prompt_positions: torch.Tensor, delta: int, start: int, count: int
) -> torch.Tensor:
    """(3, count) positions of sequence indices `[start, start + count)`: prompt indices from
    `prompt_positions`, later ones (generated tokens) as `index + delta`. This is what one scheduled
    window of a request (a prefill chunk, possibly carrying the first sampled token, or a decode step)
    needs."""
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got {start}, {count}")
    num_prompt = prompt_positions.shape[1]
    end = start + count
    head = prompt_positions[:, min(start, num_prompt) : min(end, num_prompt)]
    tail_start = max(start, num_prompt)
    if end <= tail_start:
        return head
    tail = torch.arange(tail_start + delta, end + delta, dtype=torch.int64, device=prompt_positions.device)
    return torch.cat([head, tail.expand(3, -1)], dim=1)

"""Where each sample of a micro-batch goes: one padded row per sample, or several samples packed
into a row (first-fit decreasing into a token budget), and the index tensors both layouts share.

Why pack: a micro-batch of conversations of very different lengths padded to its longest sample
spends a large share of every matmul on padding. Packed, the samples share rows, each sample's
positions restart at 0 and its attention never reaches another sample (the attention kernels
that keep samples apart are in packed_attention.py), so every sample's logits are exactly its
unpacked logits and the padding left is at most the tail of each row.

Everything here runs on the host from Python lists (in the loader workers): the device only sees
index tensors, never a data-dependent shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Layout:
    """Row of each sample, its offset in the row, and the row length (every row is padded to it)."""

    row_of: list[int]
    offset_of: list[int]
    num_rows: int
    row_length: int
    packed: bool


def padded_layout(lengths: Sequence[int]) -> Layout:
    """One sample per row, rows padded to the longest sample."""
    n = len(lengths)
    return Layout(list(range(n)), [0] * n, n, max(lengths), packed=False)


#: pack_length value: rows as long as the micro-batch's longest sample (what masked attention
#: wants: its mask grows with the square of the row length, never past the padded layout's)
LONGEST = "longest"


def packed_layout(lengths: Sequence[int], budget: int | str | None) -> Layout:
    """First-fit decreasing: samples taken longest first, each into the first row with room for it.

    `budget` None puts the whole micro-batch in one row (what a varlen attention kernel wants: no
    padding at all); LONGEST makes rows as long as the longest sample. A sample longer than the
    budget is an error naming the recipe key."""
    if budget == LONGEST:
        budget = max(lengths)
    if budget is None:
        offsets, total = [], 0
        for n in lengths:
            offsets.append(total)
            total += n
        return Layout([0] * len(lengths), offsets, 1, total, packed=True)
    longest = max(lengths)
    if longest > budget:
        raise ValueError(
            f"a sample of {longest} tokens does not fit train.pack_length={budget}; raise it to at "
            f"least the longest sample (prompt with its encoder rows plus target)"
        )
    row_of, offset_of = [0] * len(lengths), [0] * len(lengths)
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = next((k for k, filled in enumerate(used) if filled + lengths[i] <= budget), len(used))
        if r == len(used):
            used.append(0)
        row_of[i], offset_of[i] = r, used[r]
        used[r] += lengths[i]
    return Layout(row_of, offset_of, len(used), max(used), packed=True)


def layout_tensors(
    seqs: Sequence[tuple[list[int], list[bool], list[bool]]], layout: Layout, pad: int
) -> dict[str, torch.Tensor | int | list[int] | None]:
    """The batch tensors for `seqs` (ids, is_token, loss mask per sample) placed by `layout`.

    Flat positions index the (rows * row_length) view. Per sample, in sample order (the order
    ordered_rows() concatenates encoder rows in): `row_slots` its encoder positions, `target_pos`
    the positions t whose next token t + 1 is a loss token, `target_ids` that token,
    `target_weight` 1 / (its loss tokens * samples) so the loss is the mean over samples of
    per-sample means. Packed layouts add `position_ids` (restarting per sample), `segment_ids`
    (the sample index per position, -1 on a row's padding tail) and `cu_seqlens` / `max_seqlen`
    over the flat token stream (each padding tail its own segment)."""
    rows, length, b = layout.num_rows, layout.row_length, len(seqs)
    ids = [[pad] * length for _ in range(rows)]
    is_token = [[True] * length for _ in range(rows)]
    labels = [[IGNORE] * length for _ in range(rows)]
    mask = [[0] * length for _ in range(rows)]
    positions = [[0] * length for _ in range(rows)]
    segments = [[-1] * length for _ in range(rows)]
    row_slots, target_pos, target_ids, target_weight, target_counts = [], [], [], [], []
    starts: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for i, (seq_ids, seq_is_token, loss) in enumerate(seqs):
        r, off, n = layout.row_of[i], layout.offset_of[i], len(seq_ids)
        starts[r].append((off, n))
        ids[r][off : off + n] = seq_ids
        is_token[r][off : off + n] = seq_is_token
        mask[r][off : off + n] = [1] * n
        positions[r][off : off + n] = range(n)
        segments[r][off : off + n] = [i] * n
        base = r * length + off
        row_slots.extend(base + t for t, tok in enumerate(seq_is_token) if not tok)
        # position t predicts token t + 1; the first token is never predicted
        picked = [t for t in range(1, n) if loss[t]]
        if not picked:
            raise ValueError("a training sample has no target token to learn (empty target)")
        for t in picked:
            labels[r][off + t] = seq_ids[t]
        target_pos.extend(base + t - 1 for t in picked)
        target_ids.extend(seq_ids[t] for t in picked)
        target_weight.extend([1.0 / (len(picked) * b)] * len(picked))
        target_counts.append(len(picked))
    out: dict[str, torch.Tensor | int | list[int] | None] = {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "is_token": torch.tensor(is_token, dtype=torch.bool),
        "labels": torch.tensor(labels, dtype=torch.long),
        "row_slots": torch.tensor(row_slots, dtype=torch.long),
        "target_pos": torch.tensor(target_pos, dtype=torch.long),
        "target_ids": torch.tensor(target_ids, dtype=torch.long),
        "target_weight": torch.tensor(target_weight, dtype=torch.float32),
        "target_counts": target_counts,
        "attention_mask": None,
        "position_ids": None,
        "segment_ids": None,
        "cu_seqlens": None,
        "max_seqlen": 0,
    }
    if not layout.packed:
        out["attention_mask"] = torch.tensor(mask, dtype=torch.long)
        return out
    bounds, longest = [0], 0
    for r in range(rows):
        end = 0
        for off, n in sorted(starts[r]):
            bounds.append(r * length + off + n)
            longest, end = max(longest, n), off + n
        if end < length:  # the row's padding tail: a segment of its own
            bounds.append((r + 1) * length)
            longest = max(longest, length - end)
    out.update(
        position_ids=torch.tensor(positions, dtype=torch.long),
        segment_ids=torch.tensor(segments, dtype=torch.long),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=longest,
    )
    return out

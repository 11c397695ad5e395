"""Apply structured outputs' packed token masks to a step's logits, in place, before sampling.

The mask rows come packed as xgrammar fills them (bit b of int32 word w allows token 32 * w + b). They are
unpacked on the device with a few torch ops (the words read as bytes, an AND against the 8 bit values, a
compare: one byte per token in between, never an int32 per token) and the disallowed logits set to -inf:
plain tensor ops, so nothing is compiled at run time, on the GPU or the CPU alike. Columns past the
mask's width (a padded LM head) are disallowed too.
"""

from __future__ import annotations

import torch

# Byte k of an int32 word holds its bits 8k..8k+7 in little-endian memory: x86, ARM and CUDA devices, all
# the platforms torch runs on (tests hold the unpacking equal to xgrammar's own kernel).
_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """(8,) uint8: 1 << b for b in 0..7."""
    values = _BIT_VALUES.get(device)
    if values is None:
        values = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=device)
        _BIT_VALUES[device] = values
    return values


def unpack_token_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n, words) packed int32 -> (n, vocab_size) bool, True where the token is allowed."""
    n, words = bitmask.shape
    as_bytes = bitmask.contiguous().view(torch.uint8)  # (n, 4 * words): bits 8k.. of each word in byte k
    allowed = (as_bytes.unsqueeze(-1) & _bit_values(bitmask.device)).ne(0).view(n, words * 32)
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(n, vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set `logits[rows[k], t]` to -inf wherever `bitmask[k]` disallows token t (in place).

    `bitmask` is on the logits' device; `rows` are distinct. When they are every row in order, the
    logits are masked directly, else through one gather and one scatter of those rows."""
    n, vocab = bitmask.shape[0], logits.shape[1]
    if n != len(rows):
        raise ValueError(f"{n} mask rows for {len(rows)} logits rows")
    disallowed = unpack_token_mask(bitmask, vocab).logical_not_()
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(disallowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(disallowed, float("-inf")))


__all__ = ["apply_token_mask", "unpack_token_mask"]

"""Apply structured outputs' packed token masks to a step's logits, in place, before sampling.

The mask rows come packed as xgrammar fills them (bit b of int32 word w allows token 32 * w + b). They are
unpacked on the device with a few torch ops (an AND against the 32 bit values, a compare) and the
disallowed logits set to -inf: plain tensor ops, so nothing is compiled at run time, on the GPU or the
CPU alike. Columns past the mask's width (a padded LM head) are disallowed too.
"""

from __future__ import annotations

import torch

_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    """(32,) int32: 1 << b for b in 0..31 (bit 31 is the sign bit, and int32 AND works on it alike)."""
    values = _BIT_VALUES.get(device)
    if values is None:
        values = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32,
                              device=device)
        _BIT_VALUES[device] = values
    return values


def unpack_token_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(n, words) packed int32 -> (n, vocab_size) bool, True where the token is allowed."""
    n, words = bitmask.shape
    allowed = (bitmask.unsqueeze(-1) & _bit_values(bitmask.device)).ne(0).view(n, words * 32)
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

"""One decode-window step's inputs from the step before it, on the device: one kernel instead of about ten.

Why: inside a decode window (`runner.worker.decode_window`) every step after the first takes its input ids
from the previous step's argmax and moves positions, context lengths and KV slots one token on. As torch
ops that is about ten tiny launches a step (a copy, two increments, a floor division, a gather, a cast,
a multiply, a modulo, an add, a copy, and for windows with requests that reach `max_tokens` a multiply and
a masked fill), each a couple of microseconds of GPU time between two graph replays, where the GPU does
nothing else. One Triton program does the same arithmetic for every row of the batch.

`advance_window_step` dispatches: the kernel for CUDA tensors (or on the CPU when `ON_CPU`, tests under
TRITON_INTERPRET=1), `advance_window_step_reference` (the torch ops, the definition) otherwise, or when a
test sets `KERNEL` False.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.layers.triton_launch import launch

# Tests: False runs the torch-op twin (the kernel's definition) on the GPU too.
KERNEL = True
# Tests: run the kernel on CPU tensors (under TRITON_INTERPRET=1).
ON_CPU = False
# Rows a program advances: a constant, so a new batch size builds nothing.
BLOCK = 256


# One build for every batch size and row offset: the row count, the table shape and the row pointers that
# move with them (a row of the window's token table or of its alive mask) are not specialised on.
@triton.jit(do_not_specialize=["prev_ptr", "deltas_ptr", "alive_ptr", "r", "stride_bt", "width"])
def _advance_kernel(prev_ptr, ids_ptr, pos_ptr, seq_ptr, bt_ptr, slot_ptr, deltas_ptr, alive_ptr,
                    r, stride_bt, width, block_size,
                    HAS_DELTAS: tl.constexpr, HAS_ALIVE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < r
    tl.store(ids_ptr + i, tl.load(prev_ptr + i, mask=m).to(ids_ptr.dtype.element_ty), mask=m)
    p = tl.load(pos_ptr + i, mask=m, other=0) + 1
    tl.store(pos_ptr + i, p, mask=m)
    s = tl.load(seq_ptr + i, mask=m, other=0) + 1
    kv_pos = p.to(tl.int64)
    if HAS_DELTAS:
        kv_pos -= tl.load(deltas_ptr + i, mask=m, other=0).to(tl.int64)
    col = kv_pos // block_size
    blk = tl.load(bt_ptr + i.to(tl.int64) * stride_bt + col, mask=m & (col >= 0) & (col < width), other=0)
    slot = blk.to(tl.int64) * block_size + kv_pos % block_size
    if HAS_ALIVE:  # rows past their max_tokens: no keys to read, no KV to write
        alive = tl.load(alive_ptr + i, mask=m, other=0)
        s = s * alive
        slot = tl.where(alive == 0, -1, slot)
    tl.store(seq_ptr + i, s.to(seq_ptr.dtype.element_ty), mask=m)
    tl.store(slot_ptr + i, slot.to(slot_ptr.dtype.element_ty), mask=m)


def advance_window_step_reference(prev_tokens: torch.Tensor, input_ids: torch.Tensor,
                                  positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                  slot_mapping: torch.Tensor, block_size: int,
                                  deltas: torch.Tensor | None = None,
                                  alive: torch.Tensor | None = None) -> None:
    """The step's inputs in place, as torch ops: input ids from `prev_tokens`, positions and context lengths
    one on, each row's KV slot from its block table at its new position (`positions - deltas` under
    M-RoPE); rows where `alive` is 0 get context length 0 and slot -1. All (r,) but `block_tables` (r, w)."""
    input_ids.copy_(prev_tokens)
    positions += 1
    seq_lens += 1
    pos = positions if deltas is None else positions - deltas
    block = block_tables.gather(1, torch.div(pos, block_size, rounding_mode="floor").unsqueeze(1))
    slot_mapping.copy_(block.squeeze(1).long() * block_size + pos % block_size)
    if alive is not None:
        seq_lens.mul_(alive)
        slot_mapping.masked_fill_(alive == 0, -1)


def advance_window_step(prev_tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor,
                        block_size: int, deltas: torch.Tensor | None = None,
                        alive: torch.Tensor | None = None) -> None:
    """`advance_window_step_reference` in one launch on CUDA tensors (contiguous (r,) rows, as the staging
    views are); the torch ops elsewhere."""
    r = input_ids.shape[0]
    use_kernel = KERNEL and (input_ids.is_cuda or ON_CPU) and r > 0
    if use_kernel:  # the kernel reads (r,) rows with unit stride
        rows = (prev_tokens, input_ids, positions, seq_lens, slot_mapping, deltas, alive)
        use_kernel = block_tables.stride(1) == 1 and all(
            t is None or (t.shape == (r,) and t.stride(0) == 1) for t in rows)
    if not use_kernel:
        advance_window_step_reference(prev_tokens, input_ids, positions, seq_lens, block_tables, slot_mapping,
                                      block_size, deltas, alive)
        return
    launch(_advance_kernel, (triton.cdiv(r, BLOCK),))(
        prev_tokens, input_ids, positions, seq_lens, block_tables, slot_mapping,
        deltas if deltas is not None else positions, alive if alive is not None else seq_lens,
        r, block_tables.stride(0), block_tables.shape[1], block_size,
        HAS_DELTAS=deltas is not None, HAS_ALIVE=alive is not None, BLOCK=BLOCK, num_warps=4,
    )


def build_kernels(device: torch.device, block_size: int) -> None:
    """Launch every specialisation once on scratch rows (start-up's build-ahead pass builds them there):
    with and without M-RoPE deltas, with and without inert rows. Each scratch row is its own allocation,
    16-byte aligned like the staging views, so the builds are the ones real windows look up."""
    def rows(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(1, dtype=dtype, device=device)

    tables = torch.zeros((1, 2), dtype=torch.int32, device=device)
    for deltas in (None, rows(torch.int64)):
        for alive in (None, rows(torch.int32)):
            advance_window_step(rows(torch.int64), rows(torch.int64), rows(torch.int64), rows(torch.int32),
                                tables, rows(torch.int64), block_size, deltas, alive)


__all__ = ["advance_window_step", "advance_window_step_reference", "build_kernels"]

"""Triton kernel that gathers item rows (media encoder outputs, passthrough tensors) into a step's
`inputs_embeds`, on the device, from per-slot span tables.

One launch serves the whole batch, like the prompt-embeds overlay (`overlay_kernel.py`), whose grid
and batch-row search it shares. The item rows stay where the encoder cache put them; the kernel finds
them through one int64 table owned by `runner.multimodal.item_table.ItemTable`, a row per slot:

    table[slot, 0]            number of spans n (0: the slot has no item rows)
    table[slot, 1 + 4 * i]    span i's first prompt position (spans sorted, non-overlapping)
    table[slot, 2 + 4 * i]    span i's number of positions
    table[slot, 3 + 4 * i]    address of span i's rows (contiguous (rows, HIDDEN), 16-byte aligned)
    table[slot, 4 + 4 * i]    address of an int32 map position -> row (-1: a position that keeps its
                              token embedding), or 0 when position j takes row j

Each program takes BLOCK_T scheduled tokens of one batch row. It leaves at once when its positions
`[nc + t0, nc + t0 + BLOCK_T)` miss the slot's first-to-last span range (text blocks cost a few scalar
loads); otherwise each token finds its span by a binary search over the slot's span offsets
(LOG_SPANS steps, a compile-time constant from the table's capacity) and copies its row, BLOCK_H
columns at a time. Tokens outside every span are not written: they keep the token embedding.
No host sync; the grid depends on shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.layers.overlay_kernel import OverlayConfig, batch_block, default_config
from runner.layers.triton_launch import launch


@triton.jit(do_not_specialize=["num_reqs", "max_num_reqs"])
def _item_gather_kernel(
    out_ptr,
    out_row_stride,
    idx_mapping_ptr,
    query_start_loc_ptr,
    num_computed_ptr,
    table_ptr,
    table_row_stride,
    num_reqs,
    max_num_reqs,
    HIDDEN: tl.constexpr,
    LOG_SPANS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    q_start, q_len, block, slot = batch_block(tl.program_id(0), query_start_loc_ptr, idx_mapping_ptr,
                                              num_reqs, BLOCK_T)
    t0 = block * BLOCK_T
    if (block < 0) | (t0 >= q_len) | (slot < 0) | (slot >= max_num_reqs):
        return
    row = table_ptr + slot.to(tl.int64) * table_row_stride
    n_spans = tl.load(row)
    if n_spans == 0:
        return
    nc = tl.load(num_computed_ptr + slot).to(tl.int64)
    p_lo = nc + t0
    p_hi = nc + tl.minimum(t0 + BLOCK_T, q_len)  # exclusive
    first = tl.load(row + 1)
    last = row + 1 + 4 * (n_spans - 1)
    if (p_hi <= first) | (p_lo >= tl.load(last) + tl.load(last + 1)):
        return

    offs_t = t0 + tl.arange(0, BLOCK_T)
    pos = nc + offs_t
    # Span of each token: the last span whose offset <= pos.
    s_lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    s_hi = tl.zeros([BLOCK_T], dtype=tl.int64) + (n_spans - 1)
    for _ in tl.static_range(LOG_SPANS):
        s_mid = (s_lo + s_hi + 1) // 2
        go_right = tl.load(row + 1 + 4 * s_mid) <= pos
        s_lo = tl.where(go_right, s_mid, s_lo)
        s_hi = tl.where(go_right, s_hi, s_mid - 1)
    span = row + 1 + 4 * s_lo
    j = pos - tl.load(span)
    active = (offs_t < q_len) & (j >= 0) & (j < tl.load(span + 1))
    rows_addr = tl.load(span + 2, mask=active, other=0)
    map_addr = tl.load(span + 3, mask=active, other=0)
    use_map = active & (map_addr != 0)
    mapped = tl.load(map_addr.to(tl.pointer_type(tl.int32)) + j, mask=use_map, other=0).to(tl.int64)
    src_row = tl.where(use_map, mapped, j)
    active = active & (src_row >= 0)

    rows_base = rows_addr.to(tl.pointer_type(out_ptr.dtype.element_ty))
    # True by construction (ItemTable checks every rows tensor it registers); without it a pointer
    # read from memory counts as unaligned and row loads stay scalar.
    rows_base = tl.multiple_of(rows_base, 16)
    src = rows_base[:, None] + src_row[:, None] * HIDDEN
    dst = out_ptr + (q_start + offs_t).to(tl.int64)[:, None] * out_row_stride
    for h0 in range(0, HIDDEN, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        m = active[:, None] & (offs_h < HIDDEN)[None, :]
        vals = tl.load(src + offs_h[None, :], mask=m)
        tl.store(dst + offs_h[None, :], vals, mask=m)


def launch_item_gather(
    inputs_embeds: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    table: torch.Tensor,
    log_spans: int,
    config: OverlayConfig | None = None,
) -> None:
    """One launch for the whole batch (no host sync, no per-token host work). The caller (ItemTable)
    validates shapes and dtypes; `query_start_loc[-1]` must not exceed `inputs_embeds.shape[0]`."""
    num_tokens, hidden = inputs_embeds.shape
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0 or num_tokens == 0:
        return
    cfg = config or default_config(hidden, inputs_embeds.element_size())
    grid = (num_tokens // cfg.block_t + num_reqs,)
    launch(_item_gather_kernel, grid)(
        inputs_embeds,
        inputs_embeds.stride(0),
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        table,
        table.stride(0),
        num_reqs,
        table.shape[0],
        HIDDEN=hidden,
        LOG_SPANS=log_spans,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )

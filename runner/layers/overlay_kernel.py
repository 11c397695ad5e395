"""Triton kernel that overlays user prompt embeddings onto a step's `inputs_embeds`.

One launch serves the whole batch. Each live request's embeddings sit in their own device
tensor; the kernel finds them through three small per-slot tables owned by
`runner.worker.prompt_embeds.PromptEmbedsState`:

- `rows_addr[slot]` (int64): address of the slot's rows tensor (0 when none). It is always 16-byte
  aligned, which the kernel states with `tl.multiple_of` so that row loads become 128-bit accesses
  (a pointer read from memory otherwise counts as unaligned; checked by compiling for sm_90).
- `num_rows[slot]` (int32): rows of that tensor (0 when the slot has no embeddings).
- `mask_addr[slot]` (int64): address of a uint8 `is_token_ids` mask, or 0 for "no mask".

Grid: one program per (batch row, block of BLOCK_T scheduled tokens) pair, laid out without any
device-to-host sync. Row b owns program ids `key(b) .. key(b) + cdiv(q_len_b, BLOCK_T) - 1` with
`key(b) = query_start_loc[b] // BLOCK_T + b`; these ranges never overlap (key grows by at least
`floor(q_len_b / BLOCK_T) + 1` per row) and all fit below `num_tokens // BLOCK_T + num_reqs`,
which the host knows from shapes alone. A program finds its row by binary search over
`query_start_loc`, exits at once when its block has nothing to overlay, and otherwise copies its
BLOCK_T rows in BLOCK_H-wide chunks of the hidden dimension (HIDDEN is a compile-time constant:
one compile per model, exact trip count and alignment, and the interpreter needs a constant
`range` bound). That keeps the launch CUDA-graph
friendly (grid depends only on shapes) and costs O(log num_reqs) cached scalar loads per program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.layers.triton_launch import launch


@triton.jit
def batch_block(pid, query_start_loc_ptr, idx_mapping_ptr, num_reqs, BLOCK_T: tl.constexpr):
    """Which batch row and which of its BLOCK_T-token blocks program `pid` serves.

    The grid gives batch row b `cdiv(q_len_b, BLOCK_T)` programs, numbered from
    key(b) = query_start_loc[b] // BLOCK_T + b (module docstring), so b is the largest
    row with key(b) <= pid, found by binary search. Returns (q_start, q_len, block, slot) of that
    row; `block` may be past the row's tokens (a spare program), which the caller checks.
    """
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        key_mid = tl.load(query_start_loc_ptr + mid) // BLOCK_T + mid
        go_right = key_mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    q_start = tl.load(query_start_loc_ptr + lo)
    q_len = tl.load(query_start_loc_ptr + lo + 1) - q_start
    block = pid - (q_start // BLOCK_T + lo)
    slot = tl.load(idx_mapping_ptr + lo)
    return q_start, q_len, block, slot


@triton.jit(do_not_specialize=["num_reqs", "max_num_reqs"])
def _overlay_kernel(
    out_ptr,
    out_row_stride,
    idx_mapping_ptr,
    query_start_loc_ptr,
    num_computed_ptr,
    rows_addr_ptr,
    num_rows_ptr,
    mask_addr_ptr,
    num_reqs,
    max_num_reqs,
    HIDDEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    q_start, q_len, block, slot = batch_block(tl.program_id(0), query_start_loc_ptr, idx_mapping_ptr,
                                              num_reqs, BLOCK_T)
    if (block < 0) | (slot < 0) | (slot >= max_num_reqs):
        return
    n = tl.load(num_rows_ptr + slot)
    nc = tl.load(num_computed_ptr + slot)
    # The clamp: only scheduled tokens that still fall inside the embeddings are overlaid.
    limit = tl.minimum(q_len, n - nc)
    t0 = block * BLOCK_T
    if t0 >= limit:
        return

    offs_t = t0 + tl.arange(0, BLOCK_T)
    active = offs_t < limit
    src_row = (nc + offs_t).to(tl.int64)
    mask_addr = tl.load(mask_addr_ptr + slot)
    if mask_addr != 0:
        is_token = tl.load(mask_addr.to(tl.pointer_type(tl.uint8)) + src_row, mask=active, other=1)
        active = active & (is_token == 0)

    rows_base = tl.load(rows_addr_ptr + slot).to(tl.pointer_type(out_ptr.dtype.element_ty))
    # True by construction (PromptEmbedsState allocates every rows tensor itself and checks it);
    # without it a pointer read from memory counts as unaligned and row loads stay scalar.
    rows_base = tl.multiple_of(rows_base, 16)
    src = rows_base + src_row[:, None] * HIDDEN
    dst = out_ptr + (q_start + offs_t).to(tl.int64)[:, None] * out_row_stride
    for h0 in range(0, HIDDEN, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        m = active[:, None] & (offs_h < HIDDEN)[None, :]
        vals = tl.load(src + offs_h[None, :], mask=m)
        tl.store(dst + offs_h[None, :], vals, mask=m)


@dataclass(frozen=True)
class OverlayConfig:
    """Tile shape of the overlay kernel: BLOCK_T scheduled tokens x BLOCK_H hidden columns."""

    block_t: int = 8
    block_h: int = 1024
    num_warps: int = 4


def default_config(hidden_size: int, element_size: int) -> OverlayConfig:
    """About 16 KiB per tile: enough bytes in flight per program without spilling registers."""
    block_h = min(triton.next_power_of_2(hidden_size), 2048 // max(element_size, 1))
    return OverlayConfig(block_t=8, block_h=max(block_h, 16), num_warps=4)


def launch_overlay(
    inputs_embeds: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    rows_addr: torch.Tensor,
    num_rows: torch.Tensor,
    mask_addr: torch.Tensor,
    config: OverlayConfig | None = None,
) -> None:
    """Launch the overlay kernel once for the whole batch (no host sync, no per-token host work).

    The caller (PromptEmbedsState) validates shapes and dtypes; `query_start_loc[-1]` must not
    exceed `inputs_embeds.shape[0]`, which bounds the grid.
    """
    num_tokens, hidden = inputs_embeds.shape
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0 or num_tokens == 0:
        return
    cfg = config or default_config(hidden, inputs_embeds.element_size())
    grid = (num_tokens // cfg.block_t + num_reqs,)
    launch(_overlay_kernel, grid)(
        inputs_embeds,
        inputs_embeds.stride(0),
        idx_mapping,
        query_start_loc,
        num_computed_tokens,
        rows_addr,
        num_rows,
        mask_addr,
        num_reqs,
        rows_addr.shape[0],
        HIDDEN=hidden,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )

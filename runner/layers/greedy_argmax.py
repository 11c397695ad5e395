"""Row-wise argmax of logits in the model's dtype, in two short launches: a decode window's greedy tokens.

Why: a greedy decode window (`ModelRunner.execute_decode_window`) needs only each row's argmax. Before,
every step cast the LM head's bf16 logits into an fp32 buffer (a read and a write of twice the bytes)
and ran `torch.argmax` on that, whose reduction reads far below the copy rate whatever the dtype. Here
the bf16 logits are read once, split over many programs per row:

- stage 1, grid (rows, CHUNKS): each program scans its slice of a row and writes its (max, first index);
- stage 2, grid (rows,): the chunks' results, in chunk order, give the row's (max, first index).

Ties go to the lowest index, as `torch.argmax`; a NaN counts as larger than any number (torch's rule) and
the first NaN wins. Exact: comparisons only, no arithmetic on the values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from runner.layers.triton_launch import launch

# Programs per row in stage 1 (a constant, so one build serves every batch size), the columns one program
# loads per iteration, and its warps.
CHUNKS = 32
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _scan_block(x_ptr, cols, hi, best, best_nan, best_idx, MASKED: tl.constexpr):
    """Fold the logits at `cols` into each lane's running (best, is-NaN, index)."""
    if MASKED:
        ok = cols < hi
        x = tl.load(x_ptr + cols, mask=ok, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(x_ptr + cols).to(tl.float32)
    is_nan = x != x
    # Per lane, the earliest column wins a tie (later columns must be strictly larger); a NaN beats any
    # number and loses to an earlier NaN.
    empty = best_idx == 2147483647
    take = empty | (~best_nan & (is_nan | (x > best)))
    if MASKED:
        take = ok & take
    return tl.where(take, x, best), tl.where(take, is_nan, best_nan), tl.where(take, cols, best_idx)


@triton.jit(do_not_specialize=["n_cols", "chunk_blocks"])
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, chunk_blocks,
                          CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    # A chunk is a whole number of BLOCKs and its whole blocks load without a mask, so Triton can prove
    # 16-byte alignment (with the row stride, specialised) and a uniform mask: vector loads. A chunk of
    # any length, every block masked, loaded two bytes a lane at a time.
    lo = c * chunk_blocks * BLOCK
    hi = tl.minimum(lo + chunk_blocks * BLOCK, n_cols)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK * BLOCK
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_nan = tl.zeros([BLOCK], dtype=tl.int1)
    best_idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    for start in range(lo, full_hi, BLOCK):
        best, best_nan, best_idx = _scan_block(x_row, start + offs, hi, best, best_nan, best_idx, False)
    if full_hi < hi:  # the row's last, partial block
        best, best_nan, best_idx = _scan_block(x_row, full_hi + offs, hi, best, best_nan, best_idx, True)
    key = tl.where(best_nan, float("inf"), best)
    has_nan = tl.max(best_nan.to(tl.int32), 0) > 0
    top = tl.max(key, 0)
    # Among the lanes holding the top (NaN lanes when any), the smallest column.
    hit = tl.where(has_nan, best_nan, (key == top) & ~best_nan & (best_idx != 2147483647))
    idx = tl.min(tl.where(hit, best_idx, 2147483647), 0)
    tl.store(val_ptr + row * CHUNKS + c, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr + row * CHUNKS + c, idx)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, stride_o, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    v = tl.load(val_ptr + row * CHUNKS + c)
    i = tl.load(idx_ptr + row * CHUNKS + c)
    is_nan = v != v
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), v), 0)
    hit = tl.where(has_nan, is_nan, (v == top) & (i != 2147483647))
    tl.store(out_ptr + row * stride_o, tl.min(tl.where(hit, i, 2147483647), 0).to(tl.int64))


def greedy_argmax(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1, out=out)` for a (rows, vocab) matrix with unit last stride, on CUDA
    (or under TRITON_INTERPRET=1); `out` int64 (rows,), any stride. Falls back to torch elsewhere."""
    if logits.dim() != 2 or out.shape != logits.shape[:1] or out.dtype != torch.int64:
        raise ValueError(f"logits must be (rows, vocab) and out int64 (rows,), got {tuple(logits.shape)} and "
                         f"{tuple(out.shape)} {out.dtype}")
    rows, n_cols = logits.shape
    if not (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or logits.stride(1) != 1:
        return torch.argmax(logits, dim=-1, out=out)
    if rows == 0:
        return out
    if n_cols == 0 or n_cols >= 2**31 - 1:
        raise ValueError(f"greedy_argmax takes 1 to 2**31 - 2 columns, got {n_cols}")
    chunk_blocks = triton.cdiv(triton.cdiv(n_cols, CHUNKS), BLOCK)  # the last chunks may be short or empty
    vals = torch.empty((rows, CHUNKS), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((rows, CHUNKS), dtype=torch.int32, device=logits.device)
    launch(_argmax_chunks_kernel, (rows, CHUNKS))(logits, vals, idxs, n_cols, logits.stride(0), chunk_blocks,
                                                 CHUNKS=CHUNKS, BLOCK=BLOCK, num_warps=NUM_WARPS)
    launch(_argmax_rows_kernel, (rows,))(vals, idxs, out, out.stride(0), CHUNKS=CHUNKS, num_warps=1)
    return out


__all__ = ["greedy_argmax"]

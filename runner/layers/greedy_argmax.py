"""Row-wise argmax of logits in the model's dtype, in two short launches: a decode window's greedy tokens.

Why: a greedy decode window (`ModelRunner.execute_decode_window`) needs only each row's argmax. Before,
every step cast the LM head's bf16 logits into an fp32 buffer (read 19.5 MB, write 39 MB at W1's 64 x
151,936) and ran `torch.argmax` on that (another ~22 us: torch's reduction reads at about 0.9 TB/s on an
H200, whatever the dtype). Here the bf16 logits are read once, split over many programs per row:

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

# Programs per row in stage 1 (a constant, so one build serves every batch size): at 64 rows, 2,048
# programs of ~4,700 logits each, enough to stream at bandwidth; at 1 row the whole call is a few us.
CHUNKS = 32
BLOCK = 1024


@triton.jit(do_not_specialize=["n_cols", "chunk"])
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, chunk,
                          CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_nan = tl.zeros([BLOCK], dtype=tl.int1)
    best_idx = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    offs = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        ok = cols < hi
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        is_nan = x != x
        # Per lane, the earliest column wins a tie (later columns must be strictly larger); a NaN beats
        # any number and loses to an earlier NaN.
        empty = best_idx == 2147483647
        take = ok & (empty | (~best_nan & (is_nan | (x > best))))
        best = tl.where(take, x, best)
        best_nan = tl.where(take, is_nan, best_nan)
        best_idx = tl.where(take, cols, best_idx)
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
    chunk = triton.cdiv(n_cols, CHUNKS)
    vals = torch.empty((rows, CHUNKS), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((rows, CHUNKS), dtype=torch.int32, device=logits.device)
    launch(_argmax_chunks_kernel, (rows, CHUNKS))(logits, vals, idxs, n_cols, logits.stride(0), chunk,
                                                 CHUNKS=CHUNKS, BLOCK=BLOCK, num_warps=4)
    launch(_argmax_rows_kernel, (rows,))(vals, idxs, out, out.stride(0), CHUNKS=CHUNKS, num_warps=1)
    return out


__all__ = ["greedy_argmax"]

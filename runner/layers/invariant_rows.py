"""Batch-invariant row reductions on CUDA: mean, softmax and log-softmax over the last dimension.

Why: torch's CUDA reductions size their launch by the number of rows as well as the row's length; with
few rows (a decode step) one row's sum is spread over more threads and combined in another order than
in a prefill of thousands, so its bits change with the batch (Hugging Face's RMSNorm takes its mean this
way). Here one program reads one row in `BLOCK`-wide chunks in order into a `BLOCK`-wide fp32
accumulator and reduces that once: the same order for every row count. `runner.layers.batch_invariant`
sends the forward's and the sampler's calls here with `EngineConfig.batch_invariant`.

The CPU keeps torch's own: a row shorter than its parallel grain (32768 elements) is reduced by one
thread in an order fixed by its length, whatever the row count (hidden sizes and vocabularies of every
supported family; the tests check the engine's logprobs bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.layers.triton_launch import launch

BLOCK = 1024  # columns a program reads per step (a constant: the row order depends on nothing else)


@triton.jit(do_not_specialize=["n_cols"])
def _row_mean_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        acc += tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(acc, 0) / n_cols).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["n_cols"])
def _row_softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        top = tl.maximum(top, tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32))
    m = tl.max(top, 0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        acc += tl.exp(x - m)
    total = tl.sum(acc, 0)
    log_total = tl.log(total)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        ok = cols < n_cols
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            y = x - m - log_total
        else:
            y = tl.exp(x - m) / total
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def row_mean(x: torch.Tensor, *, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x.mean(-1, keepdim=keepdim, dtype=dtype)`, one program per row (fp32 accumulation)."""
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_floating_point:
        raise ValueError(f"row_mean needs a floating point tensor, got {x.dtype}")
    shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if x2.shape[0] and x2.shape[1]:
        launch(_row_mean_kernel, (x2.shape[0],))(x2, out, x2.shape[1], x2.stride(0), BLOCK=BLOCK, num_warps=4)
    elif x2.shape[0]:
        out.fill_(float("nan"))  # torch's mean of nothing
    return out


def row_softmax(x: torch.Tensor, *, log: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.softmax(x, -1)` (`log_softmax` with `log`): fp32 inside, the input's dtype (or `dtype`) out."""
    if dtype is not None:
        x = x.to(dtype)
    if not x.dtype.is_floating_point:
        raise ValueError(f"row_softmax needs a floating point tensor, got {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if x2.shape[0] and x2.shape[1]:
        launch(_row_softmax_kernel, (x2.shape[0],))(x2, out, x2.shape[1], x2.stride(0), x2.shape[1], LOG=log,
                                                    BLOCK=BLOCK, num_warps=4)
    return out


__all__ = ["row_mean", "row_softmax"]

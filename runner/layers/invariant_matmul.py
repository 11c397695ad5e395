"""Batch-invariant matrix products: the bits of an output row depend on that input row alone.

Why: cuBLAS (and MKL on the CPU) choose an algorithm by the whole shape, M included, so a row computed
in a decode step of one request, in a step of 64, or in a prefill chunk of 2048 rows is summed over K
in a different order (other tiles, split-K or not), and greedy picks flip wherever two logits are close.
With `EngineConfig.batch_invariant` every matrix product of the forward comes here
(`runner.layers.batch_invariant`).

- CUDA (or the Triton interpreter, for tests): one Triton kernel, one tile configuration per dtype for
  every M. Element (m, n) is the K reduction cut into fixed segments of `SEGMENT_K` (a property of K,
  never of M): each segment is accumulated from zero in `BLOCK_K` steps by `tl.dot`, and the segments
  are added in order into a zero-initialised fp32 total, plus the bias, rounded once. A program either
  adds every segment of its output tile itself, or, when the output tiles alone would leave most SMs
  idle (decode-sized M), programs take one segment each and write fp32 partials that a second kernel adds
  in the same order. Both run the same operations on the same values, so they give the same bits, and
  the choice between them may depend on M: the small steps get the parallelism of split-K without its
  usual batch dependence.
- CPU: `torch.mm` over fixed-shape row tiles (`CPU_TILE_ROWS` rows, zero padded). MKL picks its kernel
  by the shape, and every call has the same shape, so a row's sum never depends on how many rows came
  with it (MKL answers M = 1 and 2 with other kernels than larger M: the bits differ).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.layers.triton_launch import launch

# Rows per CPU tile: small enough that a decode step pads little, large enough for MKL to block well.
CPU_TILE_ROWS = 32
# The split-K form runs while the output tiles fill less than this share of the SMs. Only speed depends on
# it (both forms give the same bits): the split buys parallelism for decode-sized steps and costs a
# second launch and the partials' round trip.
SPLIT_BELOW_SM_SHARE = 0.5


@dataclass(frozen=True)
class MatmulConfig:
    """The one tile configuration a dtype runs at every M (`segment_k` a multiple of `block_k`)."""

    block_m: int
    block_n: int
    block_k: int
    segment_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# 16-bit: vLLM's batch-invariant tile (128 x 128 x 64 on 8 warps); 256-wide segments give decode steps
# K / 256 programs per output tile. fp32: smaller tiles (registers), the same idea.
CONFIGS: dict[torch.dtype, MatmulConfig] = {
    torch.bfloat16: MatmulConfig(128, 128, 64, 256, num_warps=8, num_stages=3),
    torch.float16: MatmulConfig(128, 128, 64, 256, num_warps=8, num_stages=3),
    torch.float32: MatmulConfig(64, 64, 32, 256, num_warps=4, num_stages=2),
}


@triton.jit
def _tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order (GROUP_M row tiles share their B columns in L2); numerics do not depend on it."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M", "split"])  # one build for every M, split or not
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, M, N, K, num_segments, split,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, IS_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEGMENT_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    # `split` (0 or 1) is a runtime value so that both forms are one compiled kernel: the same code sums.
    seg_lo = tl.program_id(1) * split
    seg_hi = split * (seg_lo + 1) + (1 - split) * num_segments
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rows = tl.where(offs_m < M, offs_m, 0)  # out-of-range rows and columns read row / column 0
    cols = tl.where(offs_n < N, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for seg in range(seg_lo, seg_hi):
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum((seg + 1) * SEGMENT_K, K)
        for k0 in range(seg * SEGMENT_K, k_end, BLOCK_K):
            ks = k0 + offs_k
            k_ok = ks < k_end
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=k_ok[None, :],
                        other=0.0)
            b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=k_ok[:, None],
                        other=0.0)
            if IS_FP32:
                part = tl.dot(a, b, part, input_precision="ieee")
            else:
                part = tl.dot(a, b, part)
        total += part
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if split:
        # Partials (num_segments, M, N) fp32, added in segment order by `_reduce_kernel`.
        part_ptrs = part_ptr + (seg_lo * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part_ptrs, total, mask=out_mask)
    else:
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 total.to(c_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(part_ptr, c_ptr, bias_ptr, M, N, num_segments, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for seg in range(0, num_segments):  # the order `_matmul_kernel` adds them in
        total += tl.load(part_ptr + (seg * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + row * stride_cm + cols * stride_cn, total.to(c_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter runs: small, so tests take the split form too


def matmul_config(dtype: torch.dtype) -> MatmulConfig:
    config = CONFIGS.get(dtype)
    if config is None:
        raise ValueError(f"batch-invariant matmul supports {sorted(map(str, CONFIGS))}, got {dtype}")
    return config


def invariant_mm_triton(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                        out: torch.Tensor | None = None, split: bool | None = None) -> torch.Tensor:
    """`a @ b (+ bias)` for a (M, K), b (K, N) of one dtype, any strides; the Triton form (see the module
    docstring). `split` forces the split-K form on or off (None: split while the output tiles fill less
    than `SPLIT_BELOW_SM_SHARE` of the SMs); the bits are the same either way."""
    config = matmul_config(a.dtype)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros((), dtype=out.dtype))
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    segments = triton.cdiv(k, config.segment_k)
    if split is None:
        split = segments > 1 and tiles < SPLIT_BELOW_SM_SHARE * _num_sms(a.device)
    split = bool(split and segments > 1)
    parts = (torch.empty((segments, m, n), dtype=torch.float32, device=a.device) if split else out)
    has_bias = bias is not None
    launch(_matmul_kernel, (tiles, segments if split else 1))(
        a, b, out, bias if has_bias else out, parts, m, n, k, segments, int(split),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=has_bias, IS_FP32=a.dtype == torch.float32, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SEGMENT_K=config.segment_k,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split:
        block = min(1024, triton.next_power_of_2(n))
        launch(_reduce_kernel, (m, triton.cdiv(n, block)))(
            parts, out, bias if has_bias else out, m, n, segments, out.stride(0), out.stride(1),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def invariant_mm_cpu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b (+ bias)` on the CPU, `torch.mm` over zero-padded tiles of `CPU_TILE_ROWS` rows."""
    m, k = a.shape
    n = b.shape[1]
    rows = -(-m // CPU_TILE_ROWS) * CPU_TILE_ROWS
    padded = torch.zeros((rows, k), dtype=a.dtype, device=a.device)
    padded[:m] = a
    result = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    for start in range(0, rows, CPU_TILE_ROWS):
        torch.mm(padded[start : start + CPU_TILE_ROWS], b, out=result[start : start + CPU_TILE_ROWS])
    result = result[:m]
    if bias is not None:
        result = result + bias
    if out is None:
        return result
    return out.copy_(result)


def uses_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s products take the Triton form: CUDA tensors, or any under TRITON_INTERPRET=1 when a
    test asks for it (`TRITON_ON_CPU`)."""
    return t.is_cuda or (TRITON_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1")


# Tests turn this on (under TRITON_INTERPRET=1) to run the Triton form on CPU tensors inside the engine.
TRITON_ON_CPU = False


def invariant_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b (+ bias)`, 2-D, whose row i depends on `a[i]`, `b` and `bias` alone (see the module
    docstring); `out` (M, N) is written when given."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"invariant_mm takes (M, K) @ (K, N), got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype or (bias is not None and bias.shape != (b.shape[1],)):
        raise ValueError(f"invariant_mm needs one dtype and a bias of ({b.shape[1]},), got {a.dtype}, "
                         f"{b.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    if uses_triton(a):
        return invariant_mm_triton(a, b, bias, out=out)
    return invariant_mm_cpu(a, b, bias, out=out)


__all__ = ["CONFIGS", "CPU_TILE_ROWS", "MatmulConfig", "invariant_mm", "invariant_mm_cpu",
           "invariant_mm_triton", "matmul_config"]

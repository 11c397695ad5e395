"""The MLP's down projection for decode-sized batches: SiLU * up, split-K GEMM and residual add, one kernel.

Why: at decode batch sizes the down projection is the layer's most fragmented step. With cuBLAS it
runs as `silu_mul` (one launch), then `addmm_` into the residual, which at small M cuBLAS runs as a
split-K GEMM, a split-K reduce and a copy: four launches that take several times what reading their
weight takes. The launches, not the bytes, are the cost
(see `runner.layers.norm_gemm`), so here they are one:

- the prologue reads gate and up from the fused gate/up GEMM's output and forms SiLU(gate) * up tile by
  tile (or reads a ready activation, when `runner.layers.norm_gemm.norm_gate_up_silu` made it);
- the K range is split over `splits` programs per output tile, so ~128 programs stream the weight
  instead of N / BLOCK_N;
- each split stores its fp32 partial sum and bumps the tile's arrival counter; the last split to arrive
  adds the partials in split order (so the result does not depend on which arrived last), adds the
  residual, rounds once and writes the residual in place, then resets the counter for the next call.

Numerics: SiLU and the product round as `silu_mul` does (SiLU rounded to the activation dtype, then the
product), the GEMM accumulates in fp32, and the residual add rounds once, as `addmm` does: the same
rounding points as the four launches, only the summation order differs. Deterministic: no atomics
touch values, only the counters.

The counters are a zeroed int32 buffer the caller owns (`new_counters`, one per call site: the fused
decoder layer keeps one per layer, made at load time, outside any CUDA-graph capture); each call leaves
them zero again, so a captured graph replays safely. Two calls must not share a buffer while both run
(one layer is never run on two streams at once). Only bf16 / fp16 (fp32 `tl.dot` would run in tf32).

It wins with a ready activation (the engine's case up to 32 rows, after `norm_gate_up_silu`); at larger
M it loses, more so with the SiLU prologue, which every column tile recomputes, so the engine stops at
`runner.layers.fused_layers.NORM_GATE_UP_MAX_ROWS`.

`residual_gemm` is the general form: `out = x + act @ W.T` out of place as well (o_proj, whose residual
is the layer's input), and with `pdl=True` the weights-first form for programmatic dependent launch
(`runner.layers.pdl`, on Hopper by default): one K step per split, the weight tile read before the
wait for the kernel ahead, so the weights stream in while that kernel ends (tiles: `PDL_CONFIGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.layers import pdl as pdl_switch
from runner.layers.norm_gemm import (
    NORM_GEMM_DTYPES,
    _as_rows,
    _dot,
    _interpreting,
    _load_w,
    _round_like_gemm,
    _zeros_acc,
    default_config,
)
from runner.layers.pdl import wait_for_predecessor
from runner.layers.triton_launch import launch


@dataclass(frozen=True)
class DownConfig:
    """A launch's tile: batch rows and output columns per program, the K step, how many programs share
    one output tile's K range (`splits`), Triton's warps and stages, and `swap_ab` (the weight tile as
    the MMA's tall operand, for row tiles under 64; see `runner.layers.norm_gemm._dot`)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    splits: int = 8
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False


# Defaults per M range, (largest M, config), first match wins. One config on purpose (each is a kernel
# build at start-up): the tile that did best across 1-32 rows in a sweep, though not the best at each.
DOWN_CONFIGS: tuple[tuple[int | None, DownConfig], ...] = (
    (None, DownConfig(block_m=16, block_n=64, block_k=256, splits=4, swap_ab=True)),
)
# The weights-first form's tiles (`residual_gemm(pdl=True)`: one K step of `block_k` per split, so a
# program holds a BLOCK_N x BLOCK_K weight tile, 64 KB here, read before its wait): the tiles that won a
# sweep of a layer's tail; the 64-row tile only ties cuBLAS.
PDL_CONFIGS: tuple[tuple[int | None, DownConfig], ...] = (
    (32, DownConfig(block_m=16, block_n=64, block_k=512, num_warps=8, swap_ab=True, num_stages=1)),
    (None, DownConfig(block_m=64, block_n=64, block_k=512, num_warps=8, num_stages=1)),
)
# The smallest row and column tiles any config may use: what `new_counters` sizes for.
_MIN_TILE = 16


def new_counters(n: int, max_rows: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed arrival counters for calls with `n` output columns and at most `max_rows` rows (one per
    output tile of the finest tiling). Make them outside CUDA-graph capture."""
    tiles = triton.cdiv(max(n, 1), _MIN_TILE) * triton.cdiv(max(max_rows, 1), _MIN_TILE)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


@triton.jit
def _activation_tile(a_rows, ok, ks, K, SILU: tl.constexpr, DTYPE: tl.constexpr):
    """A (BLOCK_M, BLOCK_K) tile of the down projection's input at columns `ks`: SiLU(gate) * up from a
    gate|up row (silu_mul's rounding), or the activation itself; zero where not `ok`."""
    if SILU:
        g = tl.load(a_rows + ks, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(a_rows + K + ks, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        a = (s * u).to(DTYPE)
    else:
        a = tl.load(a_rows + ks, mask=ok, other=0.0)
    return a


@triton.jit(do_not_specialize=["M"])  # the batch is never specialised (see runner.layers.norm_gemm)
def _down_residual_kernel(
    act_ptr, w_ptr, x_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_am, stride_wn, stride_xm, stride_om,
    K_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SILU: tl.constexpr,
    SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr, WEIGHTS_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    # One program: BLOCK_N output columns of BLOCK_M rows over one split's K range.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols[:, None] < N
    a_rows = act_ptr + rows64 * stride_am
    kk = tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + kk

    acc = _zeros_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    k_lo = split * K_PER_SPLIT
    if WEIGHTS_FIRST:
        # One K step per split (K_PER_SPLIT == BLOCK_K): the weight tile is read before the wait for the
        # kernel ahead (runner.layers.pdl), the activation after it.
        w = _load_w(w_ptrs, n_ok, k_lo, K, BLOCK_K, EVEN_K, EVEN_N)
        wait_for_predecessor(PDL)
        a_ok = row_ok if EVEN_K else row_ok & (k_lo + kk < K)
        a = _activation_tile(a_rows, a_ok, k_lo + kk, K, SILU, dtype)
        acc = _dot(a, w, acc, SWAP_AB, INTERPRET)
    else:
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            a_ok = row_ok if EVEN_K else row_ok & (k0 + kk < K)
            a = _activation_tile(a_rows, a_ok, k0 + kk, K, SILU, dtype)
            w = _load_w(w_ptrs, n_ok, k0, K, BLOCK_K, EVEN_K, EVEN_N)
            acc = _dot(a, w, acc, SWAP_AB, INTERPRET)
    acc = _as_rows(acc, SWAP_AB)

    out_ok = row_ok & (cols[None, :] < N)
    x_tile = x_ptr + rows64 * stride_xm + cols[None, :]
    out_tile = out_ptr + rows64 * stride_om + cols[None, :]
    if SPLITS == 1:
        _add_residual(x_tile, out_tile, out_ok, acc, dtype, INTERPRET)
    else:
        m_pad = tl.num_programs(1) * BLOCK_M
        first = part_ptr + rows64 * (tl.num_programs(0) * BLOCK_N) + cols[None, :]
        n_pad = tl.num_programs(0) * BLOCK_N
        tl.store(first + split * m_pad * n_pad, acc)
        tl.debug_barrier()  # every thread's partial is issued before the counter says it is there
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last split of this tile: add the partials in split order
            total = tl.load(first, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(first + s * m_pad * n_pad, cache_modifier=".cg")
            _add_residual(x_tile, out_tile, out_ok, total, dtype, INTERPRET)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (and graph replay)


@triton.jit
def _add_residual(x_tile, out_tile, ok, total, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """out = x + total, rounded once (addmm's epilogue); `out_tile` may be `x_tile` (in place)."""
    x = tl.load(x_tile, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_tile, _round_like_gemm(x + total, DTYPE, INTERPRET).to(DTYPE), mask=ok)


def default_down_config(m: int) -> DownConfig:
    """The config of `DOWN_CONFIGS` for a batch of `m` rows."""
    return default_config(DOWN_CONFIGS, m)


def default_pdl_config(m: int) -> DownConfig:
    """The config of `PDL_CONFIGS` for a batch of `m` rows."""
    return default_config(PDL_CONFIGS, m)


def down_residual_supported(x: torch.Tensor, act: torch.Tensor, weight: torch.Tensor, *, silu: bool) -> bool:
    """Whether `down_residual_` takes these tensors: bf16/fp16 matrices of one dtype and device with unit
    last stride whose shapes agree (x (M, N), weight (N, K), act (M, 2K) with `silu`, else (M, K))."""
    if x.dtype not in NORM_GEMM_DTYPES or x.dim() != 2 or act.dim() != 2 or weight.dim() != 2:
        return False
    if any(t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1 for t in (x, act, weight)):
        return False
    n, k = weight.shape
    return x.shape == (act.shape[0], n) and act.shape[1] == (2 * k if silu else k) and k > 0


def down_residual_(
    x: torch.Tensor, act: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor, *, silu: bool,
    config: DownConfig | None = None,
) -> torch.Tensor:
    """`x += (silu_mul(act) if silu else act) @ weight.T` in one launch, in place; returns `x`.

    `x` (M, N) the residual (this layer's own tensor: it is overwritten), `weight` (N, K) the down
    projection, `act` (M, 2K) gate|up when `silu`, else (M, K); `counters` from `new_counters` (zero
    between calls; not shared with a call running at the same time).
    """
    return residual_gemm(x, act, weight, counters, silu=silu, config=config, out=x)


def residual_gemm(
    x: torch.Tensor, act: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor, *, silu: bool = False,
    config: DownConfig | None = None, out: torch.Tensor | None = None, pdl: bool = False,
) -> torch.Tensor:
    """`out = x + (silu_mul(act) if silu else act) @ weight.T` in one launch; returns `out` (a new tensor
    when None; `x` itself for the in-place add of `down_residual_`).

    `pdl`: the weights-first form for PDL launches (`runner.layers.pdl`): one K step per split (the split
    count follows from the tile's K step, `config.splits` is not used), the weight tile read before the
    wait for the kernel ahead. It is launched with PDL where `runner.layers.pdl.use_pdl` allows, else
    normally and without the wait (the same arithmetic: the results are bitwise equal).
    """
    if not down_residual_supported(x, act, weight, silu=silu):
        raise ValueError(f"down_residual_ needs bf16/fp16 matrices that agree: x {tuple(x.shape)} {x.dtype}, "
                         f"act {tuple(act.shape)} {act.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
                         f"(silu={silu})")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
        raise ValueError(f"out must be like x {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    cfg = config or (default_pdl_config(x.shape[0]) if pdl else default_down_config(x.shape[0]))
    if min(cfg.block_m, cfg.block_n) < _MIN_TILE or cfg.block_k < 16 or cfg.splits < 1 or any(
            v & (v - 1) for v in (cfg.block_m, cfg.block_n, cfg.block_k)):
        raise ValueError(f"config needs power-of-two tiles of at least 16 and splits >= 1, got {cfg}")
    n, k = weight.shape
    m = x.shape[0]
    if m == 0:
        return out
    if pdl:  # one K step per split
        block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
        k_per_split = block_k
    else:
        block_k = min(cfg.block_k, max(16, triton.next_power_of_2(triton.cdiv(k, cfg.splits))))
        k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # no split left without keys
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    if counters.dtype != torch.int32 or counters.device != x.device or counters.numel() < grid[0] * grid[1]:
        raise ValueError(f"counters must be int32 on {x.device} with at least {grid[0] * grid[1]} slots "
                         f"(new_counters), got {counters.numel()} {counters.dtype} on {counters.device}")
    if splits > 1:
        part = torch.empty((splits, grid[1] * cfg.block_m, grid[0] * cfg.block_n), dtype=torch.float32,
                           device=x.device)
    else:
        part = x  # unused
    launched_pdl = pdl and pdl_switch.LAUNCH_PDL and pdl_switch.pdl_supported(x.device)
    extra = {"launch_pdl": True} if launched_pdl else {}
    launch(_down_residual_kernel, grid)(
        act, weight, x, out, part, counters, m, n, k, act.stride(0), weight.stride(0), x.stride(0),
        out.stride(0), K_PER_SPLIT=k_per_split, SPLITS=splits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, EVEN_K=k == splits * k_per_split, EVEN_N=n % cfg.block_n == 0, SILU=silu,
        SWAP_AB=cfg.swap_ab, INTERPRET=_interpreting(), WEIGHTS_FIRST=pdl, PDL=launched_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )  # fmt: skip
    return out


__all__ = ["DOWN_CONFIGS", "PDL_CONFIGS", "DownConfig", "default_down_config", "default_pdl_config",
           "down_residual_", "down_residual_supported", "new_counters", "residual_gemm"]

"""RMSNorm folded into the projection GEMM that follows it, for decode-sized batches (small M).

Why: at decode batch sizes every kernel of a decoder layer costs a few microseconds whatever its bytes,
even inside a CUDA graph, so the lever left is the number of launches per layer. The fused
layer (`runner.layers.fused_layers`) runs two three-launch sequences per layer:

    rms_norm -> F.linear(q/k/v) -> qkv_norm_rope_write   (norm, projection, q/k norm + rotary + KV write)
    rms_norm -> F.linear(gate/up) -> silu_mul            (norm, projection, SiLU * up)

Each becomes one Triton kernel here: 4 launches fewer per layer. The kernels read
the normalised activation straight from the GEMM's input tile instead of a round trip through memory,
and do the old third kernel's work as the GEMM's epilogue. They are built for small M: every program
computes the RMS statistics of its rows and normalises them itself (the same work repeated by every
column tile) and reads them twice, which outgrows the saved launches as M grows: hence the cut-offs in
`runner.layers.fused_layers` (NORM_GEMM_MAX_ROWS, NORM_GATE_UP_MAX_ROWS).

Numerics: the same rounding points as the unfused sequence. The norm takes fp32 statistics, rounds
x * rstd to the input dtype, multiplies by the weight and rounds again (HF / `rms_norm`); the GEMM
accumulates in fp32 and its result (plus bias) is rounded to the activation dtype, as F.linear's output
is, before the per-head norm and rotary (`qkv_norm_rope_write`) or SiLU * up (`silu_mul`). What can
differ is summation order only: the RMS sum of squares is reduced in chunks and the GEMM's K order is
the kernel's, so an element can land one rounding step (1 bf16 ulp) away from the unfused sequence's.

Only bf16 / fp16 activations qualify: `tl.dot` on fp32 inputs would silently use tf32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runner.layers.pdl import release_dependents, use_pdl
from runner.layers.triton_launch import launch

# Activation dtypes the fused kernels take (fp32 would run the GEMM in tf32; callers fall back).
NORM_GEMM_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NormGemmConfig:
    """A launch's tile: rows of the batch per program, output columns per program (gate/up only: the
    q/k/v kernel's column tile is one head), the K step, Triton's warps and pipeline stages, and
    whether the MMA takes the weight tile as its tall operand (`swap_ab`, see `_dot`)."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    splits: int = 1  # q/k/v only: programs sharing one head's K range (see norm_qkv_rope_write)


# Defaults per M range: (largest M, config), first match wins; None = any M; the tiles that won a sweep
# on a Qwen3-0.6B-shaped layer. Few distinct configs on purpose: each one is a separate kernel build,
# and the first call builds all of them (see `_launch`). The q/k/v kernel has at most Hq + 2 Hkv
# programs per 16 rows, so at small M it is bound by how fast those few SMs stream their weight
# columns, whatever the tile.
QKV_CONFIGS: tuple[tuple[int | None, NormGemmConfig], ...] = (
    (None, NormGemmConfig(block_m=16, block_k=256, num_warps=4, num_stages=3)),
)


# The q/k/v kernel may split its K range over `splits` programs per head (the last to arrive reduces the
# partials in split order and runs the epilogue), for small batches that leave most SMs idle; the engine
# did not measure faster with it, so the default stays unsplit (no counters, one build fewer).
GATE_UP_CONFIGS: tuple[tuple[int | None, NormGemmConfig], ...] = (
    (16, NormGemmConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)),
    (None, NormGemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3)),
)


def default_config(table: tuple[tuple[int | None, NormGemmConfig], ...], m: int) -> NormGemmConfig:
    """The config of `table` (QKV_CONFIGS or GATE_UP_CONFIGS) for a batch of `m` rows."""
    for bound, cfg in table:
        if bound is None or m <= bound:
            return cfg
    return table[-1][1]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------- kernels

@triton.jit
def head_rmsnorm(x1, x2, w_ptr, d, eps, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of head rows split in halves (x1 | x2), HF rounding: round(x * rstd) * w, rounded.

    Qwen3's q_norm / k_norm; shared with `runner.layers.fused_layers.qkv_norm_rope_write`."""
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
    rstd = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    y1 = ((x1 * rstd).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
    y2 = ((x2 * rstd).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    return y1, y2


@triton.jit
def _row_rstd(x_rows, row_ok, K, eps, BLOCK_M: tl.constexpr, STATS_K: tl.constexpr,
              STATS_CHUNKS: tl.constexpr, EVEN_STATS: tl.constexpr):
    """1 / RMS of BLOCK_M rows (pointers to their first element), fp32; (BLOCK_M, 1).

    Unrolled over the row (STATS_CHUNKS loads of STATS_K columns, all independent), so the loads go
    out together and the pass costs one memory round trip, not one per chunk: it sits in front of
    the weight stream, whose prologue cannot start before it."""
    ks = tl.arange(0, STATS_K)[None, :]
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in tl.static_range(STATS_CHUNKS):
        if EVEN_STATS:
            xv = tl.load(x_rows + i * STATS_K + ks, mask=row_ok, other=0.0).to(tl.float32)
        else:
            xv = tl.load(x_rows + i * STATS_K + ks, mask=row_ok & (i * STATS_K + ks < K), other=0.0)
            xv = xv.to(tl.float32)
        sq += tl.sum(xv * xv, 1)
    return tl.rsqrt(sq / K + eps)[:, None]


@triton.jit
def _normed_tile(x_rows, nw_ptr, rstd, row_ok, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """A (BLOCK_M, BLOCK_K) tile of rms_norm(x) with HF rounding: round(round(x * rstd) * w)."""
    dtype = x_rows.dtype.element_ty
    ks = tl.arange(0, BLOCK_K)[None, :]
    if EVEN_K:
        xv = tl.load(x_rows + k0 + ks, mask=row_ok, other=0.0)
        w = tl.load(nw_ptr + k0 + ks)
    else:
        xv = tl.load(x_rows + k0 + ks, mask=row_ok & (k0 + ks < K), other=0.0)
        w = tl.load(nw_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
    y = (xv.to(tl.float32) * rstd).to(dtype).to(tl.float32)
    return (y * w.to(tl.float32)).to(dtype)


@triton.jit
def _load_w(w_ptrs, n_ok, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """A (rows, BLOCK_K) weight tile at K offset k0; masks only where the tile can overhang."""
    # (if/else, not early returns: the compiler visits every statement after a constexpr-true return)
    ks = tl.arange(0, BLOCK_K)[None, :]
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=n_ok, other=0.0)
    else:
        if EVEN_N:
            w = tl.load(w_ptrs + k0, mask=k0 + ks < K, other=0.0)
        else:
            w = tl.load(w_ptrs + k0, mask=n_ok & (k0 + ks < K), other=0.0)
    return w


@triton.jit
def _dot(a, w, acc, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += a @ w.T (acc (BLOCK_M, N)), or with SWAP_AB acc += w @ a.T (acc (N, BLOCK_M)): the weight
    tile as the MMA's tall operand, the few batch rows as its narrow one (Hopper's wgmma wants M >= 64).
    Under the interpreter, whose bf16 dot multiplies raw bit patterns, as the exact fp32 product of
    the same bf16/fp16 values: the arithmetic the tensor cores do."""
    if INTERPRET:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _zeros_acc(BLOCK_M: tl.constexpr, N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros((N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    return acc


@triton.jit
def _as_rows(acc, SWAP_AB: tl.constexpr):
    """The accumulator as (BLOCK_M, N) for the epilogue."""
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _normed_gemm_pair(x_rows, nw_ptr, rstd, row_ok, w1_ptrs, w2_ptrs, n_ok, K, k_lo, k_hi,
                      BLOCK_M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr):
    """rms_norm(x) @ W1.T and rms_norm(x) @ W2.T over columns [k_lo, k_hi) of K (all of it, or one
    split's range) for one program's BLOCK_M rows and N weight rows each (both kernels' K loop: the
    q/k/v head's two halves, or gate and up), as (BLOCK_M, N) fp32."""
    acc1 = _zeros_acc(BLOCK_M, N, SWAP_AB)
    acc2 = _zeros_acc(BLOCK_M, N, SWAP_AB)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = _normed_tile(x_rows, nw_ptr, rstd, row_ok, k0, K, BLOCK_K, EVEN_K)
        acc1 = _dot(a, _load_w(w1_ptrs, n_ok, k0, K, BLOCK_K, EVEN_K, EVEN_N), acc1, SWAP_AB, INTERPRET)
        acc2 = _dot(a, _load_w(w2_ptrs, n_ok, k0, K, BLOCK_K, EVEN_K, EVEN_N), acc2, SWAP_AB, INTERPRET)
    return _as_rows(acc1, SWAP_AB), _as_rows(acc2, SWAP_AB)


@triton.jit
def _round_like_gemm(acc, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The GEMM's fp32 result rounded to the activation dtype (to nearest even, as cuBLAS and torch
    round F.linear's output), back in fp32. On the GPU that is a plain cast. The interpreter's
    fp32 -> bf16 cast truncates instead, so there the rounding is done on the bits, to keep this
    point comparable with F.linear in the CPU tests (the interpreted unfused kernels truncate at their
    own rounding points, and so do these kernels at the same points)."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            bits = acc.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            acc = bits.to(tl.float32, bitcast=True)
    return acc.to(DTYPE).to(tl.float32)


# M is the batch: never specialised (M == 1 or M % 16 == 0 would each build another kernel, and a
# build in the middle of serving stalls a step for seconds). The strides and K are fixed by the model
# (hidden size, head_dim, cache layout) for every batch size, so they stay specialised: that is what
# lets Triton prove 16-byte alignment of every row and vectorise the loads.
@triton.jit(do_not_specialize=["M"])
def _norm_qkv_rope_write_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr, q_out_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, part_ptr, count_ptr,
    M, K, stride_xm, stride_wn, stride_qm, stride_qh, stride_c, stride_s,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    n_q, n_kv, block_size, eps, head_eps,
    HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, STATS_K: tl.constexpr,
    STATS_CHUNKS: tl.constexpr, EVEN_STATS: tl.constexpr, INTERPRET: tl.constexpr,
    SPLITS: tl.constexpr, K_PER_SPLIT: tl.constexpr, RELEASE: tl.constexpr,
):
    # One program: one head's 2 * HALF output columns (q, k or v) for BLOCK_M rows, as two halves so the
    # rotary pairs column d with d + HALF elementwise; with SPLITS > 1, over one split of the K range.
    release_dependents(RELEASE)  # a PDL attention launch after it may start (runner.layers.pdl)
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    # The epilogue's inputs first: their latency hides behind the statistics and the K loop.
    dd = tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + rows64 * stride_c + dd, mask=row_ok, other=0.0)
    c2 = tl.load(cos_ptr + rows64 * stride_c + HALF + dd, mask=row_ok, other=0.0)
    s1 = tl.load(sin_ptr + rows64 * stride_s + dd, mask=row_ok, other=0.0)
    s2 = tl.load(sin_ptr + rows64 * stride_s + HALF + dd, mask=row_ok, other=0.0)
    slot = tl.load(slot_ptr + rows64, mask=row_ok, other=-1).to(tl.int64)
    x_rows = x_ptr + rows64 * stride_xm
    rstd = _row_rstd(x_rows, row_ok, K, eps, BLOCK_M, STATS_K, STATS_CHUNKS, EVEN_STATS)

    d = tl.arange(0, HALF)
    ks = tl.arange(0, BLOCK_K)[None, :]
    n1 = head * (2 * HALF) + d[:, None]
    w1_ptrs = w_ptr + n1.to(tl.int64) * stride_wn + ks
    w2_ptrs = w1_ptrs + HALF * stride_wn
    k_lo = tl.program_id(2) * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc1, acc2 = _normed_gemm_pair(x_rows, nw_ptr, rstd, row_ok, w1_ptrs, w2_ptrs, None, K, k_lo, k_hi,
                                   BLOCK_M, HALF, BLOCK_K, EVEN_K, True, SWAP_AB, INTERPRET)
    if SPLITS == 1:
        _qkv_epilogue(acc1, acc2, head, rows64, row_ok, c1, c2, s1, s2, slot, b_ptr, q_norm_ptr, k_norm_ptr,
                      q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qm, stride_qh, stride_kb, stride_ks,
                      stride_kh, stride_vb, stride_vs, stride_vh, n_q, n_kv, block_size, head_eps,
                      x_ptr.dtype.element_ty, HALF, HAS_BIAS, HAS_NORM, INTERPRET)
    else:
        # Each split stores its fp32 partials and counts itself in; the last to arrive adds them in split
        # order (deterministic), runs the epilogue and resets the counter (graph replays find it zero).
        n_pad = tl.num_programs(0) * (2 * HALF)
        per_split = tl.num_programs(1) * BLOCK_M * n_pad
        first = part_ptr + rows64 * n_pad + head * (2 * HALF) + dd
        mine = first + tl.program_id(2).to(tl.int64) * per_split
        tl.store(mine, acc1)
        tl.store(mine + HALF, acc2)
        tl.debug_barrier()  # every thread's partial is issued before the counter says it is there
        tile = tl.program_id(1) * tl.num_programs(0) + head
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total1 = tl.load(first, cache_modifier=".cg")
            total2 = tl.load(first + HALF, cache_modifier=".cg")
            for sp in tl.static_range(1, SPLITS):
                total1 += tl.load(first + sp * per_split, cache_modifier=".cg")
                total2 += tl.load(first + sp * per_split + HALF, cache_modifier=".cg")
            _qkv_epilogue(total1, total2, head, rows64, row_ok, c1, c2, s1, s2, slot, b_ptr, q_norm_ptr,
                          k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qm, stride_qh, stride_kb,
                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, n_q, n_kv, block_size,
                          head_eps, x_ptr.dtype.element_ty, HALF, HAS_BIAS, HAS_NORM, INTERPRET)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _qkv_epilogue(acc1, acc2, head, rows64, row_ok, c1, c2, s1, s2, slot, b_ptr, q_norm_ptr, k_norm_ptr,
                  q_out_ptr, k_cache_ptr, v_cache_ptr, stride_qm, stride_qh, stride_kb, stride_ks, stride_kh,
                  stride_vb, stride_vs, stride_vh, n_q, n_kv, block_size, head_eps, dtype: tl.constexpr,
                  HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """One head's columns from their fp32 sums: bias, the projection's rounding, the optional per-head
    norm and rotary for q and k, then q to `q_out` and k / v to their cache slots."""
    d = tl.arange(0, HALF)[None, :]
    if HAS_BIAS:  # added in fp32 before the one rounding, as the GEMM's bias epilogue
        acc1 += tl.load(b_ptr + head * (2 * HALF) + d).to(tl.float32)
        acc2 += tl.load(b_ptr + head * (2 * HALF) + HALF + d).to(tl.float32)
    # F.linear's output is in the activation dtype: round here, as the unfused path's qkv tensor is.
    x1 = _round_like_gemm(acc1, dtype, INTERPRET)
    x2 = _round_like_gemm(acc2, dtype, INTERPRET)

    if head < n_q + n_kv:  # q or k: optional per-head RMSNorm, then rotary (fp32, rounded once)
        if HAS_NORM:
            if head < n_q:
                x1, x2 = head_rmsnorm(x1, x2, q_norm_ptr, d, head_eps, HALF, dtype)
            else:
                x1, x2 = head_rmsnorm(x1, x2, k_norm_ptr, d, head_eps, HALF, dtype)
        o1 = x1 * c1.to(tl.float32) - x2 * s1.to(tl.float32)
        o2 = x2 * c2.to(tl.float32) + x1 * s2.to(tl.float32)
        if head < n_q:
            q_row = q_out_ptr + rows64 * stride_qm + head * stride_qh
            tl.store(q_row + d, o1.to(q_out_ptr.dtype.element_ty), mask=row_ok)
            tl.store(q_row + HALF + d, o2.to(q_out_ptr.dtype.element_ty), mask=row_ok)
        else:
            write = row_ok & (slot >= 0)  # slot -1: a padding row, nothing is written
            blk = tl.maximum(slot, 0) // block_size
            off = tl.maximum(slot, 0) % block_size
            dst = k_cache_ptr + blk * stride_kb + off * stride_ks + (head - n_q) * stride_kh
            tl.store(dst + d, o1.to(k_cache_ptr.dtype.element_ty), mask=write)
            tl.store(dst + HALF + d, o2.to(k_cache_ptr.dtype.element_ty), mask=write)
    else:  # v: copied into the cache as the projection rounded it
        write = row_ok & (slot >= 0)
        blk = tl.maximum(slot, 0) // block_size
        off = tl.maximum(slot, 0) % block_size
        dst = v_cache_ptr + blk * stride_vb + off * stride_vs + (head - n_q - n_kv) * stride_vh
        tl.store(dst + d, x1.to(v_cache_ptr.dtype.element_ty), mask=write)
        tl.store(dst + HALF + d, x2.to(v_cache_ptr.dtype.element_ty), mask=write)


@triton.jit(do_not_specialize=["M"])  # see _norm_qkv_rope_write_kernel
def _norm_gate_up_silu_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, SWAP_AB: tl.constexpr, STATS_K: tl.constexpr, STATS_CHUNKS: tl.constexpr,
    EVEN_STATS: tl.constexpr, INTERPRET: tl.constexpr,
):
    # One program: BLOCK_N columns of gate and the same columns of up (two accumulators) for BLOCK_M rows.
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows64 * stride_xm
    rstd = _row_rstd(x_rows, row_ok, K, eps, BLOCK_M, STATS_K, STATS_CHUNKS, EVEN_STATS)

    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols[:, None] < N
    ks = tl.arange(0, BLOCK_K)[None, :]
    wg_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks
    wu_ptrs = w_ptr + (cols[:, None] + N).to(tl.int64) * stride_wn + ks  # up rows follow the N gate rows
    acc_g, acc_u = _normed_gemm_pair(x_rows, nw_ptr, rstd, row_ok, wg_ptrs, wu_ptrs, n_ok, K, 0, K, BLOCK_M,
                                     BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, SWAP_AB, INTERPRET)

    # F.linear rounds g and u to the activation dtype; then silu_mul's arithmetic: SiLU in fp32 rounded
    # to the dtype, times up, rounded.
    g = _round_like_gemm(acc_g, dtype, INTERPRET)
    u = _round_like_gemm(acc_u, dtype, INTERPRET)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out_ok = row_ok & (cols[None, :] < N)
    tl.store(out_ptr + rows64 * stride_om + cols[None, :], (s * u).to(out_ptr.dtype.element_ty), mask=out_ok)


# ------------------------------------------------------------------------------------------ wrappers

# (kernel, signature) pairs whose other default configs were already built (see _launch).
_WARMED: set = set()


def _meta(cfg: NormGemmConfig, k: int, n: int | None, split_k: bool | None = None) -> dict:
    """Constexprs and launch options of `cfg` for reduction length `k` (the K step is clamped to the
    smallest power of two >= 16 covering K, so a small model takes one masked step) and, for gate/up,
    `n` output columns; for q/k/v (`split_k` not None) the split of K (`_split_k`)."""
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    # statistics: loads of about 4096 elements (32 a thread at 4 warps), as many as cover K
    stats_k = min(triton.next_power_of_2(k), max(16, 4096 // cfg.block_m))
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_K=block_k, EVEN_K=k % block_k == 0, SWAP_AB=cfg.swap_ab,
                STATS_K=stats_k, STATS_CHUNKS=triton.cdiv(k, stats_k), EVEN_STATS=k % stats_k == 0,
                INTERPRET=_interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if n is not None:
        meta.update(BLOCK_N=cfg.block_n, EVEN_N=n % cfg.block_n == 0)
    if split_k is not None:
        splits, k_per_split = _split_k(cfg, k, split_k)
        meta.update(SPLITS=splits, K_PER_SPLIT=k_per_split)
    return meta


def _launch(kernel, grid: tuple[int, ...], args: tuple, fixed: dict, cfg: NormGemmConfig, k: int,
            table, explicit: bool, warm_key: tuple, n: int | None = None,
            split_k: bool | None = None) -> None:
    """Launch `kernel` with `cfg`; on the first call for a signature with a default config, also build
    (not run) every other default config of `table`, so a batch size in another M range met later in
    serving finds its kernel built (M itself is never specialised)."""
    if not explicit and not _interpreting() and warm_key not in _WARMED:
        _WARMED.add(warm_key)
        for other in {c for _, c in table} - {cfg}:
            kernel.warmup(*args, grid=(1,), **fixed, **_meta(other, k, n, split_k))
    launch(kernel, grid)(*args, **fixed, **_meta(cfg, k, n, split_k))


def _check_matrix(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {shape} with unit last stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _check_common(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, wname: str,
                  n_out: int, config: NormGemmConfig | None) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be (M, K) with unit last stride, got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in NORM_GEMM_DTYPES:
        raise ValueError(f"x must be bf16 or fp16 (tl.dot on fp32 would use tf32), got {x.dtype}")
    k = x.shape[1]
    _check_matrix("norm_weight", norm_weight, (k,))
    _check_matrix(wname, weight, (n_out, k))
    for name, t in (("norm_weight", norm_weight), (wname, weight)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
    if config is not None and (min(config.block_m, config.block_n, config.num_warps, config.num_stages) < 1
                               or config.block_k < 16 or any(
                                   v & (v - 1) for v in (config.block_m, config.block_n, config.block_k))):
        raise ValueError(f"config needs powers of two (block_k >= 16), got {config}")


def norm_gemm_supported(x: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """Whether x and the weights qualify for the fused kernels: bf16/fp16, one dtype, one device, x a
    matrix with unit last stride."""
    return x.dtype in NORM_GEMM_DTYPES and x.dim() == 2 and x.stride(-1) == 1 and all(
        w is None or (w.dtype == x.dtype and w.device == x.device) for w in weights)


def norm_qkv_rope_write(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    num_q_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    *,
    config: NormGemmConfig | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qkv_norm_rope_write(F.linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias), ...)` in one
    launch; returns q (M, num_q_heads, head_dim) and writes k / v to the paged caches.

    `x` (M, K); `qkv_weight` ((Hq + 2 Hkv) D, K), q rows then k then v; `cos` / `sin` (M, D); caches
    (num_blocks, block_size, Hkv, D); `slot_mapping` (M,) flat slots, -1 = padding row (not written);
    `q_norm` = (q weight, k weight, eps) for Qwen3's per-head norms. `config` overrides the tile (the
    column tile is always one head). Same rounding points as the three-launch sequence.

    `counters`: zeroed int32 arrival counters (`qkv_counters`), needed for a config with `splits` > 1:
    the K range is split over that many programs per head, and the last to arrive adds the partials in
    split order and runs the epilogue; each call leaves the counters zero (CUDA-graph replays). Without
    counters the kernel runs unsplit.
    """
    m, k = x.shape if x.dim() == 2 else (0, 0)
    head_dim = key_cache.shape[-1]
    half = head_dim // 2
    if head_dim % 2 or half & (half - 1) or half < 1:
        raise ValueError(f"key_cache: head_dim must be twice a power of two, got {head_dim}")
    n_heads = num_q_heads + 2 * num_kv_heads
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_q_heads / num_kv_heads must be >= 1, got {num_q_heads} / {num_kv_heads}")
    _check_common(x, norm_weight, qkv_weight, "qkv_weight", n_heads * head_dim, config)
    if qkv_bias is not None:
        _check_matrix("qkv_bias", qkv_bias, (n_heads * head_dim,))
    _check_matrix("cos", cos, (m, head_dim))
    _check_matrix("sin", sin, (m, head_dim))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, head_dim) or cache.stride(-1) != 1:
            raise ValueError(f"{name} must be (num_blocks, block_size, {num_kv_heads}, {head_dim}) with unit "
                             f"last stride, got {tuple(cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    if slot_mapping.shape != (m,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be ({m},) int32/int64, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if q_norm is not None:
        _check_matrix("q_norm weights", q_norm[0], (head_dim,))
        _check_matrix("q_norm weights", q_norm[1], (head_dim,))
    q_out = torch.empty((m, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return q_out
    cfg = config or default_config(QKV_CONFIGS, m)
    split_k = counters is not None
    splits, _ = _split_k(cfg, k, split_k)
    grid = (n_heads, triton.cdiv(m, cfg.block_m), splits)
    if splits > 1:
        tiles = grid[0] * grid[1]
        if counters.dtype != torch.int32 or counters.device != x.device or counters.numel() < tiles:
            raise ValueError(f"counters must be int32 on {x.device} with at least {tiles} slots "
                             f"(qkv_counters), got {counters.numel()} {counters.dtype} on {counters.device}")
        part = torch.empty((splits, grid[1] * cfg.block_m, n_heads * head_dim), dtype=torch.float32,
                           device=x.device)
    else:
        part = counters = q_out  # unused
    qw, kw, head_eps = q_norm if q_norm is not None else (norm_weight, norm_weight, 0.0)  # unused without
    args = (
        x, norm_weight, qkv_weight, qkv_bias if qkv_bias is not None else qkv_weight, q_out, cos, sin, qw, kw,
        slot_mapping, key_cache, value_cache, part, counters,
        m, k, x.stride(0), qkv_weight.stride(0), q_out.stride(0), q_out.stride(1),
        cos.stride(0), sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_q_heads, num_kv_heads, key_cache.shape[1], eps, head_eps,
    )  # fmt: skip
    fixed = dict(HALF=half, HAS_BIAS=qkv_bias is not None, HAS_NORM=q_norm is not None,
                 RELEASE=use_pdl(x.device))
    warm_key = ("qkv", x.device, x.dtype, k, n_heads, half, qkv_bias is not None, q_norm is not None,
                key_cache.dtype, split_k)
    _launch(_norm_qkv_rope_write_kernel, grid, args, fixed, cfg, k, QKV_CONFIGS, config is not None, warm_key,
            split_k=split_k)
    return q_out


def qkv_counters(num_heads: int, max_rows: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed arrival counters for split-K q/k/v calls on `num_heads` heads (Hq + 2 Hkv) and at most
    `max_rows` rows (one per head and row: enough for any row tile, and a few KB). Make them outside
    CUDA-graph capture; one buffer per call site (a layer), never shared by two calls in flight."""
    return torch.zeros(num_heads * max(max_rows, 1), dtype=torch.int32, device=device)


def qkv_splits_configured() -> bool:
    """Whether a default q/k/v config splits K (so a layer needs `qkv_counters`)."""
    return any(cfg.splits > 1 for _, cfg in QKV_CONFIGS)


def _split_k(cfg: NormGemmConfig, k: int, allowed: bool) -> tuple[int, int]:
    """(splits, K per split) for `cfg` on reduction length `k`: whole K steps per split, no split left
    without columns; one split when not `allowed` (no counters)."""
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    if not allowed or cfg.splits <= 1:
        return 1, triton.cdiv(k, block_k) * block_k
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.splits), block_k) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def norm_gate_up_silu(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    *,
    config: NormGemmConfig | None = None,
) -> torch.Tensor:
    """`silu_mul(F.linear(rms_norm(x, norm_weight, eps), gate_up_weight))` in one launch -> (M, I).

    `gate_up_weight` is (2 I, K), the I gate rows first. Same rounding points as the three-launch
    sequence (g and u rounded to the activation dtype, SiLU rounded, the product rounded).
    """
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight must be (2 I, K), got {tuple(gate_up_weight.shape)}")
    n = gate_up_weight.shape[0] // 2
    _check_common(x, norm_weight, gate_up_weight, "gate_up_weight", 2 * n,
                  config)
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(GATE_UP_CONFIGS, m)
    args = (x, norm_weight, gate_up_weight, out, m, n, k,
            x.stride(0), gate_up_weight.stride(0), out.stride(0), eps)
    warm_key = ("gate_up", x.device, x.dtype, k, n)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _launch(_norm_gate_up_silu_kernel, grid, args, {}, cfg, k, GATE_UP_CONFIGS, config is not None, warm_key,
            n=n)
    return out


__all__ = [
    "GATE_UP_CONFIGS",
    "NORM_GEMM_DTYPES",
    "QKV_CONFIGS",
    "NormGemmConfig",
    "default_config",
    "norm_gate_up_silu",
    "norm_gemm_supported",
    "norm_qkv_rope_write",
    "qkv_counters",
    "qkv_splits_configured",
]

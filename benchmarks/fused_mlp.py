"""A whole MLP block as one persistent kernel for decode steps, against the launches it replaces (GPU).

A lever tried for issue 14 and not kept (measured on an H200, `benchmarks/RESULTS.md`, fourteenth
session): at decode batch sizes each kernel of a layer costs a few microseconds whatever its bytes, so
this runs W1's MLP block (RMSNorm, gate/up, SiLU*mul, down projection + residual; Qwen3-0.6B shapes, 19 MB
of weights, ~4.5 us at the copy rate) as one launch of at most one program per SM, all resident at once:

1. each program loads its tile of the down projection's weight (one output-column tile x one K range
   of the intermediate, at most 64 KB) into registers first (`preload_down`), nothing it depends on
   being computed yet;
2. phase A: gate/up column tiles in turn (tile t, t + P, ...): the rows' RMS norm (fp32 statistics, HF
   rounding), both GEMMs, SiLU(gate) * up rounded as `silu_mul` rounds it, into an activation scratch;
3. a grid barrier (an arrival counter every program bumps and spins on; the last to leave resets it);
4. phase B: its activation K range (through L2) times its preloaded tile, the fp32 partial stored and
   the output tile's arrival counter bumped; the last split adds the partials in split order
   (deterministic), adds the residual, rounds once and writes it in place.

It is correct (the `--check` run on the CPU, the max difference printed on the GPU, the barrier in a
replayed CUDA graph) but slower than the launches: at 64 rows 22.4 us against 16.3-18.4, phase A alone
13.3 us against ~10.1 for norm + cuBLAS gate/up + SiLU*mul, phase B alone 9.9 against cuBLAS's 9.2; the
barrier itself costs nothing measurable (two launches: 23.2 us). One Triton program per SM does not
keep enough bytes in flight. The kernel lives here, not in `runner/`, so the measurement can be
repeated without carrying unused code in the engine.

Each case is one CUDA graph of 28 calls on 28 layers' weights (a decode step's worth, so no weight stays
in L2), median replay, us per layer: `engine now` is what `runner.layers.fused_layers` runs, by rows: up
to 32 `norm_gate_up_silu` + `down_residual_` (two launches), above `rms_norm` + cuBLAS gate/up +
`silu_mul` + cuBLAS `addmm_` (five launches, the down GEMM split-K with its reduce).

    python benchmarks/fused_mlp.py [--rows 1,16,32,48,64] [--sweep] [--diagnose] [--json out.json]
    python benchmarks/fused_mlp.py --check      # CPU, TRITON_INTERPRET=1: against the unfused launches
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass

if "--check" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from runner.layers.down_gemm import _add_residual, down_residual_, new_counters  # noqa: E402
from runner.layers.fused_linear import silu_mul, silu_mul_triton  # noqa: E402
from runner.layers.fused_ops import rms_norm  # noqa: E402
from runner.layers.norm_gemm import (  # noqa: E402
    NORM_GEMM_DTYPES,
    _interpreting,
    _normed_gemm_pair,
    _round_like_gemm,
    _row_rstd,
    norm_gate_up_silu,
)
from runner.layers.triton_launch import launch  # noqa: E402

LAYERS, HIDDEN, INTER, EPS = 28, 1024, 3072, 1e-6

# ------------------------------------------------------------------------------------------- kernel

# The largest batch the kernel takes: one program holds all rows (BLOCK_M = 64).
FUSED_MLP_MAX_ROWS = 64
# The largest down-projection tile a program may hold in registers (elements): 64 KB of bf16.
_MAX_DOWN_TILE = 32768


@dataclass(frozen=True)
class FusedMlpConfig:
    """Phase A's gate/up column tile and K step, phase B's output-column tile, warps and stages.
    The K range per phase-B program follows from how many programs there may be (`plan`)."""

    block_n_a: int = 32
    block_k_a: int = 128
    block_n_b: int = 64
    num_warps: int = 8
    num_stages: int = 3
    preload_down: bool = True  # read the down tile before phase A (else after the barrier)
    two_launches: bool = False  # phase A and phase B as two kernels, no barrier (what the CPU runs)


DEFAULT_CONFIG = FusedMlpConfig()


@triton.jit
def _grid_barrier(bar_ptr, P):
    """Wait until all P programs of the grid have arrived; the last to leave resets the counter (a
    replayed CUDA graph finds it at zero). Every program must be resident (see the module doc)."""
    tl.debug_barrier()  # every thread's stores are issued before the arrival is counted
    tl.atomic_add(bar_ptr, 1, sem="release")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    while seen < P:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr, 1, sem="relaxed")
    if left == 2 * P - 1:  # everyone has passed the wait: nobody reads the counter any more
        tl.atomic_xchg(bar_ptr, 0)


@triton.jit(do_not_specialize=["M"])  # the batch is never specialised (see runner.layers.norm_gemm)
def _fused_mlp_kernel(
    x_ptr, nw_ptr, wgu_ptr, wd_ptr, act_ptr, part_ptr, count_ptr, M, H, INTER, stride_xm, stride_gu,
    stride_wd, eps,
    PHASE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N_A: tl.constexpr, BLOCK_K_A: tl.constexpr,
    BLOCK_N_B: tl.constexpr, K_B: tl.constexpr, SPLITS_B: tl.constexpr, EVEN_K_A: tl.constexpr,
    EVEN_K_B: tl.constexpr, STATS_K: tl.constexpr, STATS_CHUNKS: tl.constexpr, EVEN_STATS: tl.constexpr,
    PRELOAD: tl.constexpr, INTERPRET: tl.constexpr,
):
    # PHASE 0: both phases with the grid barrier between them (GPU); 1 / 2: one phase (the interpreter).
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    x_rows = x_ptr + rows64 * stride_xm

    # This program's phase-B item: output columns tile `jb`, intermediate K range `sb` (one item each).
    n_tiles_b = H // BLOCK_N_B
    has_b = pid < n_tiles_b * SPLITS_B
    jb = pid % n_tiles_b
    sb = pid // n_tiles_b
    cols_b = jb * BLOCK_N_B + tl.arange(0, BLOCK_N_B)
    kk_b = sb * K_B + tl.arange(0, K_B)
    if EVEN_K_B:
        w_mask = (cols_b[:, None] < H) & has_b
    else:
        w_mask = (kk_b[None, :] < INTER) & has_b
    wd_ptrs = wd_ptr + cols_b[:, None].to(tl.int64) * stride_wd + kk_b[None, :]
    if PHASE != 1 and PRELOAD:  # weights first: nothing they depend on is computed by this kernel
        w_d = tl.load(wd_ptrs, mask=w_mask, other=0.0)

    if PHASE != 2:
        rstd = _row_rstd(x_rows, row_ok, H, eps, BLOCK_M, STATS_K, STATS_CHUNKS, EVEN_STATS)
        ks = tl.arange(0, BLOCK_K_A)[None, :]
        for tile in range(pid, INTER // BLOCK_N_A, P):
            cols = tile * BLOCK_N_A + tl.arange(0, BLOCK_N_A)
            n_ok = cols[:, None] < INTER
            wg_ptrs = wgu_ptr + cols[:, None].to(tl.int64) * stride_gu + ks
            wu_ptrs = wgu_ptr + (cols[:, None] + INTER).to(tl.int64) * stride_gu + ks
            acc_g, acc_u = _normed_gemm_pair(x_rows, nw_ptr, rstd, row_ok, wg_ptrs, wu_ptrs, n_ok, H, 0, H,
                                             BLOCK_M, BLOCK_N_A, BLOCK_K_A, EVEN_K_A, True, False, INTERPRET)
            g = _round_like_gemm(acc_g, dtype, INTERPRET)
            u = _round_like_gemm(acc_u, dtype, INTERPRET)
            s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            tl.store(act_ptr + rows64 * INTER + cols[None, :], (s * u).to(dtype))

    if PHASE == 0:
        _grid_barrier(count_ptr, P)

    if PHASE != 1:
        if has_b:
            if not PRELOAD:
                w_d = tl.load(wd_ptrs, mask=w_mask, other=0.0)
            if EVEN_K_B:
                a_mask = row_ok
            else:
                a_mask = row_ok & (kk_b[None, :] < INTER)
            a = tl.load(act_ptr + rows64 * INTER + kk_b[None, :], mask=a_mask, other=0.0,
                        cache_modifier=".cg")
            if INTERPRET:
                acc = tl.dot(a.to(tl.float32), tl.trans(w_d.to(tl.float32)), input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w_d))
            m_pad = BLOCK_M
            first = part_ptr + rows64 * H + cols_b[None, :]
            tl.store(first + sb * m_pad * H, acc)
            tl.debug_barrier()  # every thread's partial is issued before the counter says it is there
            arrived = tl.atomic_add(count_ptr + 1 + jb, 1, sem="acq_rel")
            if arrived == SPLITS_B - 1:  # the last split of this tile: the partials in split order
                total = tl.load(first, cache_modifier=".cg")
                for s in tl.static_range(1, SPLITS_B):
                    total += tl.load(first + s * m_pad * H, cache_modifier=".cg")
                x_tile = x_rows + cols_b[None, :]
                _add_residual(x_tile, x_tile, row_ok, total, dtype, INTERPRET)
                tl.atomic_xchg(count_ptr + 1 + jb, 0)


@dataclass(frozen=True)
class MlpPlan:
    """How one call splits the work: programs, phase B's K range per program and split count."""

    programs: int
    k_b: int
    splits_b: int


def plan(hidden: int, inter: int, config: FusedMlpConfig, sm_count: int) -> MlpPlan | None:
    """The launch for hidden size `hidden` and intermediate size `inter` on `sm_count` SMs, or None when
    the kernel does not fit the shape (tiles that do not divide it, a down tile over 64 KB, fewer SMs
    than phase B needs programs)."""
    bn_b = config.block_n_b
    if hidden % bn_b or inter % config.block_n_a or hidden < 16 or inter < 16:
        return None
    n_tiles_b = hidden // bn_b
    max_splits = sm_count // n_tiles_b
    if max_splits < 1:
        return None
    k_b = max(16, triton.next_power_of_2(triton.cdiv(inter, max_splits)))
    if bn_b * k_b > _MAX_DOWN_TILE:
        return None
    splits = triton.cdiv(inter, k_b)
    programs = min(sm_count, max(n_tiles_b * splits, inter // config.block_n_a))
    return MlpPlan(programs=programs, k_b=k_b, splits_b=splits)


def new_mlp_counters(hidden: int, device: torch.device | str, config: FusedMlpConfig = DEFAULT_CONFIG
                     ) -> torch.Tensor:
    """Zeroed counters for one call site (a layer): the grid barrier's, then one per output tile. Make
    them outside CUDA-graph capture; each call leaves them zero."""
    return torch.zeros(1 + triton.cdiv(hidden, min(config.block_n_b, 16)), dtype=torch.int32, device=device)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter (--check): any count works, the phases launch apart


def fused_mlp_supported(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                        down_weight: torch.Tensor, config: FusedMlpConfig = DEFAULT_CONFIG) -> bool:
    """Whether `fused_mlp_` takes these tensors: bf16/fp16 of one dtype and device, at most
    FUSED_MLP_MAX_ROWS rows, shapes that agree and that `plan` can split."""
    if x.dtype not in NORM_GEMM_DTYPES or x.dim() != 2 or not 0 < x.shape[0] <= FUSED_MLP_MAX_ROWS:
        return False
    tensors = (x, norm_weight, gate_up_weight, down_weight)
    if any(t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1 for t in tensors):
        return False
    h = x.shape[1]
    if norm_weight.shape != (h,) or gate_up_weight.dim() != 2 or down_weight.dim() != 2:
        return False
    inter = down_weight.shape[1]
    if gate_up_weight.shape != (2 * inter, h) or down_weight.shape != (h, inter) or x.stride(0) < h:
        return False
    return plan(h, inter, config, _sm_count(x.device)) is not None


def fused_mlp_(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
               down_weight: torch.Tensor, counters: torch.Tensor, *,
               config: FusedMlpConfig | None = None, _phases: tuple[int, ...] | None = None) -> torch.Tensor:
    """`x += silu_mul(F.linear(rms_norm(x, norm_weight, eps), gate_up_weight)) @ down_weight.T` in one
    launch, in place; returns `x`.

    `x` (M, H), M <= 64, the residual (this layer's own tensor: it is overwritten); `gate_up_weight`
    (2 I, H), the I gate rows first; `down_weight` (H, I); `counters` from `new_mlp_counters` (zero
    between calls, one buffer per call site, never shared by two calls running at once). `_phases`
    (the diagnosis) launches just the given phases (1: norm + gate/up + SiLU, 2: down + residual).
    """
    cfg = config or DEFAULT_CONFIG
    if not fused_mlp_supported(x, norm_weight, gate_up_weight, down_weight, cfg):
        raise ValueError(f"fused_mlp_ does not take x {tuple(x.shape)} {x.dtype}, gate_up "
                         f"{tuple(gate_up_weight.shape)}, down {tuple(down_weight.shape)} with {cfg}")
    m, h = x.shape
    inter = down_weight.shape[1]
    p = plan(h, inter, cfg, _sm_count(x.device))
    n_tiles_b = h // cfg.block_n_b
    if counters.dtype != torch.int32 or counters.device != x.device or counters.numel() < 1 + n_tiles_b:
        raise ValueError(f"counters must be int32 on {x.device} with at least {1 + n_tiles_b} slots "
                         f"(new_mlp_counters), got {counters.numel()} {counters.dtype} on {counters.device}")
    act = torch.empty((FUSED_MLP_MAX_ROWS, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((p.splits_b, FUSED_MLP_MAX_ROWS, h), dtype=torch.float32, device=x.device)
    block_k_a = min(cfg.block_k_a, max(16, triton.next_power_of_2(h)))
    stats_k = min(triton.next_power_of_2(h), max(16, 4096 // FUSED_MLP_MAX_ROWS))
    meta = dict(BLOCK_M=FUSED_MLP_MAX_ROWS, BLOCK_N_A=cfg.block_n_a, BLOCK_K_A=block_k_a,
                BLOCK_N_B=cfg.block_n_b, K_B=p.k_b, SPLITS_B=p.splits_b, EVEN_K_A=h % block_k_a == 0,
                EVEN_K_B=inter == p.k_b * p.splits_b, STATS_K=stats_k, STATS_CHUNKS=triton.cdiv(h, stats_k),
                EVEN_STATS=h % stats_k == 0, PRELOAD=cfg.preload_down, INTERPRET=_interpreting(),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)  # fmt: skip
    args = (x, norm_weight, gate_up_weight, down_weight, act, part, counters, m, h, inter, x.stride(0),
            gate_up_weight.stride(0), down_weight.stride(0), eps)
    if _phases is None:
        apart = _interpreting() or x.device.type != "cuda" or cfg.two_launches
        _phases = (1, 2) if apart else (0,)
    for phase in _phases:
        launch(_fused_mlp_kernel, (p.programs,))(*args, PHASE=phase, **meta)
    return x


# ---------------------------------------------------------------------------------------- benchmark



def make_layers() -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    return [dict(nw=1 + w(HIDDEN, scale=0.1), gu=w(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
                 d=w(HIDDEN, INTER, scale=INTER**-0.5), down_counters=new_counters(HIDDEN, 64, "cuda"),
                 mlp_counters=new_mlp_counters(HIDDEN, "cuda"))
            for _ in range(LAYERS)]  # fmt: skip


def engine_now(x: torch.Tensor, lw: dict) -> torch.Tensor:
    if x.shape[0] <= 32:
        act = norm_gate_up_silu(x, lw["nw"], EPS, lw["gu"])
        return down_residual_(x, act, lw["d"], lw["down_counters"], silu=False)
    act = silu_mul(F.linear(rms_norm(x, lw["nw"], EPS), lw["gu"]))
    return x.addmm_(act, lw["d"].t())


def per_layer_us(layers: list[dict], x0: torch.Tensor, fn) -> float:
    from skinny_gemm import graph_time

    x = x0.clone()

    def body():
        for lw in layers:
            fn(x, lw)

    return graph_time(body, replays=15) / len(layers) * 1e6


def sweep_configs():
    for bna, bka, bnb, warps, stages in itertools.product((16, 32, 64), (64, 128, 256), (32, 64, 128), (4, 8),
                                                          (2, 3, 4)):
        yield FusedMlpConfig(block_n_a=bna, block_k_a=bka, block_n_b=bnb, num_warps=warps, num_stages=stages)


def diagnose(layers: list[dict], m: int, copy_bw: float) -> list[dict]:
    """Where the kernel's time goes at `m` rows: each phase launched alone, both as two launches (no
    barrier), without the down tile's preload, and other phase-A K steps, warps and stages."""
    from dataclasses import replace

    x0 = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
    base = FusedMlpConfig()
    variants = [("default", base, None), ("phase A alone", base, (1,)), ("phase B alone", base, (2,)),
                ("two launches", replace(base, two_launches=True), None),
                ("no preload", replace(base, preload_down=False), None),
                ("phase A alone, no preload", replace(base, preload_down=False), (1,))]
    for bka, stages, warps, bna in ((256, 2, 8, 32), (256, 3, 8, 32), (64, 4, 8, 32), (128, 4, 8, 32),
                                    (128, 3, 4, 32), (128, 3, 8, 16), (128, 3, 8, 64)):
        cfg = replace(base, block_k_a=bka, num_stages=stages, num_warps=warps, block_n_a=bna)
        variants += [(f"phase A alone, K {bka} stages {stages} warps {warps} N {bna}", cfg, (1,)),
                     (f"whole, K {bka} stages {stages} warps {warps} N {bna}", cfg, None)]
    rows = []
    for label, cfg, phases in variants:
        try:
            us = per_layer_us(layers, x0, lambda x, lw, cfg=cfg, phases=phases: fused_mlp_(
                x, lw["nw"], EPS, lw["gu"], lw["d"], lw["mlp_counters"], config=cfg, _phases=phases))
        except Exception as exc:  # noqa: BLE001 - a tile that does not build is reported and skipped
            print(f"  diagnose {label}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        rows.append(dict(m=m, diagnose=label, us=round(us, 2)))
        print(f"  diagnose M={m} {label:50s} {us:6.2f} us", flush=True)
    return rows


def check() -> int:
    """CPU, under the interpreter (the phases launch apart): the kernel against the unfused launches on
    small shapes, with 132 SMs (every split one 16-wide K step) and with 8 (an uneven, masked last split;
    programs looping over two gate/up tiles); the counters must be zero after every call."""
    global _sm_count
    bad = 0
    cfg = FusedMlpConfig(block_n_a=16, block_k_a=32, block_n_b=16, num_warps=4, num_stages=1)
    for sms, inter, m in itertools.product((132, 8), (96, 256), (1, 7, 64)):
        _sm_count = lambda device, sms=sms: sms  # noqa: E731
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
        gu = (torch.randn(2 * inter, 64, generator=g) / 8).to(torch.bfloat16)
        d = (torch.randn(64, inter, generator=g) * inter**-0.5).to(torch.bfloat16)
        want = x.clone().addmm_(silu_mul_triton(F.linear(rms_norm(x, nw, EPS), gu)), d.t())
        counters = new_mlp_counters(64, "cpu", cfg)
        got = fused_mlp_(x.clone(), nw, EPS, gu, d, counters, config=cfg)
        diff = (got.float() - want.float()).abs().max().item()
        ok = diff <= 2 * 2**-7 * max(want.abs().max().item(), 1.0) and not torch.count_nonzero(counters)
        bad += not ok
        print(f"SMs {sms:3d} I {inter:3d} M {m:2d}: max |diff| {diff:.4f}, bitwise "
              f"{(got == want).float().mean().item():.3f} {'ok' if ok else 'MISMATCH'}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,48,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=90.0)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--diagnose", action="store_true",
                    help="at the largest row count: each phase alone, two launches, no preload, K steps")
    ap.add_argument("--check", action="store_true", help="CPU, TRITON_INTERPRET=1: correctness only")
    args = ap.parse_args()
    if args.check:
        return check()
    if not torch.cuda.is_available():
        print("needs a CUDA device (or --check)")
        return 1
    from attention import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy rate {copy_bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}, {sms} SMs", flush=True)
    layers = make_layers()
    weight_bytes = (3 * INTER * HIDDEN) * 2
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        x0 = torch.randn(m, HIDDEN, device="cuda").to(torch.bfloat16)
        want = engine_now(x0.clone(), layers[0])
        base = per_layer_us(layers, x0, engine_now)
        cfgs = [("default", FusedMlpConfig())]
        if args.sweep and m == max(int(r) for r in args.rows.split(",")):
            cfgs += [(str(c), c) for c in sweep_configs() if c != FusedMlpConfig()]
        best, t_start = None, time.time()
        for label, cfg in cfgs:
            if time.time() - t_start > args.sweep_seconds:
                print("  (sweep time is up)", flush=True)
                break
            if plan(HIDDEN, INTER, cfg, sms) is None:
                continue
            try:
                got = fused_mlp_(x0.clone(), layers[0]["nw"], EPS, layers[0]["gu"], layers[0]["d"],
                                 layers[0]["mlp_counters"], config=cfg)
                us = per_layer_us(layers, x0, lambda x, lw, cfg=cfg: fused_mlp_(
                    x, lw["nw"], EPS, lw["gu"], lw["d"], lw["mlp_counters"], config=cfg))
            except Exception as exc:  # noqa: BLE001 - a tile that does not build is reported and skipped
                print(f"  skip {label}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            diff = (got.float() - want.float()).abs().max().item()
            pct = 100 * weight_bytes / (us * 1e-6) / copy_bw
            row = dict(m=m, config=label, engine_now_us=round(base, 2), fused_us=round(us, 2),
                       speedup=round(base / us, 3), pct_of_copy=round(pct, 1), max_diff=diff)
            results.append(row)
            if best is None or us < best[1]:
                best = (label, us)
            if label == "default" or len(cfgs) == 1:
                print(f"M={m:3d} engine now {base:6.2f} us  fused {us:6.2f} us  x{base / us:5.3f}  "
                      f"{pct:5.1f}% of copy  max |diff| {diff:.4f}  ({label})", flush=True)
        if len(cfgs) > 1 and best:
            top = sorted((r for r in results if r["m"] == m), key=lambda r: r["fused_us"])[:6]
            for r in top:
                print(f"  sweep {r['fused_us']:6.2f} us x{r['speedup']:5.3f}  {r['config']}", flush=True)
    if args.diagnose:
        results += diagnose(layers, max(int(r) for r in args.rows.split(",")), copy_bw)
    if args.json:
        args.json.write_text(json.dumps({"copy_TBps": copy_bw / 1e12, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

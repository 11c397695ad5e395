"""Decode GEMMs: a weight-streaming Triton GEMM against cuBLAS, inside CUDA graphs, on W1's projections.

A lever tried for issue 14 and not kept (measured on an H200, `benchmarks/RESULTS.md`): at decode
batch sizes cuBLAS is within about 10% of the best tile of this kernel on every W1 projection, and
the engine's W1 ran 6% slower with it. The kernel lives here, not in `runner/`, so the measurement
can be repeated (another GPU, another model) without carrying unused code in the engine.

One command, GPU (a minute or two on an H200):

    python benchmarks/skinny_gemm.py [--rows 16,32,64] [--sweep] [--out results.json]

W1's model is Qwen3-0.6B-shaped: per layer q/k/v (N 4096, K 1024), o_proj (1024, 2048) with the
residual add, gate/up (6144, 1024), down_proj (1024, 3072) with the residual add in place. Each case
captures 28 calls on 28 different weights (as a decode step meets them, so no weight stays in L2) in
one CUDA graph and reports the median replay over 28: microseconds per call and the fraction of the
device's copy bandwidth (a 1 GiB device-to-device copy, read + write, measured in the same run) that
the weight's bytes reach. cuBLAS runs as the engine calls it: `F.linear`, and `addmm` / `addmm_` for
the residual projections. `--sweep` times a grid of tiles per case and prints the best (tiles that
need more shared memory than the GPU has are skipped); without it one fixed tile is timed. The last
table is a whole step's GEMMs (the four per layer, 28 layers, in one graph): cuBLAS against the
kernel where its best tile won, side by side.

The kernel: each program owns `BLOCK_N` rows of the weight for a `BLOCK_M` slice of the batch, so
even N = 1024 spreads over every SM; the residual add is the epilogue (one rounding, as `addmm`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])  # a new batch size must not build a new kernel
def _skinny_gemm_kernel(
    x_ptr, w_ptr, res_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the caller)
        a = tl.load(x_ptrs, mask=row_ok, other=0.0)
        b = tl.load(w_ptrs, mask=col_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ok = row_ok & (cols[None, :] < N)
    if HAS_RES:
        res_ptrs = res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :]
        res = tl.load(res_ptrs, mask=out_ok, other=0.0)
        acc += res.to(tl.float32)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=out_ok)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, config: dict) -> torch.Tensor:
    """`x @ weight.T (+ residual)` with x (M, K), weight (N, K), both with unit last stride.

    `out` may be `residual` itself (an in-place residual add: each element is read before it is
    written by the same program); `config` is the tile.
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} need unit last "
                         f"strides and a shared K")
    cfg = dict(config)
    if not cfg or k % cfg["BLOCK_K"]:
        raise ValueError(f"skinny_linear: no tile for M={m}, N={n}, K={k}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"skinny_linear: residual must be ({m}, {n}) with unit last stride")
    if m == 0:
        return out
    res = residual if residual is not None else out
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _skinny_gemm_kernel[grid](
        x, weight, res, out, m, n, k, x.stride(0), weight.stride(0), res.stride(0), out.stride(0),
        HAS_RES=residual is not None, **cfg,
    )
    return out



def default_tile(m: int) -> dict:
    """The tile timed without `--sweep`."""
    return dict(BLOCK_M=16 if m <= 16 else 32, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=4)


LAYERS = 28
SHAPES = {  # name: (N, K, residual)
    "qkv": (4096, 1024, None),
    "o_proj": (1024, 2048, "out"),
    "gate_up": (6144, 1024, None),
    "down_proj": (1024, 3072, "inplace"),
}


def copy_bandwidth(dev) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])  # bytes read + written per second


def graph_time(body, replays: int = 15) -> float:
    """Median seconds of one replay of a graph capturing `body`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:])


def make_case(name: str, m: int, dev, dtype):
    n, k, res = SHAPES[name]
    weights = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
    x = torch.randn(m, k, device=dev, dtype=dtype)
    residual = torch.randn(m, n, device=dev, dtype=dtype) if res else None
    return weights, x, residual


def cublas_body(name, weights, x, residual):
    res = SHAPES[name][2]

    def body():
        for w in weights:
            if res is None:
                F.linear(x, w)
            elif res == "out":
                torch.addmm(residual, x, w.t())
            else:
                residual.addmm_(x, w.t())
    return body


def skinny_body(name, weights, x, residual, config):
    res = SHAPES[name][2]

    def body():
        for w in weights:
            skinny_linear(x, w, residual, out=residual if res == "inplace" else None, config=config)
    return body


def check(name, weights, x, residual, config) -> float:
    """Max abs difference from an fp32 reference of the same bf16 inputs, on one weight. A fresh
    residual: the in-place case's own has grown through the timed replays."""
    res = torch.randn_like(residual) if SHAPES[name][2] else None
    ref = x.float() @ weights[0].float().t() + (res.float() if res is not None else 0)
    got = skinny_linear(x, weights[0], res, config=config)
    return (got.float() - ref).abs().max().item()


SWEEP = dict(BLOCK_M=(16, 32, 64), BLOCK_N=(16, 32, 64), BLOCK_K=(64, 128, 256), num_warps=(4,),
             num_stages=(3, 5))


def sweep_configs(m: int):
    keys = list(SWEEP)
    for values in itertools.product(*SWEEP.values()):
        cfg = dict(zip(keys, values))
        if cfg["BLOCK_M"] > max(16, triton_next_pow2(m)):
            continue
        yield cfg


def triton_next_pow2(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


def step_body(cases: dict, uses: dict, kernel: bool):
    """A decode step's four GEMMs on every layer: the kernel where `uses` names a tile, else cuBLAS."""
    bodies = []
    for name in SHAPES:
        if kernel and uses[name]:
            bodies.append(skinny_body(name, *cases[name], uses[name]))
        else:
            bodies.append(cublas_body(name, *cases[name]))

    def body():
        for b in bodies:
            b()
    return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64", help="decode batch sizes (M)")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles per case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"copy_bandwidth": bw, "cases": [], "steps": []}
    best_tiles: dict = {}
    print(f"{'case':>10} {'M':>4} | {'cuBLAS us':>9} {'%bw':>5} | {'kernel us':>9} {'%bw':>5} | "
          f"{'speedup':>7} | tile")
    for m in rows:
        for name in SHAPES:
            n, k, _ = SHAPES[name]
            weights, x, residual = make_case(name, m, dev, dtype)
            nbytes = n * k * 2
            t_cublas = graph_time(cublas_body(name, weights, x, residual)) / LAYERS
            candidates = list(sweep_configs(m)) if args.sweep else [default_tile(m)]
            best = None
            for cfg in candidates:
                if cfg is None:
                    continue
                try:
                    err = check(name, weights, x, residual, cfg)
                except triton.runtime.errors.OutOfResources:
                    continue
                if err > 0.05:
                    print(f"  {name} M={m} {cfg}: max error {err:.3g}: WRONG")
                    continue
                t = graph_time(skinny_body(name, weights, x, residual, cfg)) / LAYERS
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best is None:
                print(f"{name:>10} {m:>4} | {t_cublas * 1e6:9.2f} {nbytes / t_cublas / bw * 100:5.0f} | "
                      "(no tile)")
                continue
            t_k, cfg = best
            print(f"{name:>10} {m:>4} | {t_cublas * 1e6:9.2f} {nbytes / t_cublas / bw * 100:5.0f} | "
                  f"{t_k * 1e6:9.2f} {nbytes / t_k / bw * 100:5.0f} | {t_cublas / t_k:6.2f}x | {cfg}")
            results["cases"].append(dict(case=name, m=m, n=n, k=k, cublas_s=t_cublas, kernel_s=t_k, tile=cfg))
            best_tiles[(name, m)] = cfg if t_k < t_cublas else None
            del weights
        torch.cuda.empty_cache()
    # a whole decode step's GEMMs, side by side: per projection the best tile where it beat cuBLAS
    print("\nwhole step: 4 GEMMs x 28 layers in one graph")
    for m in rows:
        cases = {name: make_case(name, m, dev, dtype) for name in SHAPES}
        uses = {name: best_tiles.get((name, m)) for name in SHAPES}

        t_c, t_k = graph_time(step_body(cases, uses, False)), graph_time(step_body(cases, uses, True))
        total = sum(SHAPES[nm][0] * SHAPES[nm][1] * 2 for nm in SHAPES) * LAYERS
        print(f"  M={m}: cuBLAS {t_c * 1e3:.3f} ms ({total / t_c / bw * 100:.0f}% bw), "
              f"kernel {t_k * 1e3:.3f} ms "
              f"({total / t_k / bw * 100:.0f}% bw): {t_c / t_k:.2f}x")
        results["steps"].append(dict(m=m, cublas_s=t_c, kernel_s=t_k))
        del cases
        torch.cuda.empty_cache()
    out = args.out or (os.path.join(os.environ["OUT"], "skinny_gemm.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

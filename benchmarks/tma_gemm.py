"""Decode GEMMs at 64 rows with TMA weight streaming (Hopper tensor descriptors) against cuBLAS (GPU).

Why: every Triton GEMM tried for W1's 64-row decode projections so far loaded its tiles through
per-thread pointers (`cp.async`), and each only tied cuBLAS at 64 rows: the fourteenth session's
diagnosis of a persistent MLP kernel was that one Triton program per SM does not keep enough bytes in
flight. The fifteenth session measured that a 64 x 6144 x 1024 GEMM whose weight is already in L2 takes
4.74 us against 6.36 us from DRAM (`benchmarks/l2_prefetch.py`), so DRAM latency and bytes in flight are
part of these kernels' cost. Hopper's tensor memory accelerator copies a whole tile into shared memory
from one instruction, without registers, so a kernel can keep several stages of weight tiles in flight
per program. This kernel does that (Triton's host-side `TensorDescriptor`, swap-AB so the weight tile
is wgmma's 64- or 128-row operand and the batch its N side, split-K with the last-arriving program of
each weight tile summing the partials and adding the residual), and times it against cuBLAS as the
engine calls it, on W1's four projections (28 different weights in one CUDA graph, as in
`skinny_gemm.py`), over a grid of tiles, splits and stages.

    python benchmarks/tma_gemm.py [--rows 64] [--json out.json]     # GPU
    python benchmarks/tma_gemm.py --check                             # CPU, TRITON_INTERPRET=1: numerics
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys

if "--check" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from skinny_gemm import LAYERS, SHAPES, copy_bandwidth, cublas_body, graph_time, make_case  # noqa: E402


@triton.jit
def _tma_gemm_kernel(w_desc, x_desc, res_ptr, y_ptr, part_ptr, count_ptr, M, N, stride_rm, stride_ym,
                     K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_RES: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    K_SPLIT: tl.constexpr = K // SPLITS
    k_lo = split * K_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k_lo + k0])  # (BLOCK_N, BLOCK_K): the weight rows, wgmma's A
        x = x_desc.load([0, k_lo + k0])  # (BLOCK_M, BLOCK_K): rows past M arrive as zeros
        acc = tl.dot(w, tl.trans(x), acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    mask = (cols[:, None] < N) & (rows[None, :] < M)
    if SPLITS > 1:
        # Each split stores its partial; the last to arrive sums them in split order and finishes the tile.
        part = part_ptr + (split * N + cols[:, None]).to(tl.int64) * BLOCK_M + rows[None, :]
        tl.store(part, acc)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLITS):
                acc += tl.load(part_ptr + (s * N + cols[:, None]).to(tl.int64) * BLOCK_M + rows[None, :])
            if HAS_RES:
                acc += tl.load(res_ptr + rows[None, :] * stride_rm + cols[:, None], mask=mask,
                               other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (and graph replay)
    else:
        if HAS_RES:
            acc += tl.load(res_ptr + rows[None, :] * stride_rm + cols[:, None], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


class TmaLinear:
    """`x @ weight.T (+ residual)` for a fixed weight and batch buffer: descriptors, the split partials and
    the arrival counters made once (CUDA graphs replay the same addresses)."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> None:
        n, k = weight.shape
        self.cfg = cfg
        bn, bm, bk, splits = cfg["BLOCK_N"], cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["SPLITS"]
        if k % (splits * bk) or x.shape[0] > bm:
            raise ValueError(f"no tile: M={x.shape[0]} N={n} K={k} {cfg}")
        self.x, self.n, self.k = x, n, k
        self.w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        self.x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        self.part = torch.empty((splits, n, bm), dtype=torch.float32, device=x.device)
        self.count = torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=x.device)

    def __call__(self, residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        m = self.x.shape[0]
        if out is None:
            out = torch.empty((m, self.n), dtype=self.x.dtype, device=self.x.device)
        res = residual if residual is not None else out
        c = self.cfg
        grid = (triton.cdiv(self.n, c["BLOCK_N"]), c["SPLITS"])
        _tma_gemm_kernel[grid](
            self.w_desc, self.x_desc, res, out, self.part, self.count, m, self.n, res.stride(0),
            out.stride(0), K=self.k, SPLITS=c["SPLITS"], BLOCK_N=c["BLOCK_N"], BLOCK_M=c["BLOCK_M"],
            BLOCK_K=c["BLOCK_K"], NUM_STAGES=c["NUM_STAGES"], HAS_RES=residual is not None,
            num_warps=c["num_warps"],
        )
        return out


def configs(n: int, k: int, m: int):
    """Tiles whose grid is one to four programs per SM of an H200 and whose K split is whole."""
    for bn, bk, splits, stages in itertools.product((64, 128), (64, 128), (1, 2, 4, 8, 16), (3, 5)):
        if k % (splits * bk) or not 128 <= (n // bn) * splits <= 528:
            continue
        yield dict(BLOCK_N=bn, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_K=bk, SPLITS=splits,
                   NUM_STAGES=stages, num_warps=4)


def reference(x, w, res):
    return x.float() @ w.float().t() + (res.float() if res is not None else 0)


def check_cpu() -> int:
    """Numerics under the interpreter on small shapes, every split and with/without a residual."""
    torch.manual_seed(0)
    worst = 0.0
    cases = ((5, 128, 256, 1, False), (16, 128, 512, 4, True), (3, 256, 256, 2, True))
    for m, n, k, splits, with_res in cases:
        x = torch.randn(m, k)
        w = torch.randn(n, k) * k**-0.5
        res = torch.randn(m, n) if with_res else None
        cfg = dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=64, SPLITS=splits, NUM_STAGES=2, num_warps=4)
        lin = TmaLinear(x, w, cfg)
        for _ in range(2):  # the counters reset themselves
            got = lin(res)
            err = (got - reference(x, w, res)).abs().max().item()
            worst = max(worst, err)
        print(f"M={m} N={n} K={k} splits={splits} residual={with_res}: max error {err:.2e}")
    ok = worst < 1e-3
    print("check:", "ok" if ok else "WRONG")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true", help="CPU numerics under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.check:
        return check_cpu()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    # Host-side descriptors need no device allocator; set one anyway for Triton versions that ask.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    bw = copy_bandwidth(dev)
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)",
          flush=True)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k, res_kind) in SHAPES.items():
            weights, x, residual = make_case(name, m, dev, dtype)
            nbytes = n * k * 2
            t_cublas = graph_time(cublas_body(name, weights, x, residual)) / LAYERS
            best = None
            for cfg in configs(n, k, m):
                try:
                    lins = [TmaLinear(x, w, cfg) for w in weights]
                    fresh = torch.randn_like(residual) if residual is not None else None
                    err = (lins[0](fresh).float() - reference(x, weights[0], fresh)).abs().max().item()
                    if err > 0.05:
                        print(f"  {name} M={m} {cfg}: max error {err:.3g}: WRONG", flush=True)
                        continue

                    def body(lins=lins, residual=residual, res_kind=res_kind):
                        for lin in lins:
                            if res_kind == "inplace":
                                lin(residual, out=residual)
                            else:
                                lin(residual)
                    t = graph_time(body) / LAYERS
                except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
                    print(f"  {name} {cfg}: skipped ({type(exc).__name__}: {str(exc)[:60]})", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best is None:
                print(f"{name:>10} M={m}: cuBLAS {t_cublas * 1e6:.2f} us; no TMA tile ran", flush=True)
                continue
            t, cfg = best
            print(f"{name:>10} M={m}: cuBLAS {t_cublas * 1e6:6.2f} us ({nbytes / t_cublas / bw:4.0%} of "
                  f"copy) | TMA best {t * 1e6:6.2f} us ({nbytes / t / bw:4.0%}) {t_cublas / t:5.2f}x | {cfg}",
                  flush=True)
            rows.append(dict(case=name, m=m, n=n, k=k, cublas_us=t_cublas * 1e6, tma_us=t * 1e6, tile=cfg))
            del weights
            torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

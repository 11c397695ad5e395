"""The one-kernel down projection (`runner.layers.down_gemm`) against the launches it replaces, in CUDA
graphs, on W1's shapes.

    silu=True:   silu_mul(gate_up) -> x.addmm_(act, W.T)   vs  down_residual_(x, gate_up, W, silu=True)
    silu=False:  x.addmm_(act, W.T)                        vs  down_residual_(x, act, W, silu=False)

The first is the decoder layer's MLP tail at M = 64 (gate/up from cuBLAS), the second at M <= 32 (the
activation from `norm_gate_up_silu`). cuBLAS runs the addmm as a split-K GEMM, a reduce and a copy.

One command, GPU (a few minutes with `--sweep`, kernel builds included):

    python benchmarks/down_gemm.py [--rows 64,32,16,1] [--sweep] [--sweep-seconds 150] [--json out.json]

Each case captures 28 calls on 28 different down weights (3072 -> 1024, bf16, as a decode step meets
them, so no weight stays in L2) in one CUDA graph and reports the median replay over 12: microseconds
per call, the speedup, and the max abs difference of the outputs on one layer with the share of
elements that agree bitwise. `--sweep` times a grid of tiles per (M, silu) and prints the best.

Check mode, CPU or GPU (small shapes; without a GPU under TRITON_INTERPRET=1), exit status 1 on a mismatch:

    python benchmarks/down_gemm.py --check
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys
import time

if "--check" in sys.argv and not os.path.exists("/dev/nvidia0"):  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
from skinny_gemm import graph_time  # noqa: E402

from runner.layers.down_gemm import DownConfig, default_down_config, down_residual_, new_counters  # noqa: E402
from runner.layers.fused_linear import silu_mul_triton  # noqa: E402

LAYERS = 28
W1 = dict(hidden=1024, inter=3072)
SMALL = dict(hidden=80, inter=200)  # --check: N and K off the tiles (masked edges)


def make_case(m: int, shape: dict, layers: int, dev, silu: bool, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, k = shape["hidden"], shape["inter"]

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=dev, dtype=torch.bfloat16)

    return dict(m=m, silu=silu, weights=[rnd(n, k, scale=k**-0.5) for _ in range(layers)],
                act=rnd(m, 2 * k if silu else k), x=rnd(m, n), counters=new_counters(n, m, dev))


def unfused(case: dict, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    act = silu_mul_triton(case["act"]) if case["silu"] else case["act"]
    return x.addmm_(act, w.t())


def fused(case: dict, w: torch.Tensor, x: torch.Tensor, cfg: DownConfig | None) -> torch.Tensor:
    return down_residual_(x, case["act"], w, case["counters"], silu=case["silu"], config=cfg)


def compare(case: dict, cfg: DownConfig | None) -> dict:
    w = case["weights"][0]
    ref = unfused(case, w, case["x"].clone())
    got = fused(case, w, case["x"].clone(), cfg)
    again = fused(case, w, case["x"].clone(), cfg)  # counters reset: the second call agrees
    return dict(max_abs=(got.float() - ref.float()).abs().max().item(),
                bitwise=(got == ref).float().mean().item(), repeatable=bool(torch.equal(got, again)))


def per_call(case: dict, fn) -> float:
    x = case["x"].clone()

    def body():
        for w in case["weights"]:
            fn(w, x)

    return graph_time(body, replays=12) / len(case["weights"])


def sweep_configs(m: int):
    m_pad = max(16, 1 << (m - 1).bit_length())
    for bm, bn, bk, splits, warps, swap in itertools.product(
            (16, 32, 64), (32, 64, 128), (128, 256), (2, 4, 6, 8, 12, 16), (4,), (False, True)):
        if bm > m_pad or (swap and bn < 64) or (not swap and bm < 64 and m_pad >= 64):
            continue
        if W1["inter"] % (splits * bk):
            continue
        yield DownConfig(block_m=bm, block_n=bn, block_k=bk, splits=splits, num_warps=warps, swap_ab=swap)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,32,16,1")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=150.0, help="stop sweeping a case after this long")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    if args.check:
        bad = 0
        for m, silu in itertools.product((1, 5, 16, 33), (True, False)):
            case = make_case(m, SMALL, 1, dev, silu)
            for cfg in (DownConfig(block_m=16, block_n=32, block_k=32, splits=4),
                        DownConfig(block_m=16, block_n=64, block_k=64, splits=2, swap_ab=True)):
                d = compare(case, cfg)
                ok = d["max_abs"] <= 0.0625 and d["repeatable"]
                bad += not ok
                print(f"M={m:3d} silu={silu!s:5} {cfg}: max |diff| {d['max_abs']:.4f}, "
                      f"bitwise {d['bitwise']:.3f}, repeatable {d['repeatable']} "
                      f"{'ok' if ok else 'MISMATCH'}")
        return 1 if bad else 0

    if dev.type != "cuda":
        print("needs a CUDA device (or --check)")
        return 1
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        for silu in (True, False):
            case = make_case(m, W1, LAYERS, dev, silu)
            base = per_call(case, lambda w, x, c=case: unfused(c, w, x))
            cfg = default_down_config(m)
            t = per_call(case, lambda w, x, c=case, cfg=cfg: fused(c, w, x, cfg))
            d = compare(case, cfg)
            row = dict(m=m, silu=silu, unfused_us=base * 1e6, fused_us=t * 1e6,
                       config=dataclasses.asdict(cfg), **d)
            print(f"M={m:3d} silu={silu!s:5} unfused {base * 1e6:6.2f} us  fused {t * 1e6:6.2f} us  "
                  f"x{base / t:4.2f}  max |diff| {d['max_abs']:.4f} bitwise {d['bitwise']:.3f} "
                  f"repeatable {d['repeatable']}  ({cfg})", flush=True)
            if args.sweep and (silu or m <= 32):  # the engine uses silu=False only up to 32 rows
                t_start = time.perf_counter()
                timed = []
                for c in sweep_configs(m):
                    if time.perf_counter() - t_start > args.sweep_seconds:
                        print("  (sweep time is up)")
                        break
                    try:
                        timed.append((per_call(case, lambda w, x, c=c, case=case: fused(case, w, x, c)), c))
                    except Exception as e:  # noqa: BLE001 - a tile that does not build or fit is skipped
                        print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
                timed.sort(key=lambda p: p[0])
                for tt, c in timed[:5]:
                    print(f"  sweep {tt * 1e6:6.2f} us  x{base / tt:4.2f}  {c}", flush=True)
                row["sweep_best"] = [dict(us=tt * 1e6, **dataclasses.asdict(c)) for tt, c in timed[:5]]
            results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

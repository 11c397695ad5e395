"""The decoder layer's tail at decode batch sizes with PDL (`runner.layers.pdl`) against cuBLAS, in graphs.

What runs per layer, 28 layers on 28 different weights (W1's Qwen3-0.6B shapes, bf16), in one graph:

    decode attention (64 x ~580 keys)  ->  o_proj + residual  ->  RMSNorm -> gate/up -> SiLU*mul
        ->  down_proj + residual

three ways:
    cublas      o_proj and down as the engine runs them without PDL: addmm / addmm_ (cuBLAS)
    wf-plain    both through `residual_gemm(pdl=True)` (weights-first split-K), launched normally
    wf-pdl      the same kernels launched with PDL, attention and SiLU*mul releasing them early

`wf-plain` against `cublas` is the kernels' own cost; `wf-pdl` against `wf-plain` is what PDL's overlap
buys (the weight tiles are read while the kernel ahead ends). The attention runs with `--batch` requests
whatever `--rows` is (it only has to be a long kernel ahead of o_proj, as in the engine); rows are the
GEMMs' M. Outputs: microseconds per layer, each side's ratio to cublas, the max abs difference from cublas
and whether wf-pdl equals wf-plain bitwise (it must: same kernels, same order of sums).

One command, GPU (a minute or two; `--sweep` tries the weights-first tiles, several minutes):

    python benchmarks/pdl_chain.py [--rows 1,16,32,64] [--sweep] [--json out.json]

Check mode, CPU or GPU (small shapes; without a GPU under TRITON_INTERPRET=1, where PDL cannot launch),
exit status 1 on a mismatch:

    python benchmarks/pdl_chain.py --check
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import random
import sys
import time

if "--check" in sys.argv and not os.path.exists("/dev/nvidia0"):  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runner.layers import pdl  # noqa: E402
from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402
from runner.layers.down_gemm import DownConfig, default_pdl_config, new_counters, residual_gemm  # noqa: E402
from runner.layers.fused_linear import silu_mul_triton  # noqa: E402
from runner.layers.fused_ops import rms_norm  # noqa: E402

LAYERS = 28
W1 = dict(hidden=1024, q_heads=16, kv_heads=8, head_dim=128, inter=3072, block=16)
SMALL = dict(hidden=64, q_heads=4, kv_heads=2, head_dim=32, inter=96, block=16)  # --check


def make_case(rows: int, batch: int, shape: dict, layers: int, dev: torch.device, seed: int = 0) -> dict:
    """Weights per layer, one KV cache shared by the layers' attention (`batch` requests of ~580 keys), and
    the inputs: the query (batch rows), the residual and the attention output that o_proj reads (rows)."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter = shape["hidden"], shape["inter"]
    o_width = shape["q_heads"] * shape["head_dim"]

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=dev, dtype=torch.bfloat16)

    r = random.Random(seed)
    keys = [r.randint(560, 600) if shape is W1 else r.randint(20, 40) for _ in range(batch)]
    blocks = [-(-k // shape["block"]) for k in keys]
    table = torch.zeros(batch, max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(at, at + n)
        at += n
    cache = (at, shape["block"], shape["kv_heads"], shape["head_dim"])
    qsl = list(range(batch + 1))
    meta = AttentionMetadata(
        torch.zeros(batch, dtype=torch.int64, device=dev), torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.tensor(keys, dtype=torch.int32, device=dev), table.to(dev), max_query_len=1,
        max_seq_len=max(keys), num_reqs=batch, is_decode_only=True, query_start_loc_cpu=qsl,
        seq_lens_cpu=keys,
    )
    return dict(
        rows=rows, meta=meta, k_cache=rnd(*cache), v_cache=rnd(*cache),
        query=rnd(batch, shape["q_heads"], shape["head_dim"]), x=rnd(rows, hidden),
        o_in=rnd(rows, o_width), norm=[1.0 + rnd(hidden, scale=0.1) for _ in range(layers)],
        o_proj=[rnd(hidden, o_width, scale=o_width**-0.5) for _ in range(layers)],
        gate_up=[rnd(2 * inter, hidden, scale=hidden**-0.5) for _ in range(layers)],
        down=[rnd(hidden, inter, scale=inter**-0.5) for _ in range(layers)],
        counters=[new_counters(hidden, max(rows, 64), dev) for _ in range(2 * layers)],
        scale=shape["head_dim"] ** -0.5,
    )


def layer_tail(case: dict, i: int, x: torch.Tensor, side: str, cfg: DownConfig | None) -> torch.Tensor:
    """One layer's tail (see the module docstring); returns the new residual."""
    from runner.layers.paged_attention_triton import paged_attention_triton

    attn_out = torch.empty_like(case["query"])
    paged_attention_triton(case["query"], case["k_cache"], case["v_cache"], case["meta"], case["scale"],
                           attn_out)
    o = case["o_in"]  # the GEMMs' rows (attention above is the long kernel ahead, as in the engine)
    if side == "cublas":
        x = torch.addmm(x, o, case["o_proj"][i].t())
    else:
        x = residual_gemm(x, o, case["o_proj"][i], case["counters"][2 * i], pdl=True, config=cfg)
    h = rms_norm(x, case["norm"][i], 1e-6)
    act = silu_mul_triton(F.linear(h, case["gate_up"][i]))
    if side == "cublas":
        return x.addmm_(act, case["down"][i].t())
    return residual_gemm(x, act, case["down"][i], case["counters"][2 * i + 1], out=x, pdl=True, config=cfg)


def run_side(case: dict, side: str, cfg: DownConfig | None, layers: int) -> torch.Tensor:
    pdl.LAUNCH_PDL = side == "wf-pdl"
    x = case["x"].clone()
    for i in range(layers):
        x = layer_tail(case, i, x, side, cfg)
    return x


def per_layer_us(case: dict, side: str, cfg: DownConfig | None) -> float:
    from skinny_gemm import graph_time

    layers = len(case["down"])
    pdl.LAUNCH_PDL = side == "wf-pdl"
    return graph_time(lambda: run_side(case, side, cfg, layers), replays=12) / layers * 1e6


def sweep_configs():
    for bm, bn, bk, warps in itertools.product((16, 64), (32, 64, 128), (128, 256, 512), (4, 8)):
        if bn * bk > 64 * 512:  # the weight tile a program holds in registers before its wait
            continue
        yield DownConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=1, swap_ab=bm < 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--batch", type=int, default=64, help="attention requests (the kernel ahead of o_proj)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-seconds", type=float, default=120.0, help="stop sweeping a row count after this")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pdl.ENABLED = True  # the releases in attention and SiLU*mul follow it (and LAUNCH_PDL, per side)

    if args.check:
        bad = 0
        for rows in (1, 5, 33):
            case = make_case(rows, 3, SMALL, 2, dev, seed=rows)
            want = run_side(case, "cublas", None, 2)
            cfg = DownConfig(block_m=16, block_n=32, block_k=32)
            got = run_side(case, "wf-plain", cfg, 2)
            diff = (got.float() - want.float()).abs().max().item()
            ok = diff <= 0.125
            bad += not ok
            print(f"rows={rows:3d} weights-first vs cuBLAS: max |diff| {diff:.4f} "
                  f"{'ok' if ok else 'MISMATCH'}")
        return 1 if bad else 0

    if dev.type != "cuda":
        print("needs a CUDA device (or --check)")
        return 1
    if not pdl.pdl_supported(dev):
        print("PDL needs compute capability 9.0 or later")
        return 1
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        case = make_case(rows, args.batch, W1, LAYERS, dev, seed=rows)
        cfg = default_pdl_config(rows)
        outs = {side: run_side(case, side, cfg, LAYERS) for side in ("cublas", "wf-plain", "wf-pdl")}
        times = {side: per_layer_us(case, side, cfg) for side in ("cublas", "wf-plain", "wf-pdl")}
        diff = (outs["wf-pdl"].float() - outs["cublas"].float()).abs().max().item()
        same = bool(torch.equal(outs["wf-pdl"], outs["wf-plain"]))
        row = dict(rows=rows, us_per_layer=times, max_abs_vs_cublas=diff, pdl_equals_plain=same,
                   config=dataclasses.asdict(cfg))
        print(f"rows={rows:3d}  cublas {times['cublas']:7.2f} us/layer  wf-plain {times['wf-plain']:7.2f} "
              f"(x{times['cublas'] / times['wf-plain']:.3f})  wf-pdl {times['wf-pdl']:7.2f} "
              f"(x{times['cublas'] / times['wf-pdl']:.3f})  max |diff| {diff:.4f}  pdl == plain: {same}  "
              f"({cfg})", flush=True)
        if args.sweep:
            started, timed = time.perf_counter(), []
            for c in sweep_configs():
                if c.block_m > max(16, rows) and c.block_m != 64:
                    continue
                if time.perf_counter() - started > args.sweep_seconds:
                    print("  (sweep time is up)")
                    break
                try:
                    timed.append((per_layer_us(case, "wf-pdl", c), c))
                except Exception as e:  # noqa: BLE001 - a tile that does not build or fit is skipped
                    print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
            timed.sort(key=lambda p: p[0])
            for us, c in timed[:5]:
                print(f"  sweep wf-pdl {us:7.2f} us/layer  x{times['cublas'] / us:.3f}  {c}", flush=True)
            row["sweep_best"] = [dict(us=us, **dataclasses.asdict(c)) for us, c in timed[:5]]
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A decode window's greedy argmax over W1's logits, alone: the kernel against torch.argmax and the copy rate.

Why: `runner.layers.greedy_argmax` reads each step's (rows, 151,936) bf16 logits once. The s13a profile
had it at 17 us a step at 64 rows, about 1.1 TB/s: its chunks were not whole blocks, so every load was
masked and unaligned and each lane read two bytes at a time. Chunks are now whole 1,024-column blocks
loaded unmasked (16-byte vector loads). This measures the kernel against `torch.argmax` on the same
logits and against the bytes at the machine's copy rate (its floor), in one run.

Each case replays a CUDA graph of `--layers` calls over as many different logits buffers (more bytes
than L2 holds, so every call reads DRAM as the engine's does), median of replays, us per call.

    python benchmarks/greedy_argmax.py [--rows 1,8,64,256] [--sweep] [--json out.json]

`--sweep` also times other launch settings of the kernel (programs per row, columns per iteration, warps;
the module's constants set for the run), each checked against torch.argmax first.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from skinny_gemm import copy_bandwidth, graph_time  # noqa: E402

import runner.layers.greedy_argmax as ga  # noqa: E402
from runner.layers.greedy_argmax import greedy_argmax  # noqa: E402

VOCAB = 151936  # Qwen3's
# (CHUNKS, BLOCK, NUM_WARPS) settings --sweep tries besides the module's own
SWEEP = [(32, 1024, 4), (64, 2048, 4), (64, 4096, 4), (64, 4096, 8), (128, 1024, 4), (128, 2048, 4),
         (128, 2048, 8), (256, 1024, 4), (16, 1024, 4), (16, 2048, 8), (8, 1024, 4), (8, 2048, 8),
         (32, 2048, 8), (32, 512, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--buffers", type=int, default=8, help="distinct logits buffers cycled in the graph")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth(dev)
    print(f"copy rate {copy / 1e12:.2f} TB/s; vocabulary {VOCAB}, bf16")
    print(f"{'rows':>5} {'MB':>7} {'kernel us':>10} {'torch us':>9} {'floor us':>9} {'vs torch':>9} "
          f"{'% of copy':>10}")
    results = {"copy_tb_s": copy / 1e12, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        logits = [torch.randn(rows, VOCAB, device=dev, dtype=torch.bfloat16) for _ in range(args.buffers)]
        outs = torch.empty(args.buffers, rows, dtype=torch.int64, device=dev)
        for i, x in enumerate(logits):
            assert torch.equal(greedy_argmax(x, outs[i]), torch.argmax(x, dim=-1)), rows

        def kernel(logits=logits, outs=outs):
            for i, x in enumerate(logits):
                greedy_argmax(x, outs[i])

        def peer(logits=logits, outs=outs):
            for i, x in enumerate(logits):
                torch.argmax(x, dim=-1, out=outs[i])

        nbytes = rows * VOCAB * 2
        ours = graph_time(kernel) / args.buffers
        theirs = graph_time(peer) / args.buffers
        floor = nbytes / copy  # copy_bandwidth counts bytes read + written per second: DRAM traffic
        print(f"{rows:>5} {nbytes / 1e6:>7.1f} {ours * 1e6:>10.2f} {theirs * 1e6:>9.2f} {floor * 1e6:>9.2f} "
              f"{theirs / ours:>8.2f}x {100 * floor / ours:>9.0f}%")
        results["rows"][str(rows)] = {"kernel_us": ours * 1e6, "torch_us": theirs * 1e6,
                                      "floor_us": floor * 1e6}
    if args.sweep:
        results["sweep"] = sweep([int(r) for r in args.rows.split(",")], args.buffers)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


def sweep(row_counts: list[int], buffers: int) -> dict:
    """us per call of each (CHUNKS, BLOCK, NUM_WARPS) setting at each row count."""
    dev = torch.device("cuda")
    own = (ga.CHUNKS, ga.BLOCK, ga.NUM_WARPS)
    print("\nsweep: us per call (CHUNKS / BLOCK / warps); * = the module's setting")
    print(f"{'setting':>16} " + " ".join(f"{r:>8}" for r in row_counts))
    out = {}
    cases = {r: [torch.randn(r, VOCAB, device=dev, dtype=torch.bfloat16) for _ in range(buffers)]
             for r in row_counts}
    try:
        for setting in [own] + [s for s in SWEEP if s != own]:
            ga.CHUNKS, ga.BLOCK, ga.NUM_WARPS = setting
            times = []
            for r in row_counts:
                outs = torch.empty(buffers, r, dtype=torch.int64, device=dev)
                for i, x in enumerate(cases[r]):
                    assert torch.equal(greedy_argmax(x, outs[i]), torch.argmax(x, dim=-1)), setting

                def body(xs=cases[r], outs=outs):
                    for i, x in enumerate(xs):
                        greedy_argmax(x, outs[i])

                times.append(graph_time(body) / buffers * 1e6)
            mark = "*" if setting == own else " "
            print(f"{mark}{'/'.join(map(str, setting)):>15} " + " ".join(f"{t:>8.2f}" for t in times))
            out["/".join(map(str, setting))] = dict(zip(map(str, row_counts), times))
    finally:
        ga.CHUNKS, ga.BLOCK, ga.NUM_WARPS = own
    return out


if __name__ == "__main__":
    main()

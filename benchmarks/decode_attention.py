"""Decode attention's launch parameters side by side on the shapes that matter (GPU).

Why: W1's decode attention (64 requests x ~600 keys, 8 KV heads of 128) ran at ~76% of the copy rate
while 256 requests of mixed lengths ran at ~94-98% (`kv_layout.py`). Compiled for Hopper, the kernel's
pipelined loop waited for every outstanding copy at the top of each tile (`async_wait num = 0`): the
next tile's K/V addresses came from a block-table load in the same iteration, so no tile was in flight
while one was computed. With the block ids loaded a tile ahead (`DecodeConfig.bt_ahead`) and 3+ stages,
Triton keeps several tiles in flight. This measures the 128-key base, the engine's choice and those
variants on W1's bucket, the same with other lengths and batch sizes, W2-like mixed lengths, and few
long requests (where the kernel splits the key range).

Every kernel runs as a CUDA-graph replay (`do_bench_cudagraph`, the way the engine runs decode steps),
block tables as the engine fills them (a request's pages in allocation order from a fresh pool), Qwen3
0.6B's attention shape in bf16. Reported: us per call, % of the copy rate for the K/V bytes read, the
ratio to the base, the max difference from the base's output, and each compiled kernel's registers,
spills and shared memory.

    python benchmarks/decode_attention.py [--quick] [--json out.json]

A stream variant (one flat stream of key tiles over a fixed grid, parts merged by last arrival) was
measured here first and lost 1.5-4x everywhere (`benchmarks/RESULTS.md`); it is not kept.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from attention import measure_copy_bandwidth  # noqa: E402

import runner.layers.paged_attention_triton as pat  # noqa: E402
from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 8, 16, 128, 16
POOL_BLOCKS = 66940  # the W1 engine's pool

COMPILED: dict[str, object] = {}


def _record_decode_builds() -> None:
    """Keep the compiled decode kernel each launch returns (registers, spills, shared memory)."""
    original = pat.launch

    def launch(kernel, grid):
        call = original(kernel, grid)

        def run(*args, **kwargs):
            compiled = call(*args, **kwargs)
            if kernel is pat._decode_kernel:
                COMPILED["decode"] = compiled
            return compiled

        return run

    pat.launch = launch


def decode_metadata(specs: list[int], first_block: int) -> AttentionMetadata:
    """One decode row per request with `specs[i]` keys (this step's included); each request's pages in
    allocation order, the first request's from `first_block`."""
    nblocks = [-(-s // BLOCK) for s in specs]
    table = torch.zeros(len(specs), max(nblocks), dtype=torch.int32)
    start = first_block
    for i, n in enumerate(nblocks):
        table[i, :n] = torch.arange(start, start + n)
        start += n
    qsl = list(range(len(specs) + 1))
    return AttentionMetadata(
        torch.zeros(len(specs), dtype=torch.int64, device="cuda"),
        torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        torch.tensor(specs, dtype=torch.int32, device="cuda"),
        table.cuda(), max_query_len=1, max_seq_len=max(specs), num_reqs=len(specs), is_decode_only=True,
        query_start_loc_cpu=qsl, seq_lens_cpu=list(specs),
    )  # fmt: skip


def metadata(specs: list[int], seed: int) -> AttentionMetadata:
    """`decode_metadata` from a first block drawn with `seed` somewhere in the engine-sized pool."""
    need = sum(-(-s // BLOCK) for s in specs)
    return decode_metadata(specs, random.Random(seed).randrange(0, POOL_BLOCKS - need))


def workloads(quick: bool) -> dict[str, list[int]]:
    r = random.Random(1)
    work = {
        "W1 64 x U[560,600]": [r.randint(560, 600) for _ in range(64)],
        "64 x U[280,300]": [r.randint(280, 300) for _ in range(64)],
        "64 x U[1120,1200]": [r.randint(1120, 1200) for _ in range(64)],
        "32 x U[560,600]": [r.randint(560, 600) for _ in range(32)],
        "128 x U[560,600]": [r.randint(560, 600) for _ in range(128)],
        "256 x U[100,2048]": [r.randint(100, 2048) for _ in range(256)],
        "8 x U[1500,2500]": [r.randint(1500, 2500) for _ in range(8)],
        "1 x 4096": [4096],
    }
    if quick:
        work = {k: work[k] for k in ("W1 64 x U[560,600]", "256 x U[100,2048]")}
    return work


def variants(quick: bool) -> list[tuple[str, pat.DecodeConfig]]:
    """The kernel's launch parameters to compare: the 128-key base (the ratios' reference), the engine's
    choice for the shape (None: `_default_decode_config`), then block ids a tile ahead (which lets
    Triton's pipeliner keep several tiles in flight) at several tiles, warps, stages and occupancies."""
    cfg = pat.DecodeConfig
    out = [("base t128/w4/s2", cfg()), ("engine default", None), ("t32/w4/s4", cfg(32, 4, 4))]
    ahead = [(128, 4, 3, 1), (64, 4, 3, 2), (64, 4, 4, 2), (32, 4, 4, 4)]
    if not quick:
        ahead += [(128, 8, 3, 1), (64, 8, 4, 2), (32, 4, 6, 2), (64, 4, 3, 3)]
    for tile_n, warps, stages, per_sm in ahead:
        out.append((f"ahead t{tile_n}/w{warps}/s{stages}/p{per_sm}",
                    cfg(tile_n, warps, stages, programs_per_sm=per_sm, bt_ahead=True)))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, seven configurations")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    from triton.testing import do_bench_cudagraph

    _record_decode_builds()
    copy_bw = measure_copy_bandwidth()
    print(f"copy rate {copy_bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    shape = (POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    scale = HEAD_DIM**-0.5
    rows = []
    for w_index, (name, specs) in enumerate(workloads(args.quick).items()):
        meta = metadata(specs, seed=w_index)
        q = torch.randn(len(specs), Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        kv_bytes = sum(specs) * 2 * KV_HEADS * HEAD_DIM * 2
        reference = None
        best = None
        for label, cfg in variants(args.quick):
            out = torch.full_like(q, float("nan"))

            def fn(cfg=cfg, out=out, meta=meta, q=q):
                pat.paged_attention_triton(q, kc, vc, meta, scale, out, decode_config=cfg)

            try:
                fn()
                torch.cuda.synchronize()
                us = do_bench_cudagraph(fn, rep=200) * 1e3
            except Exception as exc:  # noqa: BLE001 - a config that does not build is reported and skipped
                print(f"  {name:22s} {label:24s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            if reference is None:
                reference = out.float().clone()
            err = (out.float() - reference).abs().max().item()
            k = COMPILED.get("decode")
            try:
                info = f"regs {k.n_regs:3d} spills {k.n_spills:3d} smem {k.metadata.shared // 1024:3d} KB"
            except (AttributeError, TypeError):  # not a CompiledKernel in this Triton
                info = ""
            pct = 100 * kv_bytes / (us * 1e-6) / copy_bw
            row = {"workload": name, "kernel": label, "us": round(us, 2), "pct_of_copy": round(pct, 1),
                   "max_diff": err, "compiled": info}  # fmt: skip
            rows.append(row)
            if label.startswith("base"):
                base = us
            if best is None or us < best[1]:
                best = (label, us)
            print(f"  {name:22s} {label:24s} {us:8.2f} us {pct:5.1f}% of copy  x{base / us:5.3f} vs "
                  f"base  diff {err:.4f}  {info}", flush=True)
        print(f"  best for {name}: {best[0]} ({best[1]:.2f} us)\n", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"copy_TBps": copy_bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Paged-attention kernel benchmark (GPU): time, KV-read bandwidth against a measured copy bandwidth, and the
error against torch SDPA on dense (unpaged) K/V.

Shape: Qwen3-0.6B-like attention (16 query heads, 8 KV heads, head_dim 128, bf16, block size 16), block
tables shuffled so pages are scattered as they are after a while of serving.

Workloads:
- decode 64 x ~600: 64 sequences with context uniform in [576, 624], one query row each;
- decode 256 x U[100, 2048];
- mixed: one 512-row prefill chunk over a 1024-token prefix plus 255 decodes U[100, 2048] (a steady-state
  chunked-prefill step of W2);
- prefill 64 x 512 from scratch.

Decode runs eager and as a replayed CUDA graph (how the runner executes it). Every timing flushes the L2
cache first (triton.testing.do_bench), so KV reads come from HBM.

    python3 benchmarks/attention.py            # the report
    python3 benchmarks/attention.py --sweep    # also sweep decode / prefill launch configs
    python3 benchmarks/attention.py --json out.json
    python3 benchmarks/attention.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402
from runner.layers.paged_attention import paged_attention, write_kv  # noqa: E402
from runner.layers.paged_attention_triton import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    choose_num_splits,
    paged_attention_triton,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
# Workload sizes (scaled down by --smoke).
SIZES = {"decode_small": (64, 576, 624), "decode_big": (256, 100, 2048), "mixed": (1024, 512, 255),
         "prefill": (64, 512), "write_kv": (64, 32768), "copy_bytes": 1 << 30}  # fmt: skip


def bench_ms(fn) -> float:
    """Mean ms per call with the L2 cache flushed before each (triton's do_bench); a plain timer on CPU."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=100)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@dataclass
class Workload:
    name: str
    specs: list[tuple[int, int]]  # (cached context, query rows) per request
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list[torch.Tensor]  # per request (seq_len, kv_heads, head_dim), contiguous
    dense_v: list[torch.Tensor]

    @property
    def kv_bytes(self) -> int:
        """K+V bytes the kernels must read once: every request's whole context, per KV head."""
        per_token = 2 * NUM_KV_HEADS * HEAD_DIM * self.key_cache.element_size()
        return sum(ctx + q for ctx, q in self.specs) * per_token

    @property
    def causal_flops(self) -> float:
        """Useful matmul FLOPs (QK^T and PV) under the causal mask."""
        flops = 0.0
        for ctx, q in self.specs:
            visible_pairs = q * ctx + q * (q + 1) / 2
            flops += 4 * NUM_Q_HEADS * HEAD_DIM * visible_pairs
        return flops


def build_workload(name: str, specs: list[tuple[int, int]], seed: int = 0) -> Workload:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in specs]
    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 8
    kc = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    vc = torch.empty_like(kc)
    kc.normal_(generator=gen)
    vc.normal_(generator=gen)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(blocks_needed):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    qsl = [0]
    for _, q in specs:
        qsl.append(qsl[-1] + q)
    # slot mapping of this step's tokens (positions ctx .. ctx+q-1)
    slots = []
    bt_cpu = block_tables.cpu()
    for b, (ctx, q) in enumerate(specs):
        pos = torch.arange(ctx, ctx + q)
        slots.append(bt_cpu[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    slot_mapping = torch.cat(slots).to(DEVICE)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
        num_reqs=len(specs),
        is_decode_only=all(q == 1 for _, q in specs),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    query = torch.randn(qsl[-1], NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE, generator=gen)
    dense_k, dense_v = [], []
    for b, s in enumerate(seq_lens):
        blocks = block_tables[b, : blocks_needed[b]].long()
        dense_k.append(kc[blocks].flatten(0, 1)[:s].contiguous())
        dense_v.append(vc[blocks].flatten(0, 1)[:s].contiguous())
    return Workload(name, specs, query, kc, vc, meta, dense_k, dense_v)


def sdpa_reference(w: Workload, scale: float) -> torch.Tensor:
    """torch SDPA per request on contiguous K/V (GQA expanded), causal with the context offset."""
    out = torch.empty_like(w.query)
    qsl = w.meta.query_start_loc_cpu
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for b, (ctx, q_len) in enumerate(w.specs):
        q = w.query[qsl[b] : qsl[b + 1]].transpose(0, 1)[None]  # (1, Hq, q, D)
        k = w.dense_k[b].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        v = w.dense_v[b].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        seq = ctx + q_len
        mask = None
        if q_len > 1:
            q_pos = torch.arange(ctx, seq, device=DEVICE)
            mask = torch.arange(seq, device=DEVICE)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[qsl[b] : qsl[b + 1]] = o[0].transpose(0, 1)
    return out


def measure_copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), 1 GiB buffers."""
    n = SIZES["copy_bytes"] // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n * 2 / (ms * 1e-3)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def run_one(w: Workload, scale: float, copy_bw: float, *, decode=None, prefill=None, use_graph=None) -> dict:
    out = torch.empty_like(w.query)

    def step():
        paged_attention_triton(
            w.query,
            w.key_cache,
            w.value_cache,
            w.meta,
            scale,
            out,
            decode_config=decode,
            prefill_config=prefill,
        )

    step()
    _sync()
    eager_ms = bench_ms(step)
    row = {"workload": w.name, "eager_us": round(eager_ms * 1e3, 1)}
    best_ms = eager_ms
    if DEVICE == "cuda" and (use_graph if use_graph is not None else w.meta.is_decode_only):
        graph = graph_of(step)
        graph_ms = bench_ms(graph.replay)
        row["graph_us"] = round(graph_ms * 1e3, 1)
        best_ms = min(best_ms, graph_ms)
    bw = w.kv_bytes / (best_ms * 1e-3)
    row["kv_MB"] = round(w.kv_bytes / 1e6, 1)
    row["kv_read_GBps"] = round(bw / 1e9, 1)
    row["pct_of_copy_bw"] = round(100 * bw / copy_bw, 1)
    row["TFLOPs"] = round(w.causal_flops / (best_ms * 1e-3) / 1e12, 1)
    return row


def check_error(w: Workload, scale: float) -> dict:
    got = paged_attention(w.query, w.key_cache, w.value_cache, w.meta, scale)
    ref = sdpa_reference(w, scale)
    err = (got.float() - ref.float()).abs().max().item()
    return {"max_abs_err_vs_sdpa": err, "ref_max_abs": ref.float().abs().max().item()}


def dense_sdpa_time(w: Workload, scale: float) -> float | None:
    """For equal-length workloads: torch SDPA on one dense padded batch (no paging), for context."""
    lens = {(ctx, q) for ctx, q in w.specs}
    if len(lens) != 1:
        return None
    (ctx, q_len) = lens.pop()
    n = len(w.specs)
    q = w.query.view(n, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
    k = torch.stack(w.dense_k).transpose(1, 2)
    v = torch.stack(w.dense_v).transpose(1, 2)
    causal = q_len > 1 and ctx == 0
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    fn()
    return round(bench_ms(fn) * 1e3, 1)


def make_workloads() -> list[Workload]:
    rng = random.Random(0)
    n_small, lo_small, hi_small = SIZES["decode_small"]
    n_big, lo_big, hi_big = SIZES["decode_big"]
    prefix, chunk, n_mixed = SIZES["mixed"]
    n_prefill, prefill_len = SIZES["prefill"]
    decode_small = [(rng.randint(lo_small, hi_small) - 1, 1) for _ in range(n_small)]
    decode_big = [(rng.randint(lo_big, hi_big) - 1, 1) for _ in range(n_big)]
    mixed = [(prefix, chunk)] + [(rng.randint(lo_big, hi_big) - 1, 1) for _ in range(n_mixed)]
    prefill = [(0, prefill_len)] * n_prefill
    return [
        build_workload(f"decode {n_small} x U[{lo_small},{hi_small}]", decode_small, seed=1),
        build_workload(f"decode {n_big} x U[{lo_big},{hi_big}]", decode_big, seed=2),
        build_workload(f"mixed 1x{chunk} chunk (+{prefix} prefix) + {n_mixed} decodes", mixed, seed=3),
        build_workload(f"prefill {n_prefill} x {prefill_len}", prefill, seed=4),
    ]


def bench_write_kv(copy_bw: float) -> list[dict]:
    rows = []
    for num_tokens in SIZES["write_kv"]:
        kc = torch.zeros(
            num_tokens // BLOCK_SIZE + 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE
        )
        vc = torch.zeros_like(kc)
        k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
        v = torch.randn_like(k)
        slots = torch.randperm(kc.shape[0] * BLOCK_SIZE, device=DEVICE)[:num_tokens]
        fn = lambda k=k, v=v, kc=kc, vc=vc, slots=slots: write_kv(k, v, kc, vc, slots)
        fn()
        ms = bench_ms(fn)
        moved = 2 * 2 * k.numel() * k.element_size()  # read + write, K and V
        rows.append({
            "write_kv_tokens": num_tokens,
            "us": round(ms * 1e3, 1),
            "pct_of_copy_bw": round(100 * moved / (ms * 1e-3) / copy_bw, 1),
        })  # fmt: skip
    return rows


def sweep(workloads: list[Workload], scale: float, copy_bw: float, which: str = "all") -> dict:
    best = {}
    decode_wls = [w for w in workloads if w.meta.is_decode_only] if which in ("all", "decode") else []
    print("\n# decode sweep (graph replay)")
    for tile_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4), (2, 3), (1, 2, 4)):
        cfg = DecodeConfig(tile_n=tile_n, num_warps=warps, num_stages=stages, num_splits=splits)
        for w in decode_wls:
            try:
                row = run_one(w, scale, copy_bw, decode=cfg, use_graph=True)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"  {w.name} {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            row["us"] = row.get("graph_us", row["eager_us"])
            print(f"  {w.name:28s} tile={tile_n:3d} warps={warps} stages={stages} splits={splits}: "
                  f"{row['us']:8.1f} us  {row['pct_of_copy_bw']:5.1f}% of copy bw")  # fmt: skip
            if w.name not in best or row["us"] < best[w.name][1]["us"]:
                best[w.name] = (asdict(cfg), row)
    print("\n# prefill sweep (eager)")
    for w in workloads:
        # Pure prefill only: the mixed step's time is mostly its decodes.
        if which == "decode" or any(q == 1 for _, q in w.specs):
            continue
        grid = itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4))
        for block_m, tile_n, warps, stages in grid:
            cfg = PrefillConfig(block_m=block_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
            try:
                row = run_one(w, scale, copy_bw, prefill=cfg, use_graph=False)
            except Exception as exc:  # noqa: BLE001
                print(f"  {w.name} {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            print(f"  {w.name:28s} block_m={block_m:3d} tile={tile_n:3d} warps={warps} stages={stages}: "
                  f"{row['eager_us']:8.1f} us  {row['TFLOPs']:6.1f} TFLOP/s")  # fmt: skip
            if w.name not in best or row["eager_us"] < best[w.name][1]["eager_us"]:
                best[w.name] = (asdict(cfg), row)
    print("\n# best configs")
    for name, (cfg, row) in best.items():
        print(f"  {name}: {cfg} -> {row}")
    return {name: {"config": cfg, "result": row} for name, (cfg, row) in best.items()}


def _use_smoke_sizes() -> None:
    global NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE
    NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE, DEVICE = 4, 2, 16, torch.float32, "cpu"
    SIZES.update(decode_small=(3, 20, 40), decode_big=(4, 5, 70), mixed=(20, 17, 3), prefill=(2, 24),
                 write_kv=(5,), copy_bytes=1 << 20)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sweep", nargs="?", const="all", choices=("all", "decode", "prefill"),
        help="also sweep launch configs (decode, prefill or all)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    if args.smoke:
        _use_smoke_sizes()
    elif not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        device_name = f"{props.name}, {props.multi_processor_count} SMs"
    else:
        device_name = "cpu (smoke run, Triton interpreter)"
    print(f"# device: {device_name}; torch {torch.__version__}")
    copy_bw = measure_copy_bandwidth()
    print(f"# device copy bandwidth: {copy_bw / 1e12:.2f} TB/s (read + write)")
    workloads = make_workloads()
    results = {"device": device_name, "copy_TBps": copy_bw / 1e12, "workloads": []}
    print(f"# Qwen3-0.6B-like: {NUM_Q_HEADS} q heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
          f"{str(DTYPE).removeprefix('torch.')}, block {BLOCK_SIZE}")  # fmt: skip
    for w in workloads:
        row = run_one(w, scale, copy_bw)
        row.update(check_error(w, scale))
        dense = dense_sdpa_time(w, scale)
        if dense is not None:
            row["dense_sdpa_us"] = dense
        if w.meta.is_decode_only or w.meta.max_query_len == 1:
            row["num_splits"] = choose_num_splits(
                w.meta.num_reqs, NUM_KV_HEADS, w.query.device, DecodeConfig()
            )
        results["workloads"].append(row)
        print(json.dumps(row))
    for row in bench_write_kv(copy_bw):
        results["workloads"].append(row)
        print(json.dumps(row))
    if args.sweep:
        results["sweep_best"] = sweep(workloads, scale, copy_bw, args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The grouped expert GEMM (runner.layers.moe_grouped) against HF's MoE block, Qwen3-MoE-shaped layer.

One command, GPU (a minute on an H200):

    python benchmarks/moe.py [--out results.json] [--tokens 1 16 64 256 1024 4096]

Layer: Qwen3-30B-A3B's sparse MoE block (hidden 2048, 128 experts, top-8, expert intermediate 768,
normalised top-k), bf16, random weights (std 0.02). For each token count, the median time of one block
forward (router included) for:

- HF eager: transformers' per-expert loop (`experts_implementation="eager"`);
- HF grouped_mm: transformers' default on the GPU (sort + `torch._grouped_mm`);
- Bridge: the same block with `runner.layers.moe_grouped` installed over its experts (router unchanged);
- Bridge / HF grouped_mm replayed from a CUDA graph (token counts up to 512: decode-sized batches,
  where launches dominate; HF eager syncs on the host and cannot be captured),

plus the max |difference| of Bridge's output against HF grouped_mm's, and a bandwidth floor: the bytes
of the experts the batch actually hits (each read once) at the measured copy bandwidth. Report only,
no target yet.

`--quick`: tiny shapes on the CPU with the kernels under TRITON_INTERPRET=1 (set here when there is no
GPU): a smoke test of the script; the timings mean nothing.

Writes JSON to `--out`, else `$OUT/moe_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

if "--quick" in sys.argv or not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parent
for p in (BENCH.parent, BENCH):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from generate import log, measure_copy_bandwidth, write_results  # noqa: E402

from runner.layers import moe_grouped  # noqa: E402

QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QUICK = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def make_block(shape: dict, implementation: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, norm_topk_prob=True, **shape)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(dtype).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def time_call(fn, device: torch.device, iters: int) -> float:
    """Median seconds of `fn()` over `iters` calls (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph (after a warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def experts_hit_bytes(block, x: torch.Tensor) -> int:
    """Bytes of the experts this batch routes to (gate/up and down weights of each, read once)."""
    with torch.no_grad():
        _, _, top_k_index = block.gate(x.reshape(-1, x.shape[-1]))
    hit = int(torch.unique(top_k_index).numel())
    experts = block.experts
    per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    per_expert *= experts.gate_up_proj.element_size()
    return hit * per_expert


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (interpreter): smoke test")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    quick = args.quick or device.type == "cpu"
    shape = QUICK if quick else QWEN3_30B_A3B
    dtype = torch.float32 if quick else torch.bfloat16
    tokens = args.tokens or ([1, 9] if quick else [1, 16, 64, 256, 1024, 4096])
    iters = 2 if quick else args.iters
    if quick:
        moe_grouped.GROUPED_MOE_ON_CPU = True
        torch.set_num_threads(1)

    bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else None
    hf_eager = make_block(shape, "eager", device, dtype)
    hf_grouped = make_block(shape, "grouped_mm" if device.type == "cuda" else "eager", device, dtype)
    bridge = make_block(shape, "eager", device, dtype)
    assert moe_grouped.install_grouped_moe(bridge) == 1
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "shape": shape, "dtype": str(dtype), "copy_bandwidth_Bps": bandwidth, "rows": []}
    log(f"layer {shape}, {dtype}")
    for n in tokens:
        x = torch.randn(1, n, shape["hidden_size"], device=device, dtype=dtype)
        row: dict = {"tokens": n}
        with torch.no_grad():
            want = hf_grouped(x)
            got = bridge(x)
            row["max_abs_diff_vs_hf"] = float((got.float() - want.float()).abs().max())
            for name, block in (("hf_eager", hf_eager), ("hf_grouped_mm", hf_grouped), ("bridge", bridge)):
                if name == "hf_eager" and n > 1024 and not quick:
                    continue  # the host loop at 4096 tokens x 128 experts adds nothing but minutes
                row[f"{name}_us"] = time_call(lambda b=block, x=x: b(x), device, iters) * 1e6
            if device.type == "cuda" and n <= 512:
                for name, block in (("hf_grouped_mm", hf_grouped), ("bridge", bridge)):
                    try:
                        replay = graphed(lambda b=block, x=x: b(x), device)
                        row[f"{name}_graph_us"] = time_call(replay, device, iters) * 1e6
                    except RuntimeError as exc:  # not capturable
                        row[f"{name}_graph_us"] = None
                        row[f"{name}_graph_error"] = str(exc)[:200]
        if bandwidth:
            row["bandwidth_floor_us"] = experts_hit_bytes(hf_grouped, x) / bandwidth * 1e6
        results["rows"].append(row)
        log("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    print()
    cols = ["tokens", "hf_eager_us", "hf_grouped_mm_us", "bridge_us", "hf_grouped_mm_graph_us",
            "bridge_graph_us", "bandwidth_floor_us", "max_abs_diff_vs_hf"]
    print("".join(f"{c:>24}" for c in cols))
    for row in results["rows"]:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{'-':>24}" if v is None else (f"{v:>24.1f}" if c.endswith("_us") else f"{v:>24}"))
        print("".join(cells))
    write_results(results, args.out, "moe_benchmark.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

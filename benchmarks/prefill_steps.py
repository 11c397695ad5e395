"""Prefill and mixed steps from CUDA graphs against eager ones, side by side in one run.

Why: an eager step launches every kernel of every layer from Python (15-25 ms of host time for W1's
28 layers), while a 512-token prefill needs about 1.5 ms of GPU. A server admitting requests as they
arrive runs a chain of such steps; mixed-step graphs (`mixed_graph_max_tokens`, runner/worker/
cuda_graphs.py) replay them instead. This measures what a step costs each way:

- TTFT of k requests of 512 prompt-embeds rows (CPU tensors, as clients send them), one output token,
  for k = 1, 2, 4, 8 (one prefill step of 512k tokens; above the largest bucket it runs eagerly);
- W1 offline (64 requests x 512 rows, 128 greedy tokens), for regressions on the bulk path;
- construction time of each engine (the graphs are captured there).

One command, GPU (a couple of minutes on an H200):

    python benchmarks/prefill_steps.py [--repeats 5] [--out results.json]

Each side runs in its own process (`eager`: `mixed_graph_max_tokens=0` first, then `graphs`: the default),
so neither inherits the other's allocator state; Triton's on-disk cache is shared, so the second
construction does not pay for builds the first one did (construction here is not a cold start).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

SIDES = {"eager": 0, "graphs": None}  # mixed_graph_max_tokens; None: the engine's default
COUNTS = (1, 2, 4, 8)


def child(args) -> int:
    import torch
    from generate import bench_setup, embed_rows, run_bridge, workload
    from transformers import AutoConfig

    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    device, model_dir, dtype = bench_setup(args)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ids, _, output_lens = workload(64, 512, 512, 128, 128, vocab, seed=3)
    embeds = embed_rows(model_dir, ids, dtype)
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, device=device, enable_prompt_embeds=True, max_model_len=1024,
              gpu_memory_utilization=0.85, mixed_graph_max_tokens=args.mixed)
    out = {"construct_s": time.perf_counter() - started, "ttft_ms": {},
           "mixed_graphs": list(llm.runner.mixed_graphs.sizes) if llm.runner.mixed_graphs.graphs else []}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for k in COUNTS:
        prompts = [{"prompt_embeds": e} for e in embeds[:k]]
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize(device) if device.type == "cuda" else None
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        out["ttft_ms"][str(k)] = {"median": 1e3 * statistics.median(times[1:]),
                                  "runs": [1e3 * t for t in times]}
    prompts = [{"prompt_embeds": e} for e in embeds]
    run_bridge(llm, prompts, output_lens, device)  # warm-up
    runs = [run_bridge(llm, prompts, output_lens, device) for _ in range(args.repeats)]
    out["w1_tok_s"] = statistics.median(r["tok_s"] for r in runs)
    out["w1_runs"] = [r["tok_s"] for r in runs]
    out["w1_builds"] = sum(r["kernel_builds"] for r in runs)
    out["tokens"] = runs[-1]["tokens"]
    out["mixed_replays"] = llm.runner.num_mixed_graph_replays
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print("RESULT " + json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from generate import add_side_arguments

    ap.add_argument("--repeats", type=int, default=5)
    add_side_arguments(ap)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from generate import child_result, write_results

    results = {}
    for side, value in SIDES.items():
        cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
        cmd += ["--cpu"] if args.cpu else []
        cmd += ["--model-dir", args.model_dir] if args.model_dir else []
        cmd += ["--mixed", str(value)] if value is not None else []
        results[side] = child_result(cmd, f"the {side} side")
    eager, graphs = results["eager"], results["graphs"]
    print(f"device: {graphs['device']}; mixed-graph buckets {graphs['mixed_graphs']}; construction eager "
          f"{eager['construct_s']:.1f} s, graphs {graphs['construct_s']:.1f} s")
    print("| requests x 512 rows, 1 token | eager ms | graphs ms | eager / graphs |")
    print("|---:|---:|---:|---:|")
    for k in map(str, COUNTS):
        e, g = eager["ttft_ms"][k]["median"], graphs["ttft_ms"][k]["median"]
        print(f"| {k} | {e:.2f} | {g:.2f} | {e / g:.2f}x |")
    same = sum(a == b for a, b in zip(eager["tokens"], graphs["tokens"]))
    print(f"W1 offline tok/s: eager {eager['w1_tok_s']:,.0f}, graphs {graphs['w1_tok_s']:,.0f} "
          f"({graphs['w1_tok_s'] / eager['w1_tok_s']:.3f}x; {graphs['mixed_replays']} mixed replays); "
          f"requests with equal greedy tokens {same}/{len(eager['tokens'])}; "
          f"kernel builds in timed runs {eager['w1_builds']}/{graphs['w1_builds']}")
    for side in results.values():
        side.pop("tokens", None)
    write_results(results, args.out, "prefill_steps.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

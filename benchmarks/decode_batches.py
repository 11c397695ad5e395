"""Decode speed by batch size with a kernel switch off and on (default: the norm-GEMM kernels), side by side.

Why: `runner.layers.norm_gemm` folds each RMSNorm into the projection after it for steps of at most
`NORM_GEMM_MAX_ROWS` tokens (q/k/v) and `NORM_GATE_UP_MAX_ROWS` (gate/up). Its win is largest at small
batches (a low-concurrency server, one user), which W1 (64 requests) does not show, so this measures
the whole engine at several batch sizes: W1's model, prompts of 512 token ids, 128 greedy tokens.

One command, GPU (about a minute on an H200):

    python benchmarks/decode_batches.py [--batches 1,8,32,64] [--repeats 3] [--out results.json]

Each side runs in its own process (the switch is an environment variable read at import; `--switch
NAME=OFF` names it and its off value, `BRIDGE_NORM_GEMM_MAX_ROWS=0` by default, `BRIDGE_DOWN_GEMM=0` for
the down-projection kernel; `BRIDGE_PDL=0` for programmatic dependent launch; `NAME=OFF:ON` also sets the
on side's value, `BRIDGE_QKV_SPLITS=1:4` for the split-K q/k/v kernel): one warm-up call per batch size,
then the median of `--repeats` timed calls. Reported per batch size: output tok/s and ms per decode step
for both sides, their ratio, and how far the greedy tokens agree (`generate.token_match`: the share of
output positions whose tokens are equal, 1.000 when all are; a different reduction order legitimately
flips near-ties of the random-weight model, after which a request's tokens part ways).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))



def child(args) -> int:
    import torch
    from generate import bench_setup, run_bridge, workload
    from transformers import AutoConfig

    from runner.llm import LLM

    device, model_dir, dtype = bench_setup(args)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ids, _, output_lens = workload(max(batches), 512, 512, 128, 128, vocab, seed=3)
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=max(batches), max_model_len=1024,
              gpu_memory_utilization=0.85)
    out = {"construct_s": time.perf_counter() - started, "batches": {}}
    for b in batches:
        prompts = [{"prompt_token_ids": i} for i in ids[:b]]
        run_bridge(llm, prompts, output_lens[:b], device)  # warm-up
        runs = [run_bridge(llm, prompts, output_lens[:b], device) for _ in range(args.repeats)]
        tok_s = statistics.median(r["tok_s"] for r in runs)
        out["batches"][str(b)] = {"tok_s": tok_s, "ms_per_step": 1e3 * b / tok_s,
                                  "runs": [r["tok_s"] for r in runs],
                                  "builds": sum(r["kernel_builds"] for r in runs),
                                  "tokens": runs[-1]["tokens"]}
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print("RESULT " + json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (a smoke run; no kernels)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--switch", default="BRIDGE_NORM_GEMM_MAX_ROWS=0",
                    help="NAME=OFF_VALUE[:ON_VALUE] (default: %(default)s; without ON_VALUE the on side "
                         "leaves NAME unset, the engine's default)")
    ap.add_argument("--on-first", action="store_true", help="run the on side first (order effects)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from generate import child_result, write_results

    name, _, values = args.switch.partition("=")
    off_value, _, on_value = values.partition(":")
    if not name or not off_value:
        ap.error(f"--switch takes NAME=OFF_VALUE[:ON_VALUE], got {args.switch!r}")
    results = {}
    sides = {"off": off_value, "on": on_value or None}  # None: the engine's default (on)
    for side in (["on", "off"] if args.on_first else ["off", "on"]):
        value = sides[side]
        env = dict(os.environ)
        env.pop(name, None)
        if value is not None:
            env[name] = value
        cmd = [sys.executable, __file__, "--child", "--batches", args.batches, "--repeats", str(args.repeats)]
        cmd += ["--cpu"] if args.cpu else []
        cmd += ["--model-dir", args.model_dir] if args.model_dir else []
        results[side] = child_result(cmd, f"the {side} side", env)
    print(f"switch {name}; device: {results['on']['device']}; construction off "
          f"{results['off']['construct_s']:.1f} s, on {results['on']['construct_s']:.1f} s")
    from generate import token_match

    print("| batch | off tok/s | on tok/s | off ms/step | on ms/step | on / off | token match | builds |")
    print("|---:|---:|---:|---:|---:|---:|---|---|")
    table = {}
    for b in args.batches.split(","):
        off, on = results["off"]["batches"][b], results["on"]["batches"][b]
        match = token_match(off["tokens"], on["tokens"])
        table[b] = {"off": {k: v for k, v in off.items() if k != "tokens"},
                    "on": {k: v for k, v in on.items() if k != "tokens"},
                    "ratio": on["tok_s"] / off["tok_s"], "tokens_equal": off["tokens"] == on["tokens"],
                    "token_match": match}
        print(f"| {b} | {off['tok_s']:,.0f} | {on['tok_s']:,.0f} | {off['ms_per_step']:.3f} | "
              f"{on['ms_per_step']:.3f} | {on['tok_s'] / off['tok_s']:.3f} | {match:.3f} | "
              f"{off['builds']}/{on['builds']} |")
    write_results({"device": results["on"]["device"], "batches": table}, args.out, "decode_batches.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

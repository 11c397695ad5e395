"""A/B two source trees of Bridge on W1 and W2 (engine only), alternating, in one device run.

A refactor must not cost speed; run-to-run spread between processes is a few percent, so one run
of each tree proves nothing. This runs each tree's own `benchmarks/generate.py` helpers (workload,
model, `run_bridge`) in a fresh subprocess per round, alternating which tree goes first, on one
shared model directory, and prints each tree's median over rounds and the ratio B/A.

    python3 benchmarks/ab_trees.py --trees OLD_TREE . --rounds 3

HF baselines are not run (they do not depend on the tree); `benchmarks/generate.py` reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import gc, json, pathlib, sys, time
tree = pathlib.Path(sys.argv[1]).resolve()
sys.path[:0] = [str(tree), str(tree / "benchmarks")]
import torch
import generate as g
from transformers import AutoModelForCausalLM
model_dir = g.build_model(pathlib.Path(sys.argv[2]), False)
device = torch.device("cuda")
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
embed = hf.get_input_embeddings().to(device)
vocab = hf.config.vocab_size
specs = {"W1": g.workload(64, 512, 512, 128, 128, vocab, seed=1),
         "W2": g.workload(256, 100, 1024, 100, 1024, vocab, seed=2)}
with torch.no_grad():
    embeds = {n: [embed(torch.tensor(i, device=device)).detach() for i in s[0]] for n, s in specs.items()}
del hf, embed
max_len = max(p + o for _, (_, pl, ol) in specs.items() for p, o in zip(pl, ol))
t0 = time.perf_counter()
llm = g.LLM(model_dir, enable_prompt_embeds=True, dtype=torch.bfloat16, device=device, max_num_seqs=256,
            max_num_batched_tokens=16384, max_model_len=max_len + 16, gpu_memory_utilization=0.85)
out = {"init_s": time.perf_counter() - t0}
r = llm.runner
out["engine"] = {"fused_layers": r.num_fused_layers, "fused_norms": r.num_fused_norms,
                 "fused_linears": list(r.num_fused_linears), "graphs": len(r.graphs),
                 "async": llm.async_scheduling, "window": llm.decode_window,
                 "kv_blocks": (llm.stats() if hasattr(llm, "stats") else llm).num_total_blocks}
collections = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "start" and collections.__setitem__(
    info["generation"], collections[info["generation"]] + 1))
for name, (ids, _, output_lens) in specs.items():
    paths = {"ids": [{"prompt_token_ids": i} for i in ids],
             "embeds": [{"prompt_embeds": e} for e in embeds[name]]}
    reps = int(sys.argv[3]) if name == "W1" else 1
    for rep in range(reps + 1):
        for path, prompts in paths.items():
            r = g.run_bridge(llm, prompts, output_lens, device)
            if rep:
                out.setdefault(f"{name}_{path}", []).append(r["tok_s"])
    out[f"{name}_gc_collections"] = list(collections)
if len(sys.argv) > 4:  # W1 again with the garbage collector off
    gc.collect(); gc.disable()
    ids, _, output_lens = specs["W1"]
    for rep in range(4):
        res = g.run_bridge(llm, [{"prompt_embeds": e} for e in embeds["W1"]], output_lens, device)
        if rep:
            out.setdefault("W1_embeds_nogc", []).append(res["tok_s"])
    gc.enable()
print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, help="tree A (before) and tree B (after)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--w1-repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gc-off-check", action="store_true",
                    help="also time W1 embeds with Python's garbage collector disabled")
    args = ap.parse_args()
    model_dir = pathlib.Path(tempfile.gettempdir()) / "bridge_bench_qwen3_06b"
    results: dict[str, list[dict]] = {t: [] for t in args.trees}
    # Installed packages stay on the children's path (wheels carried into a folder), source trees do not:
    # each child puts its own tree first.
    site_path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p and not (pathlib.Path(p) / "bridge").is_dir())
    for rnd in range(args.rounds):
        order = args.trees if rnd % 2 == 0 else args.trees[::-1]
        for tree in order:
            extra = ["nogc"] if args.gc_off_check else []
            proc = subprocess.run([sys.executable, "-c", CHILD, tree, str(model_dir), str(args.w1_repeats),
                                   *extra],
                                  capture_output=True, text=True, env={**os.environ, "PYTHONPATH": site_path})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            res = json.loads(line[len("RESULT "):])
            results[tree].append(res)
            print(f"round {rnd} {tree}: " + ", ".join(
                f"{k} {statistics.median(v):.0f}" for k, v in res.items()
                if isinstance(v, list) and not k.endswith("collections")), flush=True)
            gcs = res.get("W1_gc_collections"), res.get("W2_gc_collections")
            print(f"  engine {res['engine']}, gc collections (gen 0/1/2) W1 {gcs[0]} W2 {gcs[1]}", flush=True)
    a, b = args.trees
    summary = {}
    keys = [k for k, v in results[a][0].items() if isinstance(v, list) and not k.endswith("collections")]
    for key in keys:
        ma = statistics.median(x for r in results[a] for x in r[key])
        mb = statistics.median(x for r in results[b] for x in r[key])
        summary[key] = {"A": ma, "B": mb, "B_over_A": mb / ma}
        print(f"{key:<12} A {ma:8.0f} tok/s   B {mb:8.0f} tok/s   B/A {mb / ma:.3f}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"trees": args.trees, "rounds": results,
                                                      "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""W1 on other families: Mistral-7B- and Gemma-2-2B-shaped models, Bridge vs Hugging Face vs the roofline.

One command, GPU (an H200; a few minutes per model, most of it building and loading the 7B directory):

    python benchmarks/families.py [--out results.json] [--model-root /tmp] [--families mistral gemma2]

W1 as in benchmarks/generate.py: 64 requests of 512 prompt-embeds rows (the embeddings of random token
ids), 128 output tokens each, greedy, ignore_eos, bf16, random weights. Per model: Hugging Face
`generate(inputs_embeds=...)` as one batch of 64 (warmed up first; sdpa, or eager for Gemma 2, whose
soft-capping sdpa lacks), then Bridge's engine on the same embeddings (one warm-up run, then
`--repeats` timed runs, median), and the roofline of generate.py (every decode step reads all weights
and the live KV at the measured copy bandwidth, about 4.2 TB/s on an H200; prefill FLOPs at the measured
bf16 matmul rate). Both models keep their sliding windows (4096: W1's 640 tokens never reach them, but
the windowed kernels run) and Gemma 2 its soft-capping and `query_pre_attn_scalar`.

Shapes: Mistral-7B-v0.1 (hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
14336, vocab 32000, window 4096); Gemma-2-2B (hidden 2304, 26 layers, 8 heads, 4 KV heads, head_dim 256,
intermediate 9216, vocab 256000, tied embeddings, window 4096, soft-caps 50 / 30).

`--quick`: tiny versions of both (hidden 64, 2 layers) on the CPU in fp32, 8 requests of 32 rows, 8 new
tokens: a smoke test of the script, no roofline.

Writes JSON to `--out`, else `$OUT/families_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

BENCH = pathlib.Path(__file__).resolve().parent
for p in (BENCH.parent, BENCH):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from generate import (  # noqa: E402
    log,
    measure_copy_bandwidth,
    measure_matmul_rate,
    roofline_tok_s,
    run_bridge,
    run_hf_generate,
    sync,
    workload,
    write_results,
)

from bridge.tiny_families import build_family_model  # noqa: E402
from runner.llm import LLM  # noqa: E402

SHAPES = {
    "mistral": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                    intermediate_size=14336, vocab_size=32000, sliding_window=4096,
                    max_position_embeddings=32768),
    "gemma2": dict(hidden_size=2304, num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256,
                   intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True, sliding_window=4096,
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   max_position_embeddings=8192),
}
LABELS = {"mistral": "Mistral-7B-shaped", "gemma2": "Gemma-2-2B-shaped"}
QUICK = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)


def build(root: pathlib.Path, family: str, quick: bool, device: torch.device) -> pathlib.Path:
    path = root / f"bridge_bench_{family}{'_tiny' if quick else ''}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        log(f"reusing model directory {path}")
        return path
    log(f"building model directory {path}")
    if quick:
        return build_family_model(path, family, seed=0, max_position_embeddings=4096)
    return build_family_model(path, family, seed=0, dtype=torch.bfloat16, device=device, **SHAPES[family])


def bench_family(family: str, path: pathlib.Path, specs, device: torch.device, dtype: torch.dtype,
                 repeats: int, machine: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    ids, prompt_lens, output_lens = specs
    config = AutoConfig.from_pretrained(path)
    attn = "eager" if family == "gemma2" else "sdpa"
    log(f"{family}: Hugging Face generate ({attn})")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    with torch.no_grad():
        embeds = [hf.get_input_embeddings()(torch.tensor(i, device=device)).detach() for i in ids]
        hf.generate(inputs_embeds=embeds[0][None, :16], max_new_tokens=4, do_sample=False)  # warm-up
    hf_res = run_hf_generate(hf, embeds, output_lens, device, batch_size=len(ids))
    log(f"  {hf_res['tok_s']:.0f} tok/s")
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()

    log(f"{family}: Bridge")
    t0 = time.perf_counter()
    llm = LLM(path, enable_prompt_embeds=True, dtype=dtype, device=device,
              max_num_seqs=64 if device.type == "cuda" else 8,
              max_num_batched_tokens=16384 if device.type == "cuda" else 256,
              max_model_len=max(p + o for p, o in zip(prompt_lens, output_lens)) + 16,
              gpu_memory_utilization=0.85)
    init_s = time.perf_counter() - t0
    prompts = [{"prompt_embeds": e} for e in embeds]
    runs = [run_bridge(llm, prompts, output_lens, device) for _ in range(repeats + 1)][1:]  # first: warm-up
    tok_s = statistics.median(r["tok_s"] for r in runs)
    entry = {
        "model": LABELS[family], "requests": len(ids), "prompt_tokens": sum(prompt_lens),
        "output_tokens": sum(output_lens), "weight_bytes": weight_bytes, "bridge_init_seconds": init_s,
        "bridge_tok_s": tok_s, "bridge_all_tok_s": [r["tok_s"] for r in runs], "hf_tok_s": hf_res["tok_s"],
        "hf_attn_implementation": attn, "bridge_over_hf": tok_s / hf_res["tok_s"],
        "fused_layers": llm.runner.num_fused_layers, "cuda_graph_buckets": len(llm.runner.graphs),
        "kv_blocks": llm.stats().num_total_blocks,
    }
    if machine:
        text = config.get_text_config()
        roof = roofline_tok_s(text, weight_bytes, prompt_lens, output_lens, machine["copy_bandwidth_Bps"],
                              machine["bf16_matmul_flops"])
        entry["roofline_tok_s"] = roof["tok_s"]
        entry["bridge_over_roofline"] = tok_s / roof["tok_s"]
    log(f"  {tok_s:.0f} tok/s ({entry['bridge_over_hf']:.1f}x HF)")
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models on the CPU: a smoke test, no roofline")
    ap.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--model-root", default=None, help="where to build (or reuse) the model directories")
    ap.add_argument("--repeats", type=int, default=3, help="timed Bridge runs after one warm-up (median)")
    ap.add_argument("--out", default=None, help="JSON output path (default: $OUT/families_benchmark.json)")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    if device.type == "cpu" and not args.quick:
        log("no CUDA device: running --quick")
        args.quick = True
    if args.quick:
        torch.set_num_threads(1)
    dtype = torch.float32 if args.quick else torch.bfloat16
    root = pathlib.Path(args.model_root or tempfile.gettempdir())
    machine: dict = {}
    if not args.quick:
        log("measuring copy bandwidth and matmul rate")
        machine = {"copy_bandwidth_Bps": measure_copy_bandwidth(device),
                   "bf16_matmul_flops": measure_matmul_rate(device)}
        log(f"  copy {machine['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
            f"matmul {machine['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    results: dict = {
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else platform.processor() or "cpu"),
        "torch": torch.__version__, "quick": args.quick, **machine, "models": {},
    }
    for family in args.families:
        path = build(root, family, args.quick, device)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        specs = workload(8, 32, 32, 8, 8, vocab, seed=1) if args.quick else workload(64, 512, 512, 128, 128,
                                                                                     vocab, seed=1)
        results["models"][family] = bench_family(family, path, specs, device, dtype, args.repeats, machine)
        if args.quick:
            results["models"][family]["model"] = f"{family} (tiny)"
        sync(device)

    print()
    print(f"Device: {results['device']}   workload: {'quick (tiny, CPU)' if args.quick else 'W1'}")
    header = f"{'model':<20}{'Bridge tok/s':>14}{'HF tok/s':>11}{'roofline':>11}{'x HF':>8}{'% roof':>9}"
    print(header)
    print("-" * len(header))
    for entry in results["models"].values():
        roof = entry.get("roofline_tok_s")
        print(f"{entry['model']:<20}{entry['bridge_tok_s']:>14.0f}{entry['hf_tok_s']:>11.0f}"
              f"{(f'{roof:.0f}' if roof else '-'):>11}{entry['bridge_over_hf']:>8.1f}"
              f"{(format(entry['bridge_over_roofline'], '.0%') if roof else '-'):>9}")
    write_results(results, args.out, "families_benchmark.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

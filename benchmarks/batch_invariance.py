"""Batch invariance: how often a prompt's greedy tokens, batched or served, equal the same prompt run alone,
with and without `batch_invariant`, and what the option costs.

GPU (the lead runs it; about 5 minutes on an H200):

    python benchmarks/batch_invariance.py [--out results.json] [--no-serve]

W1 (benchmarks/generate.py): a Qwen3-0.6B-shaped model with random bf16 weights, 64 requests of 512
prompt-embeds rows (the embeddings of random ids, pageable CPU tensors), 128 greedy output tokens each,
ignore_eos. For each setting, default and `batch_invariant=True`, with the GPU defaults otherwise (CUDA
graphs, decode windows, async scheduling, fused kernels where the setting keeps them):

1. each prompt alone (one `generate` per prompt): the reference tokens;
2. the 64 in one `generate`, once to warm up, then `--repeats` timed runs (the median is reported);
   their tokens against the reference;
3. the 64 in one `generate` on an engine with a 1024-token chunk budget (prefills cut and mixed with
   decodes): tokens against the reference;
4. unless `--no-serve`: a `bridge serve` process with the same setting, 64 concurrent clients (one request
   each, the prompt embeds in vLLM's base64 format, `return_token_ids`): tokens against the reference.

Reported per setting: the share of prompts whose tokens equal the reference exactly (`*_prompt_match`) and
the share of equal token positions (`*_token_match`), the batched throughput; and the cost, the median
batched time with the option over without it (target <= 1.5; 1.0 for the match rates with the option).

`--smoke`: the tiny model on the CPU (hidden 64), 8 requests of 16-48 rows and 16 tokens, repeats 1;
the served part runs a CPU server. Writes JSON to `--out`, else `$OUT/batch_invariance.json` when `$OUT`
is set.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from generate import bench_setup, embed_rows, log, run_bridge, token_match, workload, write_results  # noqa: E402
from serve import start_server  # noqa: E402

from bridge.wire import encode_prompt_embeds  # noqa: E402
from runner.llm import LLM  # noqa: E402

TARGET_COST = 1.5
SETTINGS = {"default": False, "batch_invariant": True}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few short requests")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 64; --smoke 8)")
    ap.add_argument("--rows", type=int, default=None, help="prompt-embeds rows each (default 512)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens each (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed batched runs (default 3; --smoke 1)")
    ap.add_argument("--chunk", type=int, default=None, help="chunk budget of step 3 (default 1024)")
    ap.add_argument("--no-serve", action="store_true", help="skip the served comparison")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.cpu = args.smoke
    smoke = args.smoke
    args.requests = args.requests or (8 if smoke else 64)
    args.max_tokens = args.max_tokens or (16 if smoke else 128)
    args.repeats = args.repeats or (1 if smoke else 3)
    args.chunk = args.chunk or (16 if smoke else 1024)
    return args


def matches(got: list[list[int]], want: list[list[int]]) -> dict:
    return {"prompt_match": sum(a == b for a, b in zip(got, want)) / max(1, len(want)),
            "token_match": token_match(want, got)}


def offline(args, model_dir, device, invariant: bool, prompts: list[dict], engine: dict) -> dict:
    """Steps 1-3 of one setting (see the module docstring)."""
    n_out = [args.max_tokens] * len(prompts)
    llm = LLM(model_dir, enable_prompt_embeds=True, batch_invariant=invariant, **engine)
    log(f"{'with' if invariant else 'without'} batch_invariant: {len(prompts)} prompts alone")
    alone = [run_bridge(llm, [p], [args.max_tokens], device)["tokens"][0] for p in prompts]
    run_bridge(llm, prompts, n_out, device)  # warm-up
    runs = [run_bridge(llm, prompts, n_out, device) for _ in range(args.repeats)]
    seconds = statistics.median(r["seconds"] for r in runs)
    result = {"batched_seconds": seconds, "batched_tok_s": sum(n_out) / seconds,
              "all_batched_seconds": [r["seconds"] for r in runs],
              **{f"batched_{k}": v for k, v in matches(runs[-1]["tokens"], alone).items()}}
    llm.shutdown()
    del llm
    llm = LLM(model_dir, enable_prompt_embeds=True, batch_invariant=invariant,
              **{**engine, "max_num_batched_tokens": args.chunk})
    chunked = run_bridge(llm, prompts, n_out, device)["tokens"]
    result.update({f"chunked_{k}": v for k, v in matches(chunked, alone).items()})
    llm.shutdown()
    del llm
    _free(device)
    return result, alone


def served(args, model_dir, invariant: bool, embeds: list[torch.Tensor], engine: dict) -> list[list[int]]:
    """Step 4: the same requests from len(embeds) concurrent clients of a `bridge serve` process."""
    import httpx

    server_args = "--batch-invariant" if invariant else ""
    side = argparse.Namespace(smoke=args.smoke)
    settings = {k: v for k, v in engine.items() if k not in ("dtype", "device")}
    log_path = pathlib.Path(tempfile.gettempdir()) / f"batch_invariance_server_{int(invariant)}.log"
    dtype = "float32" if args.smoke else "bfloat16"
    work = pathlib.Path(tempfile.mkdtemp(prefix="batch_invariance_"))
    # the offline engines' Triton cache: the server builds nothing they have built
    cache = pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or pathlib.Path.home() / ".triton" / "cache")
    server = start_server(model_dir, side, server_args, settings, dtype, cache, log_path,
                          work / "ticks.jsonl")
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    url = server.url
    bodies = [json.dumps({"model": "bench", "prompt": "", "prompt_embeds": encode_prompt_embeds(e),
                          "max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
                          "return_token_ids": True}) for e in embeds]

    async def one(http: httpx.AsyncClient, body: str) -> list[int]:
        r = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    async def run_all() -> list[list[int]]:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            return await asyncio.gather(*(one(http, b) for b in bodies))

    try:
        log(f"{'with' if invariant else 'without'} batch_invariant: {len(bodies)} concurrent clients")
        return asyncio.run(run_all())
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device, model_dir, dtype = bench_setup(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    lo, hi = (16, 48) if args.smoke else (args.rows or 512, args.rows or 512)
    ids, prompt_lens, _ = workload(args.requests, lo, hi, 1, 1, vocab, seed=0)
    embeds = embed_rows(model_dir, ids, dtype)
    prompts = [{"prompt_embeds": e} for e in embeds]
    engine = {"dtype": "float32" if args.smoke else "bfloat16", "device": device.type,
              "max_model_len": max(prompt_lens) + args.max_tokens + 16,
              # W1's settings in benchmarks/generate.py
              "max_num_seqs": 32 if args.smoke else 256,
              "max_num_batched_tokens": 2048 if args.smoke else 16384}
    if device.type == "cuda":
        engine["gpu_memory_utilization"] = 0.85
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "requests": args.requests, "rows": [lo, hi], "max_tokens": args.max_tokens,
               "repeats": args.repeats, "chunk": args.chunk}
    for name, invariant in SETTINGS.items():
        res, alone = offline(args, model_dir, device, invariant, prompts, engine)
        if not args.no_serve:
            tokens = served(args, model_dir, invariant, embeds, engine)
            res.update({f"served_{k}": v for k, v in matches(tokens, alone).items()})
        results[name] = res
    results["cost"] = results["batch_invariant"]["batched_seconds"] / results["default"]["batched_seconds"]
    print_summary(results, args.smoke)
    write_results(results, args.out, "batch_invariance.json")
    return 0


def print_summary(results: dict, smoke: bool) -> None:
    keys = [k for k in results["default"] if k.endswith("_match")]
    print(f"\n{'':26}" + "".join(f"{k:>22}" for k in ("default", "batch_invariant")))
    for key in ["batched_tok_s", *keys]:
        row = "".join(f"{results[n][key]:>22.3f}" for n in ("default", "batch_invariant"))
        print(f"{key:26}{row}")
    note = " (information only on the CPU)" if smoke else ""
    print(f"\ncost: batched time with the option / without = {results['cost']:.3f} (target <= {TARGET_COST})"
          + note)
    perfect = all(results["batch_invariant"][k] == 1.0 for k in keys)
    ways = "batched, chunked" + (", served" if "served_prompt_match" in keys else "")
    print(f"batch_invariant: every prompt {ways} equals it alone: {perfect}")


if __name__ == "__main__":
    raise SystemExit(main())

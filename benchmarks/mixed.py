"""Mixed workload: text + passthrough items (encoder-cache path) vs the same requests as pure prompt embeds.

One command, GPU (well under 3 minutes on an H200 once the model directory exists):

    python benchmarks/mixed.py [--out mixed.json] [--model-dir /tmp/bridge_qwen3_06b]

64 requests, each: 128 text tokens, one `<embeds>` placeholder carrying a 256-row passthrough item
("prompt_embeds" in multi_modal_data), 128 more text tokens (512 prompt positions), 64 output tokens,
greedy, ignore_eos. Model: the Qwen3-0.6B-shaped random bf16 model of `benchmarks/generate.py`
(built with `build_tiny_model`, reused from `--model-dir` when present). In one run, on one engine:

- `mixed_first_use`: 64 distinct items, none cached: hashed, uploaded (64 uploads), gathered per step;
- `mixed_cache_hit`: the same 64 requests again: every item served from the encoder cache (0 uploads);
- `mixed_same_item`: 64 requests sharing one item (1 upload for the whole batch);
- `pure_embeds`: the same 64 requests as whole-prompt embeds tensors (text rows = the model's own
  embedding rows), through the prompt-embeds overlay.

Reports tok/s (output tokens / wall time of `generate`), uploads and encoder calls per path, the host
time of prompt processing per path (`process_ms`: `PromptProcessor.process` on the same prompts just
before the timed `generate`, whose requests are dropped: validation, item hashing and checks), the time
spent hashing the items (content identifiers) one by one and as the engine does it (one batch per
call), and how many generated tokens agree between the mixed and the pure-embeds path. `--cpu`: a tiny
model (hidden 64) on the CPU, as a smoke test of the script. Writes JSON to `--out`, else
`$OUT/mixed_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import generate as gen  # noqa: E402  (benchmarks/generate.py: model builder, timing helpers)

from runner.llm import LLM  # noqa: E402
from runner.multimodal.encoder_protocol import tensor_content_hash, tensor_content_hashes  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402


def build_requests(llm: LLM, n: int, text_len: int, item_rows: int, seed: int, device: torch.device,
                   same_item: bool = False):
    """(mixed prompts, equivalent pure-embeds prompts, items)."""
    tok = llm.get_tokenizer()
    embeds_id = tok.convert_tokens_to_ids("<embeds>")
    vocab = llm.runner.vocab_size
    hidden = llm.runner.hidden_size
    dtype = llm.runner.dtype
    table = llm.runner.embed_tokens.weight.detach()
    g = torch.Generator().manual_seed(seed)
    specials = set(tok.all_special_ids)
    mixed, pure, items = [], [], []
    shared = (torch.randn(item_rows, hidden, generator=g) * 0.02).to(device, dtype)
    half = text_len // 2
    for _ in range(n):
        ids = torch.randint(10, vocab, (text_len,), generator=g).tolist()
        ids = [t if t not in specials else 10 for t in ids]
        item = shared if same_item else (torch.randn(item_rows, hidden, generator=g) * 0.02).to(device, dtype)
        items.append(item)
        mixed.append({"prompt_token_ids": ids[:half] + [embeds_id] + ids[half:],
                      "multi_modal_data": {"prompt_embeds": [item]}})
        head = table[torch.tensor(ids[:half], device=table.device)]
        tail = table[torch.tensor(ids[half:], device=table.device)]
        pure.append({"prompt_embeds": torch.cat([head, item.to(table.dtype), tail])})
    return mixed, pure, items


def process_ms(llm: LLM, prompts, params, device, reps: int = 3) -> float:
    """Host time of validating a call's prompts (the best of `reps`); the requests are dropped."""
    best = float("inf")
    for _ in range(reps):
        gen.sync(device)
        t0 = time.perf_counter()
        llm.processor.process(prompts, [params] * len(prompts), [f"p{i}" for i in range(len(prompts))])
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def timed(llm: LLM, prompts, params, device) -> dict:
    cache = llm.encoder_cache
    host_ms = process_ms(llm, prompts, params, device)
    up0, enc0 = cache.num_uploads, cache.num_encoder_calls
    gen.sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen.sync(device)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert llm.stats().all_free
    return {"tok_s": n_out / dt, "seconds": dt, "output_tokens": n_out, "process_ms": host_ms,
            "uploads": cache.num_uploads - up0, "encoder_calls": cache.num_encoder_calls - enc0,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (smoke test of the script)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--text-len", type=int, default=256)
    ap.add_argument("--item-rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.cpu:
        args.requests, args.text_len, args.item_rows, args.max_tokens = 8, 32, 32, 8

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    default_dir = "/tmp/bridge_tiny_cpu" if args.cpu else "/tmp/bridge_qwen3_06b"
    model_dir = pathlib.Path(args.model_dir or default_dir)
    gen.build_model(model_dir, args.cpu)
    prompt_len = args.text_len + args.item_rows
    llm = LLM(model_dir, enable_prompt_embeds=True, device=device,
              dtype="float32" if args.cpu else "bfloat16", max_num_seqs=256,
              max_num_batched_tokens=2048 if args.cpu else 16384,
              max_model_len=prompt_len + args.max_tokens + 16, gpu_memory_utilization=0.85,
              async_scheduling=False, encoder_cache_budget=2 * args.requests * args.item_rows)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    mixed, pure, items = build_requests(llm, args.requests, args.text_len, args.item_rows, 1, device)
    same, _, _ = build_requests(llm, args.requests, args.text_len, args.item_rows, 2, device, same_item=True)
    warm_mixed, warm_pure, _ = build_requests(llm, 8, args.text_len, args.item_rows, 3, device)

    gen.log("warm-up")
    llm.generate(warm_mixed + warm_pure, params, use_tqdm=False)
    gen.sync(device)
    t0 = time.perf_counter()
    for item in items:
        tensor_content_hash(item)
    hash_s = time.perf_counter() - t0
    gen.sync(device)
    t0 = time.perf_counter()
    tensor_content_hashes(items)
    hash_batched_s = time.perf_counter() - t0

    results = {}
    gen.log("mixed, first use")
    results["mixed_first_use"] = timed(llm, mixed, params, device)
    gen.log("mixed, cache hit")
    results["mixed_cache_hit"] = timed(llm, mixed, params, device)
    gen.log("mixed, one item repeated")
    results["mixed_same_item"] = timed(llm, same, params, device)
    gen.log("pure prompt embeds")
    results["pure_embeds"] = timed(llm, pure, params, device)

    match = gen.token_match(results["mixed_first_use"]["tokens"], results["pure_embeds"]["tokens"])
    base = results["pure_embeds"]["tok_s"]
    print(f"\nMixed workload: {args.requests} requests x ({args.text_len} text tokens + one "
          f"{args.item_rows}-row passthrough item), {args.max_tokens} output tokens, {device.type}")
    print(f"{'path':<18} {'seconds':>8} {'tok/s':>10} {'vs pure':>8} {'uploads':>8} {'enc calls':>9} "
          f"{'process ms':>10}")
    for name, r in results.items():
        print(f"{name:<18} {r['seconds']:>8.3f} {r['tok_s']:>10.0f} {r['tok_s'] / base:>7.2f}x "
              f"{r['uploads']:>8} {r['encoder_calls']:>9} {r['process_ms']:>10.1f}")
    print(f"content hashing of the {len(items)} items (host): {hash_s * 1000:.1f} ms one by one, "
          f"{hash_batched_s * 1000:.1f} ms as one batch")
    print(f"tokens equal between mixed_first_use and pure_embeds: {match:.4f}")

    summary = {
        "workload": {"requests": args.requests, "text_len": args.text_len, "item_rows": args.item_rows,
                     "max_tokens": args.max_tokens, "device": str(device),
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
        "hash_seconds": hash_s, "hash_batched_seconds": hash_batched_s, "token_match_mixed_vs_pure": match,
    }
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "mixed_benchmark.json")
    if out:
        pathlib.Path(out).write_text(json.dumps(summary, indent=2))
        gen.log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

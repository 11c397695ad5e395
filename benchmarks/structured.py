"""Structured outputs: W1 constrained by a small JSON schema against W1 unconstrained, in one run.

GPU (about two minutes on an H200):

    python benchmarks/structured.py [--out results.json] [--model-dir DIR]

CPU smoke (a tiny model, a few requests; targets print as information only):

    python benchmarks/structured.py --smoke

Model: Qwen3-0.6B-shaped (as benchmarks/generate.py), random bf16 weights, with a synthetic byte-level BPE
vocabulary of 151,000 tokens (letters, words with and without a leading space, punctuation-led pieces) so
that xgrammar fills its masks over a vocabulary the size of a real one; the tiny-model kit's 280-token
tokenizer would make the masks unrealistically cheap.

W1: 64 requests of 512 prompt-embeds rows as CPU tensors, 128 new tokens each, greedy, ignore_eos.
Sides, each warmed once and then timed `--repeats` times back to back in alternating order:

- `free`: W1 as it runs today (decode windows, CUDA graphs, async scheduling);
- `free_single_steps`: the same with decode windows off (`llm.decode_window = 1`), which is what a
  constrained step must give up: it separates the cost of the lost windows from the cost of the masks;
- `json`: every request constrained by `SCHEMA` (an enum then an unbounded string, compact JSON): every
  step fills 64 token masks on the host, uploads them and applies them before sampling; the string never
  closes under greedy decoding of a random model, so each request makes its 128 tokens, as on the other
  sides.

Reported: tok/s (median), the paired ratios json / free (target >= 0.8) and json / free_single_steps,
the host seconds spent filling masks per step (on the fill thread when a step's sampling is deferred)
and the engine thread's wait for those fills, the steps, windows and async steps of each side, and each
side's finish reasons; with `--profile`, one more json run under cProfile (its top host functions).
Writes JSON to `--out`, else `$OUT/structured_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import random
import statistics
import sys
import time

import torch

BENCH = pathlib.Path(__file__).resolve().parent
for _p in (BENCH.parent, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from generate import QWEN3_06B, embed_rows, write_results  # noqa: E402
from hf_baselines import log, sync  # noqa: E402

from bridge.tiny_models import build_tiny_model  # noqa: E402
from runner.llm import LLM  # noqa: E402
from runner.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

TARGET_JSON_OVER_FREE = 0.8
SCHEMA = {"type": "object",
          "properties": {"label": {"enum": ["cat", "dog", "bird"]}, "text": {"type": "string"}},
          "required": ["label", "text"], "additionalProperties": False}
WIDE_VOCAB = 151_000
SIDES = ("free", "free_single_steps", "json")


def wide_tokenizer(size: int, seed: int = 0):
    """A byte-level BPE tokenizer of `size` tokens: the kit's special tokens and 256 bytes, then random
    pieces shaped like a real vocabulary's. No merges: it encodes byte by byte, and decodes any id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bridge.tiny_models import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, UNK_TOKEN

    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[token] = len(vocab)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < size:
        word = "".join(rng.choice(letters) for _ in range(rng.choice((2, 3, 3, 4, 4, 5, 5, 6, 7, 8))))
        r = rng.random()
        if r < 0.5:
            word = "\u0120" + word  # the byte-level space mark: " word"
        elif r < 0.55:
            word = word.capitalize()
        elif r < 0.6:
            word = rng.choice(['"', ",", ".", ":", "{", "}", '\u0120"', '",', '":']) + word
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, unk_token=UNK_TOKEN,
                                   clean_up_tokenization_spaces=False)


def build_model(path: pathlib.Path, smoke: bool) -> pathlib.Path:
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        log(f"reusing model directory {path}")
        return path
    log(f"building model directory {path}")
    if smoke:
        build_tiny_model(path, "qwen3", seed=0, vocab_size=4096)
        wide_tokenizer(4000).save_pretrained(path)
    else:
        build_tiny_model(path, "qwen3", seed=0, dtype=torch.bfloat16, **QWEN3_06B)
        wide_tokenizer(WIDE_VOCAB).save_pretrained(path)
    return path


def run_side(llm: LLM, side: str, prompts: list[dict], max_tokens: int, device, window: int) -> dict:
    """One timed `generate` of W1 on `side` (`window`: the engine's own decode window)."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if side == "json" else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=so)
    llm.decode_window = 1 if side == "free_single_steps" else window
    core, runner = llm.core, llm.runner
    masks = core.token_masks
    before = (runner.num_forward_steps, runner.num_decode_windows, core.num_async_steps, masks.fill_seconds,
              masks.wait_seconds, core.num_deferred_samples, masks.num_background_fills)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = runner.num_forward_steps - before[0]
    return {"tok_s": n_out / dt, "seconds": dt, "output_tokens": n_out, "steps": steps,
            "decode_windows": runner.num_decode_windows - before[1],
            "async_steps": core.num_async_steps - before[2],
            "mask_fill_seconds": masks.fill_seconds - before[3],
            "mask_wait_seconds": masks.wait_seconds - before[4],
            "deferred_samples": core.num_deferred_samples - before[5],
            "background_fills": masks.num_background_fills - before[6],
            "finish_reasons": dict(collections.Counter(o.outputs[0].finish_reason for o in outs)),
            "texts": [o.outputs[0].text for o in outs[:2]]}


def host_profile(llm: LLM, prompts: list[dict], max_tokens: int, device, window: int,
                 top: int = 30) -> list[str]:
    """One json run under cProfile: the functions with the most own time (a wait for the device shows as
    the call that synchronises), as printed lines."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run_side(llm, "json", prompts, max_tokens, device, window)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    log("json side under cProfile, by own time:\n" + "\n".join(lines))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 8 requests; no targets")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side after one warm-up (median)")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (8 with --smoke)")
    ap.add_argument("--rows", type=int, default=None, help="prompt-embeds rows each (default: 512; 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens each (default: 128; 16)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one json run under cProfile: the top host functions")
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    n = args.requests or (8 if smoke else 64)
    rows = args.rows or (32 if smoke else 512)
    max_tokens = args.max_tokens or (16 if smoke else 128)
    repeats = 1 if args.smoke and args.repeats == 5 else args.repeats
    model_dir = pathlib.Path(args.model_dir or f"/tmp/bridge_structured_{'smoke' if smoke else 'qwen3_06b'}")
    build_model(model_dir, smoke)
    dtype = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(300, 4000 if smoke else 151_000, (rows,), generator=g).tolist() for _ in range(n)]
    prompts = [{"prompt_embeds": e} for e in embed_rows(model_dir, ids, dtype)]

    log("building the engine")
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32" if smoke else "bfloat16", device=device,
              max_model_len=rows + max_tokens + 16,  # W1's engine settings, as benchmarks/generate.py
              **({"num_kv_blocks": 256} if smoke else {"max_num_seqs": 256, "max_num_batched_tokens": 16384}))
    window = llm.decode_window
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for rep in range(repeats + 1):
        order = list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            res = run_side(llm, side, prompts, max_tokens, device, window)
            label = "warm-up" if rep == 0 else f"run {rep}"
            log(f"{side} ({label}): {res['tok_s']:.0f} tok/s, {res['steps']} steps, "
                f"{res['decode_windows']} windows, {res['async_steps']} async "
                f"({res['deferred_samples']} sampled deferred, {res['background_fills']} masks filled "
                f"in the background), mask fill {res['mask_fill_seconds'] * 1e3:.1f} ms, engine thread "
                f"waited for it {res['mask_wait_seconds'] * 1e3:.1f} ms, "
                f"{res['finish_reasons']}")
            if rep:
                runs[side].append(res)
    llm.decode_window = window
    profile = host_profile(llm, prompts, max_tokens, device, window) if args.profile else None

    med = {s: statistics.median(r["tok_s"] for r in runs[s]) for s in SIDES}
    # Paired: the ratio within each repetition, then the median (drift between repetitions cancels).
    paired = {f"json_over_{s}": statistics.median(j["tok_s"] / f["tok_s"]
                                                  for j, f in zip(runs["json"], runs[s]))
              for s in ("free", "free_single_steps")}
    json_runs = runs["json"]
    results = {
        "workload": {"requests": n, "prompt_embeds_rows": rows, "max_tokens": max_tokens, "greedy": True,
                     "schema": SCHEMA, "vocab": len(llm.tokenizer), "device": str(device)},
        "tok_s": med, **paired,
        "json_over_free_of_medians": med["json"] / med["free"],
        "mask_fill_ms_per_step": statistics.median(r["mask_fill_seconds"] / max(1, r["steps"]) * 1e3
                                                   for r in json_runs),
        "mask_fill_share_of_json_seconds": statistics.median(r["mask_fill_seconds"] / r["seconds"]
                                                             for r in json_runs),
        "mask_wait_ms_per_step": statistics.median(r["mask_wait_seconds"] / max(1, r["steps"]) * 1e3
                                                   for r in json_runs),
        "runs": {s: [{k: v for k, v in r.items() if k != "texts"} for r in runs[s]] for s in SIDES},
        "json_text_samples": json_runs[-1]["texts"],
        "target_json_over_free": TARGET_JSON_OVER_FREE,
        **({"json_host_profile": profile} if profile else {}),
    }
    verdict = "met" if paired["json_over_free"] >= TARGET_JSON_OVER_FREE else "NOT met"
    log(f"tok/s: free {med['free']:.0f}, free single steps {med['free_single_steps']:.0f}, "
        f"json {med['json']:.0f}")
    log(f"json / free {paired['json_over_free']:.3f} (target >= {TARGET_JSON_OVER_FREE}: "
        f"{verdict if not smoke else 'information only on the CPU'}); json / free single steps "
        f"{paired['json_over_free_single_steps']:.3f}; mask fill "
        f"{results['mask_fill_ms_per_step']:.2f} ms per step "
        f"({results['mask_fill_share_of_json_seconds']:.1%} of the json side's time, on the fill thread "
        f"when a step's sampling is deferred), the engine thread waited for it "
        f"{results['mask_wait_ms_per_step']:.2f} ms per step")
    write_results(results, args.out, "structured_benchmark.json")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generation throughput and start-up: Bridge's engine vs Hugging Face `generate`, and vs the roofline.

GPU, W1 and the start-up rows (a few minutes on an H200):

    python benchmarks/generate.py --skip-w2 [--out results.json] [--model-dir DIR]

W2's HF baselines generate up to 1024 tokens per batch (the dynamic cache's cold call took about
80 s in the 2026-11-29 runs, and each baseline now makes 1 + `--hf-repeats` calls), so a W2 run under
a 10-minute limit is split: `--skip-w1 --no-hf-static`, then `--skip-w1 --no-hf-dynamic`. Without
flags everything runs in one go. `--skip-w1 --skip-w2` leaves only the start-up rows.

Model: Qwen3-0.6B-shaped (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate
3072, vocab 151936, tied embeddings), random bf16 weights, written by the tiny-model kit.
W1: 64 requests of 512 prompt-embeds rows, 128 output tokens each, greedy, ignore_eos.
W2: 256 requests, prompt and output lengths uniform in [100, 1024], prompt embeds, ignore_eos.

Order of one run (the Bridge engine is the first thing built in the process):
1. `LLM(...)` construction, timed (`construction_seconds`, with its Triton builds and how many of them
   the on-disk cache answered: a warm machine constructs faster), then `llm.memory_report()` when the
   engine has it (printed and stored).
2. The first generate on that engine: one 512-row prompt-embeds prompt from CPU tensors,
   max_tokens=1 (`first_generate_seconds`).
3. Each workload on three Bridge paths: prompt embeds as pageable CPU tensors (the way users hand
   them over, the main "embeds" row), the same embeds already on the device, and the token ids whose
   embeddings they are. One warm-up run of each path, then the timed repetitions (W1 `--w1-repeats`,
   others `--repeats`), each repetition running the three paths back to back in a rotating order.
   Throughput is the median per path. The embeds/ids ratio is the median over repetitions of the
   ratio within one repetition (CPU-tensor embeds over ids); the ratio of the medians is kept too.
   Tokens are checked to match among the three paths.
4. The step 2 request again, warm: the median of 3 (`warm_single_seconds`), and first / warm.
5. The engine is shut down; the copy bandwidth and bf16 matmul rate are measured.
6. Hugging Face baselines (benchmarks/hf_baselines.py), `AutoModelForCausalLM` with sdpa, each
   warmed by one full-size run (same batches and lengths) and then timed `--hf-repeats` times
   (median): the dynamic cache, and the static cache with the decode compiled by torch.compile
   (mode reduce-overhead; transformers 5.x compiles it inside `generate`), whose first full-size call
   is reported as its compile time. W1 runs as one batch of 64; W2 runs the first `--hf-w2-subset`
   requests as one left-padded batch generating to the subset's longest output, counting only the
   tokens each request asked for. Peak GPU memory of each over its timed runs, minus the weights.

Roofline: every decode step reads all weights once and the KV of every live request at the measured
device-to-device copy bandwidth (read + write bytes over time); prefill runs its FLOPs (linear layers
plus causal attention) at the measured bf16 matmul rate. Requests run perfectly batched.

Targets: W1 embeds (CPU tensors) >= 60% of the roofline and >= 4x HF (static compiled when it ran,
else the warm dynamic cache); W2 >= 75% of the roofline; embeds/ids >= 0.98; first generate <= 2x
the warm one; construction < 15 s.

`--cpu`: a tiny model (hidden 64, 2 layers), 32 requests, the same steps; the HF static cache runs
eager (no compile) unless `--hf-static-compile`; the targets print as information only.

Writes JSON to `--out`, else `$OUT/generate_benchmark.json` when `$OUT` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BENCH = pathlib.Path(__file__).resolve().parent
for _p in (BENCH.parent, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from hf_baselines import log, run_hf_baselines, run_hf_generate, sync  # noqa: E402, F401  (re-exported)

from bridge.tiny_models import build_tiny_model  # noqa: E402
from runner.llm import LLM  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960)
TARGET_VS_HF = 4.0  # W1, against HF static compiled when it ran, else the warm dynamic cache
TARGET_VS_ROOFLINE = {"W1": 0.60, "W2": 0.75}
TARGET_EMBEDS_VS_IDS = 0.98
TARGET_FIRST_OVER_WARM = 2.0
TARGET_CONSTRUCTION_SECONDS = 15.0
SINGLE_ROWS = 512  # the start-up request: one prompt of this many prompt-embeds rows, max_tokens=1
TEMPERATURE = 0.0  # --temperature (the profile runs read it)
PATHS = ("embeds", "embeds_device", "ids")  # embeds: CPU tensors (pageable); embeds_device: on the device


# ------------------------------------------------------------------------------------------ hardware

def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes moved per second by a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def measure_matmul_rate(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def roofline_tok_s(config, weight_bytes: int, prompt_lens: list[int], output_lens: list[int],
                   bandwidth: float, matmul_rate: float) -> dict:
    """Ideal time: decode steps at copy bandwidth (weights + live KV), prefill FLOPs at matmul rate."""
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    heads, head_dim = config.num_attention_heads, config.head_dim
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    # Non-embedding parameters (the LM head runs for one row per request: negligible).
    embed_params = config.vocab_size * config.hidden_size
    linear_params = weight_bytes // 2 - embed_params
    prefill_flops = sum(2 * linear_params * n + 2 * layers * heads * head_dim * n * n for n in prompt_lens)
    # Decode step s (s >= 1) runs every request that still needs its (s+1)-th token.
    decode_bytes = 0
    for s in range(1, max(output_lens)):
        live = [p + s for p, o in zip(prompt_lens, output_lens) if o > s]
        if live:
            decode_bytes += weight_bytes + kv_bytes_per_token * sum(live)
    t = decode_bytes / bandwidth + prefill_flops / matmul_rate
    return {"tok_s": sum(output_lens) / t, "seconds": t, "decode_bytes": decode_bytes,
            "prefill_flops": prefill_flops}


# ------------------------------------------------------------------------------------------ runs

def run_bridge(llm: LLM, prompts: list[dict], output_lens: list[int], device: torch.device,
               temperature: float = 0.0) -> dict:
    # Sampled runs seed each request (seed = its index), so both paths draw the same tokens.
    params = [SamplingParams(max_tokens=o, temperature=temperature, ignore_eos=True,
                             seed=i if temperature > 0 else None) for i, o in enumerate(output_lens)]
    compiles = getattr(llm, "kernel_compiles", None)
    built_before = compiles.count if compiles else 0
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    dt = time.perf_counter() - t0
    built = (compiles.count if compiles else 0) - built_before
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(output_lens), "ignore_eos run produced fewer tokens than asked"
    assert llm.stats().all_free
    return {"tok_s": n_out / dt, "seconds": dt, "output_tokens": n_out, "kernel_builds": built,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def write_results(results: dict, out: str | None, default_name: str) -> None:
    """Write `results` as JSON to `out`, or to $OUT/default_name when $OUT is set (device runs)."""
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], default_name)
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(json.dumps(results, indent=2))
        print(f"wrote {out}")


def add_side_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of an A/B benchmark whose sides run in child processes of the same script
    (`child_result`): the model, the output, and the hidden child flags, one side's graph cap."""
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (a smoke run; no graphs)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mixed", type=int, default=None, help=argparse.SUPPRESS)


def child_result(cmd: list[str], what: str, env: dict | None = None) -> dict:
    """Run one side of an A/B benchmark in its own process (`cmd`) and return the JSON it printed on its
    last `RESULT ` line; a side that fails or prints none ends the benchmark with its output."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{what} failed")
    return json.loads(lines[-1][len("RESULT "):])


def token_match(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / max(1, sum(len(r) for r in a))


# ------------------------------------------------------------------------------------------ main

def build_model(path: pathlib.Path, cpu: bool) -> pathlib.Path:
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        log(f"reusing model directory {path}")
        return path
    log(f"building model directory {path}")
    if cpu:
        return build_tiny_model(path, "qwen3", seed=0, max_position_embeddings=4096)
    return build_tiny_model(path, "qwen3", seed=0, dtype=torch.bfloat16, **QWEN3_06B)


def embed_rows(model_dir: pathlib.Path, ids: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each prompt's input embeddings as a pageable CPU tensor, looked up in the checkpoint's table.

    Read from the safetensors file rather than through a model, so that nothing touches the GPU
    before the engine is built. The rows equal HF's `get_input_embeddings()(ids)` exactly.
    """
    from safetensors import safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            key = next((k for k in st.keys() if k.endswith("embed_tokens.weight")), None)
            if key is not None:
                table = st.get_tensor(key).to(dtype)
                return [table[torch.tensor(i)] for i in ids]
    raise RuntimeError(f"no embed_tokens.weight in {model_dir}")


def profile_paths(llm, prompts_of: dict, output_lens: list[int], device) -> None:
    """Where the time goes on each path: torch.profiler's top operators by CPU and by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    for path, prompts in prompts_of.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_bridge(llm, prompts, output_lens, device, TEMPERATURE)
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            log(f"profile of the {path} path, top operators by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=12), flush=True)


def median_run(runs: list[dict]) -> dict:
    """The median throughput of repeated runs (tokens from the last run, for the match check)."""
    tok_s = statistics.median(r["tok_s"] for r in runs)
    return {**runs[-1], "tok_s": tok_s, "seconds": runs[-1]["seconds"] * runs[-1]["tok_s"] / tok_s,
            "all_tok_s": [r["tok_s"] for r in runs]}


def workload(n: int, lo: int, hi: int, out_lo: int, out_hi: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompt_lens = [rng.randint(lo, hi) for _ in range(n)]
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(10, vocab, (p,), generator=g).tolist() for p in prompt_lens]
    return ids, prompt_lens, output_lens


def run_paths(llm, name: str, prompts_of: dict[str, list[dict]], output_lens: list[int], device,
              repeats: int, temperature: float) -> dict[str, dict]:
    """One warm-up run of every path, then `repeats` timed repetitions of all paths back to back.

    The order rotates and flips between repetitions, so no path always goes first or always follows
    the same one, and none pays another's first-use costs (Triton specialisations, allocator).
    """
    runs: dict[str, list[dict]] = {p: [] for p in prompts_of}
    paths = list(prompts_of)
    for rep in range(repeats + 1):
        k = (rep // 2) % len(paths)
        order = paths[k:] + paths[:k]
        for path in order if rep % 2 == 0 else order[::-1]:
            res = run_bridge(llm, prompts_of[path], output_lens, device, temperature)
            label = "warm-up" if rep == 0 else f"run {rep}"
            builds = ""
            if res["kernel_builds"]:
                recent = getattr(getattr(llm, "kernel_compiles", None), "recent", [])
                names = ", ".join(n.split(" ", 1)[0] for n, _ in recent[-res["kernel_builds"]:])
                builds = f", {res['kernel_builds']} Triton builds ({names})"
            log(f"{name}: Bridge {path} path ({label}): {res['tok_s']:.0f} tok/s in {res['seconds']:.2f}s"
                + builds)
            if rep:
                runs[path].append(res)
    return {p: median_run(r) for p, r in runs.items()}


def memory_report(llm) -> dict | None:
    """`llm.memory_report()` when the engine has it (None otherwise, or with the error when it raises)."""
    fn = getattr(llm, "memory_report", None)
    if fn is None:
        return None
    try:
        return dict(fn())
    except Exception as e:  # noqa: BLE001  (a report, not a reason to stop the benchmark)
        return {"error": f"{type(e).__name__}: {e}"}


def fmt_value(key: str, v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and key.endswith("bytes"):
        return f"{v:,} ({v / 2**30:.3f} GiB)"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU, 32 requests, no targets")
    ap.add_argument("--out", default=None, help="JSON output path (default: $OUT/generate_benchmark.json)")
    ap.add_argument("--model-dir", default=None, help="where to build (or reuse) the model directory")
    ap.add_argument("--skip-w1", action="store_true", help="W2 only (start-up rows still run)")
    ap.add_argument("--skip-w2", action="store_true")
    ap.add_argument("--repeats", type=int, default=2,
                    help="W2 (and CPU): timed runs per path after one warm-up run (the median is reported)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="Bridge's share of the GPU (0.85 leaves HF's baselines room in this process)")
    ap.add_argument("--w1-repeats", type=int, default=9,
                    help="W1: timed runs per path (each takes about half a second; the median is reported)")
    ap.add_argument("--hf-repeats", type=int, default=3,
                    help="HF baselines: timed runs after one full-size warm-up run (the median is reported)")
    ap.add_argument("--no-hf-static", action="store_true", help="skip the HF static-cache baseline")
    ap.add_argument("--no-hf-dynamic", action="store_true",
                    help="skip the HF dynamic-cache baseline (W2's takes minutes; split a run in two)")
    ap.add_argument("--hf-static-compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile HF's static-cache decode (default: on with CUDA, off with --cpu)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables for W1 (every path)")
    ap.add_argument("--hf-w2-subset", type=int, default=32)
    ap.add_argument("--decode-window", type=int, default=None,
                    help="greedy decode steps per host sync (default: the engine's, 32 with CUDA graphs)")
    ap.add_argument("--no-fused-ops", action="store_true", help="keep HF's own RMSNorm and rotary (A/B)")
    ap.add_argument("--no-fused-layers", action="store_true",
                    help="keep HF's decoder-layer forward (runner.layers.fused_layers off; A/B)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (A/B)")
    ap.add_argument("--async-scheduling", choices=("default", "on", "off"), default="default",
                    help="overlap step n+1's host work with step n's device work (A/B; default: engine's)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="Bridge samples at this temperature, each request seeded (0: greedy, the default)")
    return ap.parse_args(argv)


def bridge_phase(args, model_dir, device, dtype, specs, embeds_of, single_embeds, results) -> None:
    """Construction, first generate, the workloads on three paths, warm single; then shutdown."""
    max_len = max((p + o for _, pl, ol in specs.values() for p, o in zip(pl, ol)), default=0)
    log("Bridge: building the engine (weights, KV cache, CUDA graphs); the first LLM of this process")
    t0 = time.perf_counter()
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype=dtype, device=device,
              max_num_seqs=32 if args.cpu else 256, max_num_batched_tokens=2048 if args.cpu else 16384,
              max_model_len=max(max_len, SINGLE_ROWS + 1) + 16,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, decode_window=args.decode_window,
              async_scheduling={"default": None, "on": True, "off": False}[args.async_scheduling],
              **({"fused_ops": False} if args.no_fused_ops else {}),
              **({"fused_layers": False} if args.no_fused_layers else {}))
    results["construction_seconds"] = results["bridge_init_seconds"] = time.perf_counter() - t0
    # How cold the construction was: a Triton cache filled by an earlier process makes it look fast.
    compiles = getattr(llm, "kernel_compiles", None)
    if compiles is not None:
        results["construction_triton_builds"] = compiles.count
        results["construction_triton_disk_cache_hits"] = compiles.disk_cache_hits
    log(f"  constructed in {results['construction_seconds']:.2f}s, {llm.stats().num_total_blocks} KV blocks")
    results["memory_report"] = memory_report(llm)  # not a generate call: the next one is still the first
    # The very first generate on this engine: one request, CPU tensors, max_tokens=1.
    single = [{"prompt_embeds": single_embeds}]
    first = run_bridge(llm, single, [1], device)
    results["first_generate_seconds"] = first["seconds"]
    log(f"  first generate ({SINGLE_ROWS} prompt-embeds rows from the CPU, max_tokens=1): "
        f"{first['seconds'] * 1e3:.1f} ms")
    results["device"] = (torch.cuda.get_device_name(device) if device.type == "cuda"
                         else platform.processor() or "cpu")
    results["kv_blocks"] = llm.stats().num_total_blocks
    results["engine"] = {
        "cuda_graph_sizes": sorted(llm.runner.graphs), "decode_window": llm.decode_window,
        "fused_rmsnorms": llm.runner.num_fused_norms, "fused_rotary": llm.runner.fused_rotary,
        "fused_linears": list(getattr(llm.runner, "num_fused_linears", (0, 0))),
        "fused_layers": getattr(llm.runner, "num_fused_layers", 0),
        "max_num_seqs": llm.engine_config.max_num_seqs,
        "max_num_batched_tokens": llm.engine_config.max_num_batched_tokens,
        "async_scheduling": llm.async_scheduling, "temperature": args.temperature,
    }

    for name, (ids, prompt_lens, output_lens) in specs.items():
        cpu_embeds = embeds_of[name]
        prompts_of = {
            "embeds": [{"prompt_embeds": e} for e in cpu_embeds],
            "embeds_device": [{"prompt_embeds": e.to(device)} for e in cpu_embeds],
            "ids": [{"prompt_token_ids": i} for i in ids],
        }
        repeats = args.w1_repeats if name == "W1" else args.repeats
        med = run_paths(llm, name, prompts_of, output_lens, device, repeats, args.temperature)
        if args.profile and name == "W1":
            profile_paths(llm, prompts_of, output_lens, device)
        del prompts_of
        emb, dev, tok = med["embeds"], med["embeds_device"], med["ids"]
        results["workloads"][name] = {
            "requests": len(ids), "prompt_tokens": sum(prompt_lens), "output_tokens": sum(output_lens),
            "embeds_source": "CPU tensors (pageable)",
            "bridge_embeds_tok_s": emb["tok_s"], "bridge_embeds_device_tok_s": dev["tok_s"],
            "bridge_token_ids_tok_s": tok["tok_s"],
            "bridge_embeds_seconds": emb["seconds"], "bridge_embeds_device_seconds": dev["seconds"],
            "bridge_token_ids_seconds": tok["seconds"],
            "embeds_vs_token_ids_token_match": token_match(emb["tokens"], tok["tokens"]),
            "embeds_device_vs_token_ids_token_match": token_match(dev["tokens"], tok["tokens"]),
            "embeds_vs_embeds_device_token_match": token_match(emb["tokens"], dev["tokens"]),
            # Paired: each repetition runs the paths back to back, so the ratio within a repetition
            # cancels the drift between repetitions (clocks, host noise) that the ratio of medians keeps.
            "embeds_over_token_ids": statistics.median(
                e / i for e, i in zip(emb["all_tok_s"], tok["all_tok_s"])),
            "embeds_over_token_ids_of_medians": emb["tok_s"] / tok["tok_s"],
            "embeds_device_over_token_ids": statistics.median(
                e / i for e, i in zip(dev["all_tok_s"], tok["all_tok_s"])),
            "bridge_embeds_all_tok_s": emb["all_tok_s"], "bridge_embeds_device_all_tok_s": dev["all_tok_s"],
            "bridge_token_ids_all_tok_s": tok["all_tok_s"],
        }

    warm = [run_bridge(llm, single, [1], device)["seconds"] for _ in range(3)]
    results["warm_single_seconds"] = statistics.median(warm)
    results["warm_single_all_seconds"] = warm
    results["first_over_warm"] = results["first_generate_seconds"] / results["warm_single_seconds"]
    log(f"  warm single request: {results['warm_single_seconds'] * 1e3:.1f} ms (median of 3); "
        f"first / warm {results['first_over_warm']:.2f}")
    results["cuda_graph_replays"] = llm.runner.num_graph_replays
    results["decode_windows"] = llm.runner.num_decode_windows
    results["preemptions"] = llm.stats().num_preemptions
    results["async_steps"] = getattr(llm, "num_async_steps", 0)
    llm.shutdown()  # frees the KV cache, graphs and weights for the HF baselines


def hf_phase(args, model_dir, device, dtype, specs, embeds_of, results) -> int:
    """Both HF baselines on every workload; returns the weight bytes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    work = {}
    for name, (ids, _, output_lens) in specs.items():
        n = min(args.hf_w2_subset, len(ids)) if name == "W2" else len(ids)
        work[name] = (embeds_of[name][:n], output_lens[:n], n)  # one batch
    compile_decode = args.hf_static_compile if args.hf_static_compile is not None else not args.cpu
    hf_res = run_hf_baselines(hf, work, device, args.hf_repeats, weight_bytes,
                              static=not args.no_hf_static, compile_decode=compile_decode,
                              dynamic=not args.no_hf_dynamic)
    results["hf_static_compiled"] = compile_decode and not args.no_hf_static
    for name, r in hf_res.items():
        e = results["workloads"][name]
        dyn, static = r.get("dynamic"), r.get("static")
        e["hf_requests"] = work[name][2]
        if dyn is not None:
            e.update(hf_dynamic=dyn, hf_tok_s=dyn["tok_s"], hf_all_tok_s=dyn["all_tok_s"],
                     hf_first_seconds=dyn["first_seconds"],
                     embeds_over_hf=e["bridge_embeds_tok_s"] / dyn["tok_s"])
        if static is not None:
            e["hf_static"] = static
            if "error" not in static:
                e["hf_static_tok_s"] = static["tok_s"]
                e["embeds_over_hf_static"] = e["bridge_embeds_tok_s"] / static["tok_s"]
        if name == "W2":
            e["hf_note"] = (
                f"HF ran the first {work[name][2]} requests as one left-padded batch generating to the "
                "subset's longest output (min_new_tokens = max_new_tokens); its tok/s counts only the "
                "tokens those requests asked for")
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return weight_bytes


def judge(args, config, weight_bytes, specs, results) -> None:
    """Roofline (GPU) and the pass table of every workload and of start-up."""
    for name, (_, prompt_lens, output_lens) in specs.items():
        e = results["workloads"][name]
        passes = {}
        if not args.cpu:
            roof = roofline_tok_s(config, weight_bytes, prompt_lens, output_lens,
                                  results["copy_bandwidth_Bps"], results["bf16_matmul_flops"])
            e.update(roofline_tok_s=roof["tok_s"], roofline_seconds=roof["seconds"],
                     embeds_over_roofline=e["bridge_embeds_tok_s"] / roof["tok_s"])
            if name in TARGET_VS_ROOFLINE:
                t = TARGET_VS_ROOFLINE[name]
                passes[f"embeds >= {t:.0%} roofline"] = e["embeds_over_roofline"] >= t
        static_ran = "embeds_over_hf_static" in e and results["hf_static_compiled"]
        if name in ("W1", "CPU") and (static_ran or "embeds_over_hf" in e):
            ref = "HF static compiled" if static_ran else "HF dynamic (warm)"
            e["hf_reference"] = ref
            x = e["embeds_over_hf_static"] if static_ran else e["embeds_over_hf"]
            passes[f"embeds >= {TARGET_VS_HF}x {ref}"] = x >= TARGET_VS_HF
        passes[f"embeds >= {TARGET_EMBEDS_VS_IDS}x token ids"] = \
            e["embeds_over_token_ids"] >= TARGET_EMBEDS_VS_IDS
        passes["tokens match on all three paths"] = min(
            e["embeds_vs_token_ids_token_match"], e["embeds_device_vs_token_ids_token_match"],
            e["embeds_vs_embeds_device_token_match"]) == 1.0
        e["pass"] = passes
    results["pass"] = {
        f"construction < {TARGET_CONSTRUCTION_SECONDS:.0f} s":
            results["construction_seconds"] < TARGET_CONSTRUCTION_SECONDS,
        f"first generate <= {TARGET_FIRST_OVER_WARM}x warm":
            results["first_over_warm"] <= TARGET_FIRST_OVER_WARM,
    }


def print_summary(args, results) -> None:
    print()
    print(f"Device: {results['device']}   model: {results['model']}")
    eng = results["engine"]
    print(f"engine: CUDA graphs {len(eng['cuda_graph_sizes'])} buckets, "
          f"decode window {eng['decode_window']}, "
          f"fused RMSNorm x{eng['fused_rmsnorms']}, fused rotary {eng['fused_rotary']}, "
          f"fused MLP/QKV {eng['fused_linears']}, fused layers {eng['fused_layers']}, "
          f"{results['kv_blocks']} KV blocks, {results['preemptions']} preemptions")
    print(f"async scheduling {eng['async_scheduling']} ({results['async_steps']} overlapped steps), "
          f"temperature {eng['temperature']}")
    if not args.cpu:
        print(f"copy bandwidth {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
              f"bf16 matmul {results['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    builds = results.get("construction_triton_builds")
    hits = results.get("construction_triton_disk_cache_hits")
    cold = ("" if builds is None else f" ({builds} Triton builds, {hits} of them loaded from the disk cache; "
            "construction.py measures an empty cache)")
    print(f"\nstart-up: construction {results['construction_seconds']:.2f} s{cold}, first generate "
          f"{results['first_generate_seconds'] * 1e3:.1f} ms, "
          f"warm single {results['warm_single_seconds'] * 1e3:.1f} ms (median of 3), "
          f"first / warm {results['first_over_warm']:.2f}  "
          f"(one {SINGLE_ROWS}-row prompt-embeds request from CPU tensors, max_tokens=1)")
    report = results.get("memory_report")
    print("\nBridge memory_report():" + (" not available on this engine" if report is None else ""))
    for k, v in (report or {}).items():
        print(f"  {k:<28}{fmt_value(k, v)}")

    header = (f"{'workload':<9}{'embeds(CPU)':>12}{'embeds(dev)':>12}{'ids':>10}{'roofline':>10}"
              f"{'% roof':>8}{'emb/ids':>9}{'dev/ids':>9}{'match':>7}")
    print("\nBridge tok/s (embeds = CPU tensors, the main row)")
    print(header)
    print("-" * len(header))
    for name, e in results["workloads"].items():
        roof = e.get("roofline_tok_s")
        match = min(e["embeds_vs_token_ids_token_match"], e["embeds_device_vs_token_ids_token_match"],
                    e["embeds_vs_embeds_device_token_match"])
        print(f"{name:<9}{e['bridge_embeds_tok_s']:>12.0f}{e['bridge_embeds_device_tok_s']:>12.0f}"
              f"{e['bridge_token_ids_tok_s']:>10.0f}{(f'{roof:.0f}' if roof else '-'):>10}"
              f"{(format(e['embeds_over_roofline'], '.0%') if roof else '-'):>8}"
              f"{e['embeds_over_token_ids']:>9.3f}{e['embeds_device_over_token_ids']:>9.3f}{match:>7.0%}")

    header = (f"{'workload':<9}{'baseline':<26}{'tok/s':>9}{'first call s':>14}{'Bridge x':>10}"
              f"{'peak-weights':>14}")
    print(f"\nBridge embeds (CPU tensors) vs Hugging Face generate, warm (median of {args.hf_repeats} "
          "after one full-size run)")
    print(header)
    print("-" * len(header))
    static_label = "static compiled" if results.get("hf_static_compiled") else "static eager"
    for name, e in results["workloads"].items():
        for label, r in (("dynamic (warm)", e.get("hf_dynamic")), (static_label, e.get("hf_static"))):
            if r is None:
                continue
            if "error" in r:
                print(f"{name:<9}{label:<26}  error: {r['error'][:200]}")
                continue
            peak = r.get("peak_minus_weights_bytes")
            peak_s = f"{peak / 2**30:.2f} GiB" if peak is not None else "-"
            print(f"{name:<9}{label:<26}{r['tok_s']:>9.0f}{r['first_seconds']:>14.2f}"
                  f"{e['bridge_embeds_tok_s'] / r['tok_s']:>10.1f}{peak_s:>14}")
            for err in r.get("errors", []):
                print(f"{'':<9}{'':<26}  (fullgraph=True raised first: {err[:200]})")
    print("  (first call s: the untimed full-size warm-up call; for static compiled, the compile)")

    print("\ntargets" + (" (GPU targets; information only on --cpu)" if args.cpu else ""))
    for target, ok in results["pass"].items():
        print(f"start-up: {target}: {'PASS' if ok else 'FAIL'}")
    for name, e in results["workloads"].items():
        for target, ok in e.get("pass", {}).items():
            print(f"{name}: {target}: {'PASS' if ok else 'FAIL'}")
        print(f"{name}: embeds/ids {e['embeds_over_token_ids']:.3f} (median of paired runs), "
              f"{e['embeds_over_token_ids_of_medians']:.3f} (ratio of medians)")
        if "hf_note" in e:
            print(f"{name}: {e['hf_note']}")


def bench_setup(args) -> tuple[torch.device, pathlib.Path, torch.dtype]:
    """Device (falling back to `--cpu` without CUDA), the model directory (built unless it exists)
    and dtype of a W1-model benchmark; `args` needs `cpu` and `model_dir`."""
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.cpu:
        log("no CUDA device: running the --cpu benchmark")
        args.cpu = True
    if args.cpu:
        # Tiny ops are dominated by OpenMP contention on a shared box; one thread for both engines.
        torch.set_num_threads(1)
    model_dir = pathlib.Path(args.model_dir or pathlib.Path(tempfile.gettempdir()) / (
        "bridge_bench_tiny" if args.cpu else "bridge_bench_qwen3_06b"))
    build_model(model_dir, args.cpu)
    return device, model_dir, torch.float32 if args.cpu else torch.bfloat16


def main(argv=None) -> int:
    args = parse_args(argv)
    global TEMPERATURE
    TEMPERATURE = args.temperature

    device, model_dir, dtype = bench_setup(args)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    vocab = config.vocab_size
    results: dict = {"torch": torch.__version__, "workloads": {},
                     "model": "qwen3 tiny" if args.cpu else "Qwen3-0.6B-shaped (random bf16)"}
    if args.cpu:
        specs = {"CPU": workload(32, 16, 96, 32, 32, vocab, seed=1)}
    else:
        specs = {} if args.skip_w1 else {"W1": workload(64, 512, 512, 128, 128, vocab, seed=1)}
        if not args.skip_w2:
            specs["W2"] = workload(256, 100, 1024, 100, 1024, vocab, seed=2)
    single_ids = workload(1, SINGLE_ROWS, SINGLE_ROWS, 1, 1, vocab, seed=3)[0]
    embeds_of = {name: embed_rows(model_dir, ids, dtype) for name, (ids, _, _) in specs.items()}
    single_embeds = embed_rows(model_dir, single_ids, dtype)[0]

    bridge_phase(args, model_dir, device, dtype, specs, embeds_of, single_embeds, results)
    if not args.cpu:
        log("measuring copy bandwidth and matmul rate")
        results["copy_bandwidth_Bps"] = measure_copy_bandwidth(device)
        results["bf16_matmul_flops"] = measure_matmul_rate(device)
        log(f"  copy {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
            f"matmul {results['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    weight_bytes = hf_phase(args, model_dir, device, dtype, specs, embeds_of, results)
    results["weight_bytes"] = weight_bytes
    judge(args, config, weight_bytes, specs, results)
    print_summary(args, results)
    write_results(results, args.out, "generate_benchmark.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where W1's time goes (GPU): phase timings, kernel table, host/GPU timeline, host profile.

W1 as in `benchmarks/generate.py` (Qwen3-0.6B-shaped random bf16, 64 x 512 prompt rows, 128 new
tokens, greedy, ignore_eos). Diagnostics, not a target: they explain the numbers generate.py prints.

    python benchmarks/w1_diagnose.py breakdown   # generate time by max_tokens (1..128) for both paths;
                                                 # CUDA kernel table of one run and the GPU-busy share;
                                                 # cuBLAS time of the decode GEMM shapes (M=64, 128)
    python benchmarks/w1_diagnose.py timeline    # host and GPU time of every engine call of one run:
                                                 # lag ~0 means the GPU waited for the host there
    python benchmarks/w1_diagnose.py hostprof    # flagged host syncs (sync debug mode) and a cProfile
                                                 # of the eager prefill launches
    python benchmarks/w1_diagnose.py startprof   # cProfile of the host work before the first step
                                                 # launches (prompt processing, first schedule), per path
    python benchmarks/w1_diagnose.py hostgap [--workload W2]
                                                 # prompt embeds from CPU tensors (as users pass them)
                                                 # vs device-resident vs token ids: medians of 3
                                                 # interleaved runs, then a cProfile of one whole
                                                 # generate per embeds path (where the CPU path's
                                                 # extra host time goes; issue 14's 0.98x target)
    python benchmarks/w1_diagnose.py phases [--workload W2]
                                                 # GPU time of one generate (device embeds) by kind of
                                                 # engine call (prefill/mixed steps, single decode steps,
                                                 # decode windows) and GPU idle, beside the roofline's
                                                 # prefill and decode parts; kernel tables of one decode
                                                 # window and one prefill/mixed step from its middle

The first three modes pass device-resident embeds; `hostgap` also passes them as pageable CPU tensors.
`--workload W2` (hostgap and phases): 256 requests, prompt and output lengths uniform in [100, 1024].
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import pathlib
import pstats
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import generate as G  # noqa: E402

from runner.llm import LLM  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda")


# (requests, prompt length range, output length range, seed), as in benchmarks/generate.py
WORKLOADS = {"W1": (64, (512, 512), (128, 128), 1), "W2": (256, (100, 1024), (100, 1024), 2)}


def build(workload: str = "W1") -> tuple[LLM, list[dict], list[dict], list[int]]:
    from transformers import AutoConfig

    model_dir = pathlib.Path("/tmp/bridge_bench_qwen3_06b")
    G.build_model(model_dir, False)
    config = AutoConfig.from_pretrained(model_dir)
    n, (lo, hi), (out_lo, out_hi), seed = WORKLOADS[workload]
    ids, prompt_lens, output_lens = G.workload(n, lo, hi, out_lo, out_hi, config.vocab_size, seed=seed)
    longest = max(p + o for p, o in zip(prompt_lens, output_lens))
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype=torch.bfloat16, device=DEVICE, max_num_seqs=256,
              max_num_batched_tokens=16384, max_model_len=max(1024, longest + 16),
              gpu_memory_utilization=0.85)
    embed = llm.runner.model.get_input_embeddings()
    embeds = [{"prompt_embeds": embed(torch.tensor(i, device=DEVICE)).detach()} for i in ids]
    return llm, embeds, [{"prompt_token_ids": i} for i in ids], output_lens


def run(llm: LLM, prompts: list[dict], max_tokens: int | list[int]) -> float:
    lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def warm_up(llm: LLM, embeds: list[dict], ids: list[dict]) -> None:
    for _ in range(2):
        for prompts in (embeds, ids):
            run(llm, prompts, 128)
            run(llm, prompts, 2)


# ------------------------------------------------------------------------------------------ breakdown

def breakdown(llm: LLM, embeds: list[dict], ids: list[dict]) -> None:
    for mt in (1, 2, 16, 64, 128):
        e = [run(llm, embeds, mt) for _ in range(5)]
        i = [run(llm, ids, mt) for _ in range(5)]
        print(f"max_tokens {mt:4d}: embeds {statistics.median(e) * 1e3:7.1f} ms  ids "
              f"{statistics.median(i) * 1e3:7.1f} ms", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = run(llm, embeds, 128)
    total, count = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    busy = sum(total.values()) / 1e3
    print(f"profiled wall {wall * 1e3:.1f} ms, kernel sum {busy:.1f} ms ({busy / (wall * 1e3):.0%} busy)")
    for name, t in total.most_common(30):
        print(f"{t / 1e3:9.2f} ms {count[name]:7d} x {t / count[name]:8.2f} us  {name[:110]}")

    shapes = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}
    bandwidth = G.measure_copy_bandwidth(DEVICE)
    for m in (64, 128):
        for name, (k, n) in shapes.items():
            weights = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(28)]
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

            def body(weights=weights, x=x):
                for w in weights:
                    torch.nn.functional.linear(x, w)

            body()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                graph.replay()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 50 / 28
            print(f"M={m} {name:8s} K={k} N={n}: {dt * 1e6:6.2f} us/GEMM, "
                  f"{n * k * 2 / dt / bandwidth:.0%} of copy BW", flush=True)


# ------------------------------------------------------------------------------------------- timeline

def timeline(llm: LLM, embeds: list[dict], ids: list[dict]) -> None:
    marks: list[tuple[str, float, torch.cuda.Event]] = []
    on = [False]

    def mark(label: str) -> None:
        if on[0]:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((label, time.perf_counter(), ev))

    def wrap(obj, name: str, info=None) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def wrapped(*a, **k):
            mark(name + ">" + (info(*a) if info else ""))
            out = f(*a, **k)
            mark(name + "<")
            return out

        setattr(obj, name, wrapped)

    def step_info(so, *_):
        return f" reqs={so.num_reqs} toks={so.total_num_tokens} decode={so.is_decode_only}"

    wrap(llm.runner, "launch", step_info)
    wrap(llm.runner, "finish")
    wrap(llm.runner, "launch_decode_window", lambda so, k, prev=None: f" reqs={so.num_reqs} k={k}")
    wrap(llm.runner, "finish_decode_window")
    for name in ("schedule", "schedule_decode_window", "update_window", "finish_step"):
        wrap(llm.scheduler, name)
    cpu = [{"prompt_embeds": p["prompt_embeds"].cpu()} for p in embeds]  # pageable, as users pass them
    for path, prompts in (("embeds", embeds), ("embeds_cpu", cpu), ("ids", ids)):
        for mt in (2, 128):
            marks.clear()
            on[0] = True
            mark("start")
            wall = run(llm, prompts, mt)
            mark("end")
            torch.cuda.synchronize()
            on[0] = False
            print(f"=== {path} max_tokens={mt}: wall {wall * 1e3:.1f} ms; host ms, GPU ms, lag (GPU - host)")
            h0, e0 = marks[0][1], marks[0][2]
            for label, h, ev in marks:
                host, gpu = (h - h0) * 1e3, e0.elapsed_time(ev)
                print(f"{host:8.2f} {gpu:8.2f} {gpu - host:7.2f}  {label}")


# -------------------------------------------------------------------------------------------- hostgap

def hostgap(llm: LLM, embeds: list[dict], ids: list[dict], output_lens: list[int]) -> None:
    cpu = [{"prompt_embeds": p["prompt_embeds"].cpu()} for p in embeds]  # pageable, as users pass them
    paths = {"embeds_cpu": cpu, "embeds_device": embeds, "ids": ids}
    for prompts in paths.values():  # first-use costs (uploader ring, kernels) outside the timed runs
        run(llm, prompts, output_lens)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(3):
        for name in list(paths)[rep % 3:] + list(paths)[: rep % 3]:
            times[name].append(run(llm, paths[name], output_lens))
    tokens = sum(output_lens)
    ids_s = statistics.median(times["ids"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:14s} {tokens / med:8.0f} tok/s  median {med * 1e3:8.1f} ms  vs ids {ids_s / med:.3f}  "
              f"runs {[round(t * 1e3, 1) for t in ts]}", flush=True)
    for name in ("embeds_cpu", "embeds_device"):
        pr = cProfile.Profile()
        pr.enable()
        wall = run(llm, paths[name], output_lens)
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(f"=== {name}: one generate in cProfile, wall {wall * 1e3:.1f} ms; host functions by own time")
        print(out.getvalue(), flush=True)


# -------------------------------------------------------------------------------------------- phases

def _kernel_table(prof, title: str, top: int = 14) -> None:
    total, count = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    busy = sum(total.values())
    print(f"--- {title}: kernel sum {busy / 1e3:.2f} ms")
    for name, t in total.most_common(top):
        print(f"{t / 1e3:8.3f} ms {t / busy:4.0%} {count[name]:6d} x {t / count[name]:8.2f} us  {name[:100]}")


def phases(llm: LLM, embeds: list[dict], output_lens: list[int], workload: str) -> None:
    """Where one generate's GPU time goes: each engine call's GPU work (from its first embedding lookup to
    the end of its last kernel) by kind, and the GPU idle before each call (the host staging it while
    nothing ran), against the roofline's two parts. A third run profiles one decode window and one
    prefill/mixed step from the middle of the run (kernel tables)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from runner.worker import decode_window

    config = AutoConfig.from_pretrained("/tmp/bridge_bench_qwen3_06b")
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    prompt_lens = [p["prompt_embeds"].shape[0] for p in embeds]
    bandwidth, rate = G.measure_copy_bandwidth(DEVICE), G.measure_matmul_rate(DEVICE)
    roof = G.roofline_tok_s(config, weight_bytes, prompt_lens, output_lens, bandwidth, rate)

    def event() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    mode = {"timing": False, "profile_at": {}}
    seen: collections.Counter = collections.Counter()
    calls: list[dict] = []  # per call: kind, steps, first (work start), last (work end)
    profiled: dict[str, tuple] = {}
    current: dict = {}

    def wrap_call(obj, name, kind_of, window: bool):
        f = getattr(obj, name)

        def wrapped(so, *a, **k):
            kind = kind_of(so)
            seen[kind] += 1
            prof = None
            if seen[kind] == mode["profile_at"].get(kind):
                torch.cuda.synchronize()
                prof = profile(activities=[ProfilerActivity.CUDA])
                prof.__enter__()
            current.clear()
            current.update(kind=kind, steps=a[0] if window else 1)
            out = f(so, *a, **k)
            if not window:  # a launch returns once its work is queued: the end of that work
                current["last"] = event() if mode["timing"] else None
            if mode["timing"]:
                calls.append(dict(current))
            if prof is not None:
                torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                profiled[kind] = (prof, so.num_reqs, current["steps"])
            return out

        setattr(obj, name, wrapped)

    build = llm.runner.embeds_builder.build

    def timed_build(*a, **k):  # the first embedding lookup of a call starts its GPU work
        if mode["timing"] and "first" not in current:
            current["first"] = event()
        return build(*a, **k)

    argmax = decode_window.greedy_argmax

    def timed_argmax(*a, **k):  # the window's last argmax ends its GPU work
        out = argmax(*a, **k)
        if mode["timing"]:
            current["last"] = event()
        return out

    llm.runner.embeds_builder.build = timed_build
    decode_window.greedy_argmax = timed_argmax
    wrap_call(llm.runner, "launch", lambda so: "decode step" if so.is_decode_only else "prefill/mixed step",
              False)
    wrap_call(llm.runner, "launch_decode_window", lambda so: "decode window", True)

    run(llm, embeds, output_lens)  # counts the calls of each kind
    counts = dict(seen)
    seen.clear()
    mode["timing"] = True
    start = event()
    wall = run(llm, embeds, output_lens)
    end = event()
    torch.cuda.synchronize()
    mode["timing"] = False
    span = start.elapsed_time(end)
    work, idle, steps = collections.Counter(), collections.Counter(), collections.Counter()
    prev_end = start
    for c in calls:
        first = c.get("first", c["last"])
        work[c["kind"]] += first.elapsed_time(c["last"])
        idle[c["kind"]] += max(0.0, prev_end.elapsed_time(first))
        steps[c["kind"]] += c["steps"]
        prev_end = c["last"]
    tail = prev_end.elapsed_time(end)
    print(f"=== {workload}: one generate, device embeds")
    print(f"wall {wall * 1e3:.1f} ms, GPU span {span:.1f} ms; roofline {roof['seconds'] * 1e3:.1f} ms "
          f"(prefill FLOPs {roof['prefill_flops'] / rate * 1e3:.1f} ms, decode bytes "
          f"{roof['decode_bytes'] / bandwidth * 1e3:.1f} ms)")
    print(f"{'kind':20s} {'GPU work':>10s} {'GPU idle before':>16s} {'calls':>6s} {'steps':>6s}")
    for kind, t in work.most_common():
        print(f"{kind:20s} {t:7.1f} ms {idle[kind]:13.1f} ms {counts.get(kind, 0):6d} {steps[kind]:6d}")
    print(f"after the last call's work: {tail:.1f} ms; idle in all {sum(idle.values()) + tail:.1f} ms "
          f"({(sum(idle.values()) + tail) / span:.1%} of the span)")

    mode["profile_at"] = {k: max(1, counts.get(k, 0) // 2) for k in ("decode window", "prefill/mixed step")}
    run(llm, embeds, output_lens)
    for kind, (prof, reqs, k) in profiled.items():
        _kernel_table(prof, f"one {kind} from the middle ({reqs} requests, {k} steps)")
    llm.runner.embeds_builder.build = build
    decode_window.greedy_argmax = argmax


# ------------------------------------------------------------------------------------------- startprof

def startprof(llm: LLM, embeds: list[dict], ids: list[dict]) -> None:
    """cProfile of the host work before the first step launches (prompt processing, then the first
    schedule, which admits the requests), per prompt path: the GPU idles through all of it."""
    cpu = [{"prompt_embeds": p["prompt_embeds"].cpu()} for p in embeds]  # pageable, as users pass them
    for name, prompts in (("ids", ids), ("embeds_device", embeds), ("embeds_cpu", cpu)):
        run(llm, prompts, 1)  # first-use costs outside the profile
        pr, first_launch, wall = _profile_until_first_launch(llm, prompts)
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(30)
        print(f"=== {name}: first launch after {first_launch * 1e3:.1f} ms (wall {wall * 1e3:.1f} ms)")
        print(out.getvalue(), flush=True)


def _profile_until_first_launch(llm: LLM, prompts: list[dict]) -> tuple[cProfile.Profile, float, float]:
    pr = cProfile.Profile()
    state = {"profiling": True, "t0": time.perf_counter(), "first_launch": 0.0}
    originals = (llm.processor.process, llm.scheduler.schedule, llm.runner.launch)

    def profiled(f):
        def wrapped(*a, **k):
            if not state["profiling"]:
                return f(*a, **k)
            pr.enable()
            try:
                return f(*a, **k)
            finally:
                pr.disable()
        return wrapped

    def launch(*a, **k):
        if state["profiling"]:
            state["profiling"] = False
            state["first_launch"] = time.perf_counter() - state["t0"]
        return originals[2](*a, **k)

    llm.processor.process, llm.scheduler.schedule = profiled(originals[0]), profiled(originals[1])
    llm.runner.launch = launch
    try:
        state["t0"] = time.perf_counter()
        wall = run(llm, prompts, 1)
    finally:
        llm.processor.process, llm.scheduler.schedule, llm.runner.launch = originals
    return pr, state["first_launch"], wall


# ------------------------------------------------------------------------------------------- hostprof

def hostprof(llm: LLM, embeds: list[dict], ids: list[dict]) -> None:
    for name, prompts in (("ids", ids), ("embeds", embeds)):
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(llm, prompts, 1)
            print(f"{name}: no flagged host sync in a prefill-only call")
        except RuntimeError:
            print(f"{name}: flagged host sync:\n" + "".join(traceback.format_exc().splitlines(True)[-8:]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        original = llm.runner.launch
        profiles = []

        def launch(*a, original=original, profiles=profiles, **k):
            pr = cProfile.Profile()
            pr.enable()
            try:
                return original(*a, **k)
            finally:
                pr.disable()
                profiles.append(pr)

        llm.runner.launch = launch
        wall = run(llm, prompts, 2)
        llm.runner.launch = original
        print(f"=== {name}: max_tokens=2 wall {wall * 1e3:.1f} ms, {len(profiles)} launches; the first:")
        out = io.StringIO()
        pstats.Stats(profiles[0], stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("breakdown", "timeline", "hostprof", "hostgap", "startprof", "phases"))
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W1", help="hostgap and phases only")
    args = ap.parse_args()
    if args.workload != "W1" and args.mode not in ("hostgap", "phases"):
        ap.error("--workload applies to hostgap and phases only")
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    llm, embeds, ids, output_lens = build(args.workload)
    if args.mode == "hostgap":
        hostgap(llm, embeds, ids, output_lens)
        return 0
    if args.mode == "phases":
        run(llm, embeds, output_lens)  # first-use costs outside the timed runs
        phases(llm, embeds, output_lens, args.workload)
        return 0
    warm_up(llm, embeds, ids)
    modes = {"breakdown": breakdown, "timeline": timeline, "hostprof": hostprof, "startprof": startprof}
    modes[args.mode](llm, embeds, ids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

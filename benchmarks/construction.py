"""Where `LLM(...)` construction time goes on a cold machine, with and without mixed-step graphs.

Why: construction must stay under 15 s for W1 (issue target), and most of it on a fresh machine is
Triton building kernel specialisations, which a warm on-disk cache hides. Each side runs in its own
process with an empty `TRITON_CACHE_DIR`, so every side pays its builds as a fresh machine would.
Reported per side: construction seconds, each start-up phase (`ModelRunner.startup_phases`: load,
profile, KV cache, mixed-step and decode graph captures, warm-up) with its Triton builds, and the
kernels built during the graph captures with their seconds.

One command, GPU (about two minutes on an H200):

    python benchmarks/construction.py [--sides 0,512,4096] [--warm-too] [--gpu-memory-utilization 0.85]
                                      [--out results.json]

`--sides`: values of `mixed_graph_max_tokens` (0: prefill and mixed steps eager), each optionally
`CAP:THREADS`, where THREADS sets `BRIDGE_KERNEL_BUILD_THREADS` for that side (start-up kernels
built side by side on that many threads, `runner.layers.triton_launch`; 0: one by one), e.g.
`--sides 16384:0,16384:8`. `--warm-too`: each side constructs a second time in a new process on the
cache its cold run filled (a restart on the same machine), reported as `<side> warm`. With build
threads, the `kernel_builds` phase's seconds are the measure: its builds ran side by side, and each
build's own line counts from its submission to the end of the pass. Each side also reports its KV blocks
and `LLM.memory_report()` at `--gpu-memory-utilization`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


class _Builds(logging.Handler):
    """Collects the kernel-build debug lines of `runner.worker.kernel_compiles` with their phase."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:220])


def child(args) -> int:
    from generate import bench_setup

    from runner.llm import LLM

    builds = _Builds()
    logger = logging.getLogger("runner.worker.kernel_compiles")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(builds)
    device, model_dir, dtype = bench_setup(args)
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, device=device, enable_prompt_embeds=True,
              gpu_memory_utilization=args.gpu_memory_utilization, mixed_graph_max_tokens=args.mixed)
    out = {"construct_s": time.perf_counter() - started,
           "phases": {k: {"seconds": s, "builds": n} for k, (s, n) in llm.runner.startup_phases.items()},
           "builds": builds.lines, "mixed_sizes": llm.runner.mixed_graphs.sizes,
           "gpu_memory_utilization": args.gpu_memory_utilization, "kv_blocks": llm.num_total_blocks,
           "memory_report": llm.memory_report()}
    print("RESULT " + json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from generate import add_side_arguments

    ap.add_argument("--sides", default="0,512,4096")
    ap.add_argument("--warm-too", action="store_true", help="a second, warm-cache construction per side")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="the engines' setting (0.85 as generate.py; 0.9 for issue 14's KV block count)")
    add_side_arguments(ap)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from generate import bench_setup, child_result, write_results

    if args.model_dir is None:  # built once, before the timed children
        args.model_dir = str(bench_setup(args)[1])
    results = {}
    for side in args.sides.split(","):
        cap, _, threads = side.partition(":")
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            if threads:
                env["BRIDGE_KERNEL_BUILD_THREADS"] = threads
            cmd = [sys.executable, __file__, "--child", "--mixed", cap, "--model-dir", args.model_dir,
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            cmd += ["--cpu"] if args.cpu else []
            runs = [side, f"{side} warm"] if args.warm_too else [side]
            for name in runs:  # the warm run reuses the cache directory the cold one filled
                res = results[name] = child_result(cmd, f"the side {name}", env)
                _report(name, res)
    write_results(results, args.out, "construction.json")
    return 0


def _report(name: str, res: dict) -> None:
    phases = ", ".join(f"{k} {v['seconds']:.2f} s ({v['builds']} builds)" for k, v in res["phases"].items())
    print(f"side {name} (mixed_graph_max_tokens[:build threads]): constructed in {res['construct_s']:.2f} s; "
          f"{phases}")
    print(f"  {res['kv_blocks']} KV blocks at gpu_memory_utilization={res['gpu_memory_utilization']}; "
          f"buckets {res['mixed_sizes']}; {len(res['builds'])} Triton builds in all:")
    for line in res["builds"]:
        print(f"    {line}")


if __name__ == "__main__":
    raise SystemExit(main())

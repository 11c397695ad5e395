"""Benchmark: the prompt-embeds overlay kernel against a per-request loop, torch.where and a copy.

Run on a CUDA machine from the repository root (about 20-40 s, most of it Triton compiles):

    python3 benchmarks/overlay.py            # add --no-sweep to skip the tile-shape sweep

Cases (hidden 4096, bf16, 256 live requests with 256 prompt-embedding rows each):
- prefill:      every request has 32 scheduled tokens, all inside its embeddings (8192 rows);
- decode-heavy: 224 requests decode past the end of their embeddings (1 token, nothing to
                overlay), 32 requests prefill 32 rows each;
- prefill+mask: as prefill, with 10% of positions marked is_token_ids (kept, not overlaid).

Methods, each checked bit-exact against PromptEmbedsState's torch path before timing:
- kernel:  PromptEmbedsState.apply (one Triton launch);
- loop:    a per-request torch loop over host-side metadata (slice copy per request);
- where:   torch.where over a full (num_tokens, hidden) source and mask (the gather excluded);
- copy:    a device-to-device copy of the same useful bytes (rows read + rows written).
GB/s counts useful bytes only (2 x overlaid rows x hidden x 2 bytes) for every method, so
"% copy" is the copy's time over the method's time. Timing: triton.testing.do_bench median, L2
flushed before each run. Targets (issue 2), judged on the prefill case with the default tile:
kernel >= 80% of copy bandwidth and >= 50x the loop. Exit status 1 when a target fails.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.layers.overlay_kernel import OverlayConfig, default_config  # noqa: E402
from runner.worker.prompt_embeds import PromptEmbedsState  # noqa: E402

HIDDEN = 4096
DTYPE = torch.bfloat16
NUM_REQS = 256
ROWS_PER_REQ = 256
CHUNK = 32
DEVICE = "cuda"


def set_smoke_sizes() -> None:
    """--smoke: tiny sizes on the CPU (kernel interpreted), to check the script's logic only."""
    global HIDDEN, NUM_REQS, ROWS_PER_REQ, CHUNK, DEVICE
    HIDDEN, NUM_REQS, ROWS_PER_REQ, CHUNK, DEVICE = 64, 40, 16, 4, "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@dataclass
class Case:
    name: str
    state: PromptEmbedsState
    ref_state: PromptEmbedsState
    base: torch.Tensor
    idx: torch.Tensor
    qsl: torch.Tensor
    nc: torch.Tensor
    windows: list[tuple[int, int, int, int]]  # (slot, dst_start, src_start, count) per overlaid request
    masks: dict[int, torch.Tensor]
    rows_written: int


def build_case(name: str, plan: list[tuple[int, int]], mask_frac: float, seed: int) -> Case:
    """plan: (num_computed, scheduled) per batch row; every request holds ROWS_PER_REQ rows."""
    rng = random.Random(seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    state = PromptEmbedsState(NUM_REQS, HIDDEN, DTYPE, device, use_triton=True)
    ref_state = PromptEmbedsState(NUM_REQS, HIDDEN, DTYPE, device, use_triton=False)
    slots = list(range(NUM_REQS))
    rng.shuffle(slots)
    computed = [0] * NUM_REQS
    starts = [0]
    windows, masks, rows_written = [], {}, 0
    for b, (nc, q) in enumerate(plan):
        slot = slots[b]
        rows = torch.randn(ROWS_PER_REQ, HIDDEN, device=device, generator=gen, dtype=DTYPE)
        mask = None
        if mask_frac > 0:
            mask = torch.rand(ROWS_PER_REQ, device=device, generator=gen) < mask_frac
            masks[slot] = mask
        state.add_request(slot, f"r{b}", rows, mask)
        ref_state.add_request(slot, f"r{b}", rows, mask)
        computed[slot] = nc
        count = max(0, min(q, ROWS_PER_REQ - nc))
        if count:
            windows.append((slot, starts[-1], nc, count))
            kept = int(mask[nc : nc + count].sum()) if mask is not None else 0
            rows_written += count - kept
        starts.append(starts[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    base = torch.randn(starts[-1], HIDDEN, device=device, generator=gen, dtype=DTYPE)
    return Case(
        name,
        state,
        ref_state,
        base,
        torch.tensor(slots[: len(plan)], **i32),
        torch.tensor(starts, **i32),
        torch.tensor(computed, **i32),
        windows,
        masks,
        rows_written,
    )


def make_methods(case: Case, reference: torch.Tensor):
    out = case.base.clone()
    st = case.state

    def kernel():
        st.apply(out, case.idx, case.qsl, case.nc)

    rows_by_slot = st._rows  # the very tensors the kernel reads

    def loop():
        for slot, dst, src, count in case.windows:
            if slot in case.masks:
                keep = case.masks[slot][src : src + count].unsqueeze(1)
                d = out[dst : dst + count]
                d.copy_(torch.where(keep, d, rows_by_slot[slot][src : src + count]))
            else:
                out[dst : dst + count].copy_(rows_by_slot[slot][src : src + count])

    # torch.where: a dense source laid out like inputs_embeds plus a row mask (building them is the
    # gather this method needs first; it is left out of the timing in its favour).
    dense = reference.clone()
    row_mask = (reference != case.base).any(dim=1)
    row_mask2d = row_mask.unsqueeze(1)
    where_out = torch.empty_like(out)

    def where():
        torch.where(row_mask2d, dense, case.base, out=where_out)

    n = case.rows_written * HIDDEN
    copy_src = torch.randn(n, device=out.device, dtype=DTYPE)
    copy_dst = torch.empty_like(copy_src)

    def copy():
        copy_dst.copy_(copy_src)

    def result(fn, buf):
        buf.copy_(case.base)
        fn()
        sync()
        return buf

    checks = {
        "kernel": lambda: result(kernel, out),
        "loop": lambda: result(loop, out),
        "where": lambda: (where(), sync(), where_out)[2],
    }
    return {"kernel": kernel, "loop": loop, "where": where, "copy": copy}, checks


def bench(fn, rep_ms: int = 100) -> float:
    """Median microseconds per call."""
    if DEVICE != "cuda":
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return sorted(samples)[1]
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def host_us_per_apply(case: Case, calls: int = 200) -> float:
    calls = calls if DEVICE == "cuda" else 2
    out = case.base.clone()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        case.state.apply(out, case.idx, case.qsl, case.nc)
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def run_case(case: Case) -> dict[str, float]:
    reference = case.base.clone()
    case.ref_state.apply(reference, case.idx, case.qsl, case.nc)
    methods, checks = make_methods(case, reference)
    for name, check in checks.items():
        got = check()
        if not torch.equal(got, reference):
            bad = (got != reference).any(dim=1).nonzero().flatten()[:8].tolist()
            raise SystemExit(f"[{case.name}] {name} differs from the reference at rows {bad}")
    useful_bytes = 2 * case.rows_written * HIDDEN * torch.finfo(DTYPE).bits // 8
    times = {name: bench(fn) for name, fn in methods.items()}
    print(f"\n### {case.name}: {case.idx.numel()} requests, {case.base.shape[0]} tokens, "
          f"{case.rows_written} rows overlaid, {useful_bytes / 1e6:.1f} MB moved (read + write)\n")
    print("| method | median us | GB/s | % copy BW | x loop |")
    print("|---|---:|---:|---:|---:|")
    for name, us in times.items():
        gbs = useful_bytes / (us * 1e-6) / 1e9
        pct, vs_loop = 100 * times["copy"] / us, times["loop"] / us
        print(f"| {name} | {us:.1f} | {gbs:.0f} | {pct:.0f}% | {vs_loop:.1f} |")
    print(f"\nhost wall time of back-to-back apply calls: {host_us_per_apply(case):.1f} us/call")
    return times


def sweep(case: Case) -> None:
    configs = [OverlayConfig(bt, bh, nw) for bt in (4, 8, 16) for bh, nw in ((1024, 4), (2048, 8))]
    default = default_config(HIDDEN, torch.finfo(DTYPE).bits // 8)
    if default not in configs:
        configs.append(default)
    reference = case.base.clone()
    case.ref_state.apply(reference, case.idx, case.qsl, case.nc)
    copy_us = None
    print(f"\n### tile sweep on {case.name} (default {default})\n")
    print("| block_t | block_h | num_warps | median us | % copy BW |")
    print("|---:|---:|---:|---:|---:|")
    n = case.rows_written * HIDDEN
    src = torch.randn(n, device=case.base.device, dtype=DTYPE)
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src))
    out = case.base.clone()
    for cfg in configs:
        case.state.kernel_config = cfg
        out.copy_(case.base)
        case.state.apply(out, case.idx, case.qsl, case.nc)
        sync()
        ok = torch.equal(out, reference)
        us = bench(lambda: case.state.apply(out, case.idx, case.qsl, case.nc), rep_ms=50)
        mark = "" if ok else " (WRONG RESULT)"
        pct = 100 * copy_us / us
        print(f"| {cfg.block_t} | {cfg.block_h} | {cfg.num_warps} | {us:.1f}{mark} | {pct:.0f}% |")
    case.state.kernel_config = None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-shape sweep")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (TRITON_INTERPRET=1) of the logic")
    args = parser.parse_args()
    if args.smoke:
        set_smoke_sizes()
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke, timings meaningless)"
    print(f"device: {name}, hidden {HIDDEN}, {DTYPE}, "
          f"{NUM_REQS} requests x {ROWS_PER_REQ} prompt-embedding rows")
    rng = random.Random(0)

    prefill_plan = [(rng.randrange(0, ROWS_PER_REQ - CHUNK + 1), CHUNK) for _ in range(NUM_REQS)]
    num_prefill = NUM_REQS // 8
    decode_plan = [(ROWS_PER_REQ + rng.randrange(0, 64), 1) for _ in range(NUM_REQS - num_prefill)]
    decode_plan += [(rng.randrange(0, ROWS_PER_REQ - CHUNK + 1), CHUNK) for _ in range(num_prefill)]
    rng.shuffle(decode_plan)

    prefill = build_case(f"prefill ({NUM_REQS} x {CHUNK} scheduled)", prefill_plan, 0.0, seed=1)
    main_times = run_case(prefill)
    if not args.no_sweep:
        sweep(prefill)
    for name, plan, frac, seed in (
        (
            f"decode-heavy ({NUM_REQS - num_prefill} decoding past their embeds, "
            f"{num_prefill} x {CHUNK} prefill)",
            decode_plan,
            0.0,
            2,
        ),
        (f"prefill+mask ({NUM_REQS} x {CHUNK}, 10% is_token_ids)", prefill_plan, 0.1, 3),
    ):
        case = build_case(name, plan, frac, seed)
        run_case(case)
        del case
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    bw = main_times["copy"] / main_times["kernel"]
    speedup = main_times["loop"] / main_times["kernel"]
    ok_bw, ok_speedup = bw >= 0.80, speedup >= 50
    print("\n### targets (prefill case, default tile)\n")
    print(f"- kernel >= 80% of copy bandwidth: {100 * bw:.0f}% -> {'PASS' if ok_bw else 'FAIL'}")
    print(f"- kernel >= 50x the per-request loop: {speedup:.0f}x -> {'PASS' if ok_speedup else 'FAIL'}")
    return 0 if ok_bw and ok_speedup else 1


if __name__ == "__main__":
    raise SystemExit(main())

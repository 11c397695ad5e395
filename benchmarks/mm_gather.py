"""One step's item rows: the old host gather against the device gather (issue 14), per step.

    python benchmarks/mm_gather.py [--requests 32] [--item-rows 256] [--text-len 256] [--hidden 1024]

A prefill step of `--requests` windows, each `text_len / 2` token rows, one item of `item_rows`
rows, `text_len / 2` token rows (benchmarks/mixed.py's prompt shape), bf16 on the GPU:

- host: `EncoderCache.gather` (Python walk, slices, torch.cat, host mask upload) + the masked
  scatter of `assemble_inputs_embeds`;
- device: the token lookup + `ItemTable.apply` (one launch; the items were registered once).

Reports the median wall time per step (host work included, device synchronized after each step)
and checks that both paths give the same `inputs_embeds`. `--cpu`: tiny sizes, torch path.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runner.multimodal.encoder_cache import (  # noqa: E402
    EncoderCache,
    MultiModalFeature,
    PlaceholderRange,
    RequestWindow,
)
from runner.multimodal.item_table import ItemTable  # noqa: E402
from runner.worker.inputs_embeds import assemble_inputs_embeds  # noqa: E402


def timed(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--item-rows", type=int, default=256)
    ap.add_argument("--text-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if args.cpu:
        args.requests, args.item_rows, args.text_len, args.hidden, args.reps = 4, 16, 16, 64, 5
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n, rows, half, hidden = args.requests, args.item_rows, args.text_len // 2, args.hidden
    prompt_len = 2 * half + rows
    vocab = 32000
    embed = torch.nn.Embedding(vocab, hidden).to(device, dtype)
    cache = EncoderCache(4 * n * rows, hidden, dtype, device)
    table = ItemTable(n, hidden, dtype, device)
    windows = []
    for i in range(n):
        ph = PlaceholderRange(half, rows)
        item = torch.randn(rows, hidden, device=device).to(dtype)
        feature = MultiModalFeature(f"prompt_embeds:{i}", "prompt_embeds", ph, item)
        cache.ensure([feature])
        table.register(i, ph, cache.get(feature.identifier))
        windows.append(RequestWindow([feature], 0, prompt_len, prompt_len))
    t = n * prompt_len
    ids = torch.randint(0, vocab, (t,), device=device)
    i32 = dict(dtype=torch.int32, device=device)
    idx = torch.arange(n, **i32)
    qsl = torch.arange(0, t + 1, prompt_len, **i32)
    computed = torch.zeros(n, **i32)
    out_old = torch.empty(t, hidden, device=device, dtype=dtype)
    out_new = torch.empty_like(out_old)

    def old() -> None:
        g = cache.gather(windows)
        assemble_inputs_embeds(embed, ids, out_old, None, g.mm_embeds, g.is_mm_embed)

    def new() -> None:
        assemble_inputs_embeds(embed, ids, out_new)
        table.apply(out_new, idx, qsl, computed)

    old()
    new()
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out_old, out_new), "the two paths disagree"
    t_old, t_new = timed(old, device, args.reps), timed(new, device, args.reps)
    print(f"prefill step: {n} requests x ({2 * half} token rows + one {rows}-row item), hidden {hidden}, "
          f"{device.type}")
    print(f"host gather + masked scatter : {t_old * 1e3:8.3f} ms")
    print(f"token lookup + device gather : {t_new * 1e3:8.3f} ms  ({t_old / t_new:.1f}x)")
    print("inputs_embeds equal: True")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

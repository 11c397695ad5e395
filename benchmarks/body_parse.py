"""What a server spends turning one prompt-embeds request body into a tensor (CPU, no target).

Three ways to parse the same body, each followed by `load_prompt_embeds` on the payload:

    json.loads        the standard library's parser, then base64 decode + archive checks
    decode twice      `loads_body` (long base64 strings kept out of json's string scan) with its result
                      passed on as a plain str, so `load_prompt_embeds` decodes the base64 again
    decode once       `loads_body` as the server uses it: the string carries the bytes its strictness
                      check decoded (`bridge.wire.Base64Text`), and `load_prompt_embeds` takes them

    python benchmarks/body_parse.py [--rows 512] [--hidden 1024] [--dtype bfloat16] [--repeat 200]

Prints the median milliseconds of each and their ratios to `json.loads`, measured side by side.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bridge.serve.json_body import loads_body  # noqa: E402
from bridge.wire import encode_prompt_embeds, load_prompt_embeds  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rows = torch.randn(args.rows, args.hidden).to(getattr(torch, args.dtype))
    body = json.dumps({"model": "m", "prompt_embeds": encode_prompt_embeds(rows), "max_tokens": 128}).encode()
    hidden = args.hidden

    def load(payload):
        return load_prompt_embeds(payload, hidden_size=hidden, check_finite=False)

    ways = {
        "json.loads": lambda: load(json.loads(body)["prompt_embeds"]),
        "decode twice": lambda: load(str(loads_body(body)["prompt_embeds"])),
        "decode once": lambda: load(loads_body(body)["prompt_embeds"]),
    }
    assert all(torch.equal(fn(), rows) for fn in ways.values())
    print(f"body {len(body) / 1e6:.2f} MB ({args.rows} x {args.hidden} {args.dtype}), "
          f"median of {args.repeat}")
    results = {}
    for _ in range(2):  # two rounds of all three, one after another: the second is reported
        results = {name: median_ms(fn, args.repeat) for name, fn in ways.items()}
    base = results["json.loads"]
    for name, ms in results.items():
        print(f"{name:>13}: {ms:6.3f} ms  ({base / ms:.2f}x json.loads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

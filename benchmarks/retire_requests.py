"""What retiring finished requests costs the host (CPU, no target): identity against field-wise `==`.

The scheduler drops a finished request from its running list with `running.remove(request)`, which
compares entries with `==`. `Request` is a dataclass; with the dataclass's generated field-wise `__eq__`
every compare built two tuples of all its fields. Since `Request` compares by identity (`eq=False`), this
measures both side by side in one run: the same requests, and a subclass that restores the field-wise
`__eq__`, removed one by one from a list of `--requests` (from the back, the worst case, and in random
order, as requests of different lengths finish), median of `--repeat` rounds.

    python benchmarks/retire_requests.py [--requests 256] [--prompt 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from runner.engine.request import Request  # noqa: E402
from runner.sampling_params import SamplingParams  # noqa: E402


@dataclasses.dataclass(eq=True)
class FieldwiseRequest(Request):
    """`Request` with the dataclass's field-wise `__eq__` back (what the scheduler compared before)."""


def retire_ms(cls: type, n: int, prompt: int, order: str, repeat: int) -> float:
    times = []
    for seed in range(repeat):
        reqs = [cls(request_id=f"r{i}", prompt_token_ids=list(range(prompt)),
                    sampling_params=SamplingParams(max_tokens=128), index=i) for i in range(n)]
        victims = reqs[::-1] if order == "back" else random.Random(seed).sample(reqs, n)
        running = list(reqs)
        start = time.perf_counter()
        for r in victims:
            running.remove(r)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{args.requests} requests of {args.prompt} prompt tokens, removed one by one; "
          f"median of {args.repeat}")
    for order in ("back", "random"):
        fieldwise = retire_ms(FieldwiseRequest, args.requests, args.prompt, order, args.repeat)
        identity = retire_ms(Request, args.requests, args.prompt, order, args.repeat)
        print(f"  {order:>6}: field-wise == {fieldwise:7.2f} ms   identity {identity:6.2f} ms   "
              f"x{fieldwise / identity:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

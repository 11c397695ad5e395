"""Print the engine's tick timeline of each served run, next to its requests' times.

Input: the `--trace` file (one JSON line per engine tick, written by the server) and the `--out` JSON of
the same `benchmarks/serve.py` run (each run's start time and every request's sent / first token / last
token times). Both use the host's monotonic clock, so the ticks line up with the runs. Shows where a
served run loses time against offline: before the first admission (HTTP and parsing), admission
ticks, slow steps (a step that built a kernel shows as one long tick), the decode windows. For each
tick that admitted requests: when the first and last of them arrived at the API process, were parsed
and submitted, and reached the engine process, and how many came from each API process (newer
traces only).

    python3 benchmarks/serve_trace.py /tmp/ticks.jsonl /tmp/serve.json [--clients 64]
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="the ticks file (serve.py --trace)")
    ap.add_argument("results", help="serve.py's --out JSON of the same run")
    ap.add_argument("--clients", default=None, help="only this client level (default: every level)")
    args = ap.parse_args()
    with open(args.trace) as f:
        ticks = [json.loads(line) for line in f if line.strip()]
    with open(args.results) as f:
        data = json.load(f)
    variants = data.get("variants") or {"": {"levels": data["levels"]}}  # older results: one server
    runs_of = ((lv, r, v) for v, vres in variants.items() for lv, r in vres["levels"].items())
    for level, res, variant in runs_of:
        if args.clients is not None and level != args.clients:
            continue
        if variant:
            print(f"server flags: {variant}")
        for k, run in enumerate(res.get("runs", [])):
            t0, reqs = run["start_at"], run["requests_sent_first_last"]
            end = max(r[2] for r in reqs)
            sent = [r[0] - t0 for r in reqs]
            first = [r[1] - t0 for r in reqs]
            print(f"{level} clients, run {k + 1}: {run['tok_s']:.0f} tok/s, {run['builds']:.0f} builds; "
                  f"sent {min(sent):.3f}-{max(sent):.3f} s, "
                  f"first tokens {min(first):.3f}-{max(first):.3f} s, last {end - t0:.3f} s")
            for t in ticks:
                if t0 - 0.01 <= t["t"] <= end + 0.01:
                    spans = "".join(f"  {name} {t[key][0] - t0:.3f}-{t[key][1] - t0:.3f}"
                                    for key, name in (("arrived_at", "arrived"), ("submitted_at", "parsed"),
                                                      ("received_at", "at engine")) if key in t)
                    if t.get("owners"):  # submissions per API process (newer traces)
                        counts = {o: t["owners"].count(o) for o in sorted(set(t["owners"]))}
                        spans += "  from API " + " ".join(f"{o}:{n}" for o, n in counts.items())
                    print(f"  t={t['t'] - t0:6.3f} s  admitted {t['prompts']:3d} "
                          f"in {t['admit_s'] * 1e3:5.1f} ms (arriving {t['arriving']:3d})  "
                          f"window {t['window']:2d}  "
                          f"step {t['step_s'] * 1e3:6.1f} ms  running {t['running']:3d} "
                          f"waiting {t['waiting']:3d}  builds {t['builds']}{spans}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

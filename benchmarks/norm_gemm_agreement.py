"""How far the norm-GEMM path's greedy tokens agree with the unfused path's, on W1's random-weight model.

Why: `benchmarks/decode_batches.py` reports that the two paths' greedy tokens differ. The kernels keep
every rounding point of the launches they replace but sum in another order, so a bf16 value can land
one rounding step away; with random weights the top two logits are often nearly tied and one step
flips a token, after which the sequences diverge. This says whether that is all it is: each path run
twice (deterministic?), the first token where the paths part, and the largest difference of the chosen
tokens' logprobs before that point (bf16 noise is ~1e-2 at these magnitudes; a wrong kernel is not).

One command, GPU (about 20 s on an H200): eager mode, so the switch can flip between calls in one process.

    python benchmarks/norm_gemm_agreement.py [--requests 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((k for k, (x, y) in enumerate(zip(r, s)) if x != y), None) for r, s in zip(a, b)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    import types

    from generate import bench_setup, workload
    from transformers import AutoConfig

    from runner.layers import fused_layers
    from runner.llm import LLM
    from runner.sampling_params import SamplingParams

    device, model_dir, dtype = bench_setup(types.SimpleNamespace(cpu=False, model_dir=None))
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    ids, _, _ = workload(args.requests, 512, 512, args.tokens, args.tokens, vocab, seed=3)
    llm = LLM(model_dir, dtype=dtype, device=device, max_num_seqs=args.requests, max_model_len=1024,
              gpu_memory_utilization=0.5, enforce_eager=True)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    runs: dict[int, list] = {}
    for rows in (0, 64, 0, 64):  # off, on, off, on
        fused_layers.NORM_GEMM_MAX_ROWS = rows
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        chosen = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        runs.setdefault(rows, []).append((tokens, chosen))
    print("off vs off, first difference per request:", first_difference(runs[0][0][0], runs[0][1][0]))
    print("on vs on, first difference per request:", first_difference(runs[64][0][0], runs[64][1][0]))
    parted = first_difference(runs[0][0][0], runs[64][0][0])
    print("off vs on, first difference per request:", parted)
    diffs = [abs(x - y) for r, end in enumerate(parted)
             for x, y in zip(runs[0][0][1][r][:end], runs[64][0][1][r][:end])]
    print(f"chosen-token logprob |off - on| before the paths part: max {max(diffs):.4f}, "
          f"mean {sum(diffs) / len(diffs):.5f} over {len(diffs)} tokens")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

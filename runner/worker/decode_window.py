"""A greedy decode window: `k` decode steps back to back on the device, with one host sync for all of them.

Why: a decode step of a greedy batch needs nothing from the host but the previous step's tokens. Feeding
them on the device (each step's argmax becomes the next step's input id, and positions, context lengths and
KV slots advance on the device from block tables the scheduler already extended for `k` tokens) lets the
host enqueue `k` graph replays and wait once, instead of a sync and a host round trip per step.

The argmax reads the decode graph's logits in the head's dtype (`DecodeGraphs.head_logits`) through
`runner.layers.greedy_argmax`: no fp32 copy of the logits in a window.

A request that reaches its `max_tokens` inside the window is still in the batch for the window's later
steps (the graph's rows are fixed), and its tokens there are dropped. Those rows are made inert: context
length 0 (attention reads none of its KV) and KV slot -1 (nothing written). On W2 (256 requests,
max_tokens uniform in [100, 1024]) a request wastes half a window on average: ~4,000 row-steps whose
attention would read about 90 MB each. Stops on EOS or stop strings cannot be known ahead; they still
run to the window's end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runner.engine.step_io import SchedulerOutput
from runner.layers.greedy_argmax import greedy_argmax

if TYPE_CHECKING:  # the runner calls this module, not the other way round
    from runner.worker.model_runner import ModelRunner


@torch.inference_mode()
def run_decode_window(runner: ModelRunner, so: SchedulerOutput, k: int) -> list[list[int]]:
    """Run `k` greedy decode steps of `so`'s requests; returns the `k` tokens of each request (the
    caller drops those after a stop). Every step replays the decode graph of the batch's bucket."""
    sd = runner._stage(so)
    v, r, bucket, bs = sd.views, sd.r, sd.bucket, runner.block_size
    assert bucket is not None and sd.single_token and len(sd.sample_rows) == r
    mm = runner.mm
    deltas = mm.decode_deltas(so.requests) if mm is not None and mm.uses_mrope else None
    if deltas is not None:  # M-RoPE: positions carry the delta; KV slots come from the index
        v.positions[:r] += deltas
    graphs = runner.decode_graphs
    graph, tokens = graphs.graphs[bucket], graphs.window_tokens
    alive = rows_alive(so, k, v.seq_lens.device)
    dead = None if alive is None else alive == 0  # once per window, not per step
    for j in range(k):
        if j:
            v.input_ids[:r].copy_(tokens[j - 1, :r])
            v.positions[:r] += 1
            v.seq_lens[:r] += 1
            pos = v.positions[:r] if deltas is None else v.positions[:r] - deltas
            block = v.block_tables[:r].gather(1, torch.div(pos, bs, rounding_mode="floor").unsqueeze(1))
            v.slot_mapping[:r].copy_(block.squeeze(1).long() * bs + pos % bs)
            if alive is not None:  # rows past their max_tokens: no keys to read, no KV to write
                v.seq_lens[:r].mul_(alive[j])
                v.slot_mapping[:r].masked_fill_(dead[j], -1)
        runner.embeds_builder.build(runner.embed_tokens, v.input_ids)
        graph.replay()
        greedy_argmax(graphs.head_logits[:r], tokens[j, :r])
    runner.num_graph_replays += k
    runner.num_forward_steps += k
    runner.num_decode_windows += 1
    out = tokens[:k, :r].t().tolist()
    for req, toks in zip(so.requests, out):
        n = req.num_tokens
        runner.token_table[req.slot, n : n + k] = toks[: runner.max_model_len + 1 - n]
    return out


def rows_alive(so: SchedulerOutput, k: int, device: torch.device) -> torch.Tensor | None:
    """(k, r) int32 on `device`: 1 where step j of the window still produces a token its request keeps
    under `max_tokens`, 0 where the request has reached it; None when every request uses all `k` steps
    (the common case: nothing to mask, nothing uploaded)."""
    left = [req.sampling_params.max_tokens - req.num_output_tokens for req in so.requests]
    if min(left, default=k) >= k:
        return None
    steps = torch.arange(k, dtype=torch.int32).unsqueeze(1)
    return (steps < torch.tensor(left, dtype=torch.int32).unsqueeze(0)).to(torch.int32).to(device)


__all__ = ["rows_alive", "run_decode_window"]

"""A greedy decode window: `k` decode steps back to back on the device, with one host sync for all of them.

Why: a decode step of a greedy batch needs nothing from the host but the previous step's tokens. Feeding
them on the device (each step's argmax becomes the next step's input id, and positions, context lengths and
KV slots advance on the device from block tables the scheduler already extended for `k` tokens) lets the
host enqueue `k` graph replays and wait once, instead of a sync and a host round trip per step.

The argmax reads the decode graph's logits in the head's dtype (`DecodeGraphs.head_logits`) through
`runner.layers.greedy_argmax`: no fp32 copy of the logits in a window.

A request that reaches its `max_tokens` inside the window is still in the batch for the window's later
steps (the graph's rows are fixed), and its tokens there are dropped. Those rows are made inert: context
length 0 (attention reads none of its KV) and KV slot -1 (nothing written): with mixed output lengths a
request wastes half a window on average, and those row-steps would otherwise read their whole KV. Stops
on EOS or stop strings cannot be known ahead; they still run to the window's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runner.layers.greedy_argmax import greedy_argmax
from runner.step_io import SchedulerOutput
from runner.worker.step_sampling import LaunchedStep
from runner.worker.window_advance import advance_window_step

if TYPE_CHECKING:
    from runner.worker.runner_parts import RunnerParts


@dataclass
class LaunchedWindow:
    """A decode window queued on the device: its plan, its length, where each request's tokens go in the
    token table, and the host buffer its tokens are copied to (with the copy's event)."""

    so: SchedulerOutput
    k: int
    starts: list[int]  # each request's number of tokens before the window
    slots: list[int | None]
    host_tokens: torch.Tensor
    copied: torch.cuda.Event | None


@torch.inference_mode()
def launch_decode_window(runner: RunnerParts, so: SchedulerOutput, k: int,
                         prev: LaunchedWindow | LaunchedStep | None = None) -> LaunchedWindow:
    """Queue `k` greedy decode steps of `so`'s requests and the copy of their tokens to the host; no sync.

    `prev`: what is still in flight, whose tokens the host has not read. A window: each of `so`'s requests
    was in it, and its first input token is the one `prev` ended with, copied on the device from `prev`'s
    last row of `window_tokens` (the host's token table does not have it yet). A step (async scheduling):
    the token it samples for each request is copied from its sampled ids by the runner's pending-token feed,
    as for a step launched behind it. Every step replays the decode graph of the batch's bucket."""
    sd = runner.stage(so)
    v, r, bucket, bs = sd.views, sd.r, sd.bucket, runner.block_size
    assert bucket is not None and sd.single_token and len(sd.sample_rows) == r
    mm = runner.mm
    deltas = mm.decode_deltas(so.requests) if mm is not None and mm.uses_mrope else None
    if deltas is not None:  # M-RoPE: positions carry the delta; KV slots come from the index
        v.positions[:r] += deltas
    graphs = runner.decode_graphs
    graph, tokens = graphs.graphs[bucket], graphs.window_tokens
    if isinstance(prev, LaunchedStep):
        runner.token_feed.feed(so, sd, prev)
    elif prev is not None:
        last = tokens[prev.k - 1]
        if len(prev.so.requests) == r and all(a is b for a, b in zip(prev.so.requests, so.requests)):
            v.input_ids[:r].copy_(last[:r])
        else:
            row_of = {id(req): i for i, req in enumerate(prev.so.requests)}
            rows = torch.tensor([row_of[id(req)] for req in so.requests], dtype=torch.int64)
            v.input_ids[:r].copy_(last.index_select(0, _upload(rows, last.device)))
    alive = rows_alive(so, k, v.seq_lens.device)
    for j in range(k):
        if j:  # rows past their max_tokens (alive 0): no keys to read, no KV to write
            advance_window_step(tokens[j - 1, :r], v.input_ids[:r], v.positions[:r], v.seq_lens[:r],
                                v.block_tables[:r], v.slot_mapping[:r], bs, deltas,
                                None if alive is None else alive[j])
        runner.embeds_builder.build(runner.embed_tokens, v.input_ids)
        graph.replay()
        greedy_argmax(graphs.head_logits[:r], tokens[j, :r])
    runner.num_graph_replays += k
    runner.num_forward_steps += k
    runner.num_decode_windows += 1
    # The two host buffers in turn: the previous window's may still be unread, never the one before it
    # (a window is finished before the one after next is launched).
    # Whole rows: a strided copy to the host goes through a pageable temporary, which waits for the stream.
    host = graphs.host_tokens(runner.num_decode_windows)
    copied = None
    if tokens.is_cuda:
        host[:k].copy_(tokens[:k], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        host[:k].copy_(tokens[:k])
    return LaunchedWindow(so, k, [req.num_tokens for req in so.requests], [req.slot for req in so.requests],
                          host[:k, :r], copied)


def finish_decode_window(runner: RunnerParts, window: LaunchedWindow) -> list[list[int]]:
    """Wait for `window`'s tokens (the one host sync) and return the `k` tokens of each request (the caller
    drops those after a stop); they also go into the token table of each request still in its slot."""
    if window.copied is not None:
        window.copied.synchronize()
    out = window.host_tokens.t().tolist()
    cap = runner.max_model_len + 1
    for req, slot, n, toks in zip(window.so.requests, window.slots, window.starts, out):
        if req.slot == slot and not req.is_finished:
            runner.token_table[slot, n : n + len(toks)] = toks[: cap - n]
    return out


def run_decode_window(runner: RunnerParts, so: SchedulerOutput, k: int) -> list[list[int]]:
    """`k` greedy decode steps of `so`'s requests, then their tokens: launch and finish in one."""
    return finish_decode_window(runner, launch_decode_window(runner, so, k))


def rows_alive(so: SchedulerOutput, k: int, device: torch.device) -> torch.Tensor | None:
    """(k, r) int32 on `device`: 1 where step j of the window still produces a token its request keeps
    under `max_tokens`, 0 where the request has reached it; None when every request uses all `k` steps
    (the common case: nothing to mask, nothing uploaded)."""
    # Tokens of a window still in flight count as produced (`num_pending_outputs`).
    left = [req.sampling_params.max_tokens - req.num_output_tokens - req.num_pending_outputs
            for req in so.requests]
    if min(left, default=k) >= k:
        return None
    steps = torch.arange(k, dtype=torch.int32).unsqueeze(1)
    return _upload((steps < torch.tensor(left, dtype=torch.int32).unsqueeze(0)).to(torch.int32), device)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the stream: a copy from pageable memory
    first waits for every queued kernel (CUDA's rule for pageable transfers), which made a window
    launched behind another wait for it; from pinned memory it is queued like a kernel."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["LaunchedWindow", "finish_decode_window", "launch_decode_window", "rows_alive",
           "run_decode_window"]

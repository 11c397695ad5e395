"""The realtime scenario the CPU and GPU tests share (imported as `realtime_scenario`: pytest puts `tests/`
on the path): one request on an LLM with a realtime "audio" encoder, chunks appended after given `step()`
calls, its input optionally closed after another, stepped until it ends. What a caller can observe is
recorded: the request's token count after each call, where each chunk landed, and the final tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from helpers import IdentityEncoder

from runner.llm import LLM
from runner.sampling_params import SamplingParams

HIDDEN = 64
PROMPT_IDS = [11, 42, 97, 120, 7, 64, 33, 90, 5, 18]
#: after which `step()` call (1-based) a chunk of how many rows is appended
CHUNKS = {3: 3, 7: 2}


def stream_encoder() -> IdentityEncoder:
    """Realtime "audio": a chunk is an (n, hidden) tensor and encodes to itself."""
    return IdentityEncoder("audio", is_realtime=True)


def chunk(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def build(model_dir, device: str, *, graphs_on_cpu: bool = False, window: int | None = None,
          force_async: bool = False, **kw) -> LLM:
    """An LLM with the realtime encoder. On the CPU, `graphs_on_cpu` emulates the CUDA-graph buckets and
    `window` sets the decode window (both as the GPU default has them); `force_async` turns on async
    scheduling, which multimodal input turns off by default, so the lockstep policy meets it too."""
    llm = LLM(model_dir, encoders={"audio": stream_encoder()}, device=device, **kw)
    if graphs_on_cpu:
        llm.runner.capture_cuda_graphs(emulate=True)
    if window is not None:
        llm.decode_window = window
    if force_async:
        llm.core.async_scheduling = True
    return llm


@dataclass
class Trace:
    counts: list[int] = field(default_factory=list)  # the request's tokens after each step() call
    offsets: list[int] = field(default_factory=list)  # the position of each chunk's first row
    tokens: list[int] = field(default_factory=list)
    idle_between_calls: bool = True  # nothing was in flight whenever step() returned with input open


def drive(llm: LLM, params: SamplingParams, *, chunks: dict[int, int] = CHUNKS,
          close_after: int | None = None, prompt_ids: list[int] = PROMPT_IDS) -> Trace:
    """Run the scenario on `llm` (module doc); chunk k's rows are `chunk(seed=call, n)`."""
    trace = Trace()
    rid = llm.add_request({"prompt_token_ids": prompt_ids}, params)
    calls, count, finished, open_input = 0, 0, False, True
    while not finished:
        outs = [o for o in llm.step() if o.request_id == rid]
        calls += 1
        if outs:
            count, finished = len(outs[-1].outputs[0].token_ids), outs[-1].finished
            trace.tokens = outs[-1].outputs[0].token_ids
        trace.counts.append(count)
        if open_input and (llm.core.in_flight is not None or llm.core.window is not None):
            trace.idle_between_calls = False
        if finished:
            break
        if calls in chunks:
            trace.offsets.append(llm.append_input(rid, chunk(calls, chunks[calls])))
        if calls == close_after:
            llm.close_input(rid)
            open_input = False
        assert calls < 500, "the request never finished"
    return trace


def reference_tokens(hf_model, params: SamplingParams, rows: dict[int, torch.Tensor],
                     prompt_ids: list[int] = PROMPT_IDS) -> list[int]:
    """Greedy with a full forward per token; position p feeds `rows[p]` where given, else the embedding of
    the token sampled there."""
    table = hf_model.get_input_embeddings().weight.detach()
    seq = table[prompt_ids].clone()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            tok = int(hf_model(inputs_embeds=seq[None]).logits[0, -1].argmax())
            out.append(tok)
            p = seq.shape[0]
            row = rows[p][None] if p in rows else table[tok : tok + 1]
            seq = torch.cat([seq, row])
    return out


def streamed_rows(trace: Trace, chunks: dict[int, int] = CHUNKS) -> dict[int, torch.Tensor]:
    """Position -> streamed row, from where the trace's chunks landed."""
    rows = {}
    for offset, (call, n) in zip(trace.offsets, chunks.items()):
        for i, row in enumerate(chunk(call, n)):
            rows[offset + i] = row
    return rows

"""Sampling a launched step on the device, and reading its tokens back with one host sync.

`sample_on_device` runs the sampler on the rows that need a token and starts the copy of the
results to the host; `sampled_result` waits for that copy (the step's one host sync) and lays the
tokens out per scheduled request. Between the two the host is free to plan and launch the next
step (async scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runner.layers.sampler import Sampler, SamplingBatch
from runner.sampling_params import SamplingParams
from runner.step_io import SchedulerOutput, StepResult


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued on the device; `ModelRunner.finish` reads it.

    `rows` are the batch rows that sampled, `sample_index` maps their request ids to positions in
    `token_ids` (the device tensor the next step's pending input ids are copied from). `host`
    holds the host copies of token ids, logprobs, top-k ids and top-k logprobs (None: nothing
    sampled), complete once `event` (CUDA only) has fired.
    """

    so: SchedulerOutput
    rows: list[int]
    sample_index: dict[str, int]
    params: list[SamplingParams] = field(default_factory=list)
    token_ids: torch.Tensor | None = None
    host: list[torch.Tensor | None] | None = None
    event: torch.cuda.Event | None = None
    plp_logits: torch.Tensor | None = None
    plp_spans: list[tuple[int, int, int]] = field(default_factory=list)


def sample_on_device(sampler: Sampler, so: SchedulerOutput, logits: torch.Tensor,
                     eos_token_ids: tuple[int, ...]) -> LaunchedStep:
    """Sample the rows that need a token; the results start their copy to the host."""
    rows = [i for i in range(so.num_reqs) if so.samples[i]]
    step = LaunchedStep(so, rows, {so.requests[i].request_id: j for j, i in enumerate(rows)})
    if logits.shape[0] == 0:
        return step
    reqs = [so.requests[i] for i in rows]
    params = [q.sampling_params for q in reqs]
    penalties = any(p.uses_penalties for p in params)
    need_outputs = penalties or any(p.min_tokens > 0 for p in params)
    if penalties and any(q.num_pending_outputs and q.sampling_params.uses_penalties for q in reqs):
        raise RuntimeError("penalties need every output token on the host: finish the step in flight "
                           "before launching this one")
    batch = SamplingBatch(
        params=params,
        generators=[q.generator for q in reqs],
        penalty_prompt_ids=[q.real_prompt_token_ids() for q in reqs] if penalties else None,
        # min_tokens counts outputs only: a token in flight is a -1 here (penalties ignore it).
        output_ids=[q.output_token_ids + [-1] * q.num_pending_outputs if q.num_pending_outputs
                    else q.output_token_ids for q in reqs] if need_outputs else None,
        eos_token_ids=eos_token_ids,
    )
    out = sampler(logits, batch)
    step.params = params
    step.token_ids = out.token_ids
    host = [out.token_ids, out.logprobs, out.topk_ids, out.topk_logprobs]
    if logits.device.type == "cuda":
        host = [x.to("cpu", non_blocking=True) if x is not None else None for x in host]
        step.event = torch.cuda.Event()
        step.event.record()
    step.host = host
    return step

def sampled_result(step: LaunchedStep) -> StepResult:
    r = step.so.num_reqs
    sampled: list[int | None] = [None] * r
    if step.host is None:
        return StepResult(sampled)
    if step.event is not None:
        step.event.synchronize()
    token_ids, logprobs, topk_ids, topk_logprobs = step.host
    for row, tok in zip(step.rows, token_ids.tolist()):
        sampled[row] = tok
    result = StepResult(sampled)
    if logprobs is not None:
        lps = logprobs.tolist()
        result.logprobs = [None] * r
        result.top_logprobs = [None] * r
        top_ids = topk_ids.tolist() if topk_ids is not None else None
        top_lps = topk_logprobs.tolist() if topk_logprobs is not None else None
        for j, row in enumerate(step.rows):
            k = step.params[j].logprobs
            if k is None:
                continue
            result.logprobs[row] = lps[j]
            if k and top_ids is not None:
                result.top_logprobs[row] = dict(zip(top_ids[j][:k], top_lps[j][:k]))
    return result


__all__ = ["LaunchedStep", "sample_on_device", "sampled_result"]

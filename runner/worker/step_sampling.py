"""Sampling a launched step on the device, and reading its tokens back with one host sync.

`sample_on_device` runs the sampler on the rows that need a token and starts the copy of the
results to the host; `sampled_result` waits for that copy (the step's one host sync) and lays the
tokens out per scheduled request. Between the two the host is free to plan and launch the next
step (async scheduling).

Structured outputs: a step's constrained rows come with their token masks (`StepTokenMask`), which are
uploaded and applied to the logits before the sampler. A step whose masks cannot be filled yet (their
previous token is still on the device) is launched with its sampling deferred: the step keeps its logits
(`LaunchedStep.logits`) and the caller samples it once the masks are filled, before launching anything
else, so that nothing overwrites those logits meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runner.layers.sampler import Sampler, SamplingBatch
from runner.layers.token_mask import apply_token_mask
from runner.sampling_params import SamplingParams
from runner.step_io import SchedulerOutput, StepResult, StepTokenMask


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued on the device; `ModelRunner.finish` reads it.

    `rows` are the batch rows that sampled, `sample_index` maps their request ids to positions in
    `token_ids` (the device tensor the next step's pending input ids are copied from). `host`
    holds the host copies of token ids, logprobs, top-k ids and top-k logprobs (None: nothing
    sampled), complete once `event` (CUDA only) has fired. `logits` are the sampled rows' logits of a
    step whose sampling is deferred (None once it has sampled, or when it samples at launch).
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
    logits: torch.Tensor | None = None

    @property
    def awaits_sampling(self) -> bool:
        """Launched with its sampling deferred, and not sampled yet."""
        return self.logits is not None


def new_step(so: SchedulerOutput, deferred_logits: torch.Tensor | None = None) -> LaunchedStep:
    """The launched-step record of `so`, before sampling (`deferred_logits`: its sampling is deferred,
    these are the sampled rows' logits)."""
    rows = [i for i in range(so.num_reqs) if so.samples[i]]
    return LaunchedStep(so, rows, {so.requests[i].request_id: j for j, i in enumerate(rows)},
                        logits=deferred_logits)


def sample_on_device(sampler: Sampler, step: LaunchedStep, logits: torch.Tensor,
                     eos_token_ids: tuple[int, ...], token_mask: StepTokenMask | None = None) -> None:
    """Sample the rows of `step` that need a token (`logits`, one row each, in order), applying the
    constrained rows' token masks first; the results start their copy to the host. For a deferred step
    (`awaits_sampling`) each sampling request's pending tokens already count this step's own."""
    if logits is None:
        raise RuntimeError("the step has sampled already (or was not launched with deferred sampling)")
    own = 1 if step.awaits_sampling else 0
    step.logits = None
    if logits.shape[0] == 0:
        return
    if token_mask is not None:
        bitmask = token_mask.bitmask
        if logits.device.type == "cuda":  # a pinned buffer: the copy does not wait for the device
            bitmask = bitmask.to(logits.device, non_blocking=True)
        apply_token_mask(logits, bitmask, token_mask.rows)
    so, rows = step.so, step.rows
    reqs = [so.requests[i] for i in rows]
    params = [q.sampling_params for q in reqs]
    penalties = any(p.uses_penalties for p in params)
    need_outputs = penalties or any(p.min_tokens > 0 for p in params)
    pending = [max(0, q.num_pending_outputs - own) for q in reqs]  # tokens of earlier steps in flight
    if penalties and any(n and q.sampling_params.uses_penalties for n, q in zip(pending, reqs)):
        raise RuntimeError("penalties need every output token on the host: finish the step in flight "
                           "before launching this one")
    batch = SamplingBatch(
        params=params,
        generators=[q.generator for q in reqs],
        penalty_prompt_ids=[q.real_prompt_token_ids() for q in reqs] if penalties else None,
        # min_tokens counts outputs only: a token in flight is a -1 here (penalties ignore it).
        output_ids=[q.output_token_ids + [-1] * n if n else q.output_token_ids
                    for n, q in zip(pending, reqs)] if need_outputs else None,
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


@torch.inference_mode()
def sample_deferred(sampler: Sampler, step: LaunchedStep, eos_token_ids: tuple[int, ...],
                    token_mask: StepTokenMask | None) -> None:
    """Sample a step launched with `defer_sampling`, its constrained rows masked by `token_mask`."""
    sample_on_device(sampler, step, step.logits, eos_token_ids, token_mask)


def sampled_result(step: LaunchedStep) -> StepResult:
    if step.awaits_sampling:
        raise RuntimeError("a step launched with deferred sampling was read before it sampled")
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


__all__ = ["LaunchedStep", "new_step", "sample_deferred", "sample_on_device", "sampled_result"]

"""Prompt logprobs: which prompt rows need logits this step, and their logprob dicts.

Only requests that asked for `prompt_logprobs` send prompt rows through the LM head; a prefill
chunk contributes the rows it computed, so chunked prefill yields the same entries as one pass.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.step_io import SchedulerOutput


def prompt_logprob_rows(so: SchedulerOutput, nc: np.ndarray,
                        starts: np.ndarray) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Rows of prompt positions p (predicting prompt token p+1) for requests asking prompt logprobs.

    Returns the rows and, per such request, (batch index, first position, count).
    """
    rows: list[int] = []
    spans: list[tuple[int, int, int]] = []
    for i, req in enumerate(so.requests):
        if req.sampling_params.prompt_logprobs is None:
            continue
        first = int(nc[i])
        last = min(first + so.num_scheduled_tokens[i], req.num_prompt_tokens - 1)
        if last <= first:
            continue
        base = int(starts[i])
        rows.extend(range(base, base + last - first))
        spans.append((i, first, last - first))
    return rows, spans

PromptLogprobs = dict[str, tuple[int, list[dict[int, float]]]]


def compute_prompt_logprobs(so: SchedulerOutput, logits: torch.Tensor,
                            spans: list[tuple[int, int, int]]) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits, dim=-1)
    out: PromptLogprobs = {}
    offset = 0
    for i, first, count in spans:
        req = so.requests[i]
        k = req.sampling_params.prompt_logprobs
        targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + count], device=logits.device)
        lp = logprobs[offset : offset + count]
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        entries: list[dict[int, float]] = []
        if k:
            top_lp, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            for tid, c, ids, vals in zip(targets.tolist(), chosen, top_ids.tolist(), top_lp.tolist()):
                entry = dict(zip(ids, vals))
                entry[tid] = c
                entries.append(entry)
        else:
            entries = [{tid: c} for tid, c in zip(targets.tolist(), chosen)]
        out[req.request_id] = (first + 1, entries)
        offset += count
    return out


__all__ = ["compute_prompt_logprobs", "prompt_logprob_rows"]

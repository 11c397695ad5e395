"""How much activation memory the largest step needs, measured by running it (CUDA).

The KV cache takes what is left of the GPU budget after the weights and this peak, so the peak
must be the real one of the engine's own step path, not an estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from runner.request import Request
from runner.sampling_params import SamplingParams
from runner.step_io import SchedulerOutput
from runner.worker.kv_cache import allocate_kv_caches

if TYPE_CHECKING:
    from runner.worker.runner_parts import RunnerParts


@torch.inference_mode()
def profile_peak_memory(runner: RunnerParts, *, force: bool = False) -> int:
    """Activation peak of the largest step (CUDA): sizes the KV cache under a memory budget.

    Runs one full step through the runner's normal path (`execute`): `max_num_batched_tokens` prompt
    tokens split over as few requests as the context allows, on a temporary KV cache just big
    enough, then the sampler's worst case (softmax and sort of every slot's logits). `force`
    runs it on the CPU too (tests); the measurement itself is CUDA-only.
    """
    if runner.device.type != "cuda" and not force:
        return 0
    cuda = runner.device.type == "cuda"
    with largest_step_on_scratch_cache(runner) as largest_step:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device) if cuda else 0
        runner.execute(largest_step())
        worst = torch.zeros(runner.max_num_seqs, runner.vocab_size, dtype=torch.float32, device=runner.device)
        worst = torch.softmax(worst, dim=-1).sort(dim=-1)
        del worst
        peak = 0
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(runner.device) - base
    if cuda:
        torch.cuda.empty_cache()
    return int(peak)


@contextlib.contextmanager
def largest_step_on_scratch_cache(runner: RunnerParts) -> Iterator[Callable[[], SchedulerOutput]]:
    """The runner on a temporary KV cache just big enough for its largest step: `max_num_batched_tokens`
    prompt tokens over as few requests as the context allows. Yields a maker of that step (new requests
    each call); puts back the runner's KV cache, step counter and known block tables after."""
    lens: list[int] = []
    left = runner.max_num_batched_tokens
    while left > 0 and len(lens) < runner.max_num_seqs:
        lens.append(min(left, runner.max_model_len))
        left -= lens[-1]
    saved_caches, saved_steps = runner.kv_caches, runner.num_forward_steps
    runner.kv_caches = allocate_kv_caches(runner.kv_spec, sum(-(-n // runner.block_size) for n in lens),
                                          runner.device)
    try:
        yield lambda: _largest_step(runner, lens)
    finally:
        runner.kv_caches = saved_caches
        runner.num_blocks_known[:] = 0
        runner.num_forward_steps = saved_steps


def _largest_step(runner: RunnerParts, lens: list[int]) -> SchedulerOutput:
    """One prefill step of requests of `lens` tokens, their blocks laid out in turn from block 0."""
    reqs: list[Request] = []
    next_block = 0
    for i, n in enumerate(lens):
        req = Request(f"profile-{i}", i, [0] * n, SamplingParams(max_tokens=1, temperature=0.0))
        req.slot = i
        req.block_ids = list(range(next_block, next_block + -(-n // runner.block_size)))
        next_block += len(req.block_ids)
        reqs.append(req)
    return SchedulerOutput(reqs, lens, [True] * len(lens))


__all__ = ["largest_step_on_scratch_cache", "profile_peak_memory"]

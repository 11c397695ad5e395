"""Warm-up at construction: a few dummy requests through the whole step path, so the first real
`generate` does not compile kernels.

Why: Triton compiles (or loads from its disk cache) one kernel per specialisation the first time
a launch sees it, and CUDA loads a module the first time one of its kernels runs. The profiling
step compiles the prefill of one long request and graph capture the decode steps, but the first
real call still met new specialisations: the prompt-embeds overlay, a short prefill of one request,
several requests in one prefill step, a step mixing prefills and decodes, the sampler's non-greedy
path. One generate of a 512-row prompt paid about 5 s for them.

The warm-up requests cover those shapes and are then forgotten: every `num_*` counter of the
engine's parts is put back, so the counters describe the caller's requests only, and their blocks
leave the prefix cache. The KV blocks and slots go back to the pool when the requests finish, as
for any request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from runner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runner.config import EngineConfig
    from runner.engine.core import EngineCore
    from runner.multimodal.state import MultimodalState
    from runner.outputs import RequestOutput
    from runner.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class WarmUpTarget(Protocol):
    """What warm-up uses of `runner.llm.LLM` (which meets it structurally)."""

    core: EngineCore
    mm: MultimodalState
    engine_config: EngineConfig
    device: torch.device
    max_model_len: int
    enable_prompt_embeds: bool
    hidden_size: int

    @property
    def runner(self) -> ModelRunner: ...

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]: ...

    def reset_request_ids(self) -> None: ...


def _counter_owners(llm: WarmUpTarget) -> list[Any]:
    core = llm.core
    owners = [llm, core, core.scheduler, core.runner, getattr(core.scheduler, "block_manager", None),
              llm.mm, getattr(llm.mm, "cache", None), core.runner.uploader, core.runner.token_feed]
    return [o for o in owners if o is not None]


def _snapshot(owners: list[Any]) -> list[tuple[Any, str, int]]:
    """The int `num_*` attributes held in each owner's own __dict__ (not properties)."""
    return [(o, k, v) for o in owners for k, v in vars(o).items()
            if k.startswith("num_") and type(v) is int]


def warm_up_prompts(llm: WarmUpTarget) -> tuple[list[Any], list[SamplingParams]]:
    """The dummy requests: one long prompt alone, a batch of short ones (embeds and ids mixed, decoded
    a few steps so prefills and decodes share steps), and one sampled request."""
    vocab = llm.runner.vocab_size
    long_n = max(2, min(512, llm.max_model_len - 8, llm.engine_config.max_num_batched_tokens))
    short_n = max(1, min(33, llm.max_model_len - 8))
    ids = [(7 * i + 3) % vocab for i in range(long_n)]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    few = SamplingParams(max_tokens=min(4, max(1, llm.max_model_len - short_n)), temperature=0.0,
                         ignore_eos=True)
    sampled = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, top_k=5, seed=0, ignore_eos=True)
    if llm.enable_prompt_embeds:
        hidden, dtype = llm.hidden_size, llm.engine_config.dtype
        prompts = [{"prompt_embeds": torch.zeros(long_n, hidden, dtype=dtype)},
                   {"prompt_embeds": torch.zeros(short_n - 16 if short_n > 16 else short_n, hidden,
                                                 dtype=dtype)},
                   {"prompt_token_ids": ids[:short_n]},
                   {"prompt_token_ids": ids[1 : short_n + 1]}]
    else:
        prompts = [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[2 : short_n - 14]},
                   {"prompt_token_ids": ids[:short_n]}, {"prompt_token_ids": ids[1 : short_n + 1]}]
    params = [greedy, few, few, sampled]
    return prompts, params


SERVING_PROMPT_LENGTHS = (2, 3, 5, 9, 17, 33, 65)
"""One short prefill each, alone in its step: every power of two of a step's longest query (the
prefill kernel's row-block class is a compile-time choice made from it) up to the class the
construction warm-up meets."""


def warm_up(llm: WarmUpTarget) -> float:
    """Run the warm-up requests through `llm.generate`, then restore the counters; returns seconds."""
    if llm.max_model_len < 48:  # too short a context for the dummy prompts: nothing to gain
        return 0.0
    prompts, params = warm_up_prompts(llm)
    # One call per shape: the long prompt alone is the first-request case, the rest a mixed batch.
    return _forgotten_calls(llm, [(prompts[:1], params[:1]), (prompts[1:], params[1:])])


def warm_up_serving(llm: WarmUpTarget) -> float:
    """What a server meets beyond `warm_up`: a prefill step of each query-length class (a burst's
    chunk remainders, one short prompt joining a decoding batch). A server calls it before accepting
    traffic, so a request never waits for a kernel build (most of a second each, cold); an
    offline `LLM` skips it to keep construction short. Returns seconds."""
    vocab = llm.runner.vocab_size
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    calls = []
    for n in SERVING_PROMPT_LENGTHS:
        if n + greedy.max_tokens > llm.max_model_len:
            break
        ids = [(5 * i + 1) % vocab for i in range(n)]
        prompt = ({"prompt_embeds": torch.zeros(n, llm.hidden_size, dtype=llm.engine_config.dtype)}
                  if llm.enable_prompt_embeds and n % 2 else {"prompt_token_ids": ids})
        calls.append(([prompt], [greedy]))
    return _forgotten_calls(llm, calls)


def _forgotten_calls(llm: WarmUpTarget, calls: list[tuple[list[Any], list[SamplingParams]]]) -> float:
    """Run each (prompts, params) through `llm.generate`, then forget them (counters, prefix cache,
    request ids); returns the seconds taken."""
    t0 = time.perf_counter()
    owners = _counter_owners(llm)
    saved = _snapshot(owners)
    for prompts, params in calls:
        llm.generate(prompts, params, use_tqdm=False)
    for owner, name, value in saved:
        setattr(owner, name, value)
    block_manager = getattr(llm.core.scheduler, "block_manager", None)
    if hasattr(block_manager, "reset_prefix_cache"):
        block_manager.reset_prefix_cache()
    llm.reset_request_ids()
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %.2f s", seconds)
    return seconds


__all__ = ["SERVING_PROMPT_LENGTHS", "warm_up", "warm_up_prompts", "warm_up_serving"]

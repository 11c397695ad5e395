"""The runner marks eager steps whose prefill rows all start at position 0 (`fresh_prefill`), which the
prefill kernel's launch choice reads: first chunks and whole fresh prompts are fresh, a later chunk of
a prompt or a prompt behind a prefix-cache hit is not, whatever else shares the step."""

from __future__ import annotations

import pytest

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model_root):
    return build_tiny_model(tiny_model_root / "fresh_prefill_llama", "llama", seed=2,
                            max_position_embeddings=128)


def _record(llm: LLM) -> list[tuple[int, bool]]:
    seen = []
    forward = llm.runner.forward

    def recording(embeds, positions, meta, *args, **kwargs):
        if meta.max_query_len > 1:
            seen.append((meta.max_query_len, meta.fresh_prefill))
        return forward(embeds, positions, meta, *args, **kwargs)

    llm.runner.forward = recording
    return seen


def test_chunks_after_the_first_are_not_fresh(model_dir, one_cpu_thread):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    seen = _record(llm)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 13))}, {"prompt_token_ids": list(range(20, 40))}],
                 params, use_tqdm=False)
    # step 1: prompt 0 whole (10 rows) + prompt 1's first 6; step 2: prompt 1's other 14 and prompt 0's
    # decode; then decodes only (not recorded)
    assert seen == [(10, True), (14, False)]


def test_a_prefix_cache_hit_is_not_fresh(model_dir, one_cpu_thread):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, enable_prefix_caching=True, block_size=8)
    seen = _record(llm)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 30))}
    llm.generate([prompt], params, use_tqdm=False)
    llm.generate([prompt], params, use_tqdm=False)
    assert [fresh for _, fresh in seen] == [True, False]

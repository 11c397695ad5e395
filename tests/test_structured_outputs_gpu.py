"""The structured-outputs validity suite on CUDA in bf16 with the engine's defaults: CUDA graphs, decode
windows, async scheduling (tests/structured_cases.py; the CPU version is tests/test_structured_outputs.py).

1,000 sampled generations over twenty constraints, all finished by their grammar and valid: from token-id
and prompt-embeds prompts on one engine (constrained steps replay decode graphs, defer their sampling
behind the step in flight), from `<embeds>`-item prompts on another; then an unconstrained greedy batch
on the first engine still runs decode windows.
"""

from __future__ import annotations

import pytest
import torch
from structured_cases import VOCAB_WORDS, failures, run_suite

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("structured_gpu") / "qwen3", "qwen3", seed=7,
                            vocab_words=VOCAB_WORDS)


def test_a_thousand_sampled_outputs_are_valid_on_cuda_with_defaults(model_dir):
    options = dict(enable_prompt_embeds=True, dtype="bfloat16", device="cuda", max_model_len=256)
    llm = LLM(model_dir, **options)
    try:
        assert llm.runner.graphs and llm.async_scheduling and llm.decode_window > 1
        replays = llm.runner.num_graph_replays
        results = run_suite(llm, ("ids", "embeds"), 34, dtype=torch.bfloat16)
        assert llm.runner.num_graph_replays > replays  # constrained single steps replayed decode graphs
        assert llm.core.num_async_steps > 0 and llm.core.token_masks.num_filled_rows > 0
        windows = llm.runner.num_decode_windows
        greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": [20 + j, 30 + j]} for j in range(8)], greedy)
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
        assert llm.runner.num_decode_windows > windows  # unconstrained batches keep their windows
        eos, special = set(llm.eos_token_ids), set(llm.tokenizer.all_special_ids)
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()
    items = LLM(model_dir, async_scheduling=False, **options)
    try:
        results += run_suite(items, ("item",), 16, seed0=10_000, dtype=torch.bfloat16)
    finally:
        items.shutdown()
    assert len(results) == 1000
    bad = failures(results, eos, special)
    assert not bad, f"{len(bad)} invalid outputs, e.g. {bad[:5]}"

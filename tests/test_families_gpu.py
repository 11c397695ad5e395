"""On the GPU, per family: the engine with its fused paths (one-kernel norms and rotary, merged q/k/v and
gate/up GEMMs, fused decoder layers where the family has them, the grouped MoE kernel, CUDA graphs) gives
the tokens of the engine without them (fused_ops=False). fp32 so that greedy tokens can be compared
exactly; chunked prefill and decode far past the 8-token windows. The MoE families run in bf16 (without
the grouped kernel, HF's experts use `torch.nn.functional.grouped_mm`, which wants bf16 on CUDA) and are
compared by first-token logprobs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_families import TINY_FAMILIES, build_family_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams
from runner.worker.model_states import FAMILY_MODEL_STATES

pytestmark = pytest.mark.gpu
MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_models_gpu")
    return {f: build_family_model(root / f, f, seed=11, init_std=0.1) for f in TINY_FAMILIES}


def _run(path, fused: bool, dtype: str):
    llm = LLM(path, dtype=dtype, device="cuda", block_size=16, num_kv_blocks=64, max_num_batched_tokens=32,
              max_num_seqs=8, fused_ops=fused)
    g = torch.Generator().manual_seed(3)
    vocab = llm.runner.vocab_size
    prompts = [torch.randint(12, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 45)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0.0, logprobs=0), use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_fused_gpu_paths_give_the_unfused_engines_tokens(family, family_dirs):
    dtype = "bfloat16" if family in MOE_FAMILIES else "float32"
    fused_llm, fused = _run(family_dirs[family], True, dtype)
    plain_llm, plain = _run(family_dirs[family], False, dtype)
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    else:
        _assert_first_logprobs_close(fused, plain)
    state = FAMILY_MODEL_STATES[family]
    assert (fused_llm.runner.num_fused_layers > 0) == state.supports_fused_layers
    assert plain_llm.runner.num_fused_layers == 0
    if family in MOE_FAMILIES:
        assert fused_llm.runner.num_grouped_moe > 0
        assert plain_llm.runner.num_grouped_moe == 0
    assert fused_llm.use_cuda_graphs and fused_llm.runner.num_graph_replays > 0


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_fused_gpu_paths_in_bf16_stay_within_noise_of_unfused(family, family_dirs):
    _, fused = _run(family_dirs[family], True, "bfloat16")
    _, plain = _run(family_dirs[family], False, "bfloat16")
    _assert_first_logprobs_close(fused, plain)


def _assert_first_logprobs_close(fused, plain) -> None:
    for a, b in zip(fused, plain):
        first_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]]
        first_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]]
        assert abs(first_a - first_b) < 0.05

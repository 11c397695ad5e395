"""`PromptProcessor.process_many`: a server tick's submissions validated together, each on its own.

Each call gets what `process` would give it alone (its requests, or the ValueError naming its own
bad prompt), a bad call costs the others nothing, and on a GPU every call's host prompt embeds go
to the device in one upload (one charge of the keep budget).
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_root):
    return build_tiny_model(tiny_model_root / "process_many_qwen3", "qwen3", seed=4,
                            max_position_embeddings=256)


def _calls(table: torch.Tensor) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    rows = [table[torch.randint(3, 100, (n,), generator=g)].cpu() for n in (9, 30, 4, 12)]
    nan = rows[2].clone()
    nan[1, 0] = float("nan")
    return [
        ([{"prompt_embeds": rows[0]}, {"prompt_embeds": rows[1]}], [PARAMS] * 2, ["a0", "a1"], False),
        ([{"prompt_embeds": rows[3]}, {"prompt_embeds": nan}], [PARAMS] * 2, ["b0", "b1"], False),
        ([{"prompt_token_ids": [5, 6, 7]}], [PARAMS], ["c0"], True),
        ([{"prompt_token_ids": [5, 10**9]}], [PARAMS], ["d0"], False),  # outside the vocabulary
        ([{"prompt_embeds": rows[2]}], [SamplingParams(max_tokens=4, prompt_logprobs=1)], ["e0"], False),
    ]


def _check(llm: LLM) -> None:
    table = llm.runner.embed_tokens.weight.detach()
    calls = _calls(table)
    got = llm.processor.process_many(calls)
    assert [type(r).__name__ for r in got] == ["list", "ValueError", "list", "ValueError", "ValueError"]
    assert str(got[1]).startswith("prompt 1: prompt_embeds contains NaN")
    assert str(got[3]).startswith("prompt 0: token ids [1000000000] are outside the vocabulary")
    assert "prompt_logprobs" in str(got[4])  # refused by the params check, after staging
    alone = llm.processor.process(*calls[0][:3], stream_text=False)
    for many, one in zip(got[0], alone):
        assert many.request_id == one.request_id and many.prompt_token_ids == one.prompt_token_ids
        assert torch.equal(many.prompt_embeds.cpu(), one.prompt_embeds.cpu())
    assert got[2][0].prompt_token_ids == [5, 6, 7]
    for requests in (got[0], got[2]):  # the accepted calls run like any others
        for req in requests:
            llm.core.add_request(req)
    while llm.core.has_unfinished():
        llm.core.step()
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_each_call_is_validated_on_its_own(model_dir, one_cpu_thread):
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=64)
    _check(llm)
    llm.shutdown()


@pytest.mark.gpu
def test_gpu_calls_share_one_upload(model_dir):
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", num_kv_blocks=64)
    uploader = llm.processor.uploader
    calls = _calls(llm.runner.embed_tokens.weight.detach())[:2]
    spans = []
    real = uploader.upload_rows
    uploader.upload_rows = lambda srcs, dtype: spans.append(len(srcs)) or real(srcs, dtype)
    got = llm.processor.process_many(calls)
    assert spans == [4]  # both calls' four host tensors in one upload
    assert all(r.prompt_embeds.is_cuda for r in got[0]) and isinstance(got[1], ValueError)
    assert uploader.kept_bytes == 55 * llm.runner.hidden_size * 4  # charged once, for every row
    uploader.upload_rows = real
    _check(llm)
    llm.shutdown()

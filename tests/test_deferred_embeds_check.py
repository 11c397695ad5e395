"""`LLM.generate` checks the prompt embeds past the first step's prompts once that step is launched.

The leading prompts (what the first step takes) are checked before anything is scheduled, as before; a
NaN/Inf in a later prompt is found after the first step launched and drops the whole call: the same
ValueError naming the prompt, nothing returned, no request, block or slot left behind, and the engine
serves the next call as if the bad one had never come. On a GPU the later prompts' upload is the part
that overlaps the first step (`tests/test_warmup_upload.py` covers the uploads themselves).
"""

from __future__ import annotations

import gc

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams
from runner.engine.embeds_staging import num_leading_prompts
from runner.engine.parsed_prompt import ParsedPrompt

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
LENGTHS = (9, 14, 6, 11, 8, 12)


@pytest.fixture(scope="module")
def model_dir(tiny_model_root):
    return build_tiny_model(tiny_model_root / "deferred_embeds_qwen3", "qwen3", seed=7,
                            max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(model_dir):
    # A first step of at most 24 tokens: the first two prompts (9 + 14 = 23, then the third's first row).
    return LLM(model_dir, enable_prompt_embeds=True, dtype="float32", num_kv_blocks=64,
               max_num_batched_tokens=24, max_num_seqs=8)


def _prompts(llm: LLM) -> tuple[list[list[int]], list[dict]]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 100, (n,), generator=g).tolist() for n in LENGTHS]
    table = llm.runner.embed_tokens.weight.detach()
    return ids, [{"prompt_embeds": table[i].clone().cpu()} for i in ids]


def test_leading_prompts_are_those_the_first_step_takes():
    parsed = [ParsedPrompt(text=None, token_ids=[0] * n) for n in LENGTHS]
    assert num_leading_prompts(parsed, 24, 8) == 3  # 9 + 14 < 24: the third starts in the first step
    assert num_leading_prompts(parsed, 23, 8) == 2
    assert num_leading_prompts(parsed, 5, 8) == 1
    assert num_leading_prompts(parsed, 10_000, 8) == len(LENGTHS)
    assert num_leading_prompts(parsed, 10_000, 4) == 4  # the request limit
    assert num_leading_prompts(parsed, 24, 0) == 1  # at least one
    assert num_leading_prompts([], 24, 8) == 0
    parsed[4].embeds = torch.zeros(LENGTHS[4], 8, device="meta")  # a later prompt's rows on a device
    assert num_leading_prompts(parsed, 24, 8) == len(LENGTHS)  # checked now, not behind the first step
    parsed[4].embeds = torch.zeros(LENGTHS[4], 8)  # host rows: deferred
    assert num_leading_prompts(parsed, 24, 8) == 3


def test_a_bad_later_prompt_drops_the_whole_call_and_leaves_nothing(llm, one_cpu_thread):
    ids, good = _prompts(llm)
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], PARAMS, use_tqdm=False)
    first = llm.generate(good, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in by_ids]

    bad = [dict(p) for p in good]
    bad[4] = {"prompt_embeds": good[4]["prompt_embeds"].clone()}
    bad[4]["prompt_embeds"][7, 3] = float("inf")
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match=r"^prompt 4: prompt_embeds contains NaN or Inf"):
        llm.generate(bad, PARAMS, use_tqdm=False)
    assert llm.stats().num_steps > steps  # the first step ran before the later prompts were checked
    assert not llm.has_unfinished_requests()
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert llm.stats().num_free_slots == llm.stats().num_total_slots
    again = llm.generate(good, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_a_bad_leading_prompt_is_refused_before_any_step(llm, one_cpu_thread):
    _, good = _prompts(llm)
    bad = list(good)
    bad[1] = {"prompt_embeds": torch.full_like(good[1]["prompt_embeds"], float("nan"))}
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match=r"^prompt 1: prompt_embeds contains NaN or Inf"):
        llm.generate(bad, PARAMS, use_tqdm=False)
    assert llm.stats().num_steps == steps
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_other_errors_of_later_prompts_are_still_found_before_any_step(llm, one_cpu_thread):
    _, good = _prompts(llm)
    bad = list(good)
    bad[5] = {"prompt_embeds": good[5]["prompt_embeds"][:, :3]}  # the wrong width
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match=r"^prompt 5: "):
        llm.generate(bad, PARAMS, use_tqdm=False)
    params = [PARAMS] * 5 + [SamplingParams(max_tokens=2, prompt_logprobs=1)]
    with pytest.raises(ValueError, match="prompt_logprobs for a prompt-embeds prompt"):
        llm.generate(good, params, use_tqdm=False)
    assert llm.stats().num_steps == steps


@pytest.mark.gpu
def test_gpu_later_host_prompts_go_up_behind_the_first_step(model_dir):
    """On a GPU the later prompts' host rows are uploaded (and kept) once the first step is launched: the
    tokens equal those of token ids and of device embeds, and a bad later prompt drops the call cleanly."""
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=8)
    ids, host = _prompts(llm)
    on_device = [{"prompt_embeds": p["prompt_embeds"].cuda()} for p in host]
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], PARAMS,
                                                         use_tqdm=False)]
    for prompts in (host, on_device, host):
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    bad = list(host)
    bad[5] = {"prompt_embeds": host[5]["prompt_embeds"].clone()}
    bad[5]["prompt_embeds"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^prompt 5: prompt_embeds contains NaN or Inf"):
        llm.generate(bad, PARAMS, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    gc.collect()  # the traceback's frames held the call's requests
    assert llm.processor.uploader.kept_bytes == 0  # nothing of the dropped call holds device rows
    assert [o.outputs[0].token_ids for o in llm.generate(host, PARAMS, use_tqdm=False)] == want

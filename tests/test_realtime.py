"""Realtime input streamed into a live request (issue 4), through `add_request` / `step` / `append_input`.

A tiny streaming encoder (its chunk's rows are the chunk itself): the tokens generated after a chunk
depend on it and equal a full-recompute reference in which the chunk's rows stand at the positions the
engine assigned; a non-realtime engine never gathers encoder rows in decode and refuses streamed input.
"""

from __future__ import annotations

import pytest
import torch
from helpers import IdentityEncoder

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

HIDDEN = 64
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_IDS = [11, 42, 97, 120, 7, 64]


def _stream_encoder() -> IdentityEncoder:
    """Realtime "audio": a chunk is an (n, hidden) tensor and encodes to itself."""
    return IdentityEncoder("audio", is_realtime=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rt") / "qwen2", "qwen2", seed=8)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _chunk(seed: int, n: int = 3) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _stream(llm: LLM, chunk: torch.Tensor, steps_before: int = 3) -> tuple[list[int], int, int]:
    """Run one request, stream `chunk` after `steps_before` steps; (tokens, chunk offset, tokens before)."""
    rid = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)
    outs = []
    for _ in range(steps_before):
        outs = llm.step()
    before = len(outs[-1].outputs[0].token_ids)
    offset = len(PROMPT_IDS) + before
    llm.append_input(rid, chunk)
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            final = out
    assert final is not None and final.finished
    return final.outputs[0].token_ids, offset, before


def _reference(hf_model, chunk: torch.Tensor, offset: int) -> list[int]:
    """Greedy with a full forward per step; position p in [offset, offset + n) feeds chunk row p - offset."""
    table = hf_model.get_input_embeddings().weight.detach()
    seq = table[PROMPT_IDS].clone()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(PARAMS.max_tokens):
            tok = int(hf_model(inputs_embeds=seq[None]).logits[0, -1].argmax())
            out.append(tok)
            p = seq.shape[0]
            streamed = offset <= p < offset + chunk.shape[0]
            row = chunk[p - offset : p - offset + 1] if streamed else table[tok : tok + 1]
            seq = torch.cat([seq, row])
    return out


def test_tokens_after_a_streamed_chunk_depend_on_it(model_dir, hf_model):
    enc = _stream_encoder()
    llm = LLM(model_dir, encoders={"audio": enc}, device="cpu", num_kv_blocks=64)
    a, b = _chunk(1), _chunk(2)
    tok_a, off_a, before = _stream(llm, a)
    tok_b, off_b, _ = _stream(llm, b)
    assert off_a == off_b
    assert tok_a[:before] == tok_b[:before]  # identical until the chunk is fed
    assert tok_a != tok_b  # ... and different after it
    assert tok_a == _reference(hf_model, a, off_a)
    assert tok_b == _reference(hf_model, b, off_b)
    assert enc.calls == [1, 1] and llm.mm.num_decode_gathers > 0
    assert llm.stats().all_free
    assert llm.encoder_cache.num_evictable_tokens == llm.encoder_cache.num_cached_tokens


def test_two_chunks_queue_one_after_the_other(model_dir, hf_model):
    llm = LLM(model_dir, encoders={"audio": _stream_encoder()}, device="cpu", num_kv_blocks=64)
    rid = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)
    llm.step()
    first, second = _chunk(3, 2), _chunk(4, 2)
    llm.append_input(rid, first)
    llm.append_input(rid, second)  # starts right after the first chunk's rows
    offset = len(PROMPT_IDS) + 1
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            final = out
    assert final.outputs[0].token_ids == _reference(hf_model, torch.cat([first, second]), offset)


def test_non_realtime_engine_never_gathers_in_decode(model_dir):
    llm = LLM(model_dir, encoders={"image": IdentityEncoder("image")}, enable_prompt_embeds=True,
              device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    gathered: list[tuple[bool, bool]] = []
    gather = llm.mm.gather_step

    def spy(requests, num_scheduled):
        result = gather(requests, num_scheduled)
        all_decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
        gathered.append((all_decode, result is not None))
        return result

    llm.mm.gather_step = spy
    prompt = {"prompt": "red <image> blue", "multi_modal_data": {"image": [_chunk(5, 6)]}}
    llm.generate([prompt, prompt, "text"], PARAMS, use_tqdm=False)
    assert any(got for _, got in gathered)  # prefill steps did gather
    assert not any(got for all_decode, got in gathered if all_decode)
    assert llm.mm.num_decode_gathers == 0 and not llm.mm.realtime
    rid = llm.add_request("red blue", PARAMS)
    with pytest.raises(ValueError, match="realtime"):
        llm.append_input(rid, _chunk(6), modality="image")
    llm.abort_request(rid)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_streamed_rows_through_decode_graph_buckets(model_dir):
    """Decode steps replaying a (CPU-emulated) CUDA-graph bucket, with padding rows, scatter streamed
    rows exactly like eager steps."""
    results = []
    for emulate in (False, True):
        llm = LLM(model_dir, encoders={"audio": _stream_encoder()}, device="cpu", num_kv_blocks=64,
                  max_num_seqs=4)
        if emulate:
            llm.runner.capture_cuda_graphs(emulate=True)
        rids = [llm.add_request({"prompt_token_ids": PROMPT_IDS[: 3 + i]}, PARAMS) for i in range(3)]
        llm.step()
        llm.step()
        llm.append_input(rids[1], _chunk(7))
        final = {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                final[out.request_id] = out.outputs[0].token_ids
        assert llm.mm.num_decode_gathers > 0
        assert (llm.runner.num_graph_replays > 0) == emulate
        results.append([final[r] for r in rids])
    assert results[0] == results[1]

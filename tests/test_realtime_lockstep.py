"""Realtime input is the same whatever the engine options (issue 35): while a request's input is open it
gains at most one token per `step()` and nothing is left in flight between calls, so chunks appended after
the 3rd and 7th call land where the plain synchronous loop puts them and the tokens equal a full-recompute
reference. On the CPU the GPU's defaults are reproduced: CUDA-graph buckets emulated with 32-step decode
windows (pipelined, and behind overlapped steps), async scheduling forced on, chunked prefill, prefix
caching. `close_input` puts the request back at full speed; its misuse is a clear `ValueError`."""

from __future__ import annotations

import pytest
import torch
from helpers import IdentityEncoder
from realtime_scenario import PROMPT_IDS, build, chunk, drive, reference_tokens, streamed_rows

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
OPTIONS = {
    "plain": dict(),
    "windows": dict(graphs_on_cpu=True, window=32),
    "async": dict(force_async=True),
    "async_windows": dict(graphs_on_cpu=True, window=32, force_async=True),
    "chunked": dict(max_num_batched_tokens=4),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "everything": dict(graphs_on_cpu=True, window=32, force_async=True, max_num_batched_tokens=4,
                       enable_prefix_caching=True, block_size=4),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rt_lockstep") / "qwen2", "qwen2", seed=8)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plain_trace(model_dir):
    return drive(build(model_dir, "cpu", num_kv_blocks=64), PARAMS)


def test_plain_loop_grows_one_token_per_step_and_uses_both_chunks(plain_trace, hf_model):
    trace = plain_trace
    assert trace.counts == list(range(1, PARAMS.max_tokens + 1))
    n = len(PROMPT_IDS)
    assert trace.offsets == [n + 3, n + 7]  # right after the tokens the caller had seen
    assert trace.tokens == reference_tokens(hf_model, PARAMS, streamed_rows(trace))
    assert trace.tokens != reference_tokens(hf_model, PARAMS, {})


@pytest.mark.parametrize("name", list(OPTIONS))
def test_open_input_gives_the_plain_loops_steps_with_every_option(name, model_dir):
    """Against the plain loop with the same scheduling options (a chunked prefill takes a step more, a
    prefix-cache hit a step less); the second run of a prefix-caching engine reads cached prompt blocks."""
    options = OPTIONS[name]
    llm = build(model_dir, "cpu", num_kv_blocks=64, **options)
    scheduling = {k: v for k, v in options.items() if k not in ("graphs_on_cpu", "window", "force_async")}
    plain = build(model_dir, "cpu", num_kv_blocks=64, **scheduling)
    for _ in range(2 if llm.engine_config.enable_prefix_caching else 1):
        trace, expected = drive(llm, PARAMS), drive(plain, PARAMS)
        assert trace.idle_between_calls
        assert all(b - a <= 1 for a, b in zip([0, *trace.counts], trace.counts))
        assert (trace.counts, trace.offsets) == (expected.counts, expected.offsets)
        assert trace.tokens == expected.tokens
    if llm.engine_config.enable_prefix_caching:
        assert llm.block_manager.num_hit_blocks > 0
    assert llm.core.num_async_steps == 0 and llm.runner.num_decode_windows == 0
    assert llm.stats().all_free


@pytest.mark.parametrize("name", ["windows", "async_windows"])
def test_closed_input_finishes_at_full_speed(name, model_dir, hf_model):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = build(model_dir, "cpu", num_kv_blocks=64, **OPTIONS[name])
    trace = drive(llm, params, close_after=7)
    n = len(PROMPT_IDS)
    assert trace.counts[:7] == list(range(1, 8)) and trace.offsets == [n + 3, n + 7]
    assert max(b - a for a, b in zip(trace.counts, trace.counts[1:])) > 1  # decode windows after the close
    assert llm.runner.num_decode_windows > 0 and len(trace.counts) < params.max_tokens
    assert trace.tokens == reference_tokens(hf_model, params, streamed_rows(trace))
    assert not llm.core.has_open_inputs


def test_other_requests_run_in_lockstep_only_while_an_input_is_open(model_dir):
    llm = build(model_dir, "cpu", num_kv_blocks=64, **OPTIONS["async_windows"])
    text = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    other = llm.add_request({"prompt_token_ids": [5, 6, 7]}, text, streaming_input=False)
    llm.step()
    llm.step()  # the other request is decoding in windows now
    assert llm.runner.num_decode_windows > 0 and llm.core.window is not None
    rid = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)  # open by default (realtime encoder)
    assert llm.core.has_open_inputs
    # the window in flight is finished and the new request prefilled in the same call, as the plain loop would
    outs = {o.request_id: o for o in llm.step()}
    assert len(outs[rid].outputs[0].token_ids) == 1
    assert llm.core.window is None and llm.core.in_flight is None
    windows, async_steps, lockstep = (llm.runner.num_decode_windows, llm.core.num_async_steps,
                                      llm.core.num_lockstep_steps)
    for _ in range(3):
        before = len(outs[other].outputs[0].token_ids)
        outs = {o.request_id: o for o in llm.step()}
        assert len(outs[other].outputs[0].token_ids) == before + 1  # one token per call for everyone
    assert (llm.runner.num_decode_windows, llm.core.num_async_steps) == (windows, async_steps)
    assert llm.core.num_lockstep_steps == lockstep + 3
    llm.close_input(rid)
    assert not llm.core.has_open_inputs
    llm.step()
    llm.step()
    assert llm.runner.num_decode_windows > windows  # full speed again
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_a_finished_or_aborted_open_request_stops_the_lockstep(model_dir):
    llm = build(model_dir, "cpu", num_kv_blocks=64, graphs_on_cpu=True, window=32)
    short = llm.add_request({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=2, ignore_eos=True))
    gone = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)
    llm.abort_request(gone)
    llm.step()
    llm.step()  # `short` ended by length while open
    assert not llm.core.has_open_inputs
    with pytest.raises(ValueError, match="no live request"):
        llm.close_input(short)
    assert llm.generate({"prompt_token_ids": PROMPT_IDS}, PARAMS)[0].outputs[0].token_ids
    assert llm.runner.num_decode_windows > 0  # generate's requests are closed: windows as usual


def test_streaming_input_flag_and_close_input_errors(model_dir):
    llm = build(model_dir, "cpu", num_kv_blocks=64)
    closed = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS, streaming_input=False)
    assert not llm.core.has_open_inputs
    with pytest.raises(ValueError, match=f"input of request '{closed}' is closed"):
        llm.append_input(closed, chunk(1, 2))
    rid = llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)
    llm.step()
    assert llm.append_input(rid, chunk(2, 2)) == len(PROMPT_IDS) + 1
    llm.close_input(rid)
    llm.close_input(rid)  # closing twice is harmless
    with pytest.raises(ValueError, match=f"input of request '{rid}' is closed.*close_input"):
        llm.append_input(rid, chunk(3, 2))
    with pytest.raises(ValueError, match="no live request 'nope'"):
        llm.close_input("nope")
    with pytest.raises(ValueError, match="streaming_input must be True, False or None"):
        llm.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS, streaming_input="yes")
    while llm.has_unfinished_requests():
        llm.step()
    with pytest.raises(ValueError, match=f"no live request '{rid}'"):
        llm.close_input(rid)
    text_only = LLM(model_dir, encoders={"image": IdentityEncoder("image")}, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="streaming_input=True needs a realtime encoder"):
        text_only.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS, streaming_input=True)
    text_only.add_request({"prompt_token_ids": PROMPT_IDS}, PARAMS)
    assert not text_only.core.has_open_inputs  # closed by default without a realtime encoder

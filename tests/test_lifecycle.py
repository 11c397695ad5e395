"""An engine's lifecycle: `shutdown()` / `with LLM(...)` free everything at once, and engines built
one after another in one process (a notebook, a sweep) each get their KV cache."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import IdentityEncoder

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lifecycle") / "llama", "llama", seed=3)


def _use_every_input_kind(llm: LLM) -> None:
    """Text, whole-prompt embeds, an <embeds> item, an image item and a realtime request."""
    hidden = llm.hidden_size
    embeds = torch.randn(6, hidden, generator=torch.Generator().manual_seed(0))
    outs = llm.generate([
        "hello world",
        {"prompt_embeds": embeds},
        {"prompt": "a <embeds> b", "multi_modal_data": {"prompt_embeds": [embeds[:2]]}},
        {"prompt": "a <image> b", "multi_modal_data": {"image": [embeds[2:5]]}},
    ], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    rid = llm.add_request({"prompt": "stream <audio>", "multi_modal_data": {"audio": [embeds[:1]]}}, GREEDY)
    llm.append_input(rid, embeds[1:3], modality="audio")
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats().all_free


def _build(model_dir, device: str, **kw) -> LLM:
    encoders = {"image": IdentityEncoder("image"), "audio": IdentityEncoder("audio", is_realtime=True)}
    return LLM(model_dir, enable_prompt_embeds=True, encoders=encoders, device=device, **kw)


def test_shutdown_releases_and_refuses_further_use(model_dir):
    llm = _build(model_dir, "cpu", num_kv_blocks=64)
    _use_every_input_kind(llm)
    runner = llm.runner
    llm.shutdown()
    assert runner.kv_caches == [] and runner.model is None and not runner.graphs
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.add_request("hello", GREEDY)


def test_context_manager_shuts_down(model_dir):
    with _build(model_dir, "cpu", num_kv_blocks=64) as llm:
        out = llm.generate("hello", GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(RuntimeError, match="shut down"):
        llm.has_unfinished_requests()


#: LLM members that do not need the engine and keep working after shutdown()
ENGINE_FREE = {"get_tokenizer", "eos_token_ids", "shutdown", "reset_request_ids"}
#: a call of each public method (the test fails for a method added without one here)
CALLS = {
    "generate": lambda llm: llm.generate("hello", GREEDY),
    "add_request": lambda llm: llm.add_request("hello", GREEDY),
    "step": lambda llm: llm.step(),
    "has_unfinished_requests": lambda llm: llm.has_unfinished_requests(),
    "abort_request": lambda llm: llm.abort_request("0"),
    "append_input": lambda llm: llm.append_input("0", torch.zeros(1, 64), modality="audio"),
    "close_input": lambda llm: llm.close_input("0"),
    "register_encoder": lambda llm: llm.register_encoder(IdentityEncoder("video")),
    "memory_report": lambda llm: llm.memory_report(),
    "stats": lambda llm: llm.stats(),
}


def test_every_engine_member_raises_the_same_error_after_shutdown(model_dir):
    """Issue 40: after shutdown() every public method and property that needs the engine raises
    RuntimeError("this LLM was shut down; build a new one"), not an AttributeError on a freed part."""
    import inspect

    llm = _build(model_dir, "cpu", num_kv_blocks=64)
    rid = llm.add_request("hello", GREEDY)
    llm.step()
    llm.shutdown()
    message = "^this LLM was shut down; build a new one$"
    checked = set()
    for name, member in inspect.getmembers(LLM):
        if name.startswith("_") or name in ENGINE_FREE:
            continue
        checked.add(name)
        if isinstance(member, property):
            with pytest.raises(RuntimeError, match=message):
                getattr(llm, name)
            if member.fset is not None:
                with pytest.raises(RuntimeError, match=message):
                    setattr(llm, name, 1)
            continue
        assert name in CALLS, f"LLM.{name}: add a call of it to CALLS"
        with pytest.raises(RuntimeError, match=message):
            CALLS[name](llm)
    assert {"step", "abort_request", "has_unfinished_requests", "stats", "runner"} <= checked
    with pytest.raises(RuntimeError, match=message):
        llm.append_input(rid, torch.zeros(1, 64))  # a request that was live
    for part in (llm.core, llm.mm, llm.processor):
        with pytest.raises(RuntimeError, match=message):
            part.step()
    assert llm.get_tokenizer() is not None and llm.eos_token_ids
    llm.shutdown()  # still idempotent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_five_engines_in_a_row_on_the_gpu(model_dir):
    """Each engine sizes its KV cache from what is free now; none may fail for the ones before it,
    whether they were shut down, left to a `with` block, or just dropped."""
    options = [
        dict(),
        dict(enforce_eager=True),
        dict(enable_prefix_caching=True, gpu_memory_utilization=0.8),
        dict(async_scheduling=False, max_num_seqs=16),
        dict(decode_window=4, dtype="float32"),
    ]
    for i, kw in enumerate(options):
        llm = _build(model_dir, "cuda", **kw)
        _use_every_input_kind(llm)
        assert llm.stats().num_total_blocks > 0
        if i % 2 == 0:
            llm.shutdown()
        del llm  # the odd ones are only dropped: sizing must still find their memory
    gc.collect()
    with _build(model_dir, "cuda") as llm:
        _use_every_input_kind(llm)

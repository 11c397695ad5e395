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
    assert llm.num_free_blocks == llm.num_total_blocks and llm.num_free_slots == llm.num_total_slots


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
    assert llm.core is None


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
        assert llm.num_total_blocks > 0
        if i % 2 == 0:
            llm.shutdown()
        del llm  # the odd ones are only dropped: sizing must still find their memory
    gc.collect()
    with _build(model_dir, "cuda") as llm:
        _use_every_input_kind(llm)

"""`LLM(async_scheduling=...)` (issue 4): on for token and embeds prompts with identical tokens; with
multimodal input an explicit request is a ValueError and the default turns it off with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from runner.encoder_protocol import tensor_content_hash
from runner.llm import LLM
from runner.sampling_params import SamplingParams
from runner.tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class ImageEncoder:
    modality = "image"
    is_realtime = False

    def num_rows(self, item):
        return int(item.shape[0])

    def content_hash(self, item):
        return tensor_content_hash(item)

    def encode(self, items):
        return [i.clone() for i in items]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("async") / "qwen3", "qwen3", seed=2)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [
        {"prompt_token_ids": torch.randint(10, 200, (n,), generator=g).tolist()} for n in (3, 9, 17)
    ] + [{"prompt_embeds": torch.randn(n, 64, generator=g) * 0.5} for n in (5, 12)]


def test_async_on_for_token_and_embeds_prompts_same_tokens(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=True, device="cpu", num_kv_blocks=64)
        default = LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=64)
    off = LLM(model_dir, enable_prompt_embeds=True, async_scheduling=False, device="cpu", num_kv_blocks=64)
    assert on.async_scheduling and default.async_scheduling and not off.async_scheduling
    got = [o.outputs[0].token_ids for o in on.generate(_prompts(), GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in off.generate(_prompts(), GREEDY, use_tqdm=False)]
    assert got == want


def test_async_with_encoders_explicit_is_error_default_warns(model_dir):
    with pytest.raises(ValueError, match="async scheduling"):
        LLM(model_dir, encoders={"image": ImageEncoder()}, async_scheduling=True, device="cpu",
            num_kv_blocks=16)
    with pytest.warns(UserWarning, match="async scheduling turned off"):
        llm = LLM(model_dir, encoders={"image": ImageEncoder()}, device="cpu", num_kv_blocks=16)
    assert llm.async_scheduling is False


def test_async_then_multimodal_prompt(model_dir):
    item = {"prompt": "red <embeds>", "multi_modal_data": {"prompt_embeds": [torch.ones(2, 64)]}}
    explicit = LLM(model_dir, async_scheduling=True, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="async scheduling"):
        explicit.generate(["text", item], GREEDY, use_tqdm=False)
    assert explicit.num_steps == 0
    with pytest.raises(ValueError, match="async scheduling"):
        explicit.register_encoder(ImageEncoder())
    default = LLM(model_dir, device="cpu", num_kv_blocks=16)
    with pytest.warns(UserWarning, match="async scheduling turned off"):
        out = default.generate(item, GREEDY, use_tqdm=False)
    assert default.async_scheduling is False and len(out[0].outputs[0].token_ids) == GREEDY.max_tokens

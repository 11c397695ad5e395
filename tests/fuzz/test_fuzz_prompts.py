"""Fuzzing `LLM.generate`'s prompt dicts: every key with values of every shape, dtype and layout.

Each call either generates (and leaves every KV block and slot free) or raises a ValueError with a
bounded message before anything runs; no other exception type, and never a wedged engine.
"""

from __future__ import annotations

import pytest
import torch
from helpers import IdentityEncoder
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams

HIDDEN = 32
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("fuzz_prompts") / "m", "qwen3", seed=0,
                            hidden_size=HIDDEN, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                            intermediate_size=32, max_position_embeddings=64)
    torch.set_num_threads(1)
    return LLM(path, enable_prompt_embeds=True, encoders={"image": IdentityEncoder("image")}, device="cpu",
               num_kv_blocks=32, dtype="bfloat16")


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    t = torch.zeros(shape, dtype=dtype)
    if t.numel() and dtype.is_floating_point:
        t = t + draw(st.sampled_from([0.0, 1.0, 1e39, float("nan"), float("inf"), -3e38]))
    kind = draw(st.sampled_from(["dense", "sparse", "meta", "transposed", "expanded"]))
    if kind == "sparse" and t.dim() >= 1:
        return t.to_sparse()
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "transposed" and t.dim() == 2:
        return t.t()
    if kind == "expanded" and t.dim() == 2 and t.shape[0]:
        return t[:1].expand(draw(st.integers(1, 70)), -1)
    return t


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=12),
    st.lists(st.integers(-5, 300), max_size=80), st.lists(st.text(max_size=2), max_size=3), tensors(),
)
KEYS = ["prompt", "prompt_token_ids", "prompt_embeds", "prompt_is_token_ids", "multi_modal_data", "extra"]


@st.composite
def prompts(draw):
    prompt = draw(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
    if draw(st.booleans()):
        items = draw(st.lists(st.one_of(tensors(), VALUES), max_size=2))
        modality = draw(st.sampled_from(["image", "prompt_embeds", "audio", "x"]))
        prompt["multi_modal_data"] = {modality: items}
        texts = ["a <image> b", "<embeds>", "x <embeds> <image>", ""]
        prompt.setdefault("prompt", draw(st.sampled_from(texts)))
    return prompt


@settings(max_examples=150)
@given(st.lists(st.one_of(prompts(), st.text(max_size=10), st.integers()), min_size=1, max_size=3))
def test_generate_accepts_or_raises_value_error(llm, batch):
    try:
        outs = llm.generate(batch, PARAMS, use_tqdm=False)
    except ValueError as err:
        assert len(str(err)) < 600
    else:
        assert len(outs) == len(batch)
    assert llm.stats().all_free
    assert not llm.has_unfinished_requests()

"""Prefix caching keyed by token ids plus the embedding rows a block covers (issue 4).

Identical embeds prompts reuse blocks (hits counted); different embeddings behind the same
placeholder ids never do; media items share blocks only up to where they differ; outputs equal the
engine without prefix caching (also under chunking, a small pool that evicts, and preemption); after
every generate all blocks are free or cached-evictable.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.engine.prefix_cache import PrefixCachingBlockManager
from runner.llm import LLM
from runner.multimodal.encoder_protocol import tensor_content_hash
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

HIDDEN = 64
BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class TinyImageEncoder:
    modality = "image"
    is_realtime = False

    def __init__(self) -> None:
        self.proj = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))

    def num_rows(self, item):
        return int(item.shape[0] * item.shape[1])

    def content_hash(self, item):
        return tensor_content_hash(item)

    def encode(self, items):
        return [item.reshape(-1, 3) @ self.proj for item in items]




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pc") / "llama", "llama", seed=4)


def _llm(model_dir, caching: bool, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model_dir, enable_prompt_embeds=True, encoders={"image": TinyImageEncoder()}, device="cpu",
               block_size=BS, enable_prefix_caching=caching, **kw)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5


def _image(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(seed))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_free_or_evictable(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # cached blocks count as free (evictable)
    assert llm.stats().num_free_slots == llm.stats().num_total_slots


def test_identical_embeds_prompts_hit_and_match_uncached(model_dir):
    llm = _llm(model_dir, True)
    bm = llm.block_manager
    assert isinstance(bm, PrefixCachingBlockManager)
    embeds = _rows(22, seed=1)
    first = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    assert bm.num_hit_blocks == 0 and bm.num_cached_blocks > 0
    second = llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False)
    assert bm.num_hit_blocks == (22 - 1) // BS  # every full prompt block but the one holding the last token
    ref = _llm(model_dir, False).generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    assert _tokens(first) == _tokens(second) == _tokens(ref)
    _assert_free_or_evictable(llm)


def test_different_embeds_behind_the_same_placeholder_ids_never_hit(model_dir):
    llm = _llm(model_dir, True)
    bm = llm.block_manager
    a, b = _rows(20, seed=2), _rows(20, seed=3)
    b_mostly_a = a.clone()
    b_mostly_a[13] += 1e-3  # differs in block 3 only
    out_a = llm.generate({"prompt_embeds": a}, GREEDY, use_tqdm=False)
    out_b = llm.generate({"prompt_embeds": b}, GREEDY, use_tqdm=False)
    assert bm.num_hit_blocks == 0  # same placeholder ids, different rows: no sharing
    llm.generate({"prompt_embeds": b_mostly_a}, GREEDY, use_tqdm=False)
    assert bm.num_hit_blocks == 3  # blocks 0..2 equal, block 3 differs, the chain stops there
    ref = _llm(model_dir, False).generate([{"prompt_embeds": x} for x in (a, b)], GREEDY, use_tqdm=False)
    assert _tokens(out_a) + _tokens(out_b) == _tokens(ref)
    _assert_free_or_evictable(llm)


def test_media_items_share_blocks_only_before_they_differ(model_dir):
    llm = _llm(model_dir, True)
    bm = llm.block_manager
    text = "red blue green yellow red blue green yellow <image> tail of the prompt"
    prefix_len = len(llm.get_tokenizer().encode(text.split("<image>")[0]))
    p1 = {"prompt": text, "multi_modal_data": {"image": [_image(1)]}}
    p2 = {"prompt": text, "multi_modal_data": {"image": [_image(2)]}}
    o1 = llm.generate(p1, GREEDY, use_tqdm=False)
    o1b = llm.generate(p1, GREEDY, use_tqdm=False)
    n = len(o1[0].prompt_token_ids)
    assert bm.num_hit_blocks == (n - 1) // BS
    hits = bm.num_hit_blocks
    o2 = llm.generate(p2, GREEDY, use_tqdm=False)
    assert bm.num_hit_blocks - hits == prefix_len // BS  # only the text blocks before the image
    ref = _llm(model_dir, False).generate([p1, p2], GREEDY, use_tqdm=False)
    assert _tokens(o1) == _tokens(o1b) == _tokens(ref[:1]) and _tokens(o2) == _tokens(ref[1:])
    _assert_free_or_evictable(llm)


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=6, max_num_seqs=3),  # chunked prefill
    dict(num_kv_blocks=14, max_num_batched_tokens=32),  # small pool: eviction and preemption
])  # fmt: skip
def test_outputs_equal_without_caching_under_pressure(model_dir, engine):
    shared = _rows(12, seed=7)
    g = torch.Generator().manual_seed(8)
    prompts = []
    for i in range(6):
        tail = _rows(3 + i, seed=30 + i)
        prompts.append({"prompt_embeds": torch.cat([shared, tail])})
        prompts.append({"prompt_token_ids": torch.randint(10, 200, (5 + 2 * i,), generator=g).tolist()})
    prompts.append({"prompt": "red <image> blue", "multi_modal_data": {"image": [_image(3)]}})
    cached = _llm(model_dir, True, **engine)
    plain = _llm(model_dir, False, **engine)
    want = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert _tokens(cached.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert _tokens(cached.generate(prompts[::-1], GREEDY, use_tqdm=False)) == want[::-1]
    assert cached.block_manager.num_hit_blocks > 0
    _assert_free_or_evictable(cached)

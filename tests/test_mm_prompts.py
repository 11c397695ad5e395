"""Prompts with media and passthrough items through the engine (issue 4: prompts with media, penalties).

A tiny fp32 qwen3 model and a small test encoder meeting the runner's encoder protocol. Checked:
placeholders expand to each item's rows; user rows (passthrough items, whole-prompt embeds) reach the
model bit-exact next to real media rows; outputs equal the same prompt given as one all-embeds tensor;
passthrough-only batches run no encoder; a cached identifier is neither re-encoded nor re-uploaded;
chunked prefill through the middle of an item changes nothing; encoder-cache references are released;
penalties skip placeholder positions in a batch of mixed prompt lengths (reference computed by hand).
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.multimodal.encoder_cache import feature_identifier
from runner.multimodal.encoder_protocol import tensor_content_hash
from runner.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.filterwarnings("ignore:async scheduling turned off"),
    pytest.mark.usefixtures("one_cpu_thread"),
]

HIDDEN = 64
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class TinyImageEncoder:
    """An "image" is an (h, w, 3) tensor; each pixel becomes one row through a fixed projection."""

    modality = "image"
    is_realtime = False

    def __init__(self, hidden: int = HIDDEN, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.randn(3, hidden, generator=g)
        self.calls: list[int] = []

    def num_rows(self, item: torch.Tensor) -> int:
        return int(item.shape[0] * item.shape[1])

    def grid_thw(self, item: torch.Tensor) -> tuple[int, int, int]:
        return (1, int(item.shape[0]), int(item.shape[1]))

    def content_hash(self, item: torch.Tensor) -> str:
        return tensor_content_hash(item)

    def encode(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(len(items))
        return [item.reshape(-1, 3).float() @ self.proj for item in items]




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mm") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _llm(model_dir, **kw) -> tuple[LLM, TinyImageEncoder]:
    enc = TinyImageEncoder()
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model_dir, enable_prompt_embeds=True, encoders={"image": enc}, device="cpu", **kw), enc


def _image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randn(h, w, 3, generator=torch.Generator().manual_seed(seed))


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5


def _assert_clean(llm: LLM) -> None:
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert llm.stats().num_free_slots == llm.stats().num_total_slots
    cache = llm.encoder_cache
    assert cache.num_evictable_tokens == cache.num_cached_tokens  # no request holds a reference


def _equivalent_embeds(llm: LLM, enc: TinyImageEncoder, text: str, image, embeds):
    """The all-embeds equivalent of `text` with one <image> and one <embeds>: text rows from the
    model's own embedding table, the image's encoder rows, the passthrough rows."""
    tok = llm.get_tokenizer()
    ids = tok.encode(text)
    img_id, emb_id = tok.convert_tokens_to_ids(["<image>", "<embeds>"])
    table = llm.runner.embed_tokens.weight.detach()
    rows, flat_ids = [], []
    for t in ids:
        if t == img_id:
            rows.append(image.reshape(-1, 3).float() @ enc.proj)
            flat_ids += [t] * enc.num_rows(image)
        elif t == emb_id:
            rows.append(embeds)
            flat_ids += [t] * embeds.shape[0]
        else:
            rows.append(table[t : t + 1])
            flat_ids.append(t)
    return torch.cat(rows), flat_ids


TEXT = "red blue <image> green yellow <embeds> end"


def test_media_and_user_rows_reach_the_model_bit_exact(model_dir):
    llm, enc = _llm(model_dir)
    image, item = _image(2, 3, seed=1), _rows(5, seed=2)
    whole = _rows(9, seed=3)
    seen: list[torch.Tensor] = []
    forward = llm.runner.forward

    def spy(embeds, *args, **kwargs):
        seen.append(embeds.detach().clone())
        return forward(embeds, *args, **kwargs)

    llm.runner.forward = spy
    mm_prompt = {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}}
    outs = llm.generate([mm_prompt, {"prompt_embeds": whole}, {"prompt_token_ids": [5, 6, 7]}], GREEDY,
                        use_tqdm=False)
    equiv, ids = _equivalent_embeds(llm, enc, TEXT, image, item)
    n = len(ids)
    assert outs[0].prompt_token_ids == ids  # each placeholder expanded to its item's rows
    first = seen[0]  # one step prefills all three prompts, in prompt order
    assert first.shape[0] == n + 9 + 3
    assert torch.equal(first[:n], equiv)  # text rows, media rows and passthrough rows, bit-exact
    assert torch.equal(first[n : n + 9], whole)  # the whole-prompt embeds request's rows, bit-exact
    # The same prompt as one all-embeds tensor generates the same tokens.
    ref = llm.generate({"prompt_embeds": equiv}, GREEDY, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert enc.calls == [1]
    _assert_clean(llm)


def test_passthrough_only_batch_runs_no_encoder_and_uploads_once(model_dir):
    llm, enc = _llm(model_dir)
    a, b = _rows(4, seed=10), _rows(6, seed=11)
    prompts = [
        {"prompt": "red <embeds> blue", "multi_modal_data": {"prompt_embeds": [a]}},
        {"prompt": "<embeds> green <embeds>", "multi_modal_data": {"prompt_embeds": [b, a]}},
    ]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    cache = llm.encoder_cache
    assert enc.calls == [] and cache.num_encoder_calls == 0
    assert cache.num_uploads == 2  # a appears twice, uploaded once
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert cache.num_uploads == 2 and cache.num_encoder_calls == 0
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    _assert_clean(llm)


def test_cached_image_is_not_re_encoded(model_dir):
    llm, enc = _llm(model_dir)
    image = _image(3, 2, seed=4)
    prompt = {"prompt": "red <image> blue", "multi_modal_data": {"image": [image]}}
    first = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)  # same item twice in one batch
    assert enc.calls == [1] and llm.encoder_cache.num_encoded_items == 1
    second = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert enc.calls == [1]  # served from the cache across generate calls
    assert first[0].outputs[0].token_ids == first[1].outputs[0].token_ids == second[0].outputs[0].token_ids
    llm.generate({"prompt": "red <image> blue", "multi_modal_data": {"image": [_image(3, 2, 9)]}},
                 GREEDY, use_tqdm=False)
    assert enc.calls == [1, 1]  # new content: encoded
    ident = feature_identifier("image", image, {"image": enc})
    assert ident in llm.encoder_cache and not llm.encoder_cache.is_referenced(ident)
    _assert_clean(llm)


def test_chunked_prefill_through_an_item_changes_nothing(model_dir):
    image, item = _image(3, 4, seed=6), _rows(7, seed=7)  # 12 image rows, 7 passthrough rows
    prompts = [
        {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}},
        {"prompt": "<image> blue", "multi_modal_data": {"image": [_image(2, 5, seed=8)]}},
        "plain text prompt",
    ]
    whole, _ = _llm(model_dir)
    ref = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    chunked, enc = _llm(model_dir, max_num_batched_tokens=5, max_num_seqs=2)
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == ref
    assert chunked.scheduler.num_partial_prefills > 3  # items were split across steps
    assert sum(enc.calls) == 2  # each image encoded once although several chunks needed it
    _assert_clean(chunked)


def test_bad_mm_prompts_raise_before_scheduling(model_dir):
    llm, _ = _llm(model_dir)
    steps = llm.stats().num_steps
    bad = [
        {"prompt": "<image> <image>", "multi_modal_data": {"image": [_image(1, 1, 0)]}},  # 2 vs 1
        {"prompt": "red", "multi_modal_data": {"image": [_image(1, 1, 0)]}},  # 0 vs 1
        {"prompt": "<audio>", "multi_modal_data": {"audio": [torch.zeros(3)]}},  # no encoder
        {"prompt": "<embeds>", "multi_modal_data": {"prompt_embeds": [torch.zeros(2, HIDDEN + 1)]}},
        {"prompt": "<embeds>", "multi_modal_data": {"prompt_embeds": [torch.full((2, HIDDEN), torch.nan)]}},
        {"prompt_embeds": _rows(2, 0), "multi_modal_data": {}},
    ]
    for prompt in bad:
        with pytest.raises(ValueError):
            llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert llm.stats().num_steps == steps
    _assert_clean(llm)


def test_register_encoder_and_protocol_check(model_dir):
    llm = LLM(model_dir, enable_prompt_embeds=True, device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="no encoder"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": [_image(1, 2, 0)]}}, GREEDY)
    with pytest.raises(ValueError, match="protocol"):
        llm.register_encoder(object())
    enc = TinyImageEncoder()
    llm.register_encoder(enc)
    out = llm.generate({"prompt": "<image>", "multi_modal_data": {"image": [_image(1, 2, 0)]}}, GREEDY,
                       use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 2 and enc.calls == [1]


# ------------------------------------------------------------------------------------------- penalties


def _hand_reference(hf_model, embeds: torch.Tensor, real_prompt_ids: list[int], params: SamplingParams):
    """Greedy with repetition / frequency / presence penalties, computed directly from their
    definitions over the real prompt ids and the outputs, with a full forward each step."""
    table = hf_model.get_input_embeddings().weight.detach()
    seq = embeds.clone()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf_model(inputs_embeds=seq[None]).logits[0, -1].float().clone()
            for t in set(real_prompt_ids) | set(out):
                v = logits[t]
                logits[t] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
            for t in set(out):
                count = out.count(t)
                logits[t] -= params.frequency_penalty * count + params.presence_penalty
            tok = int(torch.argmax(logits))
            out.append(tok)
            seq = torch.cat([seq, table[tok : tok + 1]])
    return out


def test_penalties_ignore_placeholder_positions_mixed_lengths(model_dir, hf_model):
    llm, enc = _llm(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.7, presence_penalty=0.4)
    table = llm.runner.embed_tokens.weight.detach()
    g = torch.Generator().manual_seed(21)
    ids_a = torch.randint(10, 200, (3,), generator=g).tolist()
    ids_b = torch.randint(10, 200, (11,), generator=g).tolist()
    mask = torch.tensor([True, False, True, True, False, False, True, True, False, True, True])
    emb_b = table[ids_b].clone()
    emb_b[~mask] = _rows(int((~mask).sum()), seed=22)
    image, item = _image(2, 2, seed=23), _rows(3, seed=24)
    equiv, flat_ids = _equivalent_embeds(llm, enc, TEXT, image, item)
    real_mm = [t for t in llm.get_tokenizer().encode(TEXT)
               if t not in llm.get_tokenizer().convert_tokens_to_ids(["<image>", "<embeds>"])]
    prompts = [
        {"prompt_embeds": _rows(17, seed=20)},  # long embeds-only prompt: no real prompt ids
        {"prompt_token_ids": ids_a},  # short token prompt
        {"prompt_embeds": emb_b, "prompt_is_token_ids": mask, "prompt_token_ids": ids_b},
        {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}},
    ]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    refs = [
        _hand_reference(hf_model, prompts[0]["prompt_embeds"], [], params),
        _hand_reference(hf_model, table[ids_a], ids_a, params),
        _hand_reference(hf_model, emb_b, [t for t, m in zip(ids_b, mask.tolist()) if m], params),
        _hand_reference(hf_model, equiv, real_mm, params),
    ]
    assert got == refs
    assert len(flat_ids) == equiv.shape[0]
    _assert_clean(llm)

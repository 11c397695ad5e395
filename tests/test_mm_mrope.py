"""M-RoPE through the engine on a tiny Qwen2-VL (issue 4).

A prompt with an image grid and a passthrough item: the engine's positions equal transformers' own
`get_rope_index` (image 3-D, passthrough rows positioned as text), decode positions continue with the
delta, and greedy tokens equal a reference that runs transformers' Qwen2-VL text model + LM head on the
same inputs_embeds with those positions (full recompute each step), with and without chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.multimodal.encoder_protocol import tensor_content_hash
from runner.sampling_params import SamplingParams

HIDDEN = 64
MERGE = 2  # the tiny Qwen2-VL vision config's spatial_merge_size
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TEXT = "red <|vision_start|><image><|vision_end|> blue <embeds> green yellow"


class GridImageEncoder:
    """An (h, w, 3) "image" -> h*w rows with an (1, h, w) grid in LLM tokens."""

    modality = "image"
    is_realtime = False

    def __init__(self) -> None:
        self.proj = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))

    def num_rows(self, item):
        return int(item.shape[0] * item.shape[1])

    def grid_thw(self, item):
        return (1, int(item.shape[0]), int(item.shape[1]))

    def content_hash(self, item):
        return tensor_content_hash(item)

    def encode(self, items):
        return [item.reshape(-1, 3) @ self.proj for item in items]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mrope_e2e") / "qwen2_vl", "qwen2_vl", seed=6)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def _inputs():
    image = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(1))  # LLM grid (1, 2, 3)
    item = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.5
    return image, item


def _reference(hf_model, enc, prompt_ids: list[int], image, item, embeds_id: int):
    """transformers' positions and greedy tokens for the expanded prompt."""
    cfg = hf_model.config
    ids = torch.tensor(prompt_ids)
    is_image = ids == cfg.image_token_id
    table = hf_model.get_input_embeddings().weight.detach()
    embeds = table[ids].clone()
    if is_image.any():
        embeds[is_image] = enc.encode([image])[0]
    is_passthrough = ids == embeds_id  # positioned as text by both sides
    if is_passthrough.any():
        embeds[is_passthrough] = item
    h, w = image.shape[0], image.shape[1]
    positions, delta = hf_model.model.get_rope_index(
        ids[None],
        mm_token_type_ids=is_image.to(torch.int32)[None],
        image_grid_thw=torch.tensor([[1, h * MERGE, w * MERGE]]) if is_image.any() else None,
    )
    delta = int(delta.item())
    out: list[int] = []
    seq = embeds
    n = len(prompt_ids)
    with torch.no_grad():
        for k in range(MAX_TOKENS):
            tail = torch.arange(n, n + k) + delta
            pos = torch.cat([positions, tail.view(1, 1, -1).expand(3, 1, k)], dim=2)
            text_model = hf_model.model.language_model
            hidden = text_model(inputs_embeds=seq[None], position_ids=pos).last_hidden_state
            tok = int(hf_model.lm_head(hidden[0, -1]).argmax())
            out.append(tok)
            seq = torch.cat([seq, table[tok : tok + 1]])
    return positions[:, 0], delta, out


@pytest.mark.parametrize("chunked", [False, True])
def test_mrope_engine_matches_transformers(model_dir, hf_model, chunked):
    enc = GridImageEncoder()
    kw = dict(max_num_batched_tokens=5, max_num_seqs=2) if chunked else {}
    llm = LLM(model_dir, enable_prompt_embeds=True,
              encoders={"image": enc}, async_scheduling=False, device="cpu", num_kv_blocks=64,
              **kw)
    embeds_id = llm.get_tokenizer().convert_tokens_to_ids("<embeds>")
    image, item = _inputs()
    seen: list[torch.Tensor] = []
    forward = llm.runner.forward

    def spy(embeds, positions, *args, **kwargs):
        seen.append(positions.detach().clone().cpu())
        return forward(embeds, positions, *args, **kwargs)

    llm.runner.forward = spy
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    ref_pos, delta, ref_tokens = _reference(hf_model, enc, out.prompt_token_ids, image, item, embeds_id)
    n = len(out.prompt_token_ids)

    prefill = [p for p in seen if p.dim() == 2]
    assert all(p.shape[0] == 3 for p in prefill)
    assert torch.equal(torch.cat(prefill, dim=1)[:, :n], ref_pos)  # 3-D image grid, passthrough as text
    assert delta != 0  # the grid shortens the positions: the delta matters
    decode = torch.cat([p for p in seen if p.dim() == 1])
    assert torch.equal(decode, torch.arange(n, n + MAX_TOKENS - 1) + delta)
    assert out.outputs[0].token_ids == ref_tokens
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_mrope_prefills_stay_eager_beside_captured_graphs(model_dir, hf_model):
    """3-D prefill positions have no place in a mixed-step graph (it feeds 1-D ones): with graphs
    captured (emulated), prefill steps run eagerly, decode steps replay, and the tokens are HF's."""
    enc = GridImageEncoder()
    llm = LLM(model_dir, enable_prompt_embeds=True, encoders={"image": enc}, async_scheduling=False,
              device="cpu", num_kv_blocks=64, max_num_batched_tokens=5, max_num_seqs=2)
    llm.runner.capture_cuda_graphs(emulate=True)
    assert llm.runner.mixed_graphs.graphs  # captured, yet never used for these prefills
    embeds_id = llm.get_tokenizer().convert_tokens_to_ids("<embeds>")
    image, item = _inputs()
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    *_, ref_tokens = _reference(hf_model, enc, out.prompt_token_ids, image, item, embeds_id)
    assert out.outputs[0].token_ids == ref_tokens
    assert llm.runner.num_mixed_graph_replays == 0 and llm.runner.num_graph_replays > 0


def test_mrope_text_prompt_next_to_media_prompt(model_dir, hf_model):
    enc = GridImageEncoder()
    llm = LLM(model_dir, enable_prompt_embeds=True,
              encoders={"image": enc}, async_scheduling=False, device="cpu", num_kv_blocks=64)
    embeds_id = llm.get_tokenizer().convert_tokens_to_ids("<embeds>")
    image, item = _inputs()
    prompts = ["red blue green", {"prompt": TEXT, "multi_modal_data": {"image": [image],
                                                                      "prompt_embeds": [item]}}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _, _, ref_tokens = _reference(hf_model, enc, outs[1].prompt_token_ids, image, item, embeds_id)
    assert outs[1].outputs[0].token_ids == ref_tokens
    _, delta, ref_text = _reference(hf_model, enc, outs[0].prompt_token_ids, image, item, embeds_id)
    assert delta == 0 and outs[0].outputs[0].token_ids == ref_text


def test_mrope_refuses_realtime_encoders(model_dir):
    class Stream(GridImageEncoder):
        modality = "audio"
        is_realtime = True

    with pytest.raises(ValueError, match="realtime"):
        LLM(model_dir, encoders={"audio": Stream()}, async_scheduling=False, device="cpu", num_kv_blocks=16)


# A step in which every request runs exactly one token is not necessarily a decode step: a one-token
# prefill chunk needs its 3-D prompt position. Three ways such steps arise; in each, every position the
# engine feeds equals transformers' (`get_rope_index`, then index + delta), and so do the tokens.
TAIL_TEXT = "red blue <|vision_start|><image>"


def _mrope_llm(model_dir, **kw):
    return LLM(model_dir, enable_prompt_embeds=True,
               encoders={"image": GridImageEncoder()}, async_scheduling=False, device="cpu",
               num_kv_blocks=64, **kw)


def _generate_recording_positions(llm, prompts):
    """Generate, and return each request's fed positions as one (3, n) tensor (1-D rows expanded)."""
    steps: list[tuple[list[str], list[int]]] = []
    seen: list[torch.Tensor] = []
    launch, forward = llm.runner.launch, llm.runner.forward

    def spy_launch(so, prev=None, **kwargs):
        steps.append(([r.request_id for r in so.requests], list(so.num_scheduled_tokens)))
        return launch(so, prev, **kwargs)

    def spy_forward(embeds, positions, *args, **kwargs):
        seen.append(positions.detach().clone().cpu())
        return forward(embeds, positions, *args, **kwargs)

    llm.runner.launch, llm.runner.forward = spy_launch, spy_forward
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(steps) == len(seen)  # eager on the CPU: one forward per launched step
    per_request: dict[str, list[torch.Tensor]] = {}
    for (ids, counts), pos in zip(steps, seen):
        pos = pos if pos.dim() == 2 else pos.expand(3, -1)
        for rid, cols in zip(ids, pos.split(counts, dim=1)):
            per_request.setdefault(rid, []).append(cols)
    return outs, [torch.cat(per_request[o.request_id], dim=1) for o in outs]


def _check_against_transformers(llm, hf_model, outs, positions, image, item):
    embeds_id = llm.get_tokenizer().convert_tokens_to_ids("<embeds>")
    enc = llm.mm.encoders["image"]
    for out, pos in zip(outs, positions):
        ref_pos, delta, ref_tokens = _reference(hf_model, enc, out.prompt_token_ids, image, item, embeds_id)
        n = len(out.prompt_token_ids)
        decode = (torch.arange(n, n + MAX_TOKENS - 1) + delta).expand(3, -1)
        assert torch.equal(pos, torch.cat([ref_pos, decode], dim=1))
        assert out.outputs[0].token_ids == ref_tokens


def test_mrope_last_image_row_alone_in_a_chunk(model_dir, hf_model):
    image, item = _inputs()
    prompt = {"prompt": TAIL_TEXT, "multi_modal_data": {"image": [image]}}
    n = len(_mrope_llm(model_dir).generate(prompt, GREEDY, use_tqdm=False)[0].prompt_token_ids)
    llm = _mrope_llm(model_dir, max_num_batched_tokens=n - 1)  # the last chunk is the last image row
    outs, positions = _generate_recording_positions(llm, prompt)
    _check_against_transformers(llm, hf_model, outs, positions, image, item)


def test_mrope_one_token_chunk_beside_running_decodes(model_dir, hf_model):
    llm = _mrope_llm(model_dir, max_num_batched_tokens=2, max_num_seqs=2)
    image, item = _inputs()
    prompts = ["red blue green", {"prompt": TEXT, "multi_modal_data": {"image": [image],
                                                                      "prompt_embeds": [item]}}]
    outs, positions = _generate_recording_positions(llm, prompts)
    assert llm.scheduler.num_partial_prefills > 0
    _check_against_transformers(llm, hf_model, outs, positions, image, item)


def test_mrope_one_token_budget(model_dir, hf_model):
    llm = _mrope_llm(model_dir, max_num_batched_tokens=1)
    image, item = _inputs()
    prompt = {"prompt": TEXT, "multi_modal_data": {"image": [image], "prompt_embeds": [item]}}
    outs, positions = _generate_recording_positions(llm, prompt)
    _check_against_transformers(llm, hf_model, outs, positions, image, item)

"""Bridge's real encoders (`encoders/`) plug into the runner unchanged (issue 4).

The tiny open_clip image encoder runs inside `LLM.generate` next to a passthrough item and gives the
same tokens as the all-embeds prompt built from its own `encode` output; the tiny streaming audio
encoder feeds a live request through `append_input`. (The runner never imports `encoders/`; this test
imports both, as `bridge/` does.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.tiny_models import build_tiny_model
from encoders.api import build_encoder
from encoders.tiny import tiny_encoder_config
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:async scheduling turned off")

HIDDEN = 64
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("real_enc") / "qwen3", "qwen3", seed=12)


def test_real_image_encoder_with_passthrough_item(model_dir):
    torch.manual_seed(0)
    image_enc = build_encoder(tiny_encoder_config("image", HIDDEN)).eval()
    llm = LLM(model_dir, enable_prompt_embeds=True, encoders={"image": image_enc}, device="cpu",
              num_kv_blocks=64)
    img = np.random.RandomState(0).randint(0, 255, (32, 32, 3), dtype=np.uint8)
    item = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5
    mm_data = {"image": [img], "prompt_embeds": [item]}
    prompt = {"prompt": "red <image> blue <embeds>", "multi_modal_data": mm_data}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    img_id, emb_id = tok.convert_tokens_to_ids(["<image>", "<embeds>"])
    table = llm.runner.embed_tokens.weight.detach()
    rows = []
    for t in tok.encode("red <image> blue <embeds>"):
        rows.append(image_enc.encode([img])[0] if t == img_id else item if t == emb_id else table[t : t + 1])
    equiv = torch.cat(rows)
    assert len(out.prompt_token_ids) == equiv.shape[0]
    assert out.prompt_token_ids.count(img_id) == image_enc.num_rows(img)
    assert out.prompt_token_ids.count(emb_id) == 3
    ref = llm.generate({"prompt_embeds": equiv}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert llm.encoder_cache.num_encoder_calls == 1 and llm.encoder_cache.num_uploads == 1


def test_real_streaming_audio_encoder_feeds_a_live_request(model_dir):
    torch.manual_seed(0)
    audio_enc = build_encoder(tiny_encoder_config("audio", HIDDEN, streaming={"chunk_samples": 1600})).eval()
    assert audio_enc.is_realtime
    llm = LLM(model_dir, encoders={"audio": audio_enc}, device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(seed: int) -> list[int]:
        rid = llm.add_request({"prompt_token_ids": [5, 17, 33, 71]}, params)
        llm.step()
        llm.append_input(rid, np.random.RandomState(seed).randn(1600).astype(np.float32))
        final = None
        while llm.has_unfinished_requests():
            for out in llm.step():
                final = out
        return final.outputs[0].token_ids

    a, b = run(1), run(2)
    assert a[:1] == b[:1] and a != b
    assert llm.mm.num_decode_gathers > 0
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks

"""Multimodal prompts with a tokenizer that has no placeholder tokens (every real checkpoint's case).

The text is split at `<embeds>` / `<image>` and the pieces are tokenized one by one, by the same
function Bridge's training uses; the result must equal the same prompt given as one whole-prompt
tensor (text rows from the embedding table, item rows where the placeholders were).
"""

from __future__ import annotations

import pytest
import torch
from helpers import IdentityEncoder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bridge.data.tokenize import tokenize_prompt
from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _plain_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer like a real model's: 256 byte tokens and an EOS, no placeholders."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("plain_tok") / "llama", "llama", seed=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    _plain_byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, enable_prompt_embeds=True, encoders={"image": IdentityEncoder("image")},
               device="cpu", num_kv_blocks=64, enable_prefix_caching=True)


def test_the_tokenizer_really_has_no_placeholders(llm):
    tok = llm.get_tokenizer()
    assert len(tok.encode("<embeds>", add_special_tokens=False)) > 1
    assert len(tok.encode("<image>", add_special_tokens=False)) > 1


def test_placeholders_in_text_with_a_plain_tokenizer(llm):
    hidden = llm.hidden_size
    g = torch.Generator().manual_seed(0)
    item, image = torch.randn(3, hidden, generator=g), torch.randn(2, hidden, generator=g)
    text = "Describe <embeds> next to <image>."
    out = llm.generate({"prompt": text, "multi_modal_data": {"prompt_embeds": [item], "image": [image]}},
                       GREEDY, use_tqdm=False)[0]

    # The same prompt as one whole-prompt tensor: pieces tokenized alone, rows where the items go.
    tok = llm.get_tokenizer()
    pieces = [tok.encode(p, add_special_tokens=False) for p in ("Describe ", " next to ", ".")]
    table = llm.runner.embed_tokens.weight.detach()
    rows = [table[pieces[0]], item, table[pieces[1]], image, table[pieces[2]]]
    ids = [*pieces[0], *[0] * 3, *pieces[1], *[0] * 2, *pieces[2]]
    mask = torch.tensor([True] * len(pieces[0]) + [False] * 3 + [True] * len(pieces[1]) + [False] * 2
                        + [True] * len(pieces[2]))
    whole = llm.generate({"prompt_embeds": torch.cat(rows), "prompt_is_token_ids": mask,
                          "prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    fill = tok.pad_token_id  # a safe id at item positions: never embedded
    assert out.prompt_token_ids == [t if m else fill for t, m in zip(ids, mask.tolist())]
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids


def test_training_and_generation_tokenize_alike(llm):
    """Bridge's training path and the runner share one implementation of the split."""
    tok = llm.get_tokenizer()
    image = torch.zeros(4, llm.hidden_size)
    trained = tokenize_prompt(tok, "look: <image> ok", {"image": [image]}, {"image": lambda x: 4})
    out = llm.generate({"prompt": "look: <image> ok", "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == trained.ids


def test_prompt_embeds_item_refused_when_prompt_embeds_are_off(model_dir):
    llm = LLM(model_dir, device="cpu", num_kv_blocks=16)
    item = torch.randn(2, llm.hidden_size)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        llm.generate({"prompt": "a <embeds>", "multi_modal_data": {"prompt_embeds": [item]}}, use_tqdm=False)
    assert llm.stats().num_steps == 0


def test_num_cached_tokens_counts_prefix_cache_hits(llm):
    prompt = {"prompt_token_ids": list(range(40, 90))}  # 50 tokens: three full blocks of 16
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids

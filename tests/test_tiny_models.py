"""The tiny-model kit writes directories that load like real checkpoints, deterministically by seed."""

from __future__ import annotations

import json
import pathlib
import random
import string

import pytest
import torch
from safetensors.torch import load_file

from bridge.tiny_models import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    PLACEHOLDER_TOKENS,
    UNK_TOKEN,
    build_tiny_model,
    build_tokenizer,
    read_config_dict,
    write_config_only_model,
)

# Chosen so that bare forms collide: "edge" and "red" share the pair (e, d); "green" contains "re".
WORDS = ("red", "green", "blue", "circle", "square", "triangle", "edge", "bored", "a", "the")
CAUSAL_FAMILIES = ("llama", "qwen2", "qwen3")


def _weights(path: pathlib.Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(WORDS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny_model(root / f, f, vocab_words=WORDS) for f in (*CAUSAL_FAMILIES, "qwen2_vl")}


# ----------------------------------------------------------------------------------------- tokenizer


def test_special_tokens_have_their_own_single_ids(tokenizer):
    named = {
        tokenizer.pad_token: PAD_TOKEN,
        tokenizer.bos_token: BOS_TOKEN,
        tokenizer.eos_token: EOS_TOKEN,
        tokenizer.unk_token: UNK_TOKEN,
    }
    assert all(k == v for k, v in named.items())
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)]
    ids += [tokenizer.convert_tokens_to_ids(t) for t in PLACEHOLDER_TOKENS]
    assert len(set(ids)) == len(ids)
    assert set(ids) <= set(tokenizer.all_special_ids)
    for placeholder in PLACEHOLDER_TOKENS:
        want = tokenizer.convert_tokens_to_ids(placeholder)
        assert tokenizer.encode(placeholder, add_special_tokens=False) == [want]
        # Glued to text on both sides it is still one id, and the text around it is untouched.
        glued = tokenizer.encode(f"a red{placeholder}blue.", add_special_tokens=False)
        assert glued.count(want) == 1
        assert tokenizer.decode(glued) == f"a red{placeholder}blue."


def _ascii_samples() -> list[str]:
    rng = random.Random(0)
    samples = [
        string.printable,
        "",
        " ",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\r\n\n",
        "punctuation: don't, it's; (x) [y] {z} ~`!@#$%^&*_-+=|\\/?<>",
        "digits 0123456789 and 3.14159",
        "red circle",
        "a red circle next to a green square",
        "redred greenish bored-edge",
    ]
    samples += ["".join(rng.choice(string.printable) for _ in range(rng.randint(1, 60))) for _ in range(50)]
    return samples


def test_any_ascii_text_round_trips(tokenizer):
    for text in _ascii_samples():
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_placeholders_are_dropped_by_skip_special_tokens(tokenizer):
    text = "look <image> and listen <audio>, graph <graph> embeds <embeds>!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    stripped = text
    for placeholder in PLACEHOLDER_TOKENS:
        stripped = stripped.replace(placeholder, "")
    assert tokenizer.decode(ids, skip_special_tokens=True) == stripped


def test_vocab_words_are_single_tokens(tokenizer):
    base = build_tokenizer()
    for word in WORDS:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
    caption = " a red circle next to the green square"
    with_words = tokenizer.encode(caption, add_special_tokens=False)
    without_words = base.encode(caption, add_special_tokens=False)
    assert len(with_words) < len(without_words)
    assert tokenizer.decode(with_words) == caption


def test_tokenizer_is_deterministic_and_small(tokenizer):
    again = build_tokenizer(WORDS)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert len(tokenizer) % 8 == 0
    assert len(tokenizer) < 1000
    assert build_tokenizer(WORDS + WORDS).get_vocab() == tokenizer.get_vocab()  # duplicates ignored


@pytest.mark.parametrize("bad", ["red circle", "", "a1", 7])
def test_bad_vocab_words_are_rejected(bad):
    with pytest.raises(ValueError):
        build_tokenizer([bad])


def test_a_single_string_is_not_a_word_list():
    with pytest.raises(ValueError):
        build_tokenizer("red")


# ----------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_causal_family_loads_back_and_generates(model_dirs, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dirs[family]
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert not any(name.endswith(".bin") for name in files)

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == family
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tok)
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.bos_token_id == tok.bos_token_id

    text = "a red circle, then <image> here!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 1

    prompt = tok("a red circle", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 5)
    assert int(out.max()) < len(tok)


def test_qwen2_vl_is_a_full_qwen2_vl_checkpoint_with_mrope(model_dirs):
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLForConditionalGeneration

    path = model_dirs["qwen2_vl"]
    config = read_config_dict(path)
    assert config["model_type"] == "qwen2_vl"
    text_config = config["text_config"]
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling")
    head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
    assert sum(rope["mrope_section"]) == head_dim // 2

    tok = AutoTokenizer.from_pretrained(path)
    assert config["image_token_id"] == tok.convert_tokens_to_ids("<image>")
    # vision-start is a token no Bridge prompt holds, so HF positions Bridge prompts as text.
    assert config["vision_start_token_id"] not in tok.encode(
        "<s> <image><audio> red", add_special_tokens=False
    )

    model = Qwen2VLForConditionalGeneration.from_pretrained(path)
    assert type(AutoModelForImageTextToText.from_pretrained(path)) is Qwen2VLForConditionalGeneration
    assert model.config.text_config.vocab_size == len(tok)
    # A prompt holding the <image> placeholder but no pixels runs as text, by ids and by embeddings alike.
    prompt = tok("<image> a red circle", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 4)
    embeds = model.get_input_embeddings()(prompt["input_ids"])
    by_embeds = model.generate(
        inputs_embeds=embeds, attention_mask=prompt["attention_mask"], max_new_tokens=4, do_sample=False
    )
    assert torch.equal(by_embeds[0, -4:], out[0, -4:])


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = _weights(build_tiny_model(tmp_path / "a", "qwen3", seed=7))
    b = _weights(build_tiny_model(tmp_path / "b", "qwen3", seed=7))
    c = _weights(build_tiny_model(tmp_path / "c", "qwen3", seed=8))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    random_init = [k for k in a if a[k].dim() == 2]  # norms start at ones whatever the seed
    assert random_init
    assert all(not torch.equal(a[k], c[k]) for k in random_init)


def test_building_leaves_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", "llama", seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_dtype_overrides_and_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(
        tmp_path / "m", "llama", dtype=torch.bfloat16, tie_word_embeddings=True, rms_norm_eps=1e-5
    )
    assert all(t.dtype == torch.bfloat16 for t in _weights(path).values())
    config = json.loads((path / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"family": "mistral"},
        {"family": "qwen2", "head_dim": 32},  # qwen2 needs hidden == heads * head_dim
        {"num_heads": 4, "num_kv_heads": 3},
        {"head_dim": 15, "family": "llama"},
        {"dtype": torch.int8},
        {"num_layers": 0},
    ],
)
def test_bad_model_arguments_are_value_errors(tmp_path, kwargs):
    with pytest.raises(ValueError):
        build_tiny_model(tmp_path / "m", **kwargs)


# ----------------------------------------------------------------------------------------- config-only


@pytest.mark.parametrize(
    ("kind", "model_type"),
    [("t5", "t5"), ("bamba", "bamba"), ("qwen3_next", "qwen3_next"), ("bert", "bert")],
)
def test_config_only_dirs_have_no_weights(tmp_path, kind, model_type):
    from transformers import AutoConfig, AutoTokenizer

    path = write_config_only_model(tmp_path / kind, kind)
    assert read_config_dict(path)["model_type"] == model_type
    assert not [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == model_type
    assert config.architectures
    if kind == "t5":
        assert config.is_encoder_decoder
    if kind in ("bamba", "qwen3_next"):
        assert "linear_attention" in config.layer_types or "mamba" in config.layer_types
    if kind == "bert":
        assert not config.is_encoder_decoder and not config.is_decoder
    assert len(AutoTokenizer.from_pretrained(path)) == config.vocab_size


def test_unknown_config_only_kind_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        write_config_only_model(tmp_path / "x", "gpt2")

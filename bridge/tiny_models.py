"""Tiny, real Hugging Face model directories built in code, for tests and demos.

Nothing can be downloaded at run time, yet the runner must load models through the very same code path
as a real checkpoint (config.json + safetensors + tokenizer files). So this kit *writes* such a
directory: a family's own transformers config class, random weights seeded by ``seed``, and a tokenizer
built with the ``tokenizers`` library. Defaults are small enough that a 2-layer, hidden-64 fp32 model
generates on a CPU in well under a second.

The tokenizer is byte-level BPE, so any text round-trips (there is always a byte to fall back to). The
optional ``vocab_words`` become whole-word tokens through BPE merges: a word after a space (" red")
always encodes to exactly one token; a word at the start of a text ("red") gets one token too unless
another word's merges get in its way. Placeholders ``<image>``, ``<audio>``, ``<graph>``, ``<embeds>``
are special tokens, one id each, so a prompt's placeholder positions are found by id.

``write_config_only_model`` writes config.json only (no weights): model kinds the runner must refuse
(encoder-decoder, hybrid, encoder-only) before it reads any weights, so their directories never need any.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
PLACEHOLDER_TOKENS: tuple[str, ...] = ("<image>", "<audio>", "<graph>", "<embeds>")
# Qwen2-VL's config names a vision-start, vision-end and video token. They get ids of their own, which no
# Bridge prompt ever holds, so Hugging Face's own Qwen2-VL M-RoPE index (it looks for vision-start followed
# by the image id) positions every Bridge prompt as text, the same as the runner does for passthrough items.
QWEN2_VL_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|video_pad|>")
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    UNK_TOKEN,
    *PLACEHOLDER_TOKENS,
    *QWEN2_VL_TOKENS,
)

FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen2_vl")
CONFIG_ONLY_KINDS: tuple[str, ...] = ("t5", "bamba", "qwen3_next", "bert")

# --------------------------------------------------------------------------- tokenizer


# Qwen2's pre-tokenizer split. transformers 5.24 loads a "qwen2"/"qwen2_vl" directory through
# Qwen2Tokenizer whatever tokenizer_config.json says, and Qwen2Tokenizer rebuilds the pipeline with this
# regex + NFC. Using the same pipeline for every family makes a directory tokenize identically whichever
# class AutoTokenizer picks (TokenizersBackend or Qwen2Tokenizer, in 5.17 and 5.24 alike).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_level_pretokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _word_pieces(word: str) -> tuple[str, str]:
    """The byte-level forms of ``word`` at text start and after a space, each checked to be one pre-token.

    A word the pre-tokenizer splits (spaces, punctuation mixed with letters) could never become one token,
    so it is a caller error rather than something to paper over.
    """
    if not isinstance(word, str) or not word:
        raise ValueError(f"vocab_words entries must be non-empty strings, got {word!r}")
    pre = _byte_level_pretokenizer()
    bare = pre.pre_tokenize_str(word)
    spaced = pre.pre_tokenize_str(" " + word)
    if len(bare) != 1 or len(spaced) != 1:
        raise ValueError(
            f"vocab word {word!r} is split by the byte-level pre-tokenizer into "
            f"{[p for p, _ in bare]}; use single words of letters (digits are always split one by one)"
        )
    return bare[0][0], spaced[0][0]


def _chain_merges(piece: str) -> list[tuple[str, str]]:
    """Left-to-right merges that build ``piece`` from its characters: (a,b), (ab,c), (abc,d), ..."""
    return [(piece[:i], piece[i]) for i in range(1, len(piece))]


def _encodes_to_one(tok, text: str) -> bool:
    return len(tok.encode(text, add_special_tokens=False).ids) == 1


def _build_backend(vocab_words: Sequence[str], pad_to_multiple_of: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *alphabet):
        vocab[token] = len(vocab)

    words = list(dict.fromkeys(vocab_words))  # dedupe, keep order: deterministic
    pieces = [_word_pieces(w) for w in words]
    # Space-led chains first: each step joins a token that starts with the space mark, and such a token
    # only ever comes from these chains, so no other merge can break them. Bare chains follow.
    spaced_merges = [m for _, spaced in pieces for m in _chain_merges(spaced)]
    bare_order = [bare for bare, _ in pieces]

    def assemble(bare_pieces: list[str]) -> Tokenizer:
        merges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        full_vocab = dict(vocab)
        for merge in spaced_merges + [m for b in bare_pieces for m in _chain_merges(b)]:
            if merge in seen:
                continue
            seen.add(merge)
            merges.append(merge)
            full_vocab.setdefault(merge[0] + merge[1], len(full_vocab))
        tok = Tokenizer(models.BPE(vocab=full_vocab, merges=merges))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _byte_level_pretokenizer()
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        return tok

    # Bare words can collide (another word's first merge splits them). Repair by moving a broken word's
    # chain ahead of the others, a bounded number of times, keeping the order with the fewest broken
    # words; what still fails stays a few tokens long (its space-led form is one token regardless).
    def broken_words(tok: Tokenizer) -> list[str]:
        return [b for b in bare_order if not _encodes_to_one(tok, _decode_piece(b))]

    tok = assemble(bare_order)
    best, best_broken = tok, broken_words(tok)
    broken = best_broken
    for _ in range(len(bare_order)):
        if not broken:
            break
        bare_order = [broken[0]] + [b for b in bare_order if b != broken[0]]
        tok = assemble(bare_order)
        broken = broken_words(tok)
        if len(broken) < len(best_broken):
            best, best_broken = tok, broken
    tok = best

    size = tok.get_vocab_size()
    if pad_to_multiple_of > 1 and size % pad_to_multiple_of:
        n_extra = pad_to_multiple_of - size % pad_to_multiple_of
        tok.add_special_tokens(
            [AddedToken(f"<reserved_{i}>", special=True, normalized=False) for i in range(n_extra)]
        )
    return tok


def _decode_piece(piece: str) -> str:
    from tokenizers import decoders

    return decoders.ByteLevel().decode([piece])


def build_tokenizer(vocab_words: Iterable[str] = (), *, pad_to_multiple_of: int = 8):
    """A small byte-level BPE tokenizer made in code, wrapped as ``PreTrainedTokenizerFast``.

    Ids 0..10 are ``<pad> <s> </s> <unk> <image> <audio> <graph> <embeds>`` and Qwen2-VL's
    ``<|vision_start|> <|vision_end|> <|video_pad|>`` (all special, one id each), then the 256 byte
    tokens, then the merges that make ``vocab_words`` whole tokens, then reserved special tokens padding
    the size to ``pad_to_multiple_of`` so the model's vocab equals ``len(tokenizer)``.
    Deterministic: the same words give the same ids.
    """
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_words, str):
        raise ValueError("vocab_words must be an iterable of words, not a single string")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    backend = _build_backend(list(vocab_words), pad_to_multiple_of)
    named = {PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN}
    added = sorted(backend.get_added_tokens_decoder().items())
    extra = [t.content for _, t in added if t.content not in named]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=extra,  # placeholders first, then Qwen2-VL's and the reserved padding
        clean_up_tokenization_spaces=False,  # cleanup would rewrite " ." to "." and break round-trips
        model_max_length=1 << 20,
        padding_side="left",  # decoder-only batches pad on the left
    )


# --------------------------------------------------------------------------- models


def _text_config_kwargs(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    token_ids: dict[str, int],
) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        **token_ids,
    )
    if family in ("llama", "qwen3"):
        kwargs["head_dim"] = head_dim
    return kwargs


def _validate_shape(family: str, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    # Qwen2 and Qwen2-VL derive head_dim from hidden_size / num_heads and have no head_dim field.
    if family in ("qwen2", "qwen2_vl") and hidden_size != num_heads * head_dim:
        raise ValueError(
            f"{family} requires hidden_size == num_heads * head_dim, got {hidden_size} != "
            f"{num_heads} * {head_dim}"
        )


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (temporal, height, width), roughly 1:1.5:1.5 like Qwen2-VL."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    w = half - t - h
    return [t, h, w]


def _qwen2_vl_config(text_kwargs: dict[str, Any], head_dim: int, token_ids: dict[str, int], ids: dict):
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "mrope_section": _mrope_section(head_dim), "rope_theta": 1000000.0}
    text_config = dict(text_kwargs, rope_parameters=rope, model_type="qwen2_vl_text")
    hidden = text_kwargs["hidden_size"]
    vision_config = dict(
        depth=1,
        embed_dim=32,
        hidden_size=hidden,  # the merger's output width is the LLM hidden size
        num_heads=2,
        mlp_ratio=2,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<image>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text_kwargs["tie_word_embeddings"],
        **token_ids,
    )
    # transformers 5.17 moves these into text_config only; 5.24 keeps them at the top as well. Set them
    # at the top explicitly so config.json looks the same whichever version wrote it.
    for name, value in token_ids.items():
        setattr(config, name, value)
    return config


def _model_class_and_config(family: str, text_kwargs: dict[str, Any], head_dim: int, token_ids, ids):
    import transformers

    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**text_kwargs)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**text_kwargs)
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**text_kwargs)
    if family == "qwen2_vl":
        config = _qwen2_vl_config(text_kwargs, head_dim, token_ids, ids)
        return transformers.Qwen2VLForConditionalGeneration, config
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def build_tiny_model(
    path: str | pathlib.Path,
    family: str = "qwen3",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    vocab_words: Iterable[str] = (),
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> pathlib.Path:
    """Write a loadable Hugging Face model directory with random weights; returns its path.

    ``family`` is one of ``llama``, ``qwen2``, ``qwen3`` (loaded by ``AutoModelForCausalLM``) or
    ``qwen2_vl`` (a full Qwen2-VL checkpoint with a one-block vision tower, as real Qwen2-VL directories
    are: ``model_type`` "qwen2_vl", loaded by ``Qwen2VLForConditionalGeneration`` /
    ``AutoModelForImageTextToText``; transformers 5 has no causal-LM class for it). Its text config
    carries ``rope_parameters.mrope_section`` so M-RoPE is exercised.

    Weights are drawn under ``torch.manual_seed(seed)`` inside a forked RNG, so the same arguments give
    bit-identical weights and the caller's RNG state is untouched. ``config_overrides`` go to the
    (text) config, e.g. ``rms_norm_eps=1e-5``.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if num_layers < 1 or intermediate_size < 1 or max_position_embeddings < 1:
        raise ValueError("num_layers, intermediate_size and max_position_embeddings must be >= 1")
    _validate_shape(family, hidden_size, num_heads, num_kv_heads, head_dim)

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_words)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    token_ids = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }

    text_kwargs = _text_config_kwargs(
        family,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        token_ids=token_ids,
    )
    text_kwargs.update(config_overrides)
    model_cls, config = _model_class_and_config(family, text_kwargs, head_dim, token_ids, ids)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype).eval()
    model.config.dtype = dtype

    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(**token_ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- config-only directories


_CONFIG_ONLY_ARCHITECTURES = {
    "t5": "T5ForConditionalGeneration",
    "bamba": "BambaForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "bert": "BertForMaskedLM",
}


def _config_only(kind: str, vocab_size: int, token_ids: dict[str, int]):
    import transformers

    small = dict(vocab_size=vocab_size, **token_ids)
    if kind == "t5":
        return transformers.T5Config(
            d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=token_ids["pad_token_id"], **small,
        )  # fmt: skip
    if kind == "bamba":
        return transformers.BambaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16, **small,
        )  # fmt: skip
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **small,
        )  # fmt: skip
    if kind == "bert":
        return transformers.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, vocab_size=vocab_size, pad_token_id=token_ids["pad_token_id"],
        )  # fmt: skip
    raise ValueError(f"unknown config-only kind {kind!r}; choose one of {CONFIG_ONLY_KINDS}")


def write_config_only_model(path: str | pathlib.Path, kind: str) -> pathlib.Path:
    """Write config.json (plus tokenizer files) of a model the runner must refuse, and no weights.

    ``kind``: "t5" (encoder-decoder), "bamba" or "qwen3_next" (hybrid: mamba / linear-attention layers),
    "bert" (encoder-only). A runner that reads weights before checking capabilities fails here on a
    missing file instead of on the clear ``ValueError`` it owes the user, which is exactly what the
    fail-fast tests need to tell apart.
    """
    if kind not in CONFIG_ONLY_KINDS:
        raise ValueError(f"unknown config-only kind {kind!r}; choose one of {CONFIG_ONLY_KINDS}")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = _config_only(kind, len(tokenizer), token_ids)
    config.architectures = [_CONFIG_ONLY_ARCHITECTURES[kind]]  # as a real checkpoint's config.json has
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def read_config_dict(path: str | pathlib.Path) -> dict[str, Any]:
    """config.json of a model directory as a plain dict: all a fail-fast check needs to read."""
    return json.loads((pathlib.Path(path) / "config.json").read_text())

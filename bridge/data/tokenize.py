"""Prompt + media -> token ids with each placeholder expanded to its item's row count.

Training, evaluation and the Bridge API all go through `tokenize_prompt`, so the sequence the
projector is trained on is exactly the sequence generation later sees: the same ids, the same
placeholder expansion, the same `is_token` mask (False where an encoder row goes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bridge.data.example import PLACEHOLDER_RE, PLACEHOLDERS, check_media_matches_prompt


@dataclass
class Span:
    """Where one media item's rows go: positions [start, start + length) of the sequence."""

    modality: str
    item_index: int  # index into the example's media[modality]
    start: int
    length: int


@dataclass
class TokenizedPrompt:
    ids: list[int]
    is_token: list[bool]
    spans: list[Span] = field(default_factory=list)


_PER_TOKENIZER: dict[int, tuple[object, dict[str, int], list[int]]] = {}


def _tokenizer_facts(tokenizer) -> tuple[dict[str, int], list[int]]:
    """(placeholder fill ids, special prefix), computed once per tokenizer object: they are asked
    for on every example of every step."""
    hit = _PER_TOKENIZER.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, placeholder_fill_ids(tokenizer), _special_prefix(tokenizer))
        _PER_TOKENIZER[id(tokenizer)] = hit
    return hit[1], hit[2]


def placeholder_fill_ids(tokenizer) -> dict[str, int]:
    """Modality -> the id written at its placeholder positions.

    The tokenizer's own single-token placeholder (`<image>` ...) when it has one (the tiny kit's
    tokenizers do), else the pad id (or 0): a real model's tokenizer without such tokens still
    works, since those positions carry encoder rows and their ids are never embedded.
    """
    fallback = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = {}
    for text, modality in PLACEHOLDERS.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        single = len(ids) == 1 and ids[0] != tokenizer.unk_token_id
        out[modality] = ids[0] if single else fallback
    return out


def _special_prefix(tokenizer) -> list[int]:
    """What the tokenizer puts before any text (BOS for Llama, nothing for Qwen)."""
    return list(tokenizer.encode("", add_special_tokens=True))


def tokenize_prompt(
    tokenizer, prompt: str, media: Mapping[str, list[Any]], num_rows: Mapping[str, Callable[[Any], int]]
) -> TokenizedPrompt:
    """Tokenize `prompt` (with the tokenizer's special prefix) and expand each placeholder into
    `num_rows[modality](item)` positions. Text between placeholders is tokenized piece by piece,
    so the result does not depend on whether the tokenizer knows the placeholder strings."""
    check_media_matches_prompt(prompt, media)
    for mod in {m for m, items in media.items() if items}:
        if mod not in num_rows:
            raise ValueError(f"no encoder for {mod!r} items (encoders: {sorted(num_rows)})")
    fill, prefix = _tokenizer_facts(tokenizer)
    out = TokenizedPrompt(list(prefix), [True] * len(prefix))
    seen: dict[str, int] = {}
    pos = 0
    for match in PLACEHOLDER_RE.finditer(prompt):
        _add_text(tokenizer, prompt[pos : match.start()], out)
        mod = PLACEHOLDERS[match.group(0)]
        idx = seen.get(mod, 0)
        seen[mod] = idx + 1
        n = int(num_rows[mod](media[mod][idx]))
        if n < 1:
            raise ValueError(f"the {mod} encoder reports {n} rows for an item; expected >= 1")
        out.spans.append(Span(mod, idx, len(out.ids), n))
        out.ids.extend([fill[mod]] * n)
        out.is_token.extend([False] * n)
        pos = match.end()
    _add_text(tokenizer, prompt[pos:], out)
    if not out.ids:
        raise ValueError("empty prompt: give text or at least one placeholder")
    return out


_TEXT_CACHE_SIZE = 4096
_TEXT_IDS: dict[int, tuple[object, dict[str, tuple[int, ...]]]] = {}


def _encode_text(tokenizer, text: str) -> tuple[int, ...]:
    """`tokenizer.encode(text, add_special_tokens=False)`, memoised per tokenizer object: training
    asks for the same template pieces (and, for small label sets, the same targets) on every
    example of every step, and each call through transformers costs ~0.1 ms of host time."""
    hit = _TEXT_IDS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, {})
        _TEXT_IDS[id(tokenizer)] = hit
    memo = hit[1]
    ids = memo.get(text)
    if ids is None:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if len(memo) >= _TEXT_CACHE_SIZE:
            memo.clear()
        memo[text] = ids
    return ids


def _add_text(tokenizer, text: str, out: TokenizedPrompt) -> None:
    if text:
        ids = _encode_text(tokenizer, text)
        out.ids.extend(ids)
        out.is_token.extend([True] * len(ids))


def tokenize_target(tokenizer, target: str) -> list[int]:
    """Target ids: a leading space (so whole-word tokens apply to the first word) plus EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; generation could never stop")
    return [*_encode_text(tokenizer, " " + target.strip()), tokenizer.eos_token_id]

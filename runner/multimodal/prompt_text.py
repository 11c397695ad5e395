"""Text with placeholder strings -> token ids, for any Hugging Face tokenizer.

Real checkpoints' tokenizers have no `<image>` or `<embeds>` token, so a prompt's placeholders
cannot be found by tokenizing the whole text and looking for an id. Instead the text is split at
the placeholder strings and the pieces between them are tokenized one by one (after the
tokenizer's special prefix, e.g. Llama's BOS). Each placeholder becomes one position holding a
fill id: the tokenizer's own single-token placeholder when it has one, else its pad id (or 0).
Those positions carry encoder rows, so their ids never reach the embedding lookup.

This is the one implementation: the runner's multimodal prompts and Bridge's training,
evaluation and API (`bridge.data.tokenize`) all call it, so the sequence a projector is trained
on is exactly the sequence generation sees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

_TEXT_CACHE_SIZE = 4096
# Per tokenizer object: (the tokenizer, {text: ids}); keyed by id() with an identity check, since
# tokenizers are not hashable and live for the process.
_TEXT_IDS: dict[int, tuple[object, dict[str, tuple[int, ...]]]] = {}


def encode_text(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`tokenizer.encode(text, add_special_tokens=False)`, memoised per tokenizer object: training
    asks for the same template pieces on every example of every step, and each call through
    transformers costs host time."""
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


_PREFIX: dict[int, tuple[object, tuple[int, ...]]] = {}


def special_prefix(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before any text (BOS for Llama, nothing for Qwen), memoised."""
    hit = _PREFIX.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, tuple(tokenizer.encode("", add_special_tokens=True)))
        _PREFIX[id(tokenizer)] = hit
    return list(hit[1])


def placeholder_fill_id(tokenizer: Any, placeholder: str) -> int:
    """The id written at a placeholder's positions: the tokenizer's own single token for it when
    it has one, else the pad id (or 0)."""
    ids = encode_text(tokenizer, placeholder)
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) == 1 and ids[0] != unk:
        return int(ids[0])
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


@lru_cache(maxsize=64)
def _placeholder_re(placeholders: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first, so that a placeholder that is a prefix of another never shadows it.
    return re.compile("|".join(re.escape(p) for p in sorted(placeholders, key=len, reverse=True)))


def split_at_placeholders(tokenizer: Any, text: str,
                          placeholders: Mapping[str, str]) -> tuple[list[int], list[tuple[int, str]]]:
    """Token ids of `text` with one fill id per placeholder occurrence, and (position, modality)
    of each occurrence, left to right. `placeholders` maps placeholder text to its modality."""
    ids = special_prefix(tokenizer)
    found: list[tuple[int, str]] = []
    if not placeholders:
        ids.extend(encode_text(tokenizer, text))
        return ids, found
    pos = 0
    for match in _placeholder_re(tuple(placeholders)).finditer(text):
        if match.start() > pos:
            ids.extend(encode_text(tokenizer, text[pos : match.start()]))
        found.append((len(ids), placeholders[match.group(0)]))
        ids.append(placeholder_fill_id(tokenizer, match.group(0)))
        pos = match.end()
    if pos < len(text):
        ids.extend(encode_text(tokenizer, text[pos:]))
    return ids, found


__all__ = ["encode_text", "placeholder_fill_id", "special_prefix", "split_at_placeholders"]

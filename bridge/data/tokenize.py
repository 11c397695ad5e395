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
from runner.multimodal.prompt_text import (
    encode_text,
    placeholder_fill_id,
    special_prefix,
    split_at_placeholders,
)


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


def tokenize_prompt(
    tokenizer, prompt: str, media: Mapping[str, list[Any]], num_rows: Mapping[str, Callable[[Any], int]]
) -> TokenizedPrompt:
    """Tokenize `prompt` (with the tokenizer's special prefix) and expand each placeholder into
    `num_rows[modality](item)` positions. The text is split at the placeholder strings by the
    runner's own `split_at_placeholders` (one implementation for training and generation), so the
    result does not depend on whether the tokenizer knows the placeholder strings."""
    check_media_matches_prompt(prompt, media)
    for mod in {m for m, items in media.items() if items}:
        if mod not in num_rows:
            raise ValueError(f"no encoder for {mod!r} items (encoders: {sorted(num_rows)})")
    ids, found = split_at_placeholders(tokenizer, prompt, PLACEHOLDERS)
    out = TokenizedPrompt([], [])
    seen: dict[str, int] = {}
    prev = 0
    for pos, mod in found:
        out.ids.extend(ids[prev:pos])
        out.is_token.extend([True] * (pos - prev))
        idx = seen.get(mod, 0)
        seen[mod] = idx + 1
        n = int(num_rows[mod](media[mod][idx]))
        if n < 1:
            raise ValueError(f"the {mod} encoder reports {n} rows for an item; expected >= 1")
        out.spans.append(Span(mod, idx, len(out.ids), n))
        out.ids.extend([ids[pos]] * n)
        out.is_token.extend([False] * n)
        prev = pos + 1
    out.ids.extend(ids[prev:])
    out.is_token.extend([True] * (len(ids) - prev))
    if not out.ids:
        raise ValueError("empty prompt: give text or at least one placeholder")
    return out


def tokenize_segments(
    tokenizer,
    segments,
    media: Mapping[str, list[Any]],
    num_rows: Mapping[str, Callable[[Any], int]],
) -> tuple[TokenizedPrompt, list[bool]]:
    """A rendered conversation (bridge.data.conversation.Segment list) -> the sequence and its loss
    mask (True on every token of a learned segment, its EOS included). The tokenizer's special
    prefix comes first, as in `tokenize_prompt`; each segment is tokenized on its own, so a learned
    segment starts and ends on a token boundary, as generation's output does after its prompt.
    Media items are numbered across the whole conversation, in order, per modality."""
    check_media_matches_prompt("".join(s.text for s in segments), media)
    for mod in {m for m, items in media.items() if items}:
        if mod not in num_rows:
            raise ValueError(f"no encoder for {mod!r} items (encoders: {sorted(num_rows)})")
    prefix = special_prefix(tokenizer)
    out = TokenizedPrompt(list(prefix), [True] * len(prefix))
    loss = [False] * len(prefix)
    seen: dict[str, int] = {}
    for seg in segments:
        pos = 0
        for match in PLACEHOLDER_RE.finditer(seg.text):
            _add_text(tokenizer, seg.text[pos : match.start()], seg.loss, out, loss)
            mod = PLACEHOLDERS[match.group(0)]
            idx = seen.get(mod, 0)
            seen[mod] = idx + 1
            n = int(num_rows[mod](media[mod][idx]))
            if n < 1:
                raise ValueError(f"the {mod} encoder reports {n} rows for an item; expected >= 1")
            out.spans.append(Span(mod, idx, len(out.ids), n))
            out.ids.extend([placeholder_fill_id(tokenizer, match.group(0))] * n)
            out.is_token.extend([False] * n)
            loss.extend([False] * n)
            pos = match.end()
        _add_text(tokenizer, seg.text[pos:], seg.loss, out, loss)
        if seg.eos:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no EOS token; generation could never stop")
            out.ids.append(tokenizer.eos_token_id)
            out.is_token.append(True)
            loss.append(seg.loss)
    if not any(loss):
        raise ValueError("the conversation has no assistant token to learn")
    return out, loss


def _add_text(tokenizer, text: str, learned: bool, out: TokenizedPrompt, loss: list[bool]) -> None:
    if not text:
        return
    ids = encode_text(tokenizer, text)
    out.ids.extend(ids)
    out.is_token.extend([True] * len(ids))
    loss.extend([learned] * len(ids))


def tokenize_target(tokenizer, target: str) -> list[int]:
    """Target ids: a leading space (so whole-word tokens apply to the first word) plus EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; generation could never stop")
    return [*encode_text(tokenizer, " " + target.strip()), tokenizer.eos_token_id]

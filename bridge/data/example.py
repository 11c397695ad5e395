"""One training/eval example, and the prompt template that turns a row into its prompt text.

Every data source (JSONL rows, LLaVA conversations, Hugging Face datasets, tar shards, the synthetic
demo sets) produces `Example`s, so the trainer, the evaluation and the Bridge API share one path from
"prompt with placeholders + media items" to the LLM's input. A multi-turn conversation is an Example
with `turns`: it is rendered (chat template or the recipe's turn format) only when it is tokenized,
where the tokenizer is known (bridge.data.conversation).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: placeholder text -> modality of the item it stands for (the tiny tokenizer has one id each).
PLACEHOLDERS: dict[str, str] = {"<image>": "image", "<audio>": "audio", "<graph>": "graph"}
PLACEHOLDER_RE = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS))
_WORD_RE = re.compile(r"^[A-Za-z]+$")  # digits are split one by one by Qwen-style tokenizers


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: its role ("system", "user" or "assistant") and its text (a user
    turn may hold placeholders)."""

    role: str
    text: str


@dataclass
class Example:
    """A prompt with placeholders, the media items they stand for (in order, per modality) and
    the target text the LLM should produce after the prompt.

    A conversation sets `turns` (system?, then user / assistant alternating, ending with an
    assistant turn); the loss then covers every assistant turn, `prompt` is the turns before the last
    assistant turn in the recipe's turn format (what eval.json shows) and `target` the last assistant
    turn (what evaluation compares). `turn_format` renders a user turn when the tokenizer has no chat
    template (`{value}` is the turn's text). `skipped` names bad rows passed over to reach this one
    (`data.skip_bad_rows`), so a count made in a loader worker reaches the trainer with the batch."""

    prompt: str
    target: str
    media: dict[str, list[Any]] = field(default_factory=dict)
    turns: tuple[Turn, ...] | None = None
    turn_format: str = "{value}"
    skipped: tuple[str, ...] = ()


def placeholder_modalities(prompt: str) -> list[str]:
    """Modalities of the placeholders in `prompt`, left to right."""
    return [PLACEHOLDERS[m.group(0)] for m in PLACEHOLDER_RE.finditer(prompt)]


def check_media_matches_prompt(prompt: str, media: Mapping[str, list]) -> None:
    """Each placeholder needs exactly one item of its modality, and each item one placeholder."""
    wanted: dict[str, int] = {}
    for mod in placeholder_modalities(prompt):
        wanted[mod] = wanted.get(mod, 0) + 1
    given = {mod: len(items) for mod, items in media.items() if items}
    if wanted != given:
        raise ValueError(
            f"prompt {prompt!r} has placeholders {wanted or '{}'} but the items given are "
            f"{given or '{}'}: each <image>/<audio>/<graph> takes one item of its modality"
        )


def render_prompt(template: str, row: Mapping[str, Any]) -> str:
    """Fill `{field}` references of the template from the row; placeholders pass through."""
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = [n for n in names if n not in row]
    if missing:
        raise ValueError(
            f"prompt template {template!r} references {missing}, which the row lacks "
            f"(row keys: {sorted(row)})"
        )
    return template.format_map(row) if names else template


def target_words(targets: Iterable[str]) -> list[str]:
    """Whole words of the targets that a tiny tokenizer can make single tokens (sorted, unique)."""
    words = {w for t in targets for w in t.split() if _WORD_RE.match(w)}
    return sorted(words)


def normalize_text(text: str) -> str:
    """What exact match compares: whitespace collapsed, ends stripped."""
    return " ".join(text.split())

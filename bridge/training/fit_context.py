"""`data.truncate: true`: each example's target cut so that prompt and target fit the model's context.

Why cut the target and not the prompt: the prompt holds the media rows the projector learns from;
the target's tail is what a too-long caption can spare. The cut falls on a token boundary of the
target text (the tokenizer's offsets), so the ids the collate makes from the shortened text are a
prefix of the original ids; EOS still ends the sequence, as in an uncut example.

A conversation (LLaVA rows) loses its last exchanges (a human turn and its answer, with the media
its turns held) until it fits; when its first answer alone is too long, that answer is cut as a
target is.

Which examples are cut does not depend on the worker, the rank or the order: item i's cut is a pure
function of item i. The check before the run (bridge.run_check) counts the targets that alone
exceed the context; this wrapper also cuts a target that fits alone but not after its prompt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from bridge.data.example import Example
from bridge.data.tokenize import tokenize_prompt, tokenize_target
from runner.multimodal.prompt_text import encode_text

#: tokens a prompt may take beyond its UTF-8 bytes (special prefix tokens), for the cheap bound
_PROMPT_SLACK = 8


class FitToContext:
    """A dataset whose examples have their targets cut to fit `context` tokens with the prompt."""

    def __init__(self, dataset: Any, tokenizer: Any, num_rows: Mapping[str, Callable[[Any], int]],
                 context: int):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.num_rows = dict(num_rows)
        self.context = context

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # vocab_words, check_all_items, rows, ... of the dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int) -> Example:
        return self.fit(self.dataset[index])

    def _media_rows(self, example: Example) -> int:
        return sum(int(self.num_rows[mod](item)) for mod, items in example.media.items()
                   for item in items if mod in self.num_rows)

    def fit(self, example: Example) -> Example:
        """`example`, or a copy whose target is cut so that the whole sequence fits the context."""
        if example.turns:
            return self._fit_conversation(example)
        media_rows = self._media_rows(example)
        bound = (len(example.prompt.encode()) + _PROMPT_SLACK + media_rows
                 + len(example.target.encode()) + 2)
        if bound <= self.context:
            return example
        prompt_len = len(tokenize_prompt(self.tokenizer, example.prompt, example.media, self.num_rows).ids)
        target_len = len(tokenize_target(self.tokenizer, example.target))
        if prompt_len + target_len <= self.context:
            return example
        keep = self.context - prompt_len - 1  # target tokens that fit before EOS
        if keep < 1:
            raise ValueError(
                f"the prompt alone is {prompt_len} tokens (media rows included), which leaves no room "
                f"for a target in the model's context ({self.context}); data.truncate cuts targets only"
            )
        return dataclasses.replace(example, target=self._cut(example.target, keep))

    def _length(self, example: Example) -> int:
        from bridge.training.batching import tokenize_example

        return len(tokenize_example(self.tokenizer, example, self.num_rows).seq.ids)

    def _fit_conversation(self, example: Example) -> Example:
        if self._length(example) <= self.context:
            return example
        turns = list(example.turns or ())
        while sum(t.role == "assistant" for t in turns) > 1:
            turns = turns[:-2]  # the last human turn and its answer
            shorter = _with_turns(example, turns)
            if self._length(shorter) <= self.context:
                return shorter
        answer = turns[-1].text
        total = len(encode_text(self.tokenizer, " " + answer.strip()))
        lo, hi, best = 1, total, None
        while lo <= hi:  # the most answer tokens that fit
            keep = (lo + hi) // 2
            try:
                cut = self._cut(answer, keep)
            except ValueError:
                cut = None
            candidate = _with_turns(example, [*turns[:-1], dataclasses.replace(turns[-1], text=cut)]) \
                if cut else None
            if candidate is not None and self._length(candidate) <= self.context:
                best, lo = candidate, keep + 1
            else:
                hi = keep - 1
        if best is None:
            raise ValueError(
                f"the conversation's first human turn alone (media rows included) leaves no room for an "
                f"answer in the model's context ({self.context}); data.truncate cuts answers only"
            )
        return best

    def _cut(self, target: str, keep: int) -> str:
        """The longest prefix of `target` that ends on a token boundary and makes <= `keep` tokens."""
        text = " " + target.strip()
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        while keep > 0:
            cut = text[: offsets[keep - 1][1]].strip()
            if len(encode_text(self.tokenizer, " " + cut)) <= keep:
                return cut
            keep -= 1
        raise ValueError("no prefix of the target fits the model's context")


def _with_turns(example: Example, turns: list) -> Example:
    """`example` with only `turns`, and only the media items their placeholders stand for."""
    from bridge.data.conversation import conversation_example
    from bridge.data.example import placeholder_modalities

    counts: dict[str, int] = {}
    for turn in turns:
        for mod in placeholder_modalities(turn.text):
            counts[mod] = counts.get(mod, 0) + 1
    media = {m: items[: counts[m]] for m, items in example.media.items() if counts.get(m)}
    shorter = conversation_example(tuple(turns), media, example.turn_format)
    return dataclasses.replace(shorter, skipped=example.skipped)

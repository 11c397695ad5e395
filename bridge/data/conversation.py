"""A multi-turn conversation -> text segments, each marked as learned (assistant) or not.

Two renderings, chosen by the tokenizer:

- the model's chat template, when its tokenizer has one: the conversation is rendered once with a
  unique marker in place of each turn's text, so where every turn sits in the template's output is
  found without guessing (searching for the text itself would match a header that happens to hold
  the same word). An assistant segment is its text plus the template's end-of-turn token when one
  follows it (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...), so the model learns to stop where the template
  stops; a template that puts no special token after an assistant turn gets EOS appended there.
- else the recipe's turn format (`data.prompt`, `{value}` standing for the user turn's text): user
  turns are formatted, each assistant turn is a space, its text and EOS (exactly the single-turn
  JSONL layout: prompt, then " target" + EOS).

The text a model is evaluated on (`generation_prompt`) is the same rendering cut before the last
assistant turn, so evaluation continues exactly the context training taught it to continue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bridge.data.example import PLACEHOLDER_RE, Example, Turn
from runner.multimodal.prompt_text import special_prefix

#: marks a turn's place in a rendered template: letters and digits only, so no template's `trim`
#: or `strip` can change it
_MARK = "BRIDGExTURNx{}xMARK"


@dataclass(frozen=True)
class Segment:
    """A piece of the rendered conversation. `loss`: the model learns to produce it (an assistant
    turn); `eos`: the tokenizer's EOS id follows the text (learned as well)."""

    text: str
    loss: bool
    eos: bool = False


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_user_turn(turn_format: str, text: str) -> str:
    """A user turn in the recipe's format: `{value}` is the turn's text (the only field)."""
    try:
        return turn_format.format_map({"value": text})
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"the turn format {turn_format!r} takes only {{value}} (the user turn's text): {exc!r}"
        ) from None


def _format_segments(turns: tuple[Turn, ...], turn_format: str) -> list[Segment]:
    out = []
    for turn in turns:
        if turn.role == "system":
            out.append(Segment(turn.text + "\n", False))
        elif turn.role == "user":
            out.append(Segment(format_user_turn(turn_format, turn.text), False))
        else:
            out.append(Segment(" " + turn.text.strip(), True, eos=True))
    return out


#: per tokenizer object: (the tokenizer, its special tokens longest first, the text of its prefix);
#: every conversation of every step asks, and a real tokenizer has hundreds of special tokens
_TOKENIZER_TEXT: dict[int, tuple[Any, list[str], str]] = {}


def _tokenizer_text(tokenizer: Any) -> tuple[list[str], str]:
    """The tokenizer's special tokens as text, longest first (a template's end-of-turn is one), and
    the text of its special prefix (BOS for Llama, nothing for Qwen)."""
    hit = _TOKENIZER_TEXT.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        names = set(getattr(tokenizer, "all_special_tokens", None) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                names.add(str(tok))
        prefix = special_prefix(tokenizer)
        hit = (tokenizer, sorted((n for n in names if n), key=len, reverse=True),
               tokenizer.decode(prefix) if prefix else "")
        _TOKENIZER_TEXT[id(tokenizer)] = hit
    return hit[1], hit[2]


def _template_segments(tokenizer: Any, turns: tuple[Turn, ...]) -> list[Segment]:
    marks = [_MARK.format(i) for i in range(len(turns))]
    messages = [{"role": t.role, "content": m} for t, m in zip(turns, marks)]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001  a Jinja template raises anything
        raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    if not isinstance(text, str):
        raise ValueError("the chat template did not render text")
    specials, prefix = _tokenizer_text(tokenizer)
    if prefix and text.startswith(prefix):  # the tokenizer's prefix (BOS) is added once, as id
        text = text[len(prefix):]
    out: list[Segment] = []
    pos = 0
    for turn, mark in zip(turns, marks):
        at = text.find(mark, pos)
        if at < 0 or text.find(mark, at + len(mark)) >= 0:
            raise ValueError(
                f"the chat template does not render each turn's text once, in order (a {turn.role} "
                "turn is missing or repeated); Bridge cannot tell which tokens are the assistant's"
            )
        if at > pos:
            out.append(Segment(text[pos:at], False))
        pos = at + len(mark)
        if turn.role != "assistant":
            out.append(Segment(turn.text, False))
            continue
        end = next((s for s in specials if text.startswith(s, pos)), None)
        if end is None:
            out.append(Segment(turn.text, True, eos=True))
        else:
            out.append(Segment(turn.text + end, True))
            pos += len(end)
    return out  # what the template puts after the last answer is never learned nor read: left out


def conversation_segments(tokenizer: Any, example: Example) -> list[Segment]:
    """The whole conversation as segments (see the module docstring). Placeholders may stand only
    in user or system turns: media are read, never produced."""
    turns = example.turns or ()
    if not turns or turns[-1].role != "assistant":
        raise ValueError("a conversation must end with an assistant turn")
    for turn in turns:
        if turn.role == "assistant" and PLACEHOLDER_RE.search(turn.text):
            raise ValueError("an assistant turn holds a media placeholder; media go in user turns")
    if has_chat_template(tokenizer):
        return _template_segments(tokenizer, turns)
    return _format_segments(turns, example.turn_format)


def conversation_example(turns: tuple[Turn, ...], media: dict[str, list[Any]], turn_format: str) -> Example:
    """The Example of a conversation: `prompt` is the turns before the last assistant turn in the
    turn format (what eval.json shows), `target` the last assistant turn."""
    segments = _format_segments(turns, turn_format)
    last = max(i for i, s in enumerate(segments) if s.loss)
    prompt = "".join(s.text for s in segments[:last])
    return Example(prompt, turns[-1].text, media, turns=turns, turn_format=turn_format)


def generation_prompt(tokenizer: Any, example: Example) -> str:
    """The text before the last assistant turn, rendered as for training: what evaluation
    generates from (EOS ids between turns written as the EOS token's text)."""
    segments = conversation_segments(tokenizer, example)
    last = max(i for i, s in enumerate(segments) if s.loss)
    eos = tokenizer.eos_token or ""
    return "".join(s.text + (eos if s.eos else "") for s in segments[:last])


def example_prompt(tokenizer: Any, example: Example) -> str:
    """What evaluation and the Bridge API generate from: the prompt, or a conversation's
    generation prompt."""
    return generation_prompt(tokenizer, example) if example.turns else example.prompt

"""Which chat template a server renders with, and the one a trained run gets from its recipe.

In order: `--chat-template FILE`; else the tokenizer's own; else, for a Bridge run or checkpoint, a
template made from the run's recipe `data.prompt`: the prompt format its projector was trained on.
Training tokenized `data.prompt` as raw text after the tokenizer's special prefix (BOS where the
tokenizer adds one), with no roles or turn markers (`bridge.data.tokenize`). A chat template with
role markers would show the model a sequence it never saw, so the recipe's template renders the
conversation's contents as they are: a user turn's parts joined by the separator `data.prompt` puts
between its placeholder and its text, turns joined the same way, after the special prefix. A chat
with one user turn holding an image and the recipe's text then becomes exactly the prompt
`Bridge.generate` builds for that item (`data.prompt = "<image>\\nDescribe the image."` and parts
`[image, "Describe the image."]`; `"<image>"` and one image part).

A model directory with no template at all (and no run around it) has none: chat answers 400.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bridge.data.example import PLACEHOLDER_RE

logger = logging.getLogger("bridge.serve")

DEFAULT_PART_SEPARATOR = "\n"
"""How a turn's parts are joined when nothing says otherwise (vLLM's "string" content format)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and how its rendered text becomes token ids.

    `special_prefix`: the tokenizer's special prefix (BOS for Llama) goes before the rendered text, as
    training put it before `data.prompt`; a tokenizer's or a file's template writes its own BOS.
    `part_separator`: what joins a turn's content parts before the template sees the turn.
    `origin`: where the template came from, for the server's log."""

    source: str | None  # None: the tokenizer's own template
    origin: str
    special_prefix: bool = False
    part_separator: str = DEFAULT_PART_SEPARATOR


def recipe_part_separator(prompt: str) -> str:
    """The whitespace `prompt` puts between its first placeholder and the text beside it ("\\n" in
    "<image>\\nDescribe", " " in "Describe: <image>", "" in "<image>Describe"); the default when the
    prompt is placeholders only."""
    pieces = PLACEHOLDER_RE.split(prompt)
    if len(pieces) < 2:  # no placeholder at all (validate() refuses that for a media recipe)
        return DEFAULT_PART_SEPARATOR
    before, after = pieces[0], pieces[1]
    if after.strip():
        return re.match(r"\s*", after).group(0)
    if before.strip():
        return before[len(before.rstrip()):]
    return DEFAULT_PART_SEPARATOR


def recipe_template(prompt: str, where: str) -> ChatTemplate:
    """The template of a run whose recipe's `data.prompt` is `prompt` (read from `where`)."""
    sep = recipe_part_separator(prompt)
    literal = json.dumps(sep)  # a Jinja string literal: Jinja reads the same escapes as JSON writes
    source = ("{%- for message in messages -%}"
              "{%- if not loop.first -%}{{ " + literal + " }}{%- endif -%}"
              "{{- message['content'] -}}"
              "{%- endfor -%}")
    origin = (f"the run's recipe data.prompt {prompt!r} ({where}): each turn's contents as they are, "
              f"parts and turns joined by {sep!r}, after the tokenizer's special prefix")
    return ChatTemplate(source, origin, special_prefix=True, part_separator=sep)


def run_recipe_prompt(model_path: str | Path) -> tuple[str, Path] | None:
    """`data.prompt` of the Bridge run or checkpoint at `model_path` and the recipe file it came from;
    None for a Hugging Face model directory or a run whose recipe has none. Reads the recipe the
    served checkpoint was saved with (the same one `resolve_model` serves; its manifest check, when
    on, already ran there)."""
    from bridge.training import checkpoint as ckpt_io

    path = Path(model_path)
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        return None
    try:
        directory = ckpt_io.open_checkpoint(path, verify=False)
    except ValueError:
        return None
    recipe = directory / "recipe.yaml"
    if not recipe.is_file():
        return None
    try:
        data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{recipe}: not a readable recipe ({type(err).__name__})") from None
    prompt = (data.get("data") or {}).get("prompt") if isinstance(data, dict) else None
    return (prompt, recipe) if isinstance(prompt, str) and prompt else None


def resolve_chat_template(template_file: str | None, tokenizer: Any,
                          model_path: str | Path) -> ChatTemplate | None:
    """The template to render chats with (see the module docstring for the order); logged once.
    None: there is none, and chat completions answer 400."""
    if template_file:
        chosen = ChatTemplate(Path(template_file).read_text(encoding="utf-8"),
                              f"--chat-template {template_file}")
    elif tokenizer is not None and getattr(tokenizer, "chat_template", None):
        chosen = ChatTemplate(None, "the tokenizer's own")
    else:
        found = run_recipe_prompt(model_path) if tokenizer is not None else None
        chosen = recipe_template(*found) if found is not None else None
    if chosen is None:
        logger.info("chat template: none (the tokenizer has none and %s is not a Bridge run): chat "
                    "completions answer 400; give --chat-template FILE", model_path)
    else:
        logger.info("chat template: %s", chosen.origin)
    return chosen


__all__ = ["ChatTemplate", "recipe_part_separator", "recipe_template", "resolve_chat_template",
           "run_recipe_prompt"]

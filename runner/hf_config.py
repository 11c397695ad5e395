"""Reading a Hugging Face model directory the same way everywhere: its config's decoder fields, its tokenizer.

Composite (vision-language) configs keep the decoder's fields in a text sub-config; plain LM
configs hold them directly; a raw config.json dict may be either. One function answers "where
are the decoder's fields" for all three, so no caller repeats the fallback.

`load_tokenizer` lives here rather than with `LLM`, so that a process that needs the tokenizer and not
the engine (a server's API process) does not import the engine for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


def text_config(config: Any) -> Any:
    """The decoder's text config of a composite (VLM) config, else the config itself."""
    if isinstance(config, Mapping):
        sub = config.get("text_config")
        return sub if isinstance(sub, Mapping) else config
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's Hugging Face tokenizer, or None (a warning) when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no tokenizer in %s (%s): text prompts and stop strings unavailable", model_dir, exc)
        return None


__all__ = ["load_tokenizer", "text_config"]

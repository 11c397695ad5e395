"""Reading a Hugging Face config the same way everywhere in the runner.

Composite (vision-language) configs keep the decoder's fields in a text sub-config; plain LM
configs hold them directly; a raw config.json dict may be either. One function answers "where
are the decoder's fields" for all three, so no caller repeats the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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


__all__ = ["text_config"]

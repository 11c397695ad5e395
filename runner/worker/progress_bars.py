"""Hugging Face's own progress bars ("Loading weights", "Writing model shards") off while a library call
loads a model: `LLM(...)`, `Bridge.from_checkpoint` and `Bridge.generate` called from Python print
nothing unless asked, as `LLM.generate(use_tqdm=False)` does.

Transformers has one process-wide switch for its bars; the block turns it off and puts it back as it
found it, so a caller who turned the bars off (or on) keeps that, and nested blocks do nothing more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Transformers' (and huggingface_hub's) progress bars off inside the block, as before after it."""
    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


__all__ = ["hf_progress_bars_off"]

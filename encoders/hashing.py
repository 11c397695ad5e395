"""Content hashes of raw items: the encoder-cache and prefix-cache key.

The hash covers the decoded content (pixels, samples + sample rate, graph arrays), not the
container, so the same picture given as a path or as a PIL image maps to the same key, and any
change of content changes it. The modality is hashed in too, so equal bytes of two modalities differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any


def sha256_of_parts(parts: Iterable[bytes]) -> str:
    """sha256 over length-prefixed parts (prefixing makes the split between parts unambiguous)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def content_hash(modality: str, item: Any) -> str:
    """sha256 hex digest identifying ``item``'s content for ``modality``."""
    if modality == "image":
        from encoders.vision_inputs import image_hash_parts as parts
    elif modality == "audio":
        from encoders.audio_inputs import audio_hash_parts as parts
    elif modality == "graph":
        from encoders.graph_format import graph_hash_parts as parts
    else:
        raise ValueError(f"no content hash for modality {modality!r}; known: image, audio, graph")
    return sha256_of_parts([modality.encode(), *parts(item)])

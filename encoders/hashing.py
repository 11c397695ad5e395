"""Content hashes of raw items: the encoder-cache and prefix-cache key.

The hash covers the decoded content (pixels, samples + sample rate, graph arrays), not the
container, so the same picture given as a path or as a PIL image maps to the same key, and any
change of content changes it. The modality is hashed in too, so equal bytes of two modalities differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from encoders.audio_inputs import audio_hash_parts
from encoders.graph_format import graph_hash_parts
from encoders.vision_inputs import image_hash_parts

_PARTS = {"image": image_hash_parts, "audio": audio_hash_parts, "graph": graph_hash_parts}


def sha256_of_parts(parts: Iterable[bytes]) -> str:
    """sha256 over length-prefixed parts (prefixing makes the split between parts unambiguous)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def content_hash(modality: str, item: Any) -> str:
    """sha256 hex digest identifying ``item``'s content for ``modality``."""
    parts = _PARTS.get(modality)
    if parts is None:
        raise ValueError(f"no content hash for modality {str(modality)[:40]!r}; known: image, audio, graph")
    return sha256_of_parts([modality.encode(), *parts(item)])

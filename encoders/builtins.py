"""Registers the built-in towers, projectors and preprocessors by importing their modules once.

`encoders.api` and `encoders.encoder` (which resolves part names) import this, so every lookup sees
the built-ins; open_clip,
torchaudio and transformers stay imported lazily inside the towers that need them.
"""

from encoders import audio_towers, graph_tower, projectors, vision_towers

__all__ = ["audio_towers", "graph_tower", "projectors", "vision_towers"]

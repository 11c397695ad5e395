"""`bridge serve`'s media-limit flags: the flag of each `MediaLimits` field, and the limits the flags set.

Apart from `media.py` (which decodes media, with PIL and numpy): `bridge serve` checks the flags before it
starts anything, in the process that only starts the others.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from encoders.media_budget import MediaLimits

MEDIA_FLAGS = {f.name: "--max-media-items" if f.name == "max_items" else "--" + f.name.replace("_", "-")
               for f in fields(MediaLimits)}
"""The `bridge serve` flag of each `MediaLimits` field (named in a refusal)."""


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The per-request media budget from the flags (a bad value is a ValueError naming its flag)."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in MEDIA_FLAGS.items()}
    try:
        return MediaLimits(**values)
    except ValueError as err:
        name = str(err).split(" ", 1)[0]
        raise ValueError(f"{MEDIA_FLAGS.get(name, name)}: {str(err).split(' ', 1)[1]}") from None


__all__ = ["MEDIA_FLAGS", "media_limits"]
